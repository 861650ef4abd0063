"""The benchmark scripts import their parts as bench/ does when run (`python bench/serve.py`): put
bench/ on sys.path for the tests of those parts."""
from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
