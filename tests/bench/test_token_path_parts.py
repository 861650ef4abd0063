"""bench/token_path.py's and bench/guidellm_compare.py's pure parts: joining the processes' trace
records into per-hop latencies, and reading guidellm's report."""
from __future__ import annotations

import pytest

from bench import guidellm_compare, token_path


def test_hops_are_joined_by_request_and_token_count():
    # two tokens; token 2's step ran 10.000-10.004, then each hop 1 ms after the one before
    hops = {"r": {"step_end": {1: 9.0, 2: 10.004}, "got": {1: 9.1, 2: 10.005}, "sent": {1: 9.2, 2: 10.006},
                  "recv": {1: 9.3, 2: 10.007}, "detok": {1: 9.4, 2: 10.008}, "sse": {1: 9.5, 2: 10.009}}}
    steps = [(8.99, 9.0, 1), (10.0, 10.004, 1)]
    r = token_path.analyse([{"rid": "r", "client": [9.6, 10.010], "after": "sse"}], hops, steps)
    assert r["step_ms_p50"] == pytest.approx(4.0)
    assert r["period_ms_p50"] == pytest.approx(1004.0)
    assert all(v == pytest.approx(1.0) for v in r["hop_ms_p50"].values()), r["hop_ms_p50"]
    assert r["step_end_to_client_ms_p50"] == pytest.approx(6.0)
    assert r["itl_ms_p50"] == pytest.approx(410.0) and r["server_itl_ms_p50"] == pytest.approx(509.0)


def test_guidellm_report_figures():
    dist = lambda med, p99: {"successful": {"median": med, "percentiles": {"p99": p99}}}  # noqa: E731
    report = {"benchmarks": [{"metrics": {
        "output_tokens_per_second": {"successful": {"mean": 120.0}},
        "requests_per_second": {"successful": {"mean": 2.0}},
        "time_to_first_token_ms": dist(50.0, 90.0), "inter_token_latency_ms": dist(8.0, 20.0),
        "request_latency": dist(1.5, 2.5), "request_totals": {"successful": 16, "errored": 0, "incomplete": 0}}}]}
    s = guidellm_compare.summary(report)
    assert s["output_tokens_per_s"] == 120.0 and s["ttft_ms"] == {"p50": 50.0, "p99": 90.0}
    assert s["itl_ms"]["p50"] == 8.0 and s["requests"]["successful"] == 16


def test_guidellm_cached_share_is_what_the_server_said_it_cached():
    # llama-server's second profile once found 127 of 128 prompt tokens cached: the figure says so
    reqs = [{"prompt_tokens": 128, "cached_tokens": 127}, {"prompt_tokens": 128, "cached_tokens": 0}]
    assert guidellm_compare._cached_share({"requests": {"successful": reqs}}) == pytest.approx(127 / 256)
    silent = [{"prompt_tokens": 128, "cached_tokens": None}]
    assert guidellm_compare._cached_share({"requests": {"successful": silent}}) is None


def test_guidellm_rounds_are_summarised_by_their_medians():
    rounds = [{"tps": 100.0, "ttft": {"p50": 50.0}, "cached": None},
              {"tps": 140.0, "ttft": {"p50": 30.0}, "cached": None},
              {"tps": 120.0, "ttft": {"p50": 90.0}, "cached": 0.5}]
    assert guidellm_compare.median_over_rounds(rounds) == {"tps": 120.0, "ttft": {"p50": 50.0}, "cached": 0.5}


def test_guidellm_scenarios_carry_their_prompt_seed(tmp_path):
    args = type("A", (), {"requests": 4, "prompt_tokens": 16, "output_tokens": 8})()
    specs = [guidellm_compare.scenario("http://127.0.0.1:1", "m", {"kind": "synchronous"}, args, tmp_path,
                                       tmp_path / "r.json", {}, seed)["spec"] for seed in (7, 8)]
    assert [s["seed"] for s in specs] == [{"kind": "static", "value": 7}, {"kind": "static", "value": 8}]
