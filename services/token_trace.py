"""Opt-in timestamps of each token's hops from the engine's step to the gateway's SSE write.

Off by default and then free: every call site checks `ON` (a module bool) before anything else.
With HYBRIDSERVE_TOKEN_TRACE=DIR each process that reads its settings calls `configure(DIR, name)`,
and every hop a token takes is kept in memory as (request id, hop, tokens so far, time); a request's
records are appended to DIR/<name>-<pid>.jsonl when that process is done with it, so no file is
written per token. Times are `time.perf_counter()`, CLOCK_MONOTONIC on Linux: one clock for every
process on the host, so bench/token_path.py can subtract the engine's times from the gateway's.

Hops, in order (`n`: the request's tokens up to and including this message's):
  engine: step_end (the loop's step returned), got (the gRPC thread has the event),
          sent (its message built and handed to gRPC), resumed (gRPC has sent it and asks for the next)
  gateway: recv (the message read from the call), detok (its text detokenized, stops applied),
           sse (the SSE chunk built, handed to the HTTP server)
and the loop's steps themselves (`step`, with start and end), for the engine's own step time.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

ON = False
_path: Path | None = None
_records: dict[str, list] = {}
_steps: list[tuple[float, float, int]] = []
_lock = threading.Lock()


def configure(directory: str | None, process: str) -> None:
    """Start tracing into `directory` (None: stay off)."""
    global ON, _path
    if not directory:
        return
    d = Path(directory).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    _path, ON = d / f"{process}-{os.getpid()}.jsonl", True


def mark(request_id: str, hop: str, n: int, t: float | None = None) -> None:
    """Record that the request's first `n` tokens passed `hop` (at `t`, default now)."""
    _records.setdefault(request_id, []).append((hop, n, time.perf_counter() if t is None else t))


def step(start: float, end: float, rows: int) -> None:
    """One engine step: its start, its end, the sequences in it."""
    _steps.append((start, end, rows))


def flush(request_id: str) -> None:
    """Append the request's records (and the steps so far) to this process's file."""
    records = _records.pop(request_id, None)
    steps = _steps[:]
    del _steps[:len(steps)]
    lines = [json.dumps({"rid": request_id, "hop": h, "n": n, "t": t}) for h, n, t in records or ()]
    lines += [json.dumps({"step": [s, e, r]}) for s, e, r in steps]
    if lines and _path is not None:
        with _lock, open(_path, "a") as f:
            f.write("\n".join(lines) + "\n")
