"""A hybrid request's hand-off (decode_fpga/hybrid.py): the total time always holds the exposed wait, and a
call that ended under it is reported with its own error."""
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


def test_a_failed_prefills_error_is_found_behind_every_layer_it_sent():
    """A slot found freed at the first layer's read, the prefill having failed at its last layer: the
    call's error is still the request's (INTERNAL), behind all the layer messages sent before it (4
    were read once, and a failure at layer 3 of 30 came back FAILED_PRECONDITION)."""
    from services.decode_fpga.hybrid import _why_the_call_ended
    from services.errors import EngineStepFailed

    n_layers = 30

    def call_failing_at(layer: int):
        yield from (("layer", i) for i in range(1, layer))  # the first one was read already
        raise EngineStepFailed("the engine failed while serving the request")

    for layer in (3, 8, n_layers):
        assert isinstance(_why_the_call_ended(call_failing_at(layer), n_layers + 1), EngineStepFailed), layer
    assert _why_the_call_ended(iter([("layer", 1), ("done", 0)]), n_layers + 1) is None  # it ended cleanly
