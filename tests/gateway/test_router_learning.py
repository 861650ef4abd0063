"""The router learning from finished requests: a wrong profile corrected, bounded exploration,
a physical fit, queueing on the engines' own service times. Scripted truth, no engines."""
from __future__ import annotations

import json

import numpy as np
from prometheus_client import REGISTRY

from services.gateway.routing.cost_model import CostModel, fit_stage, nnls
from services.gateway.routing.router import CONFIRMING, Router
from services.gateway.routing.samples import samples_from_timings
from services.modes import MODE_NAMES, MODES
from tests.gateway.test_router import HANDOFF, PER_TOKEN, PREFILL, synthetic_samples, truth

# a 1-client mixed load as the issue tried it: prompts of 30-400 tokens, outputs of 64-192
LOAD = [(n_in, n_out) for n_in, n_out in zip((30, 400, 120, 64, 250, 90, 330, 45, 180, 300, 75, 210),
                                             (64, 192, 128, 96, 160, 64, 128, 192, 96, 64, 160, 128))]


def timings_of(mode: str, n_in: int, n_out: int) -> dict:
    """What a finished request reports under the scripted truth (decode_tokens = n_out - 1)."""
    m = MODES[mode]
    steps = n_out - 1
    return {"prefill_s": PREFILL[m.prefill_engine](n_in), "decode_tokens": steps,
            "decode_s": steps * PER_TOKEN[m.decode_engine](n_in + steps / 2),
            "handoff_exposed_s": HANDOFF(n_in) if mode == "hybrid" else 0.0}


def serve(router: Router, n_in: int, n_out: int, forced: str | None = None):
    d = router.choose(n_in, n_out, forced=forced)
    router.started(d.mode)
    router.finished(d.mode, truth(d.mode, n_in, n_out))
    router.observe(samples_from_timings(d.mode, n_in, timings_of(d.mode, n_in, n_out)))
    return d


def wrong_profile(factor: float = 50.0) -> list[dict]:
    """The start-up profile a busy machine recorded: fpga decode `factor` x too slow."""
    return [dict(s, seconds=s["seconds"] * factor) if (s["stage"], s.get("device")) == ("decode", "fpga") else s
            for s in synthetic_samples()]


def best(n_in: int, n_out: int) -> str:
    return min(MODE_NAMES, key=lambda m: truth(m, n_in, n_out))


def test_a_profile_50x_wrong_is_corrected_within_ten_requests():
    router = Router(wrong_profile())
    assert any(router.estimates(n_in, n_out) and min(router.estimates(n_in, n_out), key=router.estimates(n_in, n_out).get)
               != best(n_in, n_out) for n_in, n_out in LOAD), "the wrong profile must mislead the router at first"
    for n_in, n_out in LOAD[:10]:
        serve(router, n_in, n_out)
    for n_in, n_out in LOAD:
        est = router.estimates(n_in, n_out)
        assert min(est, key=est.get) == best(n_in, n_out), (n_in, n_out, est)
        assert abs(est["hybrid"] / truth("hybrid", n_in, n_out) - 1) < 0.15


def test_without_exploration_the_wrong_profile_stays_wrong():
    """What exploration is for: the router never runs the mode it wrongly thinks slow."""
    router = Router(wrong_profile(), explore_share=0)
    picks = [serve(router, n_in, n_out).mode for n_in, n_out in LOAD * 3]
    assert set(picks) == {"gpu"} and any(best(n_in, n_out) != "gpu" for n_in, n_out in LOAD)


def test_exploration_is_a_bounded_share_and_never_forced_or_far_off():
    router = Router(synthetic_samples(), stale_after=40)
    explored, n = [], 1000
    for i in range(n):
        n_in, n_out = LOAD[i % len(LOAD)]
        confirmed_before = set(router.snapshot()["corrections"])
        d = serve(router, n_in, n_out)
        if d.reason == "explore":
            explored.append(d)
            stages = {f"{st}/{dev}" for st, dev in CostModel.stage_keys(d.mode)}
            if stages <= confirmed_before:  # a confirmed mode is explored only when within 3x of the best
                assert d.estimates[d.mode] <= 3 * min(d.estimates.values())
        else:
            assert d.mode == min(d.estimates, key=d.estimates.get)
    assert 1 <= len(explored) <= CONFIRMING * 5 + 0.05 * n  # until each of 5 stages is confirmed, then the share
    assert {d.mode for d in explored} >= {"gpu", "fpga"}  # stale stages do get refreshed
    assert all(serve(router, 64, 64, forced="fpga").reason == "forced" for _ in range(100))


def test_one_token_requests_do_not_spend_exploration_on_a_decode_they_cannot_measure():
    router = Router(wrong_profile())
    # e.g. a client polling with max_tokens=1 until the router is calibrated: the hand-off and both
    # prefills get measured (each stage by two requests: four explorations), no decode is, and none is pretended
    polls = [serve(router, 8, 1).reason for _ in range(6)]
    assert polls.count("explore") == 4 and "decode/fpga" not in router.snapshot()["corrections"]
    for n_in, n_out in LOAD[:5]:
        serve(router, n_in, n_out)
    assert "decode/fpga" in router.snapshot()["corrections"]
    est = router.estimates(250, 160)
    assert min(est, key=est.get) == best(250, 160)


