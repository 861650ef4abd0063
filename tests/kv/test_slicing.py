"""The slicing DP against brute force over every slicing of small prompts, and against every uniform
slicing on synthetic cost tables shaped like a prefill (cost growing with length and context)."""
from __future__ import annotations

import itertools
import math

import pytest

from services.kv.slicing import CostTable, Link, best_slices, pipeline_time, uniform_slices


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


def synthetic_table(per_token_s: float, attn: float, overhead: float) -> CostTable:
    lengths, contexts = [16, 64, 256, 1024, 4096], [0, 512, 1024, 2048, 4096]
    return CostTable(lengths, contexts, [[overhead + per_token_s * s + attn * s * (c + s / 2) for c in contexts]
                                         for s in lengths])


@pytest.mark.parametrize("n", [256, 1024, 4096])
@pytest.mark.parametrize("gbit", [1, 10])
@pytest.mark.parametrize("table", [synthetic_table(2e-4, 2e-8, 4e-3), synthetic_table(5e-5, 1e-7, 1e-2),
                                   synthetic_table(1e-5, 0.0, 1e-3)])
@pytest.mark.parametrize("layers", [1, 30])
def test_dp_slices_beat_or_equal_every_uniform_slicing(n, gbit, table, layers):
    link, bpt = Link(gbit * 1.25e8, 5e-4), 2 * 4 * 64 * 4 * 22  # fp32 K and V, 4 heads of 64, 22 layers
    granule = 16 if n <= 1024 else 64  # the DP is exact among multiples of its granule: uniform sizes are
    dp, t = best_slices(n, table, link, bpt, granule=granule, layers=layers)
    for size in (s for s in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if s % granule == 0):
        assert t <= pipeline_time(uniform_slices(n, size), table, link, bpt, layers) * (1 + 1e-12)
    assert t <= pipeline_time([n], table, link, bpt, layers) * (1 + 1e-12)


def test_the_cost_table_interpolates_and_extrapolates_linearly():
    t = CostTable([10, 20], [0, 100], [[1.0, 2.0], [3.0, 4.0]])
    assert t(10, 0) == 1.0 and t(20, 100) == 4.0
    assert math.isclose(t(15, 50), 2.5)
    assert math.isclose(t(30, 0), 5.0)  # past the lengths: the slope goes on
    assert CostTable.from_json(t.to_json())(15, 50) == t(15, 50)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        CostTable([20, 10], [0, 1], [[1, 1], [1, 1]])
    with pytest.raises(ValueError):
        pipeline_time([4, 0], COSTS[0], LINKS[0], 1.0)
    with pytest.raises(ValueError):
        best_slices(0, COSTS[0], LINKS[0], 1.0)
    assert uniform_slices(10, 4) == [4, 4, 2]
