"""The start-up profile's cache on disk, and the lock that makes the engines profile in turn.

Two engines timing themselves at once on the same cores measure each other, so every
sweep (and every probe of a cached one) runs under one cross-process lock, a `flock` on
a file in the cache directory both engines share: they take turns.

A sweep that says the machine was busy while it ran (see `Sweep.busy`) is never cached:
it is retried after a pause, and if every attempt is busy the least noisy one serves
this run only; the next start measures again. A cached profile is checked at every
start by a quick probe when one is given, and measured again when the probe disagrees.

With `keep_busy` a busy sweep is kept too, in a file of its own (`<key>.busy.json`), for
machines that are never quiet (a test suite starting dozens of engines): the next start
probes it and keeps it while the probe finds the machine busy, never calling it quiet,
and sweeps again to replace it once a probe could tell (quiet now, or a profile off).

What comes back says whether it is `quiet`: timed on a quiet machine in this process (a
sweep that was not busy, or a cached profile a quiet probe agreed with now). The router
trusts a quiet profile as it trusts a measured request; any other (every attempt busy, a
cache kept because the probe could not tell) it checks with requests first.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import time
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)

LOCK_NAME = ".sweep.lock"


class Profile(list):
    """A profile's samples, and whether they were timed (or confirmed) on a quiet machine."""

    def __init__(self, samples=(), quiet: bool = False):
        super().__init__(samples)
        self.quiet = quiet


@contextlib.contextmanager
def sweep_lock(cache_dir: str) -> Iterator[None]:
    """Held around anything that times an engine; blocks while another process holds it."""
    path = Path(cache_dir).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    with open(path / LOCK_NAME, "a+") as f:
        waited = time.perf_counter()
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        waited = time.perf_counter() - waited
        if waited > 0.5:
            log.info("profile: waited %.1f s for the other engine's sweep", waited)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def cache_path(cache_dir: str, key: str) -> Path:
    return Path(cache_dir).expanduser() / (key.replace("/", "_").replace(" ", "_") + ".json")


def read_cached(path: Path) -> list[dict] | None:
    """The cached samples, or None when absent or corrupt."""
    if not path.is_file():
        return None
    try:
        samples = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        log.warning("profile cache %s is corrupt; rerunning the sweep", path)
        return None
    if isinstance(samples, list) and samples and all(isinstance(s, dict) and "seconds" in s for s in samples):
        return samples
    log.warning("profile cache %s holds no samples; rerunning the sweep", path)
    return None


def _write(path: Path, samples: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([dict(s) for s in samples], indent=1))
    tmp.replace(path)  # a reader never sees half a file


def _noise(samples) -> float:
    return float(getattr(samples, "spread", 0.0)) + float(getattr(samples, "foreign_load", 0.0))


def busy_path(path: Path) -> Path:
    """Where a busy sweep of `path`'s key is kept (with keep_busy)."""
    return path.with_suffix(".busy.json")


def cached_sweep(cache_dir: str, key: str, run: Callable[[], list[dict]],
                 probe: Callable[[list[dict]], str] | None = None,
                 attempts: int = 2, retry_wait_s: float = 5.0, keep_busy: bool = False) -> Profile:
    """The samples cached under `key` (kept unless `probe(cached)` says "disagrees" or False),
    else run()'s, as a `Profile`.

    run() returns a list of samples; when it also carries `busy` (a `Sweep`), a busy sweep
    is retried up to `attempts` times and never cached as quiet (with keep_busy, the least noisy is
    kept apart; see the module's docstring). probe() answers "agrees" (quiet and
    within its tolerance), "busy" (it could not tell: the cache is kept, not confirmed) or
    "disagrees". All of it under `sweep_lock`.
    """
    path = cache_path(cache_dir, key)
    with sweep_lock(cache_dir):
        cached = read_cached(path)
        if cached is not None:
            verdict = "busy" if probe is None else probe(cached)
            if verdict != "disagrees":
                log.info("profile: %d samples from %s (%s)", len(cached), path,
                         "confirmed by a quiet probe" if verdict == "agrees" else "not confirmed now")
                return Profile(cached, quiet=verdict == "agrees")
            log.warning("profile: the quick probe disagrees with %s by more than 2x; profiling again", path)
        rough = read_cached(busy_path(path)) if keep_busy else None
        if rough is not None:
            verdict = "busy" if probe is None else probe(rough)
            if verdict == "busy":
                log.info("profile: %d samples from %s (timed on a busy machine; busy now too: kept, not quiet)",
                         len(rough), busy_path(path))
                return Profile(rough, quiet=False)
            log.info("profile: a probe could tell now (%s); sweeping to replace the busy profile", verdict)
        log.info("profile: running the start-up sweep (%s)", key)
        noisy = []
        for attempt in range(max(1, attempts)):
            samples = run()
            if not getattr(samples, "busy", False):
                _write(path, samples)
                busy_path(path).unlink(missing_ok=True)
                return Profile(samples, quiet=True)
            noisy.append(samples)
            log.warning("profile: the machine was busy during sweep %d/%d (%s); not cached", attempt + 1,
                        attempts, getattr(samples, "verdict", "noisy repeats"))
            if attempt + 1 < attempts:
                time.sleep(retry_wait_s)
        least_noisy = min(noisy, key=_noise)
        if keep_busy:
            _write(busy_path(path), least_noisy)
            log.info("profile: the least noisy busy sweep is kept in %s (never called quiet)", busy_path(path))
        return Profile(least_noisy, quiet=False)