def test_a_hybrid_request_teaches_gpu_prefill_handoff_and_fpga_decode():
    router = Router(synthetic_samples(), explore_share=0)
    router.observe(samples_from_timings("hybrid", 200, {"prefill_s": 3 * PREFILL["gpu"](200), "decode_tokens": 63,
                                                        "decode_s": 2 * 63 * PER_TOKEN["fpga"](231.5),
                                                        "handoff_exposed_s": 4 * HANDOFF(200)}))
    factors = {k: v["factor"] for k, v in router.snapshot()["corrections"].items()}
    assert set(factors) == {"prefill/gpu", "handoff/link", "decode/fpga"}
    assert abs(factors["prefill/gpu"] - 3) < 0.1 and abs(factors["decode/fpga"] - 2) < 0.1
    assert abs(factors["handoff/link"] - 4) < 0.1


def test_estimate_ratio_histogram_counts_each_stage():
    def count(stage, device):
        return REGISTRY.get_sample_value("hybridserve_router_estimate_ratio_count",
                                         {"stage": stage, "device": device}) or 0.0

    before = count("decode", "fpga"), count("prefill", "gpu")
    router = Router(synthetic_samples(), explore_share=0)
    serve(router, 100, 32, forced="hybrid")
    assert (count("decode", "fpga"), count("prefill", "gpu")) == (before[0] + 1, before[1] + 1)


def test_snapshot_is_json_with_every_fitted_stage():
    router = Router(synthetic_samples())
    serve(router, 64, 64)
    snap = json.loads(json.dumps(router.snapshot()))
    assert set(snap["base"]) == {"prefill/gpu", "prefill/fpga", "decode/gpu", "decode/fpga", "handoff/link"}
    assert all(v >= 0 for fit in snap["base"].values() for v in fit.values())
    assert snap["exploration"]["auto_decisions"] == 1


def test_queueing_uses_each_engines_own_stage_time():
    """A hybrid request occupies the gpu for its prefill only: that, not its end-to-end time, queues there."""
    router = Router(synthetic_samples(), explore_share=0)
    router.concurrency["gpu"] = 2
    router.finished("hybrid", 10.0)
    router.observe(samples_from_timings("hybrid", 256, {"prefill_s": 0.4, "decode_tokens": 100, "decode_s": 6.0,
                                                        "handoff_exposed_s": 0.01}))
    quiet = router.estimates(256, 64)
    router.started("hybrid")
    router.started("hybrid")
    busy = router.estimates(256, 64)
    assert abs((busy["gpu"] - quiet["gpu"]) - 2 * 0.4 / 2) < 1e-9  # two waiting prefills over two slots
    assert abs((busy["fpga"] - quiet["fpga"]) - 2 * 6.0) < 1e-9


def test_queueing_follows_what_the_engines_report_of_their_batch():
    """The engine's own running and waiting counts (other gateways' requests included), over the
    sequences its batch holds, plus what this gateway sent since the report."""
    router = Router(synthetic_samples(), explore_share=0)
    router.observe(samples_from_timings("fpga", 256, {"prefill_s": 1.0, "decode_tokens": 100, "decode_s": 3.0}))
    quiet = router.estimates(256, 64)
    router.set_engine_load("fpga", running=30, waiting=10, max_num_seqs=32)
    loaded = router.estimates(256, 64)
    assert abs((loaded["fpga"] - quiet["fpga"]) - 40 * 4.0 / 32) < 1e-9
    router.started("fpga")  # sent after the report: counts on top of it
    assert abs((router.estimates(256, 64)["fpga"] - quiet["fpga"]) - 41 * 4.0 / 32) < 1e-9
    router.set_engine_load("fpga", running=0, waiting=0, max_num_seqs=32)  # drained: back to this gateway's own
    router.finished("fpga", 4.0)
    assert router.estimates(256, 64)["fpga"] == quiet["fpga"]


# ---- the fit ------------------------------------------------------------------------------------------
def test_nnls_meets_the_optimality_conditions():
    rng = np.random.default_rng(3)
    for _ in range(200):
        a = rng.uniform(0, 1, (6, 3)) * [1, 100, 1e4]
        b = rng.normal(0, 1, 6) * 10
        x = nnls(a, b)
        grad = a.T @ (a @ x - b)
        assert np.all(x >= 0)
        scale = np.abs(a).max(axis=0) * (np.linalg.norm(b) + 1)
        assert np.all(np.abs(grad[x > 0]) / scale[x > 0] < 1e-8)  # free coefficients: stationary
        assert np.all(grad[x == 0] / scale[x == 0] > -1e-8)  # clamped ones: the bound is what holds them


