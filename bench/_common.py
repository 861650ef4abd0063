"""What every benchmark shares: statistics, a terminal table, JSON under bench/results, plots."""
from __future__ import annotations

import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def machine() -> dict:
    import torch

    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write_json(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    out = (out_dir or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    print(f"wrote {path}")
    return path


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def memory_bandwidth_gbs(mb: int = 512, reps: int = 5) -> float:
    """numpy copy of a buffer much larger than the caches: (read + write) bytes / time, median."""
    import numpy as np

    a = np.ones(mb << 18, np.float32)
    b = np.empty_like(a)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return 2 * a.nbytes / statistics.median(times) / 1e9


def _busy(stop, duty: float) -> None:
    """Busy for `duty` of every 10 ms until stop is set."""
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < 0.01 * duty:
            pass
        if duty < 1:
            time.sleep(0.01 * (1 - duty))


class CpuHog:
    """`procs` busy processes (busy `duty` of the time), as a compile running beside the stack would be."""

    def __init__(self, procs: int, duty: float = 1.0):
        self.stop = multiprocessing.Event()
        self.procs = [multiprocessing.Process(target=_busy, args=(self.stop, duty), daemon=True)
                      for _ in range(procs)]

    def __enter__(self):
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.join(10)


def checkout_env(tree: Path) -> dict[str, str]:
    """The environment of a child process that runs checkout `tree`'s code: its directory first on the path
    and the working directory never prepended (PYTHONSAFEPATH), so `python -m` from this checkout's root
    imports the other checkout's `services` (the A/B micro-benchmarks of an earlier commit)."""
    return {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)])}
