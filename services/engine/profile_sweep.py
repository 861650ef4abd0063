"""The short stage-timing sweep each engine runs for the router, cached on disk.

Samples are `{"stage", "device", "n_in", "n_out", "seconds"}` as the router's
calibration file takes them; decode seconds are the total for n_out tokens.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

PREFILL_LENGTHS = (16, 64, 256)
DECODE_POINTS = ((16, 8), (256, 8))


def run_sweep(engine, device: str) -> list[dict]:
    rng = np.random.default_rng(0)
    vocab = engine.cfg.vocab_size
    _warm_up(engine)
    samples = []
    for n_in in PREFILL_LENGTHS:
        seq = engine.new_sequence(n_in + 1)
        try:
            t = time.perf_counter()
            engine.prefill(seq, rng.integers(3, vocab, n_in).tolist())
            samples.append({"stage": "prefill", "device": device, "n_in": n_in, "seconds": time.perf_counter() - t})
        finally:
            engine.release(seq)
    for n_in, n_out in DECODE_POINTS:
        seq = engine.new_sequence(n_in + n_out + 1)
        try:
            token = int(np.argmax(engine.prefill(seq, rng.integers(3, vocab, n_in).tolist())))
            t = time.perf_counter()
            for _ in range(n_out):
                token = engine.decode_greedy([seq], [token])[0]
            samples.append({"stage": "decode", "device": device, "n_in": n_in, "n_out": n_out,
                            "seconds": time.perf_counter() - t})
        finally:
            engine.release(seq)
    return samples


def _warm_up(engine) -> None:
    """First calls pay for lazy allocations and kernel set-up; keep them out of the samples."""
    seq = engine.new_sequence(16)
    try:
        token = int(np.argmax(engine.prefill(seq, list(range(3, 11)))))
        for _ in range(2):
            token = engine.decode_greedy([seq], [token])[0]
    finally:
        engine.release(seq)


def code_fingerprint(root: Path | None = None) -> str:
    """A short hash of the engines' code (every .py and .cl under services/): a cached profile
    measured with other kernels would mislead the router, so a code change reruns the sweep."""
    root = root or Path(__file__).parents[1]
    h = hashlib.sha1()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cl") and "__pycache__" not in p.parts):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def cached_sweep(cache_dir: str, key: str, run) -> list[dict]:
    """The samples cached under `key`, or run() and cache them. A corrupt cache is rerun."""
    path = Path(cache_dir).expanduser() / (key.replace("/", "_").replace(" ", "_") + ".json")
    if path.is_file():
        try:
            samples = json.loads(path.read_text())
            if isinstance(samples, list) and all(isinstance(s, dict) and "seconds" in s for s in samples):
                log.info("profile: %d samples from %s", len(samples), path)
                return samples
        except json.JSONDecodeError:
            log.warning("profile cache %s is corrupt; rerunning the sweep", path)
    log.info("profile: running the start-up sweep (%s)", key)
    samples = run()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(samples, indent=1))
    return samples
