"""tests/lanes.py's CPU laps: each lane's end reports the CPU its reaped processes used, the figure
that tells a lane that computes from one that waits."""
from __future__ import annotations

import subprocess
import sys

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
