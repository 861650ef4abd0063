"""The gateway's watch loop keeps checking health while an engine's Profile is still being measured
(a first sweep takes minutes on a busy machine): the Profile call runs beside the loop, never in it.
Pure asyncio over stand-ins for the pair set (the loop only reads their health, load and profiles)."""
from __future__ import annotations

import asyncio

from services.gateway.routing.engine_watch import watch_engines
from services.gateway.routing.router import Router


class SlowProfileEngines:
    """One pair whose gpu engine is up and answers Profile only when `release` is set."""

    def __init__(self):
        self.up = {"gpu": True, "fpga": False}
        self.info: dict = {}
        self.profiles: dict = {}
        self.release = asyncio.Event()
        self.profile_calls = 0

    async def refresh_load(self) -> None:
        pass

    async def fetch_profile(self, engine: str):
        self.profile_calls += 1
        await self.release.wait()
        self.profiles[engine] = [{"stage": "prefill", "device": "gpu", "n_in": 16, "seconds": 0.01},
                                 {"stage": "prefill", "device": "gpu", "n_in": 256, "seconds": 0.1}]
        return self.profiles[engine]


class OnePair:
    def __init__(self, clients):
        self.members = {0: clients}
        self.health_checks = 0

        class Loads:
            def report(self, *args):
                pass
        self.loads = Loads()

    async def check_all(self) -> None:
        self.health_checks += 1


def test_health_checks_go_on_while_a_profile_is_measured():
    async def scenario():
        clients = SlowProfileEngines()
        pairs = OnePair(clients)
        router = Router([], explore_share=0)
        watch = asyncio.create_task(watch_engines(pairs, router, [], interval_s=0.01, share_cpu=True))
        await asyncio.sleep(0.3)
        checks_while_profiling = pairs.health_checks
        assert clients.profile_calls == 1  # one call in flight, not one per interval
        clients.release.set()
        await asyncio.sleep(0.1)
        watch.cancel()
        try:
            await watch
        except asyncio.CancelledError:
            pass
        return checks_while_profiling, clients

    checks, clients = asyncio.run(scenario())
    assert checks >= 5  # the loop kept going while Profile was pending
    assert "gpu" in clients.profiles and clients.profile_calls == 1
