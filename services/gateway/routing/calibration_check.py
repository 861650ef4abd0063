"""Checks a profile the engines could not time on a quiet machine, with a few short requests.

An engine says whether its start-up profile is `quiet` (timed, or confirmed by a probe, on a
quiet machine). When one is not (a compile ran beside the first start), the router would
otherwise check each unconfirmed stage with users' requests: a request sent to a mode the
profile shows slow, to see whether it really is (on this machine, one such gpu-only request
of 190 tokens costs 12 s against 1 s in hybrid). Here the gateway does it first: short
requests (a 32-token prompt, 16 tokens out) in each mode that would measure an unconfirmed
stage, sent straight to one pair's engines, their timings fed to the router as any finished
request's. The gateway is ready (/health 200) once this is done, and `hybridserve up` says so.

The check yields to requests: it waits while this gateway has any call open, and a check request
still running when one arrives is cancelled and sent again once they are all done. Measured on a
cold start, a gpu-mode check (a 16-token CPU decode: ~2 s beside the other engine) and the first user
streams shared the two cores, and a stream froze for 2.5 s. So a check never shares the engines with
a request; what it costs is time: under traffic that never pauses the check never runs, and the
stages it would have confirmed are confirmed by those requests' own timings, as the router does for
any stage (a user's request may then go to a mode the profile shows slow, as it did before the
check existed). Another gateway's requests are not seen here.
"""
from __future__ import annotations

import asyncio
import logging
import random

import grpc

from services.gateway import metrics as m
from services.gateway.fleet.pairs import Pairs
from services.gateway.routing.router import CONFIRMING, Router
from services.gateway.routing.samples import samples_from_timings
from services.modes import MODE_NAMES, MODES
from services.rpc.hybridserve.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)

PROMPT_TOKENS, OUTPUT_TOKENS = 32, 16
TIMEOUT_S = 300.0
IDLE_POLL_S = 0.05  # how often the check looks for requests while it waits or runs


async def check_unconfirmed_stages(pairs: Pairs, router: Router, vocab_size: int) -> int:
    """Short requests until every stage is confirmed (bounded: CONFIRMING per stage of every mode);
    how many ran. An engine error ends the check: users' requests then confirm what is left."""
    rng = random.Random()
    ran = 0
    router.checking = True
    try:
        while ran < CONFIRMING * len(MODE_NAMES):
            mode = router.mode_to_confirm(OUTPUT_TOKENS)
            serving = pairs.serving(mode) if mode else []
            if not serving:
                return ran
            prompt = [rng.randrange(3, vocab_size) for _ in range(PROMPT_TOKENS)]
            try:
                t = await _between_requests(pairs, lambda: _timings_of(pairs.members[serving[0]], mode, prompt, ran))
            except grpc.aio.AioRpcError as exc:
                log.warning("calibration check: %s mode failed (%s); requests will confirm the rest",
                            mode, exc.code().name)
                return ran
            if t is None:  # yielded to a request: asked again once requests pause (theirs may confirm it first)
                m.CALIBRATION_CHECKS.labels(mode=mode, outcome="yielded").inc()
                continue
            m.CALIBRATION_CHECKS.labels(mode=mode, outcome="ran").inc()
            router.observe(samples_from_timings(mode, PROMPT_TOKENS, t))
            ran += 1
            log.info("calibration check: %s mode, %d-token prompt, %d tokens: %.3f s prefill, %.3f s decode",
                     mode, PROMPT_TOKENS, OUTPUT_TOKENS, t["prefill_s"], t["decode_s"])
        return ran
    finally:
        router.checking = False


async def _between_requests(pairs: Pairs, check):
    """`check()`'s result, run while this gateway has no call open; None when a call opened meanwhile
    (the check is then cancelled at once, so it never shares the engines with a request)."""
    while pairs.loads.open_calls():
        await asyncio.sleep(IDLE_POLL_S)
    task = asyncio.ensure_future(check())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=IDLE_POLL_S)
            if done:
                return task.result()
            if pairs.loads.open_calls():
                log.info("calibration check: yields to a request")
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _timings_of(clients, mode: str, prompt: list[int], i: int) -> dict:
    m = MODES[mode]
    request = pb.GenerateRequest(request_id=f"calibration-check-{i}", prompt_token_ids=prompt, mode=m.proto,
                                 sampling=pb.SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True))
    call = clients.generate(m.served_by, request, timeout=TIMEOUT_S)
    timings = None
    async for msg in call:
        if msg.finish_reason:
            timings = msg.timings
    if timings is None:
        raise RuntimeError(f"the {mode} call ended without its timings")
    return {"prefill_s": timings.prefill_s, "decode_s": timings.decode_s,
            "decode_tokens": max(0, timings.generated_tokens - 1), "handoff_exposed_s": timings.handoff_exposed_s,
            "cached_tokens": timings.cached_tokens}
