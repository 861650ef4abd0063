"""tests/lanes.py's CPU laps: each lane's end reports the CPU its reaped processes used, the figure
that tells a lane that computes from one that waits."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.lanes import CpuLaps

BURN = "import time\nwhile time.process_time() < {s}: pass\n"  # until the child itself has used s CPU seconds


def test_a_lap_is_the_cpu_of_the_children_reaped_since_the_last_one():
    laps = CpuLaps()
    subprocess.run([sys.executable, "-c", BURN.format(s=0.5)], check=True)
    first = laps.lap()
    assert first >= 0.5
    assert laps.lap() < 0.5  # nothing reaped since: the first child is not counted again
    subprocess.run([sys.executable, "-c", BURN.format(s=0.3)], check=True)
    assert 0.3 <= laps.lap() < first + 0.3


def test_each_lane_collects_the_files_of_all_its_prefixes_and_a_wrong_prefix_is_an_error(monkeypatch):
    from tests import lanes

    for lane, prefixes in lanes.LANES.items():
        files = lanes.lane_files(lane)
        assert all(any(f.startswith(p.split("::")[0]) for f in files) for p in prefixes), lane
        assert all(any(f.startswith(p.split("::")[0]) for p in prefixes) for f in files), lane
    assert "tests/gateway/test_api_logprobs.py" in lanes.lane_files("stack_lane")  # a file-name prefix
    monkeypatch.setitem(lanes.LANES, "stack_lane", ("tests/stack/test_no_such_",))
    with pytest.raises(FileNotFoundError, match="test_no_such_"):
        lanes.lane_files("stack_lane")


def test_tests_named_on_the_command_line_are_what_every_lane_collects():
    from tests import lanes

    assert lanes.files_of("quiet", ["--durations=15"]) == lanes.lane_files("quiet")
    named = ["-k", "sweep", "tests/engine/test_profile_sweep.py"]
    assert lanes.files_of("quiet", named) == [] and lanes.files_of("engine_dirs", named) == []
    assert lanes.files_of("not_engine_dirs", named) is None  # the split's first half runs them all


def test_the_in_process_split_covers_every_test_once():
    from tests import lanes

    engines, rest = lanes.files_of("engine_dirs", []), lanes.files_of("not_engine_dirs", [])
    assert rest == [f"--ignore={d}" for d in engines] and all((lanes.ROOT / d).is_dir() for d in engines)
