"""The KV hand-off seam: one request's KV, from the engine that prefilled it to the one that decodes it.
(Just past 300 lines on purpose: the two halves, their shared state machine and the header checks that
make the KV one request's are one contract, and every transport subclasses both halves from here.)

Two small halves and a state, whatever carries the bytes. The control messages
(`SlotGrant`, `LayerReady`, `PrefillDone`) travel in the Prefill RPC; the KV
itself goes through the transport.

Which side calls what, for one request:

    sender (prefill_gpu)                           receiver (decode_fpga)
    grant = sender.open()        ── SlotGrant ──►  receiver.accept(grant)       checks the header
    for each layer l, as the prefill computes it:
      copy layer l into sender.layer_buffer(l)
      sender.layer_written(l, t) ── LayerReady ─►  receiver.import_layer(msg)   onto the device
    sender.finish()              ── PrefillDone ►  receiver.finish()            every layer on the device
    sender.close()  once the receiver has ended the call (frees the transport's memory; any exit path)

(`receiver.consume(events)` runs the right-hand column over a stream of those messages.)

State of either half (`HandoffState`):

    WAITING ──open/accept──► TRANSFERRING ──finish──► DONE
       └───────────────────────────┴── a failed check, the peer gone, cancelled ──► FAILED

The receiver checks what it is told against what it expects from its own request
(the prompt's token count, the wire dtype, the model's KV shape, the request's
nonce): a mismatch is `HeaderMismatch`, never garbage tokens. The KV belongs to
exactly one request: before and after copying each layer the receiver reads the
slot's header again, and a header that changed (the slot freed, or handed to
another request, while this reader was slow) fails the hand-off with `SlotChanged`
(a `HandoffFailed`). The check after the last layer comes once the engine has the
bytes on its device (`finish`), since an engine may only enqueue its copies. Copying a framework's tensor into
`layer_buffer` is the sender's caller's business (prefill_gpu/kv_export.py for torch).

Transports, one module each: shm.py (the shared-memory arena; the one the services
use) and inprocess.py (plain memory in one process, for tests; a network transport
would follow its shape). A new transport is one more module with a `KVSender` and a
`KVReceiver` subclass implementing their underscored methods.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Union

import numpy as np

from services.errors import HandoffFailed
from services.kv.header import HeaderMismatch, SlotHeader
from services.kv.layout import WireLayout, wire_dtype


class HandoffState(enum.Enum):
    WAITING = "waiting"  # no slot granted yet
    TRANSFERRING = "transferring"  # slot granted, layers moving
    DONE = "done"  # sender: every layer written; receiver: every layer on its device
    FAILED = "failed"  # a check failed, the peer went away, or the request was cancelled


@dataclass(frozen=True)
class SlotGrant:
    """Sender → receiver, first: where this request's KV will be, and what it holds."""

    offset: int  # the transport's handle for the request's memory (shm: the header's offset in the arena)
    size: int
    n_tokens: int
    dtype: str
    # the request's nonce (header.request_nonce) as the *receiver* knows it: filled in on the receiving
    # side from its own request, never read off the wire; 0: not known, the header's is taken as it is
    nonce: int = 0


class SlotChanged(HandoffFailed):
    """The slot's header changed while the receiver was reading it: freed or handed to another request."""


@dataclass(frozen=True)
class LayerReady:
    """Sender → receiver, once per layer: layer `layer` is complete in the transport's memory."""

    layer: int
    offset: int  # where its bytes are, in the transport's terms
    nbytes: int
    written_at: float  # unix time it was complete


@dataclass(frozen=True)
class PrefillDone:
    """Sender → receiver, last: the prompt's first generated token and the sender's timings."""

    first_token: int
    prefill_s: float
    queue_s: float
    compute_done_at: float  # unix time the prefill compute ended
    # services.engine.logprobs.TokenLogprob values, when the request asked for them (the first token's,
    # and the prompt's positions 1..n-1): the engine that prefilled computed them
    first_logprob: Any = None
    prompt_logprobs: Any = None


HandoffEvent = Union[SlotGrant, LayerReady, PrefillDone]


def layout_of(header: SlotHeader) -> WireLayout:
    return WireLayout(header.n_layers, header.n_kv_heads, header.head_dim, header.n_tokens,
                      wire_dtype(header.dtype).numpy)


