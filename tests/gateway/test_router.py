"""The router from synthetic samples with known costs: exact picks, estimates within 10%."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.gateway.routing.router import Router
from services.gateway.routing.samples import samples_from_timings
from services.modes import MODE_NAMES as MODES

# the truth: seconds as functions of prompt and output length
PREFILL = {"gpu": lambda n: 0.02 + 0.0015 * n, "fpga": lambda n: 0.01 + 0.012 * n}
PER_TOKEN = {"gpu": lambda ctx: 0.045 + 2e-6 * ctx, "fpga": lambda ctx: 0.016 + 3e-6 * ctx}
HANDOFF = lambda n: 0.05 + 1e-4 * n  # noqa: E731  (a costly link, so gpu-only wins short outputs)


def truth(mode, n_in, n_out):
    pre = PREFILL["gpu" if mode in ("gpu", "hybrid") else "fpga"](n_in)
    dec = n_out * PER_TOKEN["gpu" if mode == "gpu" else "fpga"](n_in + n_out / 2)
    return pre + dec + (HANDOFF(n_in) if mode == "hybrid" else 0.0)


def synthetic_samples():
    s = []
    for dev in ("gpu", "fpga"):
        for n in (16, 64, 256, 1024):
            s.append({"stage": "prefill", "device": dev, "n_in": n, "seconds": PREFILL[dev](n)})
        for n, m in ((16, 8), (256, 8), (1024, 32)):
            s.append({"stage": "decode", "device": dev, "n_in": n, "n_out": m,
                      "seconds": m * PER_TOKEN[dev](n + m / 2)})
    s += [{"stage": "handoff", "n_in": n, "seconds": HANDOFF(n)} for n in (16, 256, 1024)]
    return s


GRID = [(n_in, n_out) for n_in in (1, 8, 64, 256, 512, 1024, 2048) for n_out in (1, 4, 16, 64, 256, 512)]


def test_picks_the_truly_fastest_mode_over_a_grid():
    router = Router(synthetic_samples(), explore_share=0)  # the estimates alone: no exploration
    for n_in, n_out in GRID:
        best = min(MODES, key=lambda m: truth(m, n_in, n_out))
        assert router.choose(n_in, n_out).mode == best, (n_in, n_out)


def test_estimates_within_ten_percent():
    router = Router(synthetic_samples())
    for n_in, n_out in GRID:
        est = router.estimates(n_in, n_out)
        for mode in MODES:
            assert abs(est[mode] - truth(mode, n_in, n_out)) <= 0.10 * truth(mode, n_in, n_out), (mode, n_in, n_out)


def test_each_mode_wins_somewhere():
    """The grid is not degenerate: the router's choice depends on both lengths."""
    router = Router(synthetic_samples(), explore_share=0)
    assert {router.choose(n_in, n_out).mode for n_in, n_out in GRID} == set(MODES)


def test_forced_and_fallback_reasons():
    router = Router(synthetic_samples())
    assert router.choose(64, 64, forced="fpga").reason == "forced"
    d = router.choose(2048, 512, available=("gpu",))
    assert (d.mode, d.reason) == ("gpu", "fallback") and set(d.estimates) == {"gpu"}
    with pytest.raises(LookupError):
        router.choose(10, 10, available=())


def test_online_samples_move_the_model():
    router = Router(synthetic_samples(), refit_every=1)
    before = router.estimates(256, 64)["fpga"]
    for _ in range(50):  # the fpga decode got 3x slower in practice
        router.observe(samples_from_timings("fpga", 256, {"prefill_s": PREFILL["fpga"](256), "decode_tokens": 64,
                                                          "decode_s": 3 * 64 * PER_TOKEN["fpga"](288)}))
    # the start-up samples stay in the fit, so the estimate moves most but not all the way (3x)
    assert router.estimates(256, 64)["fpga"] > 1.3 * before


def test_queueing_adds_to_the_busy_engine():
    router = Router(synthetic_samples())
    quiet = router.estimates(64, 64)
    router.finished("gpu", 2.0)  # mean latency 2 s
    router.started("gpu")
    busy = router.estimates(64, 64)
    assert busy["gpu"] > quiet["gpu"] + 1.5 and busy["fpga"] == quiet["fpga"]


def test_cli_prints_mode_and_estimates(tmp_path):
    f = tmp_path / "cal.json"
    f.write_text(json.dumps(synthetic_samples()))
    out = subprocess.run([sys.executable, "-m", "services.gateway.routing", "--calibration", str(f), "--n-in", "1024",
                          "--n-out", "512"], capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    assert got["mode"] == min(MODES, key=lambda m: truth(m, 1024, 512))
    assert set(got["estimates"]) == set(MODES)


def test_cli_bad_file_is_a_clear_error(tmp_path):
    f = tmp_path / "cal.json"
    f.write_text("{not json")
    r = subprocess.run([sys.executable, "-m", "services.gateway.routing", "--calibration", str(f), "--n-in", "1",
                        "--n-out", "1"], capture_output=True, text=True)
    assert r.returncode == 2 and "router: error" in r.stderr
