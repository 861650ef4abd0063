"""The slicing DP against brute force over every slicing of small prompts and against every uniform
slicing on prefill-shaped costs (growing with length and context); the cost model's fit on synthetic
data whose coefficients are known."""
from __future__ import annotations

import itertools
import math

import pytest

from services.kv.slicing import Link, PrefillCost, best_slices, pipeline_time, uniform_slices


def compositions(n: int):
    """Every ordered way to write n as a sum of positive integers."""
    for cuts in itertools.product([False, True], repeat=n - 1):
        out, run = [], 1
        for cut in cuts:
            if cut:
                out.append(run)
                run = 1
            else:
                run += 1
        yield out + [run]


def quadratic(a: float, b: float, c: float):
    """A prefill-like cost: per-slice overhead a, per token b, attention c per (token × context)."""
    return lambda s, ctx: a + b * s + c * s * (ctx + s / 2)


COSTS = [quadratic(1e-3, 1e-4, 1e-7), quadratic(5e-3, 2e-5, 0.0), quadratic(0.0, 1e-4, 5e-6),
         lambda s, ctx: 2e-3 + 3e-4 * s ** 1.3 + 1e-6 * ctx]
LINKS = [Link(1.25e8, 5e-4), Link(1.25e9, 5e-4), Link(1e6, 1e-2), Link(1e9, 0.0)]


@pytest.mark.parametrize("n", [1, 2, 5, 9, 12])
@pytest.mark.parametrize("cost", COSTS)
@pytest.mark.parametrize("link", LINKS)
@pytest.mark.parametrize("layers", [1, 3])
def test_the_dp_finds_the_brute_force_optimum(n, cost, link, layers):
    bpt = 20_000.0
    brute = min(pipeline_time(c, cost, link, bpt, layers) for c in compositions(n))
    slices, t = best_slices(n, cost, link, bpt, layers=layers)
    assert sum(slices) == n
    assert math.isclose(t, brute, rel_tol=1e-12)
    assert math.isclose(pipeline_time(slices, cost, link, bpt, layers), t, rel_tol=1e-12)


def test_the_dp_with_a_granule_is_optimal_among_granule_multiples():
    cost, link, bpt, n, g = COSTS[0], LINKS[0], 2e4, 50, 8  # 7 units, the last of 2 tokens
    brute = min(pipeline_time([min(u * g, n - sum(c[:i]) * g) if i == len(c) - 1 else u * g
                               for i, u in enumerate(c)], cost, link, bpt) for c in compositions(math.ceil(n / g)))
    slices, t = best_slices(n, cost, link, bpt, granule=g)
    assert sum(slices) == n and all(s % g == 0 for s in slices[:-1])
    assert math.isclose(t, brute, rel_tol=1e-12)


GRID = [(n, ctx) for n in (64, 256, 1024) for ctx in (0, 1024, 2048, 3072)]


@pytest.mark.parametrize("n", [256, 1024, 4096])
@pytest.mark.parametrize("gbit", [1, 10, 0.1])
@pytest.mark.parametrize("cost", [PrefillCost(4e-3, 2e-4, 2e-8, 1e-8), PrefillCost(1e-2, 5e-5, 1e-7, 5e-8),
                                  PrefillCost(1e-3, 1e-5, 0.0, 0.0), PrefillCost(0.0, 3e-3, 0.0, 2e-6)])
@pytest.mark.parametrize("layers", [1, 30])
def test_dp_slices_are_predicted_no_slower_than_any_uniform_slicing_of_the_grid(n, gbit, cost, layers):
    link, bpt = Link(gbit * 1.25e8, 5e-4), 2 * 4 * 64 * 4 * 22  # fp32 K and V, 4 heads of 64, 22 layers
    granule = 16 if n <= 1024 else 64
    dp, t = best_slices(n, cost, link, bpt, granule=granule, layers=layers)
    assert sum(dp) == n and all(s % granule == 0 for s in dp[:-1])
    for size in range(granule, n + granule, granule):  # every uniform slicing on the granule grid
        assert t <= pipeline_time(uniform_slices(n, size), cost, link, bpt, layers)


def test_the_fit_recovers_the_coefficients_of_quadratic_data():
    truth = PrefillCost(0.03, 2.5e-3, 4e-7, 6e-7)
    fitted = PrefillCost.fit([(n, ctx, truth(n, ctx)) for n, ctx in GRID])
    for got, want in zip((fitted.a, fitted.b, fitted.c, fitted.d), (truth.a, truth.b, truth.c, truth.d)):
        assert math.isclose(got, want, rel_tol=1e-6)
    assert max(map(abs, fitted.relative_errors([(n, ctx, truth(n, ctx)) for n, ctx in GRID]))) < 1e-9
    # past the grid it grows as the data did, not along a line from the last two lengths
    assert math.isclose(fitted(4096, 0), truth(4096, 0), rel_tol=1e-6)


def test_the_fit_keeps_coefficients_non_negative_where_plain_least_squares_would_not():
    # time falling slightly with context: unconstrained least squares makes c negative
    pts = [(n, ctx, 0.01 + 1e-3 * n - 1e-9 * n * ctx) for n, ctx in GRID]
    fitted = PrefillCost.fit(pts)
    assert min(fitted.a, fitted.b, fitted.c, fitted.d) >= 0
    assert fitted.c == 0.0
    assert max(map(abs, fitted.relative_errors(pts))) < 0.05
    assert all(fitted(n, ctx) > 0 for n in (1, 64, 8192) for ctx in (0, 10**6))


def test_the_model_never_predicts_a_free_slice():
    assert PrefillCost(0.0, 0.0, 0.0, 0.0)(64, 0) > 0
    with pytest.raises(ValueError):
        PrefillCost(-1e-3, 1e-4, 0.0, 0.0)
    with pytest.raises(ValueError):
        PrefillCost.fit([(64, 0, 0.1), (128, 0, 0.2), (256, 0, 0.4)])  # three points, four unknowns
    assert PrefillCost.from_json(PrefillCost(1.0, 2.0, 3.0, 4.0).to_json()) == PrefillCost(1.0, 2.0, 3.0, 4.0)


def test_a_quadratic_cost_and_a_link_as_slow_as_the_compute_make_the_dp_slice():
    cost = PrefillCost(5e-3, 1e-4, 2e-7, 1e-7)
    link, bpt, n = Link(1.25e8, 5e-4), 46_080, 2048  # 1 Gbit/s: sending the KV takes as long as computing it
    dp, t = best_slices(n, cost, link, bpt, granule=64, layers=1)
    whole = pipeline_time([n], cost, link, bpt, 1)
    assert len(dp) >= 3
    assert t < 0.9 * whole
    # what the old linear table got wrong: a long slice's cost grows faster than its length
    assert cost(4096, 0) > 2 * cost(2048, 0)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        PrefillCost.fit([(0, 0, 1.0), (1, 0, 1.0), (2, 0, 1.0), (3, 0, 1.0)])
    with pytest.raises(ValueError):
        pipeline_time([4, 0], COSTS[0], LINKS[0], 1.0)
    with pytest.raises(ValueError):
        best_slices(0, COSTS[0], LINKS[0], 1.0)
    assert uniform_slices(10, 4) == [4, 4, 2]