class KVSender(ABC):
    """The prefilling side of one request's hand-off. A context manager: leaving it closes."""

    def __init__(self, header: SlotHeader):
        self.header = header
        self.layout = layout_of(header)
        self.state = HandoffState.WAITING

    @property
    def memory_bytes(self) -> int:
        """The bytes this hand-off holds from `open` to `close`: what an admission sized from
        memory counts (a transport with overhead, e.g. a slot's header and alignment, says more)."""
        return self.layout.nbytes

    def reserve_now(self) -> bool:
        """Reserve the request's memory now if the transport has it, without waiting; False when it
        does not fit yet. `open` then uses what was reserved. A transport whose memory is its own
        (a buffer per request) has nothing shared to reserve: True, and its admission's byte budget
        bounds it."""
        return True

    def open(self) -> SlotGrant:
        """Reserve the request's memory (unless `reserve_now` did) and write its header (may wait, or
        raise the transport's back-pressure error)."""
        if self.state is not HandoffState.WAITING:
            raise RuntimeError(f"open() on a {self.state.value} sender")
        grant = self._open()
        self.state = HandoffState.TRANSFERRING
        return grant

    def layer_buffer(self, layer: int) -> np.ndarray:
        """Where layer `layer` goes: a writable [2, n_kv_heads, n_tokens, head_dim] array of the wire dtype."""
        if self.state is not HandoffState.TRANSFERRING:
            raise RuntimeError(f"layer_buffer() on a {self.state.value} sender")
        return self.layout.layer_view(self._data(), layer)

    def layer_written(self, layer: int, written_at: float | None = None) -> LayerReady:
        """Layer `layer` is complete in `layer_buffer(layer)`: the message that tells the receiver."""
        return LayerReady(layer, self._layer_location(layer), self.layout.layer_nbytes,
                          time.time() if written_at is None else written_at)

    def finish(self) -> None:
        self.state = HandoffState.DONE

    def close(self) -> None:
        """Free the request's memory (idempotent). Only after the receiver let go of it."""
        if self.state is not HandoffState.DONE:
            self.state = HandoffState.FAILED
        self._close()

    def __enter__(self) -> "KVSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- a transport implements these ------------------------------------------
    @abstractmethod
    def _open(self) -> SlotGrant:
        """Reserve `layout.nbytes` (plus the header), write `self.header`, say where."""

    @abstractmethod
    def _data(self) -> np.ndarray:
        """The request's KV bytes, uint8 [layout.nbytes], writable."""

    @abstractmethod
    def _layer_location(self, layer: int) -> int:
        """The offset a LayerReady for `layer` names."""

    @abstractmethod
    def _close(self) -> None:
        """Free what `_open` reserved, if it did."""


