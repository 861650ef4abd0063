"""The serving benchmarks' pure parts, without servers: percentiles, summaries, the workload's
determinism, the unique first tokens, the table, the plot, the long-prompt and prefix-cache figures."""
from __future__ import annotations

import json

import pytest

from bench.serving.long_prompts import summarize_arrivals
from bench.serving.report import LATENCY_PANELS, plot_against_concurrency, serve_table
from bench.serving.stats import over_rounds, pct, ratios_to, summarize
from bench.serving.workload import Salter, chat_workload, salt_seed, workload

CORPUS = list(range(10_000, 12_000))  # distinct ids: a window's position is its first id


def ok(ttft, itl, e2e, tokens, n_out=None):
    return {"error": None, "ttft": ttft, "itl": itl, "e2e": e2e, "tokens": tokens,
            "short": tokens < (n_out or tokens)}


def test_percentiles_interpolate_linearly_and_none_without_samples():
    assert pct([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert pct(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert pct([7.0], 99) == 7.0
    assert pct([], 50) is None


def test_summarize_counts_tokens_over_wall_time_and_keeps_errors_apart():
    results = [ok(0.1, [0.01, 0.03], 0.2, 3), ok(0.3, [0.02], 0.5, 2, n_out=4),
               {"error": "HTTP 503: busy"}, {"error": "HTTP 503: busy"}]
    s = summarize(results, wall=2.0)
    assert (s["tokens"], s["requests"], s["errors"], s["short_outputs"]) == (5, 2, 2, 1)
    assert s["output_tok_s"] == 2.5 and s["req_s"] == 1.0
    assert s["ttft_p50"] == pytest.approx(0.2) and s["itl_p50"] == pytest.approx(0.02)
    assert s["e2e_p99"] == pytest.approx(0.497)
    # TPOT: (0.2 - 0.1) / 2 and (0.5 - 0.3) / 1
    assert s["tpot_p50"] == pytest.approx((0.05 + 0.2) / 2)
    assert s["error_messages"] == ["HTTP 503: busy"]
    assert s["tokens_per_chunk"] == 1.0  # 3 + 2 chunks carried 5 tokens


def test_summarize_with_only_errors_has_no_latencies():
    s = summarize([{"error": "x"}], wall=1.0)
    assert s["requests"] == 0 and s["output_tok_s"] == 0 and s["ttft_p50"] is None and s["itl_p99"] is None


def test_over_rounds_takes_medians_and_sums_totals():
    rounds = [summarize([ok(t, [0.01], 1.0, 10)], wall=w) for t, w in ((0.1, 1.0), (0.3, 2.0), (0.2, 4.0))]
    rounds[1]["cpu_s"] = {"gateway": 1.5}  # per-round detail that is not a figure stays in the rounds only
    v = over_rounds(rounds)
    assert v["median"]["ttft_p50"] == pytest.approx(0.2) and v["median"]["output_tok_s"] == 5.0
    assert v["totals"] == {"tokens": 30, "requests": 3, "errors": 0, "short_outputs": 0}
    assert "cpu_s" not in v["median"] and v["rounds"][1]["cpu_s"] == {"gateway": 1.5}


def test_ratios_are_medians_of_per_round_ratios():
    runs = {"ours": {1: [{"output_tok_s": 10.0}, {"output_tok_s": 30.0}, {"output_tok_s": 9.0}]},
            "theirs": {1: [{"output_tok_s": 20.0}, {"output_tok_s": 20.0}, {"output_tok_s": 10.0}]}}
    r = ratios_to(runs, "theirs")
    assert r["ours"][1] == pytest.approx(0.9) and r["theirs"][1] == 1.0


def test_workload_is_deterministic_windows_in_range():
    a = workload(CORPUS, 50, seed=7, prompt_range=(32, 512), output_range=(64, 256))
    assert a == workload(CORPUS, 50, seed=7, prompt_range=(32, 512), output_range=(64, 256))
    assert a != workload(CORPUS, 50, seed=8, prompt_range=(32, 512), output_range=(64, 256))
    for prompt, n_out in a:
        assert 32 <= len(prompt) <= 512 and 64 <= n_out <= 256
        start = prompt[0] - CORPUS[0]
        assert prompt == CORPUS[start:start + len(prompt)]
    assert len({len(p) for p, _ in a}) > 10  # a mix, not one length


def test_workload_refuses_prompts_longer_than_the_corpus():
    with pytest.raises(SystemExit):
        workload(CORPUS[:100], 1, seed=1, prompt_range=(200, 200), output_range=(1, 1))


def test_each_run_salts_its_prompts_afresh_unless_told_the_seed():
    """Two runs against the same servers (serve.py --url) must not send the same prompts: the second
    would be answered from the first's prefix cache."""
    prompts = [list(range(i, i + 40)) for i in range(20)]
    first, second = Salter(salt_seed(None)), Salter(salt_seed(None))
    assert [first(p)[0] for p in prompts] != [second(p)[0] for p in prompts]
    assert salt_seed(7) == 7 and [Salter(salt_seed(7))(p) for p in prompts] == [Salter(7)(p) for p in prompts]


def test_salter_gives_every_prompt_its_own_first_token_and_keeps_the_rest():
    salt, other = Salter(3), Salter(3)
    prompts = [p for p, _ in workload(CORPUS, 300, seed=1, prompt_range=(2, 40), output_range=(1, 1))] * 3
    salted = [salt(p) for p in prompts]
    assert len({s[0] for s in salted}) == len(salted)
    assert all(len(s) == len(p) and s[1:] == p[1:] for s, p in zip(salted, prompts))
    assert [other(p) for p in prompts] == salted  # seeded: the same run twice sends the same ids


def test_chat_workload_shares_one_system_prompt_of_exact_length():
    system, users = chat_workload(CORPUS, 9, seed=4, system_tokens=300, user_range=(16, 64))
    assert len(system) == 300 and len(users) == 9
    assert all(16 <= len(u) <= 64 for u in users) and len({tuple(u) for u in users}) == 9
    assert (system, users) == chat_workload(CORPUS, 9, seed=4, system_tokens=300, user_range=(16, 64))


def test_long_prompt_summary_reads_the_streams_gaps_and_the_arrivals():
    streams = [ok(0.1, [0.01, 0.02, 0.5], 1.0, 4), {"error": "HTTP 500: x"}]
    arrivals = [ok(0.7, [], 0.8, 1), ok(0.9, [], 1.0, 1), {"error": "HTTP 503: y"}]
    s = summarize_arrivals(streams, arrivals)
    assert s["stream_itl_p50"] == pytest.approx(0.02) and s["stream_itl_max"] == 0.5
    assert s["stream_gaps_over_150ms"] == pytest.approx(1 / 3)  # one gap of three felt (0.5 s)
    assert (s["stream_errors"], s["arrivals"], s["arrival_errors"]) == (1, 2, 1)
    assert s["arrival_ttft_p50"] == pytest.approx(0.8)
    assert s["error_messages"] == ["HTTP 500: x", "HTTP 503: y"]


def results_for(names, levels):
    return {n: {c: over_rounds([summarize([ok(0.1 * c, [0.01 * i], 1.0, 10)], wall=1.0 + i)])
                for c in levels} for i, n in enumerate(names, 1)}


def test_table_has_a_row_per_target_and_level_and_the_ratio():
    results = results_for(["hybridserve-fpga", "llama-server"], (1, 2))
    text = serve_table(results, {"hybridserve-fpga": {1: 1.5, 2: None}}, "llama-server")
    lines = text.splitlines()
    assert "x llama-server" in lines[0] and len(lines) == 2 + 4
    fpga_1 = lines[2].split()
    assert fpga_1[:4] == ["hybridserve-fpga", "1", "5.0", "0.50"] and fpga_1[-1] == "1.50"
    assert fpga_1[8] == "5.00"  # 10 tokens in 2 chunks
    assert lines[3].split()[-1] == "-"


def test_plot_writes_a_png_with_one_line_per_target(tmp_path):
    import matplotlib.image

    path = plot_against_concurrency(tmp_path / "lat.png", results_for(["a", "b", "c"], (1, 2, 4)), (1, 2, 4),
                                    LATENCY_PANELS, "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    h, w = matplotlib.image.imread(path).shape[:2]
    assert h > 300 and w > 3 * 400


def test_write_json_records_the_machine(tmp_path):
    from bench._common import write_json

    path = write_json("serve_vs_llama", {"results": {"a": {"1": {"median": {"output_tok_s": 1.0}}}}}, out_dir=tmp_path)
    data = json.loads(path.read_text())
    assert path.name == "serve_vs_llama.json" and data["machine"]["cpu_count"] >= 1
    assert data["results"]["a"]["1"]["median"]["output_tok_s"] == 1.0


def test_serve_accepts_repeats_for_rounds_and_llama_server_auto():
    from bench import serve

    args = serve.build_args().parse_args(["--start-stack", "--repeats", "5", "--llama-server", "auto"])
    assert args.rounds == 5 and args.llama_server == "auto"
    assert serve.PRESETS["default"].levels == (1, 2, 4, 8, 16, 32)
    assert serve.PRESETS["default"].prompt_range == (32, 512) and serve.PRESETS["default"].output_range == (64, 256)


def test_prefix_cache_env_names_both_engines_and_reads_hit_ratios():
    from bench import prefix_cache

    assert prefix_cache.caching_env(False) == {"HYBRIDSERVE_PREFILL_ENABLE_PREFIX_CACHING": "false",
                                               "HYBRIDSERVE_DECODE_ENABLE_PREFIX_CACHING": "false"}
    gauge = {"hybridserve_engine_prefix_cache_hit_rate": 0.75}
    assert prefix_cache.hit_ratio({}, gauge) == 0.75
    before = {"hybridserve_engine_prefix_cache_hits_total": 100.0, "hybridserve_engine_prefix_cache_queries_total": 200.0}
    after = {"hybridserve_engine_prefix_cache_hits_total": 130.0, "hybridserve_engine_prefix_cache_queries_total": 240.0}
    assert prefix_cache.hit_ratio(before, after) == pytest.approx(0.75)
    assert prefix_cache.hit_ratio({}, {"hybridserve_engine_queue_depth": 1.0}) is None


def test_recorded_paths_do_not_carry_this_machines_folders():
    from pathlib import Path

    from bench import serve

    assert serve.shown_path(str(Path.home() / ".cache/hybridserve/llama-server/1/llama-server")) == \
        "~/.cache/hybridserve/llama-server/1/llama-server"
    assert serve.shown_path("/opt/llama/bin/llama-server") == "llama-server"
