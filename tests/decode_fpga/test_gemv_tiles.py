"""The tiled batched block GEMV of the paged step (gemv_quant_tiles: several output rows a work-item,
passes of 4, 2 and 1 rows of x): every row bit for bit what the one-row GEMV gives it, whatever the
number of rows beside it (batch invariance), at row counts that hit its passes and remainders and an
output count that leaves its last work-item a partial tile; and the work-group split it launches with."""
from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest

from services.decode_fpga.device import DeviceContext
from services.decode_fpga.launch import balanced_groups
from services.decode_fpga.quant_gemv import QuantMatrix
from tests.decode_fpga.kquant_checkpoint import random_blocks
from tests.decode_fpga.test_gemv_rows import one_row, run_rows
from tests.decode_fpga.test_quant_gemv import synthetic

COUNTS = (1, 3, 5, 8, 13)  # rows of x: a lone row, passes of 2 + 1, 4 + 1, 4 + 4, 4 x 3 + 1
OUT_ROWS = 71  # not a multiple of any tile: the last work-item's tile is partial
# (every format at the default tile and 9 rows: test_gemv_rows.py, test_kquant_gemv.py); here a format
# of each kind (minimums, 5 bits, Q6_K's two scales a block, K minimums) at each tile, and tile 0:
# gemv_quant_rows, the kernel before, kept for A/B runs
CASES = [("q4_1", 2), ("q5_0", 2), ("q6_k", 2), ("q4_k", 4), ("q8_0", 4), ("q4_0", 1), ("q4_1", 0)]


def matrix_tensor(qtype: str):
    if qtype.endswith("_k"):
        return random_blocks(qtype, OUT_ROWS, 512, seed=7)  # two K super-blocks a row
    if qtype.startswith("q5"):
        return random_blocks(qtype, OUT_ROWS, 32 * 7, seed=7)
    return synthetic(qtype, OUT_ROWS, 32 * 7, seed=7)  # an odd block count: ROW_DOT's tail block


@pytest.mark.parametrize("qtype,tile", CASES, ids=[f"{q}-tile{t}" for q, t in CASES])
def test_tiled_rows_are_one_row_gemvs_at_any_count(cl_dev, qtype, tile):
    dev = DeviceContext(cl_dev.device, cl_dev.context, cl_dev.queue, lanes=1, gemv_tile=tile)
    m = QuantMatrix(dev, matrix_tensor(qtype))
    assert m.tile == tile
    rng = np.random.default_rng(11)
    x = rng.normal(size=(max(COUNTS), m.cols)).astype(np.float32)
    y0 = rng.normal(size=(max(COUNTS), m.rows)).astype(np.float32)
    alone = np.stack([one_row(dev, m, x[r:r + 1], y0[r:r + 1], True)[0] for r in range(max(COUNTS))])
    # each kernel at every count: the tiles (by default only past x's L1 size), then gemv_quant_tiles1
    for above in (0, 10**6):
        m.tile_above = above
        for n in COUNTS:
            got = run_rows(dev, m, x[:n], y0[:n], True)
            np.testing.assert_array_equal(got, alone[:n], err_msg=f"{n} rows, tiles past {above}")


def test_tiles_run_past_the_rows_whose_x_fills_l1(cl_dev):
    """bind_gemv_rows: one output a work-item while x's rows fit a core's L1 data cache (gemv_quant_tiles1),
    the tiles past them; tile 0 keeps gemv_quant_rows at every count."""
    t = synthetic("q8_0", OUT_ROWS, 1536)
    m = QuantMatrix(DeviceContext(cl_dev.device, cl_dev.context, cl_dev.queue, lanes=1, gemv_tile=2), t)
    launch = m.bind_gemv_rows(*(cl.Buffer(cl_dev.context, cl.mem_flags.READ_WRITE, 4),) * 3)
    assert m.tile_above == 8 and launch.up_to == 8  # 8 rows of 1536 floats: 48 KiB
    assert launch.few.kernel.function_name == "gemv_quant_tiles1"
    assert launch.many.kernel.function_name == "gemv_quant_tiles"
    off = QuantMatrix(DeviceContext(cl_dev.device, cl_dev.context, cl_dev.queue, lanes=1, gemv_tile=0), t)
    assert off.bind_gemv_rows(*(cl.Buffer(cl_dev.context, cl.mem_flags.READ_WRITE, 4),) * 3).kernel.function_name \
        == "gemv_quant_rows"


@pytest.mark.parametrize("items,units,max_local,per_unit", [(12288, 2, 4096, 1), (36, 2, 4096, 1), (1, 2, 4096, 1),
                                                            (24576, 2, 4096, 1), (288, 3, 4096, 4)])
def test_balanced_groups_give_every_unit_as_many_groups(items, units, max_local, per_unit):
    size, local = balanced_groups(items, units, max_local, per_unit)
    groups = size // local
    assert size % local == 0 and size >= items and local <= max_local
    assert groups % units == 0 and groups >= units * per_unit
    assert size - items < groups  # fewer than one spare item a group