class KVReceiver(ABC):
    """The decoding side of one request's hand-off: imports each layer into an engine's sequence.

    `expected` is built from the receiver's own request and model (never from the sender's
    messages); `engine` implements `import_kv_layer` and `finish_import` (services/engine/api.py).
    """

    def __init__(self, engine, seq, expected: SlotHeader):
        self.engine, self.seq, self.expected = engine, seq, expected
        self.layout = layout_of(expected)
        self.state = HandoffState.WAITING
        self.grant: SlotGrant | None = None
        self.accepted: SlotHeader | None = None  # the header as accepted: every later read must equal it
        self.bytes = 0
        self.layers: set[int] = set()  # the layers imported so far
        self.first_written_at: float | None = None
        self.on_device_at: float | None = None

    def accept(self, grant: SlotGrant) -> None:
        """Check the granted slot's message and header against what this request expects."""
        with self._failing():
            if self.state is not HandoffState.WAITING:
                raise HeaderMismatch(f"a slot was granted to a {self.state.value} hand-off")
            e = self.expected
            if (grant.n_tokens, grant.dtype) != (e.n_tokens, e.dtype):
                raise HeaderMismatch(f"the slot holds {grant.n_tokens} tokens of {grant.dtype}; this request "
                                     f"expects {e.n_tokens} tokens of {e.dtype}")
            if e.nonce and grant.nonce and e.nonce != grant.nonce:
                raise HeaderMismatch("the slot was granted for another request")
            if not e.nonce and grant.nonce:
                e = dataclasses.replace(e, nonce=grant.nonce)
            header = self._read_header(grant)
            header.check_against(e)
            self.grant, self.accepted = grant, header
            self.state = HandoffState.TRANSFERRING

    def import_layer(self, msg: LayerReady) -> None:
        """Copy one layer from the transport into the engine's sequence (may only enqueue the copy)."""
        with self._failing():
            if self.state is not HandoffState.TRANSFERRING:
                raise HeaderMismatch(f"layer {msg.layer} arrived before its slot was granted")
            lay = self.layout
            if msg.nbytes != lay.layer_nbytes or not 0 <= msg.layer < lay.n_layers:
                raise HeaderMismatch(f"layer {msg.layer} of {msg.nbytes} bytes does not match the slot's layout "
                                     f"({lay.n_layers} layers of {lay.layer_nbytes} bytes)")
            if msg.layer in self.layers:
                raise HeaderMismatch(f"layer {msg.layer} arrived twice")
            self._check_unchanged(f"before layer {msg.layer}")
            raw = self._layer_bytes(msg)
            kv = np.frombuffer(raw, dtype=lay.dtype).reshape(lay.layer_shape)  # [2, kv_heads, n_tokens, dim]
            self.engine.import_kv_layer(self.seq, msg.layer, kv)
            self._check_unchanged(f"while layer {msg.layer} was copied")
            self.bytes += msg.nbytes
            self.layers.add(msg.layer)
            if self.first_written_at is None:
                self.first_written_at = msg.written_at

    def finish(self) -> None:
        """Every layer sent: wait until they are on the device. Only then may the sender free them."""
        with self._failing():
            missing = sorted(set(range(self.layout.n_layers)) - self.layers)
            if self.state is not HandoffState.TRANSFERRING or missing:
                raise HeaderMismatch(f"the hand-off ended after {len(self.layers)} of {self.layout.n_layers} layers "
                                     f"(missing {missing[:8]}{'...' if len(missing) > 8 else ''})")
            self.engine.finish_import(self.seq, self.layout.n_tokens)
            # the engine's copies have read the slot now (they may have been only enqueued before)
            self._check_unchanged("while the layers went to the device")
            self.on_device_at = time.time()
            self.state = HandoffState.DONE

    @property
    def layers_imported(self) -> int:
        return len(self.layers)

    def fail(self) -> None:
        if self.state is not HandoffState.DONE:
            self.state = HandoffState.FAILED

    def _check_unchanged(self, when: str) -> None:
        """SlotChanged unless the slot's header still reads exactly as it did when accepted. The sender
        zeroes it before the slot may be reused, so an equal header after a copy means the copy read
        this request's bytes (stores and loads are ordered on the hosts this runs on: x86-64 TSO)."""
        try:
            now = self._read_header(self.grant)
        except HeaderMismatch:
            now = None
        if now != self.accepted:
            raise SlotChanged(f"the KV slot was freed or given to another request {when}")

    def consume(self, events: Iterable[HandoffEvent], keep_going: Callable[[], bool] = lambda: True
                ) -> PrefillDone | None:
        """Drive the hand-off from a stream of messages: the PrefillDone once every layer is on the
        device, or None if `keep_going()` turned false or the stream ended first (state FAILED)."""
        for msg in events:
            if isinstance(msg, SlotGrant):
                self.accept(msg)
            elif isinstance(msg, LayerReady):
                self.import_layer(msg)
            elif isinstance(msg, PrefillDone):
                self.finish()
                return msg
            if not keep_going():
                break
        self.fail()
        return None

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.fail()
            raise

    # ---- a transport implements these ------------------------------------------
    @abstractmethod
    def _read_header(self, grant: SlotGrant) -> SlotHeader:
        """The header the sender wrote for `grant`."""

    @abstractmethod
    def _layer_bytes(self, msg: LayerReady) -> memoryview | np.ndarray:
        """The `msg.nbytes` bytes of layer `msg.layer`; HeaderMismatch if `msg.offset` is not where
        that layer of the granted slot lies."""


class NetworkSender(KVSender):
    """What the network transports' senders (tcp.py, nixl.py) share: the KV at its wire offsets in a buffer of
    their own, a whole layer sent as a slice of every position once written, and `send_slice`'s precondition.
    A subclass implements `send_slice` (and `_open`, `_data`, `_close`)."""

    def _layer_location(self, layer: int) -> int:
        return self.layout.layer_offset(layer)

    def layer_written(self, layer: int, written_at: float | None = None) -> LayerReady:
        """Layer `layer` is complete: send it (returns at once), then say so."""
        self.send_slice(layer, layer + 1, 0, self.layout.n_tokens)
        return super().layer_written(layer, written_at)

    @abstractmethod
    def send_slice(self, layer0: int, layer1: int, start: int, stop: int) -> None:
        """Layers [layer0, layer1) × positions [start, stop) are in the buffer: on to the receiver."""

    def _check_slice(self, layer0: int, layer1: int, start: int, stop: int) -> None:
        """`send_slice`'s precondition: transferring, and the slice inside the layout."""
        if self.state is not HandoffState.TRANSFERRING:
            raise RuntimeError(f"send_slice() on a {self.state.value} sender")
        lay = self.layout
        if not (0 <= layer0 < layer1 <= lay.n_layers and 0 <= start < stop <= lay.n_tokens):
            raise ValueError(f"slice layers [{layer0}, {layer1}) × tokens [{start}, {stop}) is outside "
                             f"{lay.n_layers} layers × {lay.n_tokens} tokens")
