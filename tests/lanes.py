"""`make test`'s runner: the suite in two pytest processes side by side, then the tests that time the
machine, alone.

On 2 cores the suite ran test after test for ~13 minutes while the tests that start whole stacks
(`hybridserve up` with two to four engines, the serve and suite benchmarks' quick runs) spent much of
theirs waiting: for processes to start, for an engine to be found dead and come back, for streams
to finish. They run in one lane (`stack_lane`) while everything else runs in the other; the tests
whose verdict depends on the machine being quiet (a profile sweep judged quiet and cached, the router
corrected within ten requests against forced runs) run after both, alone (`quiet`). Which test goes
where is decided by path (`LANES` below; tests/conftest.py marks the tests), so a new `up` test joins
its lane by name, and the stacks and quiet lanes' pytest collect only their own files.
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

# the lanes, by node-id prefix (a file, a file-name prefix or a test): tests/conftest.py marks each test
# collected with its lane's name. Tests that start whole stacks of processes run beside the rest; tests
# whose verdict needs a quiet machine run after both, alone.
LANES = {
    "stack_lane": ("tests/stack/test_up_", "tests/stack/test_lifetime_live.py", "tests/bench/test_serve_quick.py",
                   "tests/bench/test_suite.py", "tests/kv/test_prefill_restart_live.py",
                   "tests/gateway/test_batching_live.py",
                   "tests/gateway/test_engine_failure.py", "tests/stack/test_hybrid_tcp.py", "tests/stack/test_cli.py",
                   "tests/engine/test_grpc_edge.py", "tests/harness/test_process.py",
                   "tests/gateway/test_engine_reconnect.py",
                   # the users of tests/stack's shared engine pair: it then starts in this lane only (the
                   # in-process lane was the long pole by ~110 s in a fresh clone's 15 min 17 s)
                   "tests/stack/test_hybrid.py", "tests/stack/test_kv_events_live.py",
                   "tests/stack/test_service_basics.py",
                   # and the users of tests/gateway's shared stack (test_calibration_check.py included: its
                   # verdict is a count of requests, not a time): from a fresh clone the in-process lane,
                   # which builds most of PoCL's kernels cold, ended 147-231 s after this one on a Xeon
                   "tests/gateway/test_api", "tests/gateway/test_calibration_check.py",
                   "tests/gateway/test_fuzz.py", "tests/gateway/test_prometheus.py",
                   # a process of its own building the default model's kernels into an empty PoCL cache
                   # (~25 s): from a fresh clone the in-process lane still ended last, by ~50 s
                   "tests/decode_fpga/test_pocl_builds.py",
                   # no stack, but K-quant engines whose kernels a fresh clone builds cold (~55 s): the
                   # in-process lane ended last with none of them here (878 s against 811), the stacks lane
                   # with all (722 against 662, an empty HOME, 2026-11-28): about half of it each
                   "tests/decode_fpga/test_kquant_engine.py::test_one_launch_layers_bit_for_bit_per_type[q4",
                   "tests/decode_fpga/test_kquant_engine.py::test_one_launch_layers_bit_for_bit_per_type[mixed]",
                   "tests/decode_fpga/test_kquant_engine.py::test_three_modes_give_transformers_tokens",
                   "tests/decode_fpga/test_kquant_engine.py::test_every_matrix_is_stored_in_its_own_format"),
    # (the one-launch checks: on a busy machine every one-launch step may give up, by design, and
    # "ran as one launch at least once" then fails; test_engine_loss: its kill must land while two
    # streams run, and beside the in-process lane one of them twice ended first)
    "quiet": ("tests/engine/test_profile_sweep.py", "tests/gateway/test_router_live.py",
              "tests/gateway/test_engine_loss.py",
              "tests/decode_fpga/test_paged_step.py::test_one_decode_row_runs_as_one_launch_bit_for_bit",
              "tests/decode_fpga/test_decode_layers.py::test_bit_for_bit_the_launch_by_launch_step"),
}

# (name, marks, the lane whose files it collects: None for all)
SIDE_BY_SIDE = (("stacks", "stack_lane and not quiet", "stack_lane"),
                ("in-process", "not stack_lane and not quiet", None))
ALONE = ("quiet", "quiet", "quiet")
NO_TESTS = 5  # pytest's status when a selection is empty: not a failure


def lane_files(lane: str) -> list[str]:
    """The test files holding a lane's prefixes: that lane's pytest collects only these (collecting all
    ~1,600 tests, imports included, took 22 s of CPU where the quiet lane's own five files took 11)."""
    files = set()
    for prefix in LANES[lane]:
        path = prefix.split("::")[0]
        found = [path] if path.endswith(".py") else [str(p.relative_to(ROOT)) for p in ROOT.glob(path + "*.py")]
        if not found or not all((ROOT / f).is_file() for f in found):
            raise FileNotFoundError(f"lane {lane!r}: no test file at {prefix!r}")
        files.update(found)
    return sorted(files)


def pytest_cmd(marks: str, extra: list[str], files: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-ra", "-m", marks, *extra, *files]


def side_by_side_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def files_of(lane: str | None, extra: list[str]) -> list[str]:
    """What a lane's pytest collects: its files, unless the caller named tests itself (then every lane
    collects those, each keeping its own marks) or the lane has none (all)."""
    named = any(a.startswith("tests") or "::" in a or a.endswith(".py") for a in extra)
    return lane_files(lane) if lane and not named else []


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
    (first, first_marks, first_files), (second, second_marks, second_files) = SIDE_BY_SIDE
    with tempfile.NamedTemporaryFile("w+", prefix=f"hybridserve-{first}-", suffix=".log") as log:
        print(f"== lanes: '{first}' (output below once it ends) beside '{second}' (output now)", flush=True)
        background = subprocess.Popen(pytest_cmd(first_marks, extra, files_of(first_files, extra)), cwd=ROOT, stdout=log,
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
            foreground = subprocess.call(pytest_cmd(second_marks, extra, files_of(second_files, extra)), cwd=ROOT, env=side_by_side_env())
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
    name, marks, files = ALONE
    print(f"== lane '{name}', alone:", flush=True)
    alone_started = time.monotonic()
    alone = subprocess.call(pytest_cmd(marks, extra, files_of(files, extra)), cwd=ROOT)
    print(f"== lane '{name}' took {time.monotonic() - alone_started:.0f} s (CPU {laps.lap():.0f} s)", flush=True)
    codes = {first: status(behind), second: status(foreground), name: status(alone)}
    print(f"== lanes done in {time.monotonic() - started:.0f} s: " + ", ".join(f"{k} {v}" for k, v in codes.items()),
          flush=True)
    return max(codes.values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
