"""`make test`'s runner: the suite in three pytest processes side by side, then the tests that time the
machine, alone.

On 2 cores the suite ran test after test for ~13 minutes while the tests that start whole stacks
(`hybridserve up` with two to four engines, the serve and suite benchmarks' quick runs) spent much of
theirs waiting: for processes to start, for an engine to be found dead and come back, for streams
to finish. They run in one lane (`stack_lane`) while everything else runs in two others (the engines'
tests, and the rest: `SIDE_BY_SIDE`); the tests whose verdict depends on the machine being quiet (a
profile sweep judged quiet and cached, the router corrected within ten requests against forced runs)
run after them, alone (`quiet`). Which test goes
where is decided by path (`LANES` below; tests/conftest.py marks the tests), so a new `up` test joins
its lane by name, and each lane's pytest but the rest's collects only its own files.
Every test still runs once; the exit status is the worst of the four runs. Each lane's end says its
wall time and the CPU its processes used (theirs and their children's, as reaped): a lane whose CPU is
near its wall time computes, one well under it waits, which is what moving tests between lanes needs.

The lanes side by side run torch on one thread each (OMP_NUM_THREADS=1, inherited by the engines
their stacks start) unless the caller set it: the lanes' processes share 2 cores, and torch's
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

# the lanes, by node-id prefix (a directory, a file, a file-name prefix or a test): tests/conftest.py marks
# each test collected with the lane of the longest prefix it has (lane_of), none for the in-process rest.
# Tests that start whole stacks of processes run beside the rest; tests whose verdict needs a quiet
# machine run after all, alone.
LANES = {
    "stack_lane": ("tests/stack/test_up_", "tests/stack/test_lifetime_live.py", "tests/bench/test_serve_quick.py",
                   "tests/bench/test_suite.py", "tests/kv/test_prefill_restart_live.py",
                   "tests/gateway/test_engine_failure.py",
                   "tests/engine/test_grpc_edge.py", "tests/harness/test_process.py",
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
                   "tests/decode_fpga/test_kquant_engine.py::test_every_matrix_is_stored_in_its_own_format",
                   # a fresh clone on a 2-vCPU Xeon (2026-11-30): the in-process lane ended at 945 s, this one
                   # at 679; these two in-process tests took 86 s and 70 s there
                   "tests/prefill_gpu/test_batched_step.py", "tests/gateway/test_batching_live.py"),
    # (the one-launch checks: on a busy machine every one-launch step may give up, by design, and
    # "ran as one launch at least once" then fails; test_engine_loss: its kill must land while two
    # streams run, and beside the in-process lane one of them twice ended first)
    "quiet": ("tests/engine/test_profile_sweep.py", "tests/gateway/test_router_live.py",
              "tests/gateway/test_engine_loss.py",
              "tests/decode_fpga/test_paged_step.py::test_one_decode_row_runs_as_one_launch_bit_for_bit",
              "tests/decode_fpga/test_decode_layers.py::test_bit_for_bit_the_launch_by_launch_step"),
    # the engines' own tests (the OpenCL engine's, the KV's, the engine loop's), and two `up` tests of
    # four engines each: with these the stacks lane ended at 649 s where it had at 697, against the
    # other lanes' 597 and 613 where they had 592 and 476 (fresh clones, 2026-11-28). (test_hybrid_tcp.py
    # and test_cli.py, ~27 s with their own engines, then left the stacks lane for the in-process rest.)
    "engine_lane": ("tests/decode_fpga/", "tests/kv/", "tests/engine/", "tests/stack/test_up_pools.py",
                    "tests/stack/test_up_pairs.py",
                    # round 4 added three stack tests (readiness from a cold start, NIXL, the planner on the
                    # shared stack) and the stacks lane ended at 1002 s against 659 and 651 (a fresh clone,
                    # 2026-11-29, serve_quick also running a built llama-server): two move here, and the
                    # batching and reconnect tests (~80 s, their own engines) to the in-process rest
                    "tests/stack/test_up_ready.py", "tests/stack/test_up_nixl.py"),
}


def lane_of(nodeid: str) -> str | None:
    """The lane of the longest prefix of LANES that `nodeid` starts with; None: the in-process rest."""
    best = max(((len(p), lane) for lane, prefixes in LANES.items() for p in prefixes if nodeid.startswith(p)),
               default=(0, None))
    return best[1]

# the lanes run side by side: (name, lane of LANES: its marks and files; None, the in-process rest: the
# tests of no lane, collected from all but the engine lane's directories). The in-process tests were one
# lane: run alone it kept one core busy (617 s wall for ~600 s of CPU on 2 cores: its torch and
# transformers runs are on one thread), so beside the stacks lane, which waits now and then, the second
# core sat idle ~10% of the time
SIDE_BY_SIDE = (("stacks", "stack_lane"), ("engines", "engine_lane"), ("in-process", None))
ALONE = ("quiet", "quiet")
NO_TESTS = 5  # pytest's status when a selection is empty: not a failure


def lane_files(lane: str) -> list[str]:
    """The test files holding a lane's prefixes: that lane's pytest collects only these (collecting all
    ~1,600 tests, imports included, took 22 s of CPU where the quiet lane's own five files took 11)."""
    files = set()
    for prefix in LANES[lane]:
        path = prefix.split("::")[0]
        found = [path] if (ROOT / path).is_file() else [str(p.relative_to(ROOT)) for p in ROOT.glob(path + "*.py")
                                                         if p.name.startswith("test_")]
        if not found:
            raise FileNotFoundError(f"lane {lane!r}: no test file at {prefix!r}")
        files.update(found)
    return sorted(files)


def pytest_cmd(lane: str | None, extra: list[str]) -> list[str]:
    """A lane's pytest: the tests marked with its lane (the rest: those of none) among what it collects."""
    marks = lane or " and ".join(f"not {other}" for other in LANES)
    return [sys.executable, "-m", "pytest", "-q", "-ra", "-m", marks, *extra, *files_of(lane, extra)]


def side_by_side_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def named_tests(extra: list[str]) -> bool:
    """Whether the caller named tests (paths or node ids) among pytest's arguments."""
    return any(a.startswith("tests") or "::" in a or a.endswith(".py") for a in extra)


def files_of(lane: str | None, extra: list[str]) -> list[str]:
    """What a lane's pytest is given to collect: its lane's files, or, for the rest, everything but the
    directories the engine lane takes whole (--ignore's); where the caller named tests, those (the
    arguments themselves: []), each lane running those of its own marks."""
    if named_tests(extra):
        return []
    if lane is None:
        return [f"--ignore={p.rstrip('/')}" for p in LANES["engine_lane"] if p.endswith("/")]
    return lane_files(lane)


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
    started, laps, cpu, ended, codes = time.monotonic(), CpuLaps(), {}, {}, {}
    *behind, (front, front_lane) = SIDE_BY_SIDE
    print(f"== lanes: {', '.join(repr(n) for n, _ in behind)} (output below once each ends) beside "
          f"'{front}' (output now)", flush=True)
    logs = {name: tempfile.NamedTemporaryFile("w+", prefix="hybridserve-lane-", suffix=".log")
            for name, _ in behind}
    procs: dict[str, subprocess.Popen] = {}

    def watch(name: str) -> None:
        # each lane's one waiter, which notes when it ended (not when the foreground got round to
        # asking): what balancing the lanes needs; its CPU is the lap taken as it is reaped (two lanes
        # reaped within the same instant would share theirs: a figure to read, not a verdict)
        codes[name] = procs[name].wait()
        cpu[name], ended[name] = laps.lap(), time.monotonic() - started

    try:
        for name, lane in behind:
            procs[name] = subprocess.Popen(pytest_cmd(lane, extra), cwd=ROOT, stdout=logs[name],
                                           stderr=subprocess.STDOUT, env=side_by_side_env())
        watchers = [threading.Thread(target=watch, args=(name,), daemon=True) for name in procs]
        for w in watchers:
            w.start()
        codes[front] = subprocess.call(pytest_cmd(front_lane, extra), cwd=ROOT, env=side_by_side_env())
        cpu[front] = laps.lap()
        print(f"== lane '{front}' ended ({codes[front]}) at {time.monotonic() - started:.0f} s "
              f"(CPU {cpu[front]:.0f} s); waiting for the others", flush=True)
        for w in watchers:
            w.join()
    finally:
        for p in procs.values():
            if p.poll() is None:  # interrupted: never leave a lane (and its stacks) running
                p.terminate()
                p.wait()
    for name, log in logs.items():
        log.seek(0)
        print(f"== lane '{name}' ({codes[name]}), ended at {ended[name]:.0f} s (CPU {cpu[name]:.0f} s):",
              flush=True)
        sys.stdout.write(log.read())
        log.close()
    name, lane = ALONE
    print(f"== lane '{name}', alone:", flush=True)
    alone_started = time.monotonic()
    codes[name] = subprocess.call(pytest_cmd(lane, extra), cwd=ROOT)
    print(f"== lane '{name}' took {time.monotonic() - alone_started:.0f} s (CPU {laps.lap():.0f} s)", flush=True)
    codes = {k: status(v) for k, v in codes.items()}
    print(f"== lanes done in {time.monotonic() - started:.0f} s: " + ", ".join(f"{k} {v}" for k, v in codes.items()),
          flush=True)
    return max(codes.values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
