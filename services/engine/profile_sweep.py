"""The short stage-timing sweep each engine runs for the router at start-up, cached on disk.

Samples are `{"stage", "device", "n_in", "n_out", "seconds"}` as the router's
calibration file takes them; decode seconds are the total for n_out tokens.

A sweep that cannot be fooled by the first calls or by a busy machine:
* one untimed pass over every point first (first calls pay for lazy allocations and,
  on PoCL, for specialising each kernel to its launch size);
* every point timed REPEATS times, the median kept; the decode points are timed right
  after the prefills of their context, so they cost no prefill of their own;
* the machine is judged busy, and the sweep not cached (profile_cache.py), when the
  repeats of a point disagree (spread = (max - min) / median over MAX_SPREAD) or when
  other processes used more than MAX_FOREIGN_LOAD of the machine's CPU meanwhile;
* a cached profile is checked at every start by `probe_verdict` (one prefill and one decode point).

A service times its engine through its engine loop (`LoopTimer`): the same path, batching
machinery and kernels as a request it serves. A tool without a service times an engine through a
loop of its own (one_request.local_loop). The sweep takes any timer: a `time_point(prompt, n_out)`
and the model's `cfg`.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
from pathlib import Path

import numpy as np

from services.engine.profile_cache import Profile, cached_sweep, sweep_lock

__all__ = ["run_sweep", "probe_verdict", "Profile", "profile_engine", "cached_sweep", "sweep_lock", "code_fingerprint", "Sweep"]

log = logging.getLogger(__name__)

PREFILL_LENGTHS = (16, 64, 256)
DECODE_CONTEXTS = (16, 256)  # decode is timed after the prefill of these lengths
DECODE_TOKENS = 4
REPEATS = 3
MAX_SPREAD = 1.0  # (max - min) / median of a point's repeats beyond which the machine was busy: a quiet
# 2-core machine here spread up to 0.77 on its few-ms decode points; a hog shows as foreign load too
MAX_FOREIGN_LOAD = 0.3  # share of all cores other processes used during the sweep
JUDGED_FROM_S = 0.002  # points shorter than this are timer and scheduler jitter: not judged for spread
PROBE_TOLERANCE = 2.0  # a cached profile off by more than this factor is measured again
PROBE_POINTS = ((16, DECODE_TOKENS),)  # (prefill length, decode tokens after it): both stages, cheaply


class Sweep(list):
    """The samples (a plain list, as the Profile RPC sends them) and how quiet the machine was."""

    spread: float = 0.0
    foreign_load: float = 0.0

    @property
    def busy(self) -> bool:
        return self.spread > MAX_SPREAD or self.foreign_load > MAX_FOREIGN_LOAD

    @property
    def verdict(self) -> str:
        return f"repeat spread {self.spread:.2f} (max {MAX_SPREAD}), other processes' CPU " \
               f"{self.foreign_load:.2f} (max {MAX_FOREIGN_LOAD})"


def run_sweep(timer, device: str, prefill_lengths=PREFILL_LENGTHS, decode_contexts=DECODE_CONTEXTS,
              decode_tokens: int = DECODE_TOKENS, repeats: int = REPEATS) -> Sweep:
    """Warm up, then time every point `repeats` times; one sample (the median) per point. A length
    past the model's context (a small model's) is timed at the longest prompt that fits instead."""
    prefill_lengths, decode_contexts = _fitting(timer, prefill_lengths, decode_tokens), \
        _fitting(timer, decode_contexts, decode_tokens)
    _timed_pass(timer, _prompts(timer, prefill_lengths), decode_contexts, decode_tokens)  # warm-up, discarded
    load = ForeignLoad()
    runs = [_timed_pass(timer, _prompts(timer, prefill_lengths), decode_contexts, decode_tokens)
            for _ in range(repeats)]
    out = Sweep()
    for point in runs[0]:
        times = np.array([r[point] for r in runs])
        med = float(np.median(times))
        if med >= JUDGED_FROM_S:
            out.spread = max(out.spread, float((times.max() - times.min()) / med))
        n_in, n_out = point
        if n_out:
            out.append({"stage": "decode", "device": device, "n_in": n_in, "n_out": n_out, "seconds": med})
        else:
            out.append({"stage": "prefill", "device": device, "n_in": n_in, "seconds": med})
    out.foreign_load = load.share()
    log.info("profile sweep %s: %s", device, out.verdict)
    return out


def _fitting(timer, lengths, decode_tokens: int) -> tuple[int, ...]:
    """`lengths` capped for the timer's context (a LoopTimer's loop's max_model_len, or the timer's
    max_context; no cap when neither is known)."""
    loop = getattr(timer, "loop", None)
    context = loop.config.max_model_len if loop is not None else getattr(timer, "max_context", None)
    return fitting_lengths(lengths, context, decode_tokens) if context else tuple(lengths)


def fitting_lengths(lengths, context: int, decode_tokens: int) -> tuple[int, ...]:
    """`lengths`, each capped to leave room in `context` for the first token and decode_tokens more (a
    small model's context cannot take every timed length: the longest prompt that fits instead)."""
    return tuple(dict.fromkeys(min(n, context - decode_tokens - 1) for n in lengths))


_PASSES = itertools.count()  # every pass of this process gets prompts of its own


def _prompts(timer, lengths) -> dict[int, list[int]]:
    """Prompts no earlier pass used: a repeat of the same prompt would be timed as a prefix-cache
    hit (the prefill of its last block only), and the router would believe prefill ~10x cheaper."""
    rng = np.random.default_rng(next(_PASSES))
    return {n: rng.integers(3, timer.cfg.vocab_size, n).tolist() for n in lengths}


def _timed_pass(timer, prompts: dict[int, list[int]], decode_contexts, decode_tokens: int) -> dict:
    """{(n_in, 0): prefill seconds, (n_in, n_out): decode seconds for n_out tokens}."""
    times = {}
    for n_in, prompt in prompts.items():
        n_out = decode_tokens if n_in in decode_contexts else 0
        times[(n_in, 0)], decode_s = timer.time_point(prompt, n_out)
        if n_out:
            times[(n_in, n_out)] = decode_s
    return times


class LoopTimer:
    """Times a point as a request through an engine loop (engine_loop.py): what serving costs."""

    def __init__(self, loop):
        self.loop, self.cfg = loop, loop.engine.cfg

    def time_point(self, prompt: list[int], n_out: int) -> tuple[float, float]:
        """(prefill seconds: scheduled → first token, seconds of the n_out tokens after the first)."""
        from services.engine.sampling import SamplingParams

        stream = self.loop.submit(prompt, SamplingParams(max_tokens=n_out + 1, temperature=0.0, ignore_eos=True))
        for _ in stream:
            pass
        return stream.timings.prefill_s, stream.timings.decode_s


class ForeignLoad:
    """The share of the machine's CPU that other processes used since construction (Linux; else 0)."""

    def __init__(self):
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait, in clock ticks
        own = os.times()
        return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.monotonic()

    def share(self) -> float:
        end = self._read()
        if self._start is None or end is None or end[2] - self._start[2] <= 0:
            return 0.0
        busy, own, wall = (e - s for e, s in zip(end, self._start))
        return max(0.0, busy - own) / (wall * (os.cpu_count() or 1))


def probe_verdict(timer, device: str, cached: list[dict]) -> str:
    """"agrees" when a quick quiet measurement of two points is within PROBE_TOLERANCE of the cached
    profile, "disagrees" when it is not, "busy" when the machine was too busy to tell (the cache is
    kept then: it passed the quiet-machine check when written, but this start did not confirm it)."""
    lengths = tuple(n for n, _ in PROBE_POINTS)
    decode_contexts = tuple(n for n, m in PROBE_POINTS if m)
    now = run_sweep(timer, device, lengths, decode_contexts, DECODE_TOKENS, repeats=REPEATS)
    if now.busy:
        log.info("profile probe %s: machine busy (%s); keeping the cache", device, now.verdict)
        return "busy"
    for s in now:
        ref = _per_unit(s, cached)
        if ref is None:
            log.info("profile probe %s: the cache lacks %s at %d tokens", device, s["stage"], s["n_in"])
            return "disagrees"
        ratio = _unit(s) / ref
        if not 1 / PROBE_TOLERANCE <= ratio <= PROBE_TOLERANCE:
            log.warning("profile probe %s: %s at %d tokens measures %.2fx the cache", device, s["stage"], s["n_in"],
                        ratio)
            return "disagrees"
    return "agrees"


def _unit(s: dict) -> float:
    return s["seconds"] / s["n_out"] if s["stage"] == "decode" else s["seconds"]


def _per_unit(s: dict, cached: list[dict]) -> float | None:
    """The cached time of the same point (decode: per token, any token count), median over matches."""
    same = [_unit(c) for c in cached if c.get("stage") == s["stage"] and c.get("device") == s["device"]
            and c.get("n_in") == s["n_in"] and (s["stage"] != "decode" or c.get("n_out"))]
    return float(np.median(same)) if same else None


def profile_engine(timer, device: str, cache_dir: str, key: str, attempts: int = 2,
                   keep_busy: bool = False) -> Profile:
    """The profile of the engine `timer` times: cached and probed, or measured (in turn with the other
    engine), a busy sweep retried until `attempts` ran (and kept apart with `keep_busy`)."""
    return cached_sweep(cache_dir, key, lambda: run_sweep(timer, device),
                        probe=lambda cached: probe_verdict(timer, device, cached), attempts=attempts,
                        keep_busy=keep_busy)


def code_fingerprint(root: Path | None = None) -> str:
    """A short hash of the engines' code (every .py and .cl under services/): a cached profile
    measured with other kernels would mislead the router, so a code change reruns the sweep."""
    root = root or Path(__file__).parents[1]
    h = hashlib.sha1()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cl") and "__pycache__" not in p.parts):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]
