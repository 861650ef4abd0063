"""Keeps the gateway's picture of the engines fresh while it runs: every interval, the pairs found by
discovery (when the settings name a DNS name), a health check of each engine of each pair, its load
(requests running and waiting in its batch and its KV usage, from Info) into the pair choice and,
summed over the pairs, into the router, and each engine's Profile (its start-up timing sweep) into
the router once one pair's engine is up (pairs are alike: one profile per engine serves them all).
A profile that was not timed on a quiet machine is then checked with a few short requests
(calibration_check.py) before the router counts as calibrated.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from services.gateway import metrics as m
from services.gateway.fleet.engine_client import EngineClients
from services.gateway.fleet.pairs import Pairs
from services.gateway.routing.calibration_check import check_unconfirmed_stages
from services.gateway.routing.router import Router
from services.modes import ENGINES, MODE_NAMES


def engines_share_cpu(prefill_device: str, decode_device: str) -> bool:
    """Whether both engines run on the host's CPU: torch on "cpu" and an OpenCL CPU device (PoCL
    names its CPU devices "pthread-<cpu>" or "cpu-<cpu>"). Then they compete for the same cores."""
    name = decode_device.lower().rsplit("/", 1)[-1].strip()
    return prefill_device == "cpu" and (name.startswith("pthread") or name.startswith("cpu"))


async def watch_engines(pairs: Pairs, router: Router, file_samples: list[dict], interval_s: float,
                        share_cpu: bool | None = None,
                        discover: Callable[[], Awaitable[None]] | None = None) -> None:
    """Runs until cancelled. `file_samples`: calibration from a file, kept under the engines' own.
    `share_cpu`: whether the engines share one processor (the router's `shared_compute`); None: from
    the devices their Info names. `discover`: brings `pairs` up to date with the pods found."""
    fetching: dict[str, asyncio.Task] = {}  # engine -> its Profile call in flight; "check" -> the check
    try:
        await _watch(pairs, router, file_samples, interval_s, share_cpu, discover, fetching)
    finally:
        for task in fetching.values():
            task.cancel()


async def _watch(pairs: Pairs, router: Router, file_samples: list[dict], interval_s: float,
                 share_cpu: bool | None, discover: Callable[[], Awaitable[None]] | None,
                 fetching: dict[str, asyncio.Task]) -> None:
    checked: dict = {}
    while True:
        if discover is not None:
            await discover()
        await pairs.check_all()
        await asyncio.gather(*(c.refresh_load() for c in pairs.members.values()))
        report_load(pairs, router)
        if share_cpu is None:
            detected = _detect_shared_cpu(pairs)
            if detected is not None:
                share_cpu = router.shared_compute = detected
        else:
            router.shared_compute = share_cpu
        for engine in ENGINES:
            # a Profile can take minutes (an engine's first sweep): it runs beside this loop, never in
            # it, so health checks and load reports go on meanwhile
            if engine in fetching and not fetching[engine].done():
                continue
            source = profile_source(pairs, engine)
            if source is not None:
                fetching[engine] = asyncio.create_task(_fetch_profile(source, engine, pairs, router, file_samples,
                                                                      fetching, checked))
        _start_check(pairs, router, fetching, checked)
        await asyncio.sleep(interval_s)


def _start_check(pairs: Pairs, router: Router, tasks: dict[str, asyncio.Task], checked: dict) -> None:
    """Once every engine's profile is in: check what no quiet profile confirmed, once per set of
    profiles (`checked` remembers which set was checked last)."""
    profiles = tuple(id(c.profiles.get(e)) for c in pairs.members.values() for e in ENGINES)
    running = "check" in tasks and not tasks["check"].done()
    if running or checked.get("profiles") == profiles:
        return
    vocab = next((c.info[e].vocab_size for c in pairs.members.values() for e in ENGINES
                  if e in c.info and c.info[e].vocab_size), 0)
    if not vocab or router.mode_to_confirm(2) is None or not all(router.model.can_estimate(x) for x in MODE_NAMES):
        return
    router.checking = True  # from now: /health says calibrated only once the check is over
    tasks["check"] = asyncio.create_task(check_unconfirmed_stages(pairs, router, vocab))
    checked["profiles"] = profiles


async def _fetch_profile(source: EngineClients, engine: str, pairs: Pairs, router: Router,
                         file_samples: list[dict], tasks: dict[str, asyncio.Task], checked: dict) -> None:
    if await source.fetch_profile(engine) is not None:
        router.set_base_samples(file_samples + profile_samples(pairs))
        info = source.info.get(engine)
        router.concurrency[engine] = max(1, info.max_concurrency if info else 1)
        # at once, with no await in between: /health must never read calibrated between the new
        # profiles and the start of their check
        _start_check(pairs, router, tasks, checked)


def report_load(pairs: Pairs, router: Router) -> None:
    """Each up engine's last Info into the pair choice; the sum over the pairs into the router, whose
    queueing term is about all the work of an engine kind this gateway can reach."""
    totals: dict[str, list[int]] = {}
    for p, clients in pairs.members.items():
        for e in ENGINES:
            up = bool(clients.up.get(e))
            m.PAIR_ENGINE_UP.labels(pair=str(p), engine=e).set(1 if up else 0)
            info = clients.info.get(e)
            if not up or info is None:
                continue
            seqs = info.max_num_seqs or info.max_concurrency
            pairs.loads.report(p, e, info.num_requests_running, info.num_requests_waiting, seqs,
                               info.kv_cache_usage_ratio)
            t = totals.setdefault(e, [0, 0, 0, 0])
            t[0], t[1], t[2] = t[0] + info.num_requests_running, t[1] + info.num_requests_waiting, t[2] + seqs
            t[3] += 1
    for e, (running, waiting, seqs, engines) in totals.items():
        router.set_engine_load(e, running, waiting, seqs, engines)


def _detect_shared_cpu(pairs: Pairs) -> bool | None:
    for clients in pairs.members.values():
        if "gpu" in clients.info and "fpga" in clients.info:
            return engines_share_cpu(clients.info["gpu"].device, clients.info["fpga"].device)
    return None


def profile_source(pairs: Pairs, engine: str) -> EngineClients | None:
    """The pair to ask for `engine`'s Profile: none when one pair already gave a whole one, else the
    first pair whose engine is up and wants one."""
    if any(engine in c.profiles and not wants_profile(c, engine) for c in pairs.members.values()):
        return None
    return next((c for c in pairs.members.values() if c.up.get(engine) and wants_profile(c, engine)), None)


def profile_samples(pairs: Pairs) -> list[dict]:
    """One profile per engine (a whole one when a pair has it): pairs are alike."""
    out = []
    for engine in ENGINES:
        have = [c for c in pairs.members.values() if engine in c.profiles]
        have.sort(key=lambda c: wants_profile(c, engine))  # whole ones first
        if have:
            out += have[0].profiles[engine]
    return out


def wants_profile(clients: EngineClients, engine: str) -> bool:
    """No profile yet, or decode_fpga's lacks the hand-off samples it can only measure with prefill_gpu up."""
    have = clients.profiles.get(engine)
    if have is None:
        return True
    return engine == "fpga" and clients.up["gpu"] and not any(s["stage"] == "handoff" for s in have)