def test_the_fit_is_never_negative_nor_predicts_zero_on_adversarial_samples():
    # what the issue found in a busy machine's cache: first calls slower than later, longer ones
    issue = [{"stage": "prefill", "device": "gpu", "n_in": 16, "seconds": 1.75},
             {"stage": "prefill", "device": "gpu", "n_in": 64, "seconds": 0.58},
             {"stage": "decode", "device": "fpga", "n_in": 16, "n_out": 8, "seconds": 1.71},
             {"stage": "decode", "device": "fpga", "n_in": 256, "n_out": 8, "seconds": 0.14},
             {"stage": "handoff", "n_in": 16, "seconds": 0.0}, {"stage": "handoff", "n_in": 256, "seconds": 1e-7}]
    rng = np.random.default_rng(7)
    sets = [issue]
    for _ in range(300):
        sets.append([{"stage": st, "device": dev, "n_in": int(rng.integers(1, 2048)), "n_out": int(rng.integers(1, 64)),
                      "seconds": float(rng.choice([0.0, 1e-9, rng.exponential(1.0), 1e3 * rng.exponential(1.0)]))}
                     for st, dev in [("prefill", "gpu"), ("decode", "fpga"), ("handoff", None)] * 3])
    for samples in sets:
        model = CostModel.fit(samples)
        for fit in model.stages.values():
            assert all(c >= 0 for c in fit.coef) and fit.floor_per_unit > 0
        for key in model.stages:
            for n_in, n_out in ((0, 1), (1, 1), (17, 3), (4096, 1024)):
                assert model.stage_seconds(key, n_in, n_out) > 0, (key, n_in, samples)


def test_one_outlier_repeat_does_not_bend_the_fit():
    pts = [{"stage": "prefill", "device": "gpu", "n_in": n, "seconds": 0.02 + 0.0015 * n} for n in (16, 64, 256)] * 3
    clean = fit_stage("prefill", pts)
    spiked = fit_stage("prefill", pts + [{"stage": "prefill", "device": "gpu", "n_in": 16, "seconds": 5.0}])
    for n in (16, 64, 256, 1024):
        assert abs(spiked.predict(n) / clean.predict(n) - 1) < 1e-6


def test_a_stage_no_profile_measured_is_learnt_from_requests():
    """decode_fpga profiled while prefill_gpu was down: no hand-off samples, so no hybrid estimate at first."""
    router = Router([s for s in synthetic_samples() if s["stage"] != "handoff"], explore_share=0)
    assert "hybrid" not in router.estimates(128, 64)
    serve(router, 128, 64, forced="hybrid")
    est = router.estimates(128, 64)
    assert abs(est["hybrid"] / truth("hybrid", 128, 64) - 1) < 0.01


def test_one_request_timed_on_a_busy_machine_does_not_pin_its_stages_slow():
    """A first hybrid request that ran beside a compile (every stage 6x slow) misleads the router
    only until a quiet request of those stages has been seen: the smallest recent ratio counts."""
    router = Router(synthetic_samples(), explore_share=0.0)
    n_in, n_out = LOAD[1]
    slow = {k: v * 6 if k.endswith("_s") else v for k, v in timings_of("hybrid", n_in, n_out).items()}
    router.observe(samples_from_timings("hybrid", n_in, slow))
    assert router.estimates(n_in, n_out)["hybrid"] > 3 * truth("hybrid", n_in, n_out)
    router.observe(samples_from_timings("hybrid", n_in, timings_of("hybrid", n_in, n_out)))
    assert abs(router.estimates(n_in, n_out)["hybrid"] / truth("hybrid", n_in, n_out) - 1) < 0.15


def test_a_slowdown_that_holds_is_learned_after_the_recent_window():
    router = Router(synthetic_samples(), explore_share=0.0, recent=3)
    n_in, n_out = LOAD[2]
    slow = {k: v * 4 if k.endswith("_s") else v for k, v in timings_of("fpga", n_in, n_out).items()}
    router.observe(samples_from_timings("fpga", n_in, timings_of("fpga", n_in, n_out)))
    for _ in range(3):
        router.observe(samples_from_timings("fpga", n_in, slow))
    assert abs(router.estimates(n_in, n_out)["fpga"] / (4 * truth("fpga", n_in, n_out)) - 1) < 0.15


def test_engines_on_one_processor_share_their_queue():
    """With both engines on the same cores, requests queued on decode_fpga delay gpu mode as much:
    the router keeps choosing by each mode's own cost instead of spilling onto the slower mode."""
    n_in, n_out = LOAD[0]
    picks = {}
    for shared in (False, True):
        router = Router(synthetic_samples(), explore_share=0.0, shared_compute=shared)
        router.concurrency = {"gpu": 2, "fpga": 4}
        for _ in range(4):
            serve(router, n_in, n_out, forced="hybrid")
        for _ in range(12):
            router.started("hybrid")  # twelve requests still running on both engines' stages
        picks[shared] = router.choose(n_in, n_out).mode
    assert picks[True] == best(n_in, n_out)
    assert picks[False] != picks[True], "without sharing, the queue on decode_fpga sends work to the other engine"


def test_engines_share_the_cpu_when_both_run_on_it():
    from services.gateway.routing.engine_watch import engines_share_cpu

    pocl = "Portable Computing Language / pthread-skylake-avx512-AMD EPYC 7R13"
    assert engines_share_cpu("cpu", pocl)
    assert engines_share_cpu("cpu", "Portable Computing Language / cpu-znver3-AMD EPYC")
    assert not engines_share_cpu("cuda:0", pocl)
    assert not engines_share_cpu("cpu", "NVIDIA CUDA / NVIDIA H100 80GB HBM3")
    assert not engines_share_cpu("cpu", "Xilinx / xilinx_u280_gen3x16_xdma_base_1")


