"""The wire → channel mapping is pure, lossless and collision-free for any channel count."""
from __future__ import annotations

import numpy as np
import pytest

from services.decode_fpga.kv_channels import ChannelLayout, channels_to_wire, wire_to_channels


@pytest.mark.parametrize("n_channels", [1, 2, 3, 7, 32])
def test_planes_never_overlap_and_fill_the_channels(n_channels):
    lay = ChannelLayout(n_layers=5, n_kv_heads=3, head_dim=8, max_context=6, n_slots=3, n_channels=n_channels)
    seen = {c: set() for c in range(n_channels)}
    for slot in range(3):
        for layer in range(5):
            for kv in range(2):
                for head in range(3):
                    ch, off = lay.locate(slot, layer, kv, head)
                    assert off % lay.plane_elems == 0 and off + lay.plane_elems <= lay.channel_elems(ch)
                    assert off not in seen[ch]
                    seen[ch].add(off)
    assert sum(len(s) for s in seen.values()) == 3 * lay.planes_per_slot
    assert all(len(seen[c]) * lay.plane_elems == lay.channel_elems(c) for c in range(n_channels))


@pytest.mark.parametrize("n_channels", [1, 2, 3, 32])
def test_wire_round_trip(n_channels):
    lay = ChannelLayout(n_layers=4, n_kv_heads=2, head_dim=4, max_context=9, n_slots=2, n_channels=n_channels)
    chans = [np.zeros(max(1, lay.channel_elems(c)), np.float32) for c in range(n_channels)]
    wire = np.random.default_rng(n_channels).normal(size=(4, 2, 2, 7, 4)).astype(np.float32)
    other = np.random.default_rng(99).normal(size=(4, 2, 2, 9, 4)).astype(np.float32)
    wire_to_channels(lay, 1, wire, chans)
    wire_to_channels(lay, 0, other, chans)  # the other slot must not disturb slot 1
    np.testing.assert_array_equal(channels_to_wire(lay, 1, 7, chans), wire)
    np.testing.assert_array_equal(channels_to_wire(lay, 0, 9, chans), other)


def test_zero_channels_is_refused():
    with pytest.raises(ValueError):
        ChannelLayout(1, 1, 4, 4, 1, 0)
