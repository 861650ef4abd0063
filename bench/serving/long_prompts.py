"""Chunked prefill's test: the inter-token latency of running streams while long prompts arrive.

`streams` requests with long outputs start together; once each has its first token, one more client
sends long prompts (short outputs) back to back until the streams end (bounded in count and time).
Without chunked prefill, each arrival's whole prefill runs between two decode steps of every stream
and shows up as an ITL spike; with it, the prefill is cut into chunks that share steps with the
decodes. The same streams run once quiet (no arrivals) as the reference. `at_once` long prompts arrive
together (a wave) and the next wave once they are all answered: 1 is one at a time.

Beside p50 and p99 of the streams' gaps, what a user feels: the largest gap, and the share of gaps over
SMOOTH_S (150 ms: the target the long-prompt issue set).
"""
from __future__ import annotations

import asyncio
import time

from bench.serving.client import Target, async_client, one_request
from bench.serving.stats import first_distinct, pct

SMOOTH_S = 0.150  # a gap longer than this is one a reader of the stream notices


async def streams_with_arrivals(target: Target, streams: list, long_prompts: list, long_out: int, arrive: bool,
                                prepare, max_arrivals: int = 200, time_limit: float = 600, at_once: int = 1) -> dict:
    """One run: the streams' results and, when `arrive`, the long prompts' results."""
    started, all_started = 0, asyncio.Event()

    def on_first() -> None:
        nonlocal started
        started += 1
        if started == len(streams):
            all_started.set()

    arrivals: list[dict] = []
    async with async_client(len(streams) + at_once) as client:
        tasks = [asyncio.create_task(one_request(client, target, prepare(p), n, on_first)) for p, n in streams]

        async def injector() -> None:
            # start once every stream is decoding (or one has already ended, e.g. with an error)
            waiter = asyncio.create_task(all_started.wait())
            await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            deadline = time.monotonic() + time_limit
            while not all(t.done() for t in tasks) and len(arrivals) < max_arrivals and time.monotonic() < deadline:
                wave = [long_prompts[(len(arrivals) + i) % len(long_prompts)] for i in range(at_once)]
                arrivals.extend(await asyncio.gather(*(one_request(client, target, prepare(prompt), long_out)
                                                       for prompt in wave)))

        injecting = asyncio.create_task(injector()) if arrive else None
        results = await asyncio.gather(*tasks)
        if injecting:
            await injecting
    return summarize_arrivals(results, arrivals)


def summarize_arrivals(streams: list[dict], arrivals: list[dict]) -> dict:
    ok = [r for r in streams if r["error"] is None]
    gaps = [g for r in ok for g in r["itl"]]
    landed = [r for r in arrivals if r["error"] is None]
    return {"stream_itl_p50": pct(gaps, 50), "stream_itl_p99": pct(gaps, 99),
            "stream_itl_max": max(gaps) if gaps else None,
            "stream_gaps_over_150ms": sum(g > SMOOTH_S for g in gaps) / len(gaps) if gaps else None,
            "stream_errors": len(streams) - len(ok),
            "arrivals": len(landed), "arrival_errors": len(arrivals) - len(landed),
            "arrival_ttft_p50": pct([r["ttft"] for r in landed], 50),
            "arrival_ttft_p99": pct([r["ttft"] for r in landed], 99),
            "error_messages": first_distinct(r["error"] for r in streams + arrivals if r["error"])}