# ---- what a request adds to a running batch -------------------------------------------------------
def taught_batch_slowdowns(router: Router) -> Router:
    """`router` after fpga and gpu requests at several company sizes, fpga's decode costing (1 + 0.5 s)
    its alone-time beside s others and gpu's (1 + 0.02 s)."""
    beta = {"fpga": 0.5, "gpu": 0.02}
    for i, company in enumerate((0, 2, 4, 8, 1, 6, 3, 5)):
        for mode in ("fpga", "gpu"):
            n_in, n_out = LOAD[i]
            t = timings_of(mode, n_in, n_out)
            t["decode_s"] *= 1 + beta[mode] * company
            router.observe(samples_from_timings(mode, n_in, t, {"gpu": company, "fpga": company}))
    return router


def test_what_a_request_adds_to_a_running_batch_is_learned_from_decode_times():
    """fpga's decode costs (1 + 0.5 s) x its alone-time beside s others, gpu's barely grows. Learned
    from the requests' own times: a busy fpga batch sends a request to gpu, an idle one does not,
    and the busy samples do not make fpga look slow alone."""
    router = taught_batch_slowdowns(Router(synthetic_samples(), explore_share=0))
    snap = router.snapshot()["engines"]
    assert abs(snap["fpga"]["batch_slowdown_beta"] - 0.5) < 0.02 and snap["gpu"]["batch_slowdown_beta"] < 0.05
    n_in, n_out = 64, 128
    alone = router.estimates(n_in, n_out)
    assert abs(alone["fpga"] / truth("fpga", n_in, n_out) - 1) < 0.1  # the corrections learned alone-times
    assert router.choose(n_in, n_out).mode in ("fpga", "hybrid")
    router.set_engine_load("fpga", running=16, waiting=0, max_num_seqs=64)
    busy = router.estimates(n_in, n_out)
    decode_alone = (n_out - 0) * PER_TOKEN["fpga"](n_in + n_out / 2)
    assert busy["fpga"] - alone["fpga"] > 0.9 * 0.5 * 16 * decode_alone  # x (1 + 0.5 x 16) on the decode part
    assert router.choose(n_in, n_out).mode == "gpu"


def test_without_company_sizes_the_batch_term_stays_off():
    router = Router(synthetic_samples(), explore_share=0)
    for n_in, n_out in LOAD:
        serve(router, n_in, n_out, forced="fpga")  # samples without a company: a router fed by old gateways
    quiet = router.estimates(64, 128)
    router.set_engine_load("fpga", running=16, waiting=0, max_num_seqs=64)
    assert router.snapshot()["engines"]["fpga"]["batch_slowdown_beta"] == 0.0
    # the queueing term only: what it added was there before batches were modelled
    assert abs(router.estimates(64, 128)["fpga"] - quiet["fpga"] - router.queueing("fpga")) < 1e-9


# ---- a quiet profile ------------------------------------------------------------------------------
def test_a_quiet_profile_is_trusted_and_a_mode_it_shows_slow_is_not_run_to_check_it():
    """Profiles timed on a quiet machine (the engines say so): a cold start goes straight to the
    fastest mode; the same profile without that word is checked with requests first."""
    quiet = Router([dict(s, quiet=True) for s in synthetic_samples()])
    unsure = Router(synthetic_samples())
    ran_quiet = [serve(quiet, n_in, n_out) for n_in, n_out in LOAD]
    ran_unsure = [serve(unsure, n_in, n_out) for n_in, n_out in LOAD]
    assert all(d.reason == "auto" and d.mode == best(n_in, n_out) for d, (n_in, n_out) in zip(ran_quiet, LOAD))
    assert any(d.reason == "explore" for d in ran_unsure)
    assert quiet.snapshot()["quiet_profiled"] == ["decode/fpga", "decode/gpu", "handoff/link", "prefill/fpga",
                                                  "prefill/gpu"]


def test_a_first_request_far_slower_than_a_quiet_profile_is_checked_by_a_second():
    """A serve benchmark's warm-up request, the first after two stacks started side by side, took 32x
    decode_fpga's quiet profile. Trusted as confirmed, that one sample made both decode_fpga modes
    look 32x slower and no auto request ran them again (live: every request of the 8- and 32-client
    rounds went to gpu mode, 42 and 57 tokens/s against 87 and 77 beside it). Now the stage is
    unconfirmed until a second request measured it: the next auto request runs a decode_fpga mode,
    and with its true time auto is back to the fastest. A first request within DISAGREE x of the
    profile changes nothing of the kind."""
    from services.gateway.routing.router import DISAGREE

    for slower, checked in ((32.0, True), (0.9 * DISAGREE, False)):
        router = Router([dict(s, quiet=True) for s in synthetic_samples()], shared_compute=True)
        n_in, n_out = LOAD[0]
        d = router.choose(n_in, n_out)
        assert d.mode == best(n_in, n_out) == "hybrid"  # decoding on decode_fpga
        t = timings_of("hybrid", n_in, n_out)
        router.observe(samples_from_timings("hybrid", n_in, dict(t, decode_s=t["decode_s"] * slower)))
        d = serve(router, n_in, n_out)
        if checked:
            assert d.reason == "explore" and MODES[d.mode].decode_engine == "fpga", d
            assert [serve(router, n_in, n_out).mode for _ in range(3)] == ["hybrid"] * 3
        else:
            assert d.reason == "auto", d


def test_one_unquiet_sample_makes_its_stage_unconfirmed():
    samples = [dict(s, quiet=(s["stage"], s.get("device")) != ("decode", "gpu")) for s in synthetic_samples()]
    assert "decode/gpu" not in Router(samples).snapshot()["quiet_profiled"]


