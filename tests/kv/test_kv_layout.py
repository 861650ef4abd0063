"""The wire layout: offsets, sizes and zero-copy layer views."""
from __future__ import annotations

import numpy as np
import pytest

from services.kv.layout import WireLayout


def test_layer_views_round_trip(model_config):
    lay = WireLayout.for_model(model_config, n_tokens=7, dtype="fp16")
    assert lay.layer_nbytes == 2 * 3 * 7 * 64 * 2 and lay.nbytes == 30 * lay.layer_nbytes
    full = np.random.default_rng(0).normal(size=lay.shape).astype(np.float16)
    buf = memoryview(full.tobytes())
    for layer in (0, 13, 29):
        np.testing.assert_array_equal(lay.layer_view(buf, layer), full[layer])
    with pytest.raises(IndexError):
        lay.layer_offset(30)


def test_torch_export_is_wire_layout(torch_engine, model_config):
    """A layer exported from the torch engine's blocks (what the hand-off sends) is its pool's KV in the
    wire layout, whatever blocks hold it."""
    from tests.engine.step_calls import chunk

    table = (7, 2)
    torch_engine.step([chunk(0, 0, [4, 8, 15, 16, 23], table)], greedy=True)
    kv = torch_engine.export_kv_blocks(table, 3, 5).numpy()
    assert kv.shape == WireLayout.for_model(model_config, 5).layer_shape
    np.testing.assert_array_equal(kv, torch_engine.read_kv_blocks(table, 5)[3])
