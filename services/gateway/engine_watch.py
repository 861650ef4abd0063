"""Keeps the gateway's picture of the engines fresh while it runs: a health check of each engine
every interval, its load (requests running and waiting in its batch, from Info) into the router,
and each engine's Profile (its start-up timing sweep) into the router once it is up.
"""
from __future__ import annotations

import asyncio

from services.gateway.engine_client import EngineClients
from services.gateway.router import Router


def engines_share_cpu(prefill_device: str, decode_device: str) -> bool:
    """Whether both engines run on the host's CPU: torch on "cpu" and an OpenCL CPU device (PoCL
    names its CPU devices "pthread-<cpu>" or "cpu-<cpu>"). Then they compete for the same cores."""
    name = decode_device.lower().rsplit("/", 1)[-1].strip()
    return prefill_device == "cpu" and (name.startswith("pthread") or name.startswith("cpu"))


async def watch_engines(clients: EngineClients, router: Router, file_samples: list[dict], interval_s: float,
                        share_cpu: bool | None = None) -> None:
    """Runs until cancelled. `file_samples`: calibration from a file, kept under the engines' own.
    `share_cpu`: whether the engines share one processor (the router's `shared_compute`); None: from
    the devices their Info names."""
    while True:
        await clients.check_all()
        await clients.refresh_load()
        for engine, info in clients.info.items():
            if clients.up.get(engine):
                router.set_engine_load(engine, info.num_requests_running, info.num_requests_waiting,
                                       info.max_num_seqs or info.max_concurrency)
        if share_cpu is None and "gpu" in clients.info and "fpga" in clients.info:
            share_cpu = engines_share_cpu(clients.info["gpu"].device, clients.info["fpga"].device)
            router.shared_compute = share_cpu
        elif share_cpu is not None:
            router.shared_compute = share_cpu
        for engine, up in clients.up.items():
            if up and wants_profile(clients, engine):
                if await clients.fetch_profile(engine) is not None:
                    router.set_base_samples(file_samples + [s for p in clients.profiles.values() for s in p])
                    info = clients.info.get(engine)
                    router.concurrency[engine] = max(1, info.max_concurrency if info else 1)
        await asyncio.sleep(interval_s)


def wants_profile(clients: EngineClients, engine: str) -> bool:
    """No profile yet, or decode_fpga's lacks the hand-off samples it can only measure with prefill_gpu up."""
    have = clients.profiles.get(engine)
    if have is None:
        return True
    return engine == "fpga" and clients.up["gpu"] and not any(s["stage"] == "handoff" for s in have)