def test_a_prefix_cache_hit_teaches_the_cost_of_the_positions_computed_only():
    """A request whose prompt was mostly cached prefilled its last block only: its sample is of
    those positions, so the router does not learn that a fresh prompt of that length is cheap."""
    t = {"prefill_s": 0.05, "decode_tokens": 10, "decode_s": 0.2, "handoff_exposed_s": 0.01, "cached_tokens": 240}
    pre, dec, hand = samples_from_timings("hybrid", 256, t)
    assert (pre["n_in"], dec["n_in"], hand["n_in"]) == (16, 256, 16)
    assert samples_from_timings("gpu", 256, dict(t, cached_tokens=0))[0]["n_in"] == 256
    router = Router([dict(s, quiet=True) for s in synthetic_samples()], explore_share=0)
    before = router.estimates(256, 10)["fpga"]
    for _ in range(3):  # all cache hits, timed at the true cost of what they computed
        router.observe(samples_from_timings("fpga", 256, {"prefill_s": PREFILL["fpga"](16), "decode_tokens": 0,
                                                          "cached_tokens": 240}))
    assert abs(router.estimates(256, 10)["fpga"] / before - 1) < 0.05


def test_on_one_processor_a_busy_batch_slows_every_mode_alike():
    """The same learned slowdowns (fpga's decode x (1 + 0.5 s), gpu's barely growing), the engines on
    one processor: a busy batch does not send the request to gpu mode, whose decode takes its turn on
    the same cores and costs them far more per token; each mode is judged by its own cost."""
    router = taught_batch_slowdowns(Router(synthetic_samples(), explore_share=0, shared_compute=True))
    n_in, n_out = 64, 128
    idle = router.choose(n_in, n_out).mode
    router.set_engine_load("fpga", running=16, waiting=0, max_num_seqs=64)
    busy = router.estimates(n_in, n_out)
    assert idle in ("fpga", "hybrid") and router.choose(n_in, n_out).mode == idle
    assert busy["gpu"] > busy[idle], busy


def test_on_one_processor_a_busy_batch_keeps_a_second_decode_off_the_other_engine():
    """A long prompt with a two-token answer: gpu mode is its cheapest (gpu prefills 8x faster and no
    hand-off), alone and, on its own time, beside 4 decodes on decode_fpga. But on one processor gpu
    mode's decode would take half the cores from those 4 for its whole length, where hybrid's decode
    joins their batch (one more row): auto sends it to hybrid; with the term off, still gpu. On
    separate devices nothing changes."""
    n_in, n_out = 2048, 2
    assert best(n_in, n_out) == "gpu"
    routers = {name: taught_batch_slowdowns(Router(synthetic_samples(), explore_share=0, **kw)) for name, kw in (
        ("crowding", dict(shared_compute=True)), ("off", dict(shared_compute=True, crowding=False)),
        ("separate", dict(shared_compute=False)))}
    for router in routers.values():
        assert router.choose(n_in, n_out).mode == "gpu"  # idle: nobody to crowd
        router.set_engine_load("fpga", running=4, waiting=0, max_num_seqs=64)
    d = routers["crowding"].choose(n_in, n_out)
    assert d.mode == "hybrid" and d.crowding["gpu"] > d.crowding["hybrid"] > 0, d
    assert d.estimates["gpu"] < d.estimates["hybrid"]  # the estimates themselves are unchanged
    assert routers["off"].choose(n_in, n_out).mode == "gpu"
    assert routers["separate"].choose(n_in, n_out).mode == "gpu"
    assert routers["separate"].choose(n_in, n_out).crowding == {m: 0.0 for m in MODE_NAMES}
    last = routers["crowding"].snapshot()["recent_decisions"][-1]  # what /debug/router shows of it
    assert (last["mode"], last["n_in"], last["company"]["fpga"]) == ("hybrid", n_in, 4)
    assert last["crowding"]["gpu"] == round(d.crowding["gpu"], 4)


def test_on_one_processor_a_loaded_decode_does_not_make_the_other_engine_look_cheap():
    """A 64-client burst on one processor: fpga's decodes ran beside ~60 others at 30x their alone-time,
    far past what the batch term had learned. Taken into fpga's own decode correction, that made gpu
    mode's decode (its quiet profile untouched) look 30x cheaper in comparison, and auto sent it
    work that took the cores. On one processor the correction learns from decodes that ran nearly
    alone; on separate devices the loaded engine's correction still counts (the other device is idle)."""
    n_in, n_out = 300, 150
    shared, separate = (Router([dict(s, quiet=True) for s in synthetic_samples()], explore_share=0,
                               shared_compute=flag) for flag in (True, False))
    for router in (shared, separate):
        for _ in range(3):
            t = timings_of("fpga", n_in, n_out)
            t["decode_s"] *= 30
            router.observe(samples_from_timings("fpga", n_in, t, {"gpu": 60, "fpga": 60}))
        router.set_engine_load("fpga", running=60, waiting=0, max_num_seqs=64)
    assert shared.choose(n_in, n_out).mode != "gpu"
    assert shared.snapshot()["corrections"]["decode/fpga"]["factor"] == 1.0
    assert separate.snapshot()["corrections"]["decode/fpga"]["factor"] > 10
    # alone again: a decode beside nobody teaches the correction as before
    t = timings_of("fpga", n_in, n_out)
    t["decode_s"] *= 1.5
    shared.observe(samples_from_timings("fpga", n_in, t, {"gpu": 0, "fpga": 0}))
    assert abs(shared.snapshot()["corrections"]["decode/fpga"]["factor"] - 1.5) < 0.05


