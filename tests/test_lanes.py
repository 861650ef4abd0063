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
    assert all(lanes.files_of(lane, named) == [] for lane in ("quiet", "engine_lane", None))


def test_a_test_is_in_the_lane_of_its_longest_prefix_and_that_lane_collects_its_file():
    from tests import lanes

    assert lanes.lane_of("tests/stack/test_up_heals.py::test_x") == "stack_lane"
    assert lanes.lane_of("tests/stack/test_up_pools.py::test_x") == "engine_lane"  # longer than test_up_
    assert lanes.lane_of("tests/decode_fpga/test_pocl_builds.py::test_x") == "stack_lane"
    assert lanes.lane_of("tests/decode_fpga/test_paged_step.py::test_one_decode_row_runs_as_one_launch_bit_for_bit") \
        == "quiet"
    assert lanes.lane_of("tests/decode_fpga/test_paged_step.py::test_step_gives_transformers_tokens") == "engine_lane"
    assert lanes.lane_of("tests/model/test_gguf_file.py::test_x") is None
    ignored = [a.removeprefix("--ignore=") + "/" for a in lanes.files_of(None, [])]
    for path in sorted(lanes.ROOT.glob("tests/**/test_*.py")):
        f = str(path.relative_to(lanes.ROOT))
        lane = lanes.lane_of(f + "::test_x")
        if lane is not None:
            assert f in lanes.lane_files(lane), f
        # what the rest's pytest does not collect, a lane does
        assert lane is not None or not f.startswith(tuple(ignored)), f
