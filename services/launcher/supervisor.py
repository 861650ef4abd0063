"""Keeps `hybridserve up`'s processes running: one that exits is started again, with backoff.

Each restart is logged and counted (`hybridserve_engine_restarts_total{service}`, on
`up`'s own metrics port). The delay before a restart doubles with every exit that comes
soon after a start (`backoff_s`, 2x, ... up to `backoff_max_s`) and falls back to
`backoff_s` once a process has run for `stable_s`. A child may follow another
(`ChildSpec.follows`): decode_fpga follows prefill_gpu, whose KV arena it maps, so when
prefill_gpu exits decode_fpga is stopped too and both start again, the follower only once
its leader answers its readiness probe. Only `stop_all` ends the supervision. Children may join
(`add`) and leave (`remove`) while it runs: the engines `up --autoscale` starts and stops.
"""
from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import Counter

RESTARTS = Counter("hybridserve_engine_restarts", "Processes of the stack started again after they exited",
                   ["service"])


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: list[str]
    env: dict[str, str]
    follows: str | None = None  # restarted with this child, and started only once it is ready
    ready: Callable[[], bool] = lambda: True  # readiness probe, for the children that follow this one


@dataclass
class _Child:
    spec: ChildSpec
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    quick_exits: int = 0  # exits in a row, each within stable_s of its start
    restart_at: float | None = None  # when to start it again (time.monotonic); None: running or not to start
    restarts: int = 0


@dataclass
class Supervisor:
    """`start_all`, then `poll()` every fraction of a second, then `stop_all`."""

    specs: list[ChildSpec]
    start: Callable[[ChildSpec], subprocess.Popen]  # starts one child (its output relayed by the caller)
    say: Callable[[str], None]
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    stable_s: float = 60.0
    stop_timeout_s: float = 20.0
    clock: Callable[[], float] = time.monotonic
    children: dict[str, _Child] = field(init=False)

    def __post_init__(self):
        self.children = {s.name: _Child(s) for s in self.specs}

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {n: c.proc for n, c in self.children.items() if c.proc is not None}

    def restarts(self, name: str) -> int:
        return self.children[name].restarts

    def start_all(self) -> None:
        for child in self.children.values():
            self._start(child)

    def add(self, spec: ChildSpec) -> None:
        """A child that joins now, started at once and from then on healed like the others."""
        if spec.name in self.children:
            raise ValueError(f"{spec.name} is supervised already")
        child = self.children[spec.name] = _Child(spec)
        self._start(child)

    def remove(self, name: str) -> None:
        """A child that leaves: stopped as in stop_all, never started again; its followers are not touched."""
        child = self.children.pop(name, None)
        if child is not None:
            child.restart_at = None
            self._stop(child)

    def exited(self) -> list[str]:
        """The children that are not running now (for the start-up phase, before supervision)."""
        return [n for n, c in self.children.items() if c.proc is None or c.proc.poll() is not None]

    def poll(self) -> None:
        """One round: notice exits, schedule their restarts, start what is due."""
        now = self.clock()
        for child in self.children.values():
            if child.proc is not None and child.proc.poll() is not None:
                self._exited(child, now)
        for child in self.children.values():
            if child.restart_at is not None and now >= child.restart_at and self._leader_ready(child):
                child.restarts += 1
                RESTARTS.labels(service=child.spec.name).inc()
                self.say(f"restarting {child.spec.name} (restart {child.restarts})")
                self._start(child)

    def stop_all(self, order: list[str]) -> None:
        """SIGTERM each running child in `order` (then SIGKILL after stop_timeout_s); nothing restarts."""
        for child in self.children.values():
            child.restart_at = None
        for name in order:
            self._stop(self.children[name])

    # ---- internals -------------------------------------------------------------------------
    def _start(self, child: _Child) -> None:
        child.proc, child.started_at, child.restart_at = self.start(child.spec), self.clock(), None

    def _exited(self, child: _Child, now: float) -> None:
        code, child.proc = child.proc.returncode, None
        child.quick_exits = child.quick_exits + 1 if now - child.started_at < self.stable_s else 1
        delay = min(self.backoff_max_s, self.backoff_s * 2 ** (child.quick_exits - 1))
        child.restart_at = now + delay
        self.say(f"{child.spec.name} exited ({_exit_text(code)}); starting it again in {delay:.1f}s")
        for follower in self.children.values():
            if follower.spec.follows == child.spec.name and follower.proc is not None:
                self.say(f"stopping {follower.spec.name} too: it restarts once {child.spec.name} is back "
                         f"(they share the KV arena)")
                self._stop(follower)
                follower.restart_at = now  # due at once, started when its leader is ready

    def _leader_ready(self, child: _Child) -> bool:
        leader = self.children.get(child.spec.follows) if child.spec.follows else None
        if leader is None:
            return True
        return leader.proc is not None and leader.proc.poll() is None and leader.spec.ready()

    def _stop(self, child: _Child) -> None:
        p, child.proc = child.proc, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