def test_a_load_seen_before_any_request_alone_is_learned_as_company():
    """fpga's decode costs (1 + 0.5 s) x its alone-time; the first requests it finishes ran at 12 company
    (a start under load), then two alone. beta is fitted on measured / the uncorrected base: before, the
    ratios were taken against the corrected estimate, which had already taken the load in after the
    first request, so the later busy ones looked like no slowdown and beta came out 3x too large."""
    router = Router(synthetic_samples(), explore_share=0)
    n_in, n_out = 64, 128
    for company in [12] * 4 + [0] * 2:
        t = timings_of("fpga", n_in, n_out)
        t["decode_s"] *= 1 + 0.5 * company
        router.observe(samples_from_timings("fpga", n_in, t, {"gpu": company, "fpga": company}))
    beta = router.snapshot()["engines"]["fpga"]["batch_slowdown_beta"]
    assert abs(beta - 0.5) < 0.05, beta


def test_a_burst_teaches_what_a_batch_adds():
    """Two requests alone, then sixteen sent at once, all decoding side by side: each one's decode takes
    (1 + 0.5 x 15) its alone-time whatever it found when sent (0 for the first, 15 for the last). Tagged
    with the mean of the company found when sent and what is left when it ends, the burst teaches beta
    and fpga alone still looks as fast as it is; tagged with the company when sent, it taught beta ~0
    and a 7x slower fpga, and a busy machine's auto sent work to gpu mode."""
    router = Router(synthetic_samples(), explore_share=0)
    n_in, n_out = 64, 128
    for _ in range(2):  # two requests alone first, as a start's warm-up sends them
        alone = router.choose(n_in, n_out, forced="fpga").company
        router.observe(samples_from_timings("fpga", n_in, timings_of("fpga", n_in, n_out),
                                            router.lifetime_company(alone)))
    sent = []
    for _ in range(16):
        sent.append(router.choose(n_in, n_out, forced="fpga").company)
        router.started("fpga")
    for company in sent:
        router.finished("fpga", 1.0)
        t = timings_of("fpga", n_in, n_out)
        t["decode_s"] *= 1 + 0.5 * 15
        router.observe(samples_from_timings("fpga", n_in, t, router.lifetime_company(company)))
    assert router.snapshot()["engines"]["fpga"]["batch_slowdown_beta"] > 0.2
    assert router.estimates(n_in, n_out)["fpga"] < 2 * truth("fpga", n_in, n_out)


# ---- what a mode's stages miss before its first token -----------------------------------------------
def finish_late(router: Router, d, seconds_over: float) -> None:
    """A request of decision `d` whose first token came `seconds_over` later than its mode's prefill,
    hand-off and queueing said."""
    router.observe_first_token(d.mode, d.first_token[d.mode], d.missed[d.mode],
                               d.first_token[d.mode] - d.missed[d.mode] + seconds_over)


def test_what_a_modes_stages_miss_before_the_first_token_is_learned_from_its_requests():
    """Hybrid's first tokens come 5 s later than its stages say (waits outside them: the hand-off's
    admission, joining the decode batch), three in a row: auto stops ranking hybrid first. One request
    on time brings it back (the smallest of the last three, as stage corrections)."""
    router = Router(synthetic_samples(), explore_share=0)
    n_in, n_out = next((n, o) for n, o in LOAD if best(n, o) == "hybrid")
    before = router.estimates(n_in, n_out)
    d = router.choose(n_in, n_out)
    assert d.mode == "hybrid"
    assert 0 < d.first_token["hybrid"] < d.estimates["hybrid"] and d.missed == {m: 0.0 for m in MODE_NAMES}
    for over in (5.0, 6.0, 5.5):
        finish_late(router, router.choose(n_in, n_out, forced="hybrid"), over)
    after = router.estimates(n_in, n_out)
    assert abs(after["hybrid"] - before["hybrid"] - 5.0) < 1e-6, (before, after)
    assert after["gpu"] == before["gpu"] and after["fpga"] == before["fpga"]
    d = router.choose(n_in, n_out)
    assert d.mode != "hybrid" and d.missed["hybrid"] == 5.0
    assert router.snapshot()["missed_s"]["hybrid"] == 5.0
    finish_late(router, router.choose(n_in, n_out, forced="hybrid"), 0.0)  # measured against the term's removal
    assert router.choose(n_in, n_out).mode == "hybrid"


def test_with_the_term_off_late_first_tokens_change_nothing():
    router = Router(synthetic_samples(), explore_share=0, first_token_waits=False)
    n_in, n_out = LOAD[0]
    before = router.estimates(n_in, n_out)
    for _ in range(3):
        finish_late(router, router.choose(n_in, n_out, forced="fpga"), 9.0)
    assert router.estimates(n_in, n_out) == before and router.snapshot()["missed_s"]["fpga"] == 0.0


def test_a_first_token_sooner_than_estimated_never_lowers_the_estimate():
    router = Router(synthetic_samples(), explore_share=0)
    n_in, n_out = LOAD[0]
    before = router.estimates(n_in, n_out)
    for _ in range(3):
        finish_late(router, router.choose(n_in, n_out, forced="fpga"), -2.0)
    assert router.estimates(n_in, n_out) == before


