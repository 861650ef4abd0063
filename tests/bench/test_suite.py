"""`python -m bench.suite --quick --url ...` measures every cell and mode of a running stack (the package's:
conftest.py) and writes JSON and plots."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_suite_writes_every_cell_and_mode_and_valid_pngs(tmp_path, bench_stack):
    url, _ = bench_stack
    cmd = [sys.executable, "-m", "bench.suite", "--quick", "--url", url, "--inputs", "16,64",
           "--outputs", "4,8", "--reps", "2", "--load-clients", "2", "--load-requests", "1", "--out", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=os.environ)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "router regret" in r.stdout
    data = json.loads((tmp_path / "suite.json").read_text())
    cells = {(c["n_in"], c["n_out"]): c for c in data["cells"]}
    assert set(cells) == {(16, 4), (16, 8), (64, 4), (64, 8)}
    for c in cells.values():
        assert set(c["modes"]) == {"gpu", "fpga", "hybrid", "auto"}
        for mode, m in c["modes"].items():
            assert m["e2e"]["n"] == 2 and 0 < m["e2e"]["min"] <= m["e2e"]["median"] <= m["e2e"]["max"]
            assert m["ran"] == [mode] * 2 if mode != "auto" else all(x in ("gpu", "fpga", "hybrid") for x in m["ran"])
        assert c["best_forced"] in ("gpu", "fpga", "hybrid") and c["transformers_s"]["median"] > 0
    assert set(data["load"]["results"]) == {"gpu", "fpga", "hybrid", "auto"}
    assert all(v["throughput_tok_s"] > 0 for v in data["load"]["results"].values())
    import matplotlib.image

    for name in ("suite_latency.png", "suite_regret.png", "suite_load.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        h, w = matplotlib.image.imread(png).shape[:2]
        assert h > 200 and w > 400
