"""A hybrid request's hand-off times (decode_fpga/hybrid.py): the total always holds the exposed wait."""
from __future__ import annotations

import pytest

from services.decode_fpga.hybrid import handoff_seconds


def test_layers_streamed_while_the_prefill_computed_expose_only_the_tail():
    total, exposed = handoff_seconds(first_written_at=10.0, compute_done_at=10.5, on_device_at=10.6)
    assert total == pytest.approx(0.6) and exposed == pytest.approx(0.1)


def test_a_first_frame_arriving_after_the_compute_ended_is_timed_from_the_compute_end():
    """Over TCP on a busy machine (CI, 2026-11-26): compute done, the first frame 5 ms later, on the device
    42 ms after that. Timed from the first frame the total was 42 ms against a 48 ms exposed wait."""
    total, exposed = handoff_seconds(first_written_at=100.005, compute_done_at=100.0, on_device_at=100.047)
    assert exposed == pytest.approx(0.047) and total == pytest.approx(0.047)
    assert 0 <= exposed <= total


def test_a_device_ready_before_the_compute_reported_its_end_exposes_nothing():
    total, exposed = handoff_seconds(first_written_at=5.0, compute_done_at=5.2, on_device_at=5.15)
    assert exposed == 0.0 and total == pytest.approx(0.15)