def test_what_a_mode_missed_is_forgotten_when_it_has_not_run_for_a_while():
    """A load that made gpu mode's first tokens 30 s late and then ended: once `stale_after` auto
    decisions passed without a gpu request, its estimate is its stages' again."""
    router = Router(synthetic_samples(), explore_share=0, stale_after=20)
    n_in, n_out = LOAD[0]
    for _ in range(3):
        finish_late(router, router.choose(n_in, n_out, forced="gpu"), 30.0)
    late = router.estimates(n_in, n_out)["gpu"]
    for _ in range(20):
        router.choose(n_in, n_out)
    assert router.estimates(n_in, n_out)["gpu"] == late
    router.choose(n_in, n_out)
    assert abs(router.estimates(n_in, n_out)["gpu"] - (late - 30.0)) < 1e-6


def test_a_runs_first_token_teaches_its_mode_as_it_comes(tokenizer):
    """The gateway's side: Run hands the router the first token's time when it arrives (not when the
    request ends), against the Decision it was sent with; a request moved before it teaches nothing."""
    import time

    from services.gateway.output.choice import Choice
    from services.gateway.output.detokenizer import IncrementalDetokenizer
    from services.gateway.dispatch.serving import Run
    from services.gateway.output.stops import StopMatcher
    from services.rpc.hybridserve.v1 import engine_pb2 as pb

    router = Router(synthetic_samples(), explore_share=0)
    n_in, n_out = LOAD[0]

    def run_late(seconds: float, moved: bool = False) -> None:
        d = router.choose(n_in, n_out, forced="gpu")
        run = Run(router, d, n_in, time.perf_counter() - seconds,
                  [Choice(0, IncrementalDetokenizer(tokenizer), StopMatcher([]))])
        if moved:
            run.migrations = ["a migration before the first token"]
        run.take(pb.GenerateResponse(token_ids=[42]))

    run_late(7.0, moved=True)
    assert router.snapshot()["missed_s"]["gpu"] == 0.0
    first = router.choose(n_in, n_out, forced="gpu").first_token["gpu"]
    for _ in range(3):
        run_late(7.0)
    missed = router.snapshot()["missed_s"]["gpu"]
    assert 7.0 - first <= missed < 7.5 - first, (missed, first)


def burst(router: Router, n: int, n_in: int, n_out: int) -> list[str]:
    """`n` requests sent at once, their first tokens then arriving as one processor finishes their
    prompts one after another (the k-th after the first k prompts' prefill and hand-off); each
    first token taught as the dispatcher and Run teach it. The modes they were sent to."""
    sent = []
    for _ in range(n):
        d = router.choose(n_in, n_out)
        router.started(d.mode, d.prefill_s)
        sent.append(d)
    done = 0.0
    for d in sent:
        m = MODES[d.mode]
        done += PREFILL[m.prefill_engine](n_in) + (HANDOFF(n_in) if d.mode == "hybrid" else 0.0)
        router.observe_first_token(d.mode, d.first_token[d.mode], d.missed[d.mode], done)
        router.finished(d.mode, prefill_s=d.prefill_s)
    return [d.mode for d in sent]


def test_on_one_processor_a_burst_does_not_herd_the_next_one_to_another_mode():
    """Sixteen requests at once on one processor, all in the cheapest mode (hybrid): the last one's
    first token comes after sixteen prompts. Whatever the estimate missed of that (here all of it:
    no prefill-ahead term), every mode would have waited it on these cores: taken as hybrid's own
    missed seconds, it made hybrid look 7 s slower than modes that ran no burst, and the next burst
    went elsewhere (live, at 32 clients, fpga's 7.6 s sent 32 requests in a row to hybrid, whose
    prompts then queued on prefill_gpu)."""
    n_in, n_out = 300, 64
    assert best(n_in, n_out) == "hybrid"
    router = Router([dict(s, quiet=True) for s in synthetic_samples()], explore_share=0, shared_compute=True,
                    prefill_ahead=False)
    assert set(burst(router, 16, n_in, n_out)) == {"hybrid"}
    assert set(burst(router, 16, n_in, n_out)) == {"hybrid"}
    assert router.snapshot()["missed_s"]["hybrid"] == 0.0


def test_on_one_processor_what_one_mode_misses_beyond_the_others_counts_against_it():
    """Under load the first-token estimate runs high for every mode alike (fpga's first tokens came 9 s
    before it, hybrid's 1 s): hybrid's own 8 s (its prefill beside a busy batch, the hand-off) count
    against it; clamped at 0 each, both were 0 and auto sent work to hybrid (live, at 64 clients:
    TTFT p50 14.6 s). On separate devices a mode's shortfall is its own, never below 0."""
    shared, separate = (Router(synthetic_samples(), explore_share=0, shared_compute=flag) for flag in (True, False))
    for router in (shared, separate):
        for _ in range(3):
            router.observe_first_token("fpga", 20.0, 0.0, 11.0)
            router.observe_first_token("hybrid", 20.0, 0.0, 19.0)
    assert shared.snapshot()["missed_s"] == {"gpu": 0.0, "fpga": 0.0, "hybrid": 8.0}
    assert separate.snapshot()["missed_s"] == {"gpu": 0.0, "fpga": 0.0, "hybrid": 0.0}


