"""An unquiet profile is checked with a few short requests on the real engines before the router
counts as calibrated: afterwards every stage is confirmed, so users' requests are never sent to a
mode only to check it. Real engines on loopback (the package's stack), the router in this process."""
from __future__ import annotations

import asyncio

from services.gateway.fleet.engine_client import EngineClients
from services.gateway.fleet.pairs import Pairs
from services.gateway.routing.calibration_check import OUTPUT_TOKENS, PROMPT_TOKENS, check_unconfirmed_stages
from services.gateway.routing.router import CONFIRMING, Router
from services.modes import MODE_NAMES
from tests.gateway.test_router import synthetic_samples


def test_an_unquiet_profile_is_confirmed_by_short_requests_on_the_engines(stack):
    async def scenario():
        clients = EngineClients(stack["prefill"].address, stack["decode"].address)
        try:
            await clients.check_all()
            pairs = Pairs([clients])
            router = Router(synthetic_samples())  # a profile nobody said was quiet
            unsure = router.mode_to_confirm(OUTPUT_TOKENS)
            assert unsure is not None and not router.checking
            ran = await check_unconfirmed_stages(pairs, router, clients.info["gpu"].vocab_size)
            return router, unsure, ran
        finally:
            await clients.close()

    router, unsure, ran = asyncio.run(scenario())
    assert router.mode_to_confirm(OUTPUT_TOKENS) is None and router.calibrated and not router.checking
    assert CONFIRMING <= ran <= CONFIRMING * len(MODE_NAMES)
    corrections = router.snapshot()["corrections"]
    # every stage now rests on requests measured here: 5 stages, CONFIRMING samples or more each
    assert set(corrections) == {"prefill/gpu", "prefill/fpga", "decode/gpu", "decode/fpga", "handoff/link"}
    assert all(c["online_samples"] >= CONFIRMING for c in corrections.values())
    # and a user's auto request on this router explores nothing
    assert all(router.choose(PROMPT_TOKENS * k, 64).reason == "auto" for k in (1, 4, 8))
