"""`make test`'s runner: the suite in two pytest processes side by side, then the tests that time the
machine, alone.

On 2 cores the suite ran test after test for ~13 minutes while the tests that start whole stacks
(`hybridserve up` with two to four engines, the serve and suite benchmarks' quick runs) spent much of
theirs waiting: for processes to start, for an engine to be found dead and come back, for streams
to finish. They run in one lane (`stack_lane`) while everything else runs in the other; the tests
whose verdict depends on the machine being quiet (a profile sweep judged quiet and cached, the router
corrected within ten requests against forced runs) run after both, alone (`quiet`). Which test goes
where is decided by path in tests/conftest.py (`LANES`), so a new `up` test joins its lane by name.
Every test still runs once; the exit status is the worst of the three runs. Each lane's end says its
wall time and the CPU its processes used (theirs and their children's, as reaped): a lane whose CPU is
near its wall time computes, one well under it waits, which is what moving tests between lanes needs.

The two lanes side by side run torch on one thread each (OMP_NUM_THREADS=1, inherited by the engines
their stacks start) unless the caller set it: two lanes' worth of processes share 2 cores, and torch's
OpenMP team of 2 then waits at every barrier for a thread the other lane holds (measured beside one
spinning process: the torch batched-step tests 89 s with 2 threads, 50 s with 1, half the CPU). The
quiet lane keeps torch's default: it times the machine as a user's stack would see it.

    python tests/lanes.py [extra pytest arguments]
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIDE_BY_SIDE = (("stacks", "stack_lane and not quiet"), ("in-process", "not stack_lane and not quiet"))
ALONE = ("quiet", "quiet")
NO_TESTS = 5  # pytest's status when a selection is empty: not a failure


def pytest_cmd(marks: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-ra", "-m", marks, *extra]


def side_by_side_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def status(code: int) -> int:
    return 0 if code == NO_TESTS else code


class CpuLaps:
    """CPU seconds (user + sys) of this process's reaped children since the last lap: taken as each
    lane's process is reaped, one lap is that lane's processes (its engines included, once reaped)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._last = self._now()

    @staticmethod
    def _now() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    def lap(self) -> float:
        with self._lock:
            now = self._now()
            spent, self._last = now - self._last, now
            return spent


def main(extra: list[str]) -> int:
    started, laps, cpu = time.monotonic(), CpuLaps(), {}
    (first, first_marks), (second, second_marks) = SIDE_BY_SIDE
    with tempfile.NamedTemporaryFile("w+", prefix=f"hybridserve-{first}-", suffix=".log") as log:
        print(f"== lanes: '{first}' (output below once it ends) beside '{second}' (output now)", flush=True)
        background = subprocess.Popen(pytest_cmd(first_marks, extra), cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, env=side_by_side_env())
        # the one waiter of the background lane, which notes when it ended (not when the foreground got
        # round to asking): what balancing the lanes needs
        ended: list[float] = []
        def watch() -> None:
            background.wait()
            cpu[first] = laps.lap()
            ended.append(time.monotonic())

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            foreground = subprocess.call(pytest_cmd(second_marks, extra), cwd=ROOT, env=side_by_side_env())
            cpu[second] = laps.lap()
            print(f"== lane '{second}' ended ({foreground}) at {time.monotonic() - started:.0f} s "
                  f"(CPU {cpu[second]:.0f} s); waiting for '{first}'", flush=True)
            watcher.join()
            behind = background.returncode
        finally:
            if background.poll() is None:  # interrupted: never leave a lane (and its stacks) running
                background.terminate()
                background.wait()
        log.seek(0)
        print(f"== lane '{first}' ({behind}), ended at {ended[0] - started:.0f} s (CPU {cpu[first]:.0f} s):",
              flush=True)
        sys.stdout.write(log.read())
    name, marks = ALONE
    print(f"== lane '{name}', alone:", flush=True)
    alone_started = time.monotonic()
    alone = subprocess.call(pytest_cmd(marks, extra), cwd=ROOT)
    print(f"== lane '{name}' took {time.monotonic() - alone_started:.0f} s (CPU {laps.lap():.0f} s)", flush=True)
    codes = {first: status(behind), second: status(foreground), name: status(alone)}
    print(f"== lanes done in {time.monotonic() - started:.0f} s: " + ", ".join(f"{k} {v}" for k, v in codes.items()),
          flush=True)
    return max(codes.values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