def test_on_one_processor_a_mode_out_of_use_is_judged_against_the_first_tokens_of_its_own_time():
    """8 clients, then 32 (live, the serve benchmark): hybrid's first tokens missed 3.5 s beyond fpga's;
    then auto sent the next ones to fpga, whose estimates ran 25 s high under the new load. Judged
    against those, hybrid's term rose to 28.5 s and kept it out until it went stale, the rest of the
    round (77-78 tokens/s against 90-99 where auto kept sending prompts to hybrid). Against fpga's
    first tokens of its own time it stays 3.5 s; hybrid's next ones, under the new load, are judged
    against fpga's of that load. Another mode's first tokens stale by then count for none."""
    router = Router(synthetic_samples(), explore_share=0, shared_compute=True, stale_after=20)
    n_in, n_out = LOAD[0]
    for _ in range(3):
        router.observe_first_token("fpga", 20.0, 0.0, 20.0)
        router.observe_first_token("hybrid", 20.0, 0.0, 23.5)
        router.choose(n_in, n_out)
    assert router.snapshot()["missed_s"] == {"gpu": 0.0, "fpga": 0.0, "hybrid": 3.5}
    for _ in range(3):
        router.choose(n_in, n_out)
        router.observe_first_token("fpga", 40.0, 0.0, 15.0)
    assert router.snapshot()["missed_s"] == {"gpu": 0.0, "fpga": 0.0, "hybrid": 3.5}
    for _ in range(3):
        router.observe_first_token("hybrid", 40.0, 0.0, 16.0)
    assert router.snapshot()["missed_s"] == {"gpu": 0.0, "fpga": 0.0, "hybrid": 1.0}
    for _ in range(21):  # hybrid's and fpga's first tokens go stale; a gpu one comes 2 s late
        router.choose(n_in, n_out)
    for _ in range(3):
        router.observe_first_token("gpu", 20.0, 0.0, 22.0)
    assert router.snapshot()["missed_s"] == {"gpu": 0.0, "fpga": 0.0, "hybrid": 0.0}


def test_a_burst_on_separate_devices_spreads_over_the_prefill_engines():
    """On separate devices the prompts sent ahead wait on their own prefill engine: a burst of sixteen
    long prompts fills prefill_gpu's queue (hybrid, the cheapest alone) until fpga's own prefill is the
    sooner first token, and the rest go there; without the term all sixteen queue on prefill_gpu."""
    n_in, n_out = 300, 64
    on, off = (Router([dict(s, quiet=True) for s in synthetic_samples()], explore_share=0, prefill_ahead=flag)
               for flag in (True, False))
    sent = {}
    for name, router in (("on", on), ("off", off)):
        sent[name] = []
        for _ in range(16):
            d = router.choose(n_in, n_out)
            router.started(d.mode, d.prefill_s)
            sent[name].append(d)
    modes = {name: [d.mode for d in ds] for name, ds in sent.items()}
    assert set(modes["off"]) == {"hybrid"}
    assert modes["on"][0] == "hybrid" and "fpga" in modes["on"], modes["on"]
    # what the estimate holds: the prompts sent before, on that mode's prefill engine only
    d = on.choose(n_in, n_out)
    assert abs(d.first_token["hybrid"] - off.choose(n_in, n_out).first_token["hybrid"]
               - on.prefill_ahead_seconds("hybrid")) < 1e-9
    assert abs(on.prefill_ahead_seconds("hybrid") - on.snapshot()["prefill_ahead_s"]["gpu"]) < 1e-3
    assert on.prefill_ahead_seconds("hybrid") > 0
    for name, router in (("on", on), ("off", off)):  # every first token in: nothing ahead
        for d in sent[name]:
            router.finished(d.mode, prefill_s=d.prefill_s)
    assert on.snapshot()["prefill_ahead_s"] == {"gpu": 0.0, "fpga": 0.0}


def test_on_separate_devices_the_prompts_ahead_are_shared_by_the_prefill_engines_of_their_kind():
    """With two pairs (two prefill_gpu engines, the placement spreading the prompts) a new prompt waits
    behind half of what was sent to prefill_gpu, so more of a burst goes to hybrid before fpga's own
    prefill is the sooner first token; counted whole, the ahead term sent a burst to fpga as if one
    engine had all the prompts. On one processor two engines take turns on the same cores: no change."""
    n_in, n_out = 300, 64

    def sent_to_hybrid(engines: int, shared: bool) -> tuple[int, float]:
        router = Router([dict(s, quiet=True) for s in synthetic_samples()], explore_share=0, shared_compute=shared)
        for e in ("gpu", "fpga"):
            router.set_engine_load(e, running=0, waiting=0, max_num_seqs=64 * engines, engines=engines)
        ds = []
        for _ in range(16):
            d = router.choose(n_in, n_out)
            router.started(d.mode, d.prefill_s)
            ds.append(d)
        raw = router.snapshot()["prefill_ahead_s"]
        ahead = router.prefill_ahead_seconds("hybrid")
        assert abs(ahead - (sum(raw.values()) if shared else raw["gpu"] / engines)) < 1e-3
        return sum(d.mode == "hybrid" for d in ds), ahead

    one, two = sent_to_hybrid(1, shared=False), sent_to_hybrid(2, shared=False)
    assert 0 < one[0] < 16 and two[0] > one[0], (one, two)
    assert sent_to_hybrid(2, shared=True) == sent_to_hybrid(1, shared=True)
