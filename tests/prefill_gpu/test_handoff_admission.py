"""prefill_gpu's hand-off admission on its own: sized from a real arena's memory, not a count.

No model here: the senders are the real shared-memory ones over a small /dev/shm arena, the
admission reserves their slots. (Through the engines: tests/stack/test_engine_runtime.py, more than
eight hand-offs in flight in process, and tests/stack/test_hybrid.py, a full arena over gRPC.)
"""
from __future__ import annotations

import contextlib
import threading
import time

import pytest

from services.engine.requests import Cancellation
from services.errors import Cancelled, HandoffTimedOut, HandoffTooLarge, QueueFull
from services.kv.arena import Arena
from services.kv.header import SlotHeader
from services.kv.shm import ShmSender
from services.prefill_gpu.handoff_admission import HandoffAdmission

# a token's KV in these headers: 1 layer x (K, V) x 2 heads x 16 dims x fp32 = 256 bytes


def sender(arena: Arena, n_tokens: int) -> ShmSender:
    return ShmSender(arena, SlotHeader("fp32", 1, 2, 16, n_tokens, "test-model"))


@pytest.fixture
def arena():
    a = Arena(1 << 20)  # 1 MiB: 4096 tokens of these, a 2048-token hand-off takes half
    yield a
    a.close()


@contextlib.contextmanager
def admitted(admission: HandoffAdmission, s: ShmSender, cancel: Cancellation | None = None):
    """As the runtime does: admitted with the sender's memory reserved, the grant open, closed on the way out."""
    with admission.admit(s.memory_bytes, s.reserve_now, cancel or Cancellation()) as waited:
        try:
            s.open()
            yield waited
        finally:
            s.close()


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def until(probe, within: float = 10.0) -> None:
    """Poll until `probe()`: a bound for a hang, not a speed check."""
    deadline = time.monotonic() + within
    while not probe():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.01)


def test_as_many_hand_offs_run_as_their_memory_fits_many_more_than_eight(arena):
    admission = HandoffAdmission(arena.size, max_running=64, queue_depth=0)  # no queue: nothing may wait
    with contextlib.ExitStack() as held:
        for _ in range(24):  # 24 x 100 tokens x 256 bytes: 24 slots of ~28 KiB in 1 MiB
            held.enter_context(admitted(admission, sender(arena, 100)))
        assert admission.running == arena.slots_in_use == 24
        assert admission.bytes_held == arena.used_bytes
    assert admission.running == arena.slots_in_use == admission.bytes_held == 0


def test_an_explicit_count_still_caps_them(arena):
    admission = HandoffAdmission(arena.size, max_running=2, queue_depth=0)
    with admitted(admission, sender(arena, 10)), admitted(admission, sender(arena, 10)):
        with pytest.raises(QueueFull):
            with admitted(admission, sender(arena, 10)):
                pass
        assert arena.slots_in_use == 2  # the refused one reserved nothing


def test_with_little_memory_a_hand_off_waits_then_runs_once_memory_frees(arena):
    admission = HandoffAdmission(arena.size, max_running=64, queue_depth=4)
    first = admitted(admission, sender(arena, 3000))  # ~750 KiB of the 1 MiB
    first.__enter__()
    second = sender(arena, 2000)  # ~500 KiB: fits only once the first let go

    def run_second():
        with admitted(admission, second) as waited:
            return waited, second.slot.offset

    t, out = in_thread(run_second)
    until(lambda: admission.waiting == 1)
    assert admission.running == 1 and "error" not in out  # waiting, not refused
    first.__exit__(None, None, None)
    t.join(10)
    waited, offset = out["value"]
    assert waited > 0 and offset == 0  # it got the space the first one freed
    assert admission.running == admission.waiting == arena.slots_in_use == 0


def test_first_come_first_served_a_long_prompt_is_not_overtaken(arena):
    admission = HandoffAdmission(arena.size, max_running=64, queue_depth=4)
    holder = admitted(admission, sender(arena, 3000))
    holder.__enter__()
    order: list[str] = []

    def run(name: str, n_tokens: int):
        def go():
            with admitted(admission, sender(arena, n_tokens)):
                order.append(name)
        return go

    long_t, _ = in_thread(run("long", 2000))  # does not fit beside the holder
    until(lambda: admission.waiting == 1)
    short_t, _ = in_thread(run("short", 100))  # would fit now, but waits behind the long one
    until(lambda: admission.waiting == 2)
    time.sleep(0.2)
    assert order == []
    holder.__exit__(None, None, None)
    long_t.join(10)
    short_t.join(10)
    assert order[0] == "long"


def test_a_hand_off_larger_than_all_the_memory_is_refused_at_once(arena):
    admission = HandoffAdmission(arena.size, max_running=64, queue_depth=4)
    too_large = sender(arena, 5000)  # 1.2 MiB
    reserves: list[bool] = []

    def reserve() -> bool:
        reserves.append(too_large.reserve_now())
        return reserves[-1]

    def refused():
        # no deadline, and a holder that keeps the memory taken: queued, it would wait for good
        with admission.admit(too_large.memory_bytes, reserve, Cancellation()):
            pass

    with admitted(admission, sender(arena, 100)):
        t, out = in_thread(refused)
        t.join(10)  # a bound for a hang, not a speed check
        assert not t.is_alive(), "queued: it waits for memory that can never be enough"
        assert isinstance(out.get("error"), HandoffTooLarge)
        assert "can never fit the 1.0 MiB hand-off memory" in str(out["error"])
        assert reserves == [] and admission.waiting == 0  # refused before it asked for memory or queued
        assert admission.running == arena.slots_in_use == 1  # the holder's only


def test_a_waiter_leaves_the_queue_when_cancelled_or_past_its_deadline(arena):
    admission = HandoffAdmission(arena.size, max_running=64, queue_depth=1)
    with admitted(admission, sender(arena, 3000)):
        cancel = Cancellation()
        t, out = in_thread(lambda: admitted(admission, sender(arena, 2000), cancel).__enter__())
        until(lambda: admission.waiting == 1)
        with pytest.raises(QueueFull):  # the queue holds one
            with admitted(admission, sender(arena, 2000)):
                pass
        cancel.cancel()
        t.join(10)
        assert isinstance(out["error"], Cancelled) and admission.waiting == 0
        with pytest.raises(HandoffTimedOut):
            with admitted(admission, sender(arena, 2000), Cancellation(time.monotonic() + 0.2)):
                pass
        assert admission.waiting == 0 and arena.slots_in_use == 1


def test_the_count_is_auto_by_default_and_an_integer_still_caps_it():
    from services.prefill_gpu.settings import PrefillSettings

    default = PrefillSettings()
    assert default.prefill_max_concurrency == "auto" and default.handoff_max_running == default.max_num_seqs
    assert PrefillSettings(prefill_max_concurrency=8).handoff_max_running == 8
