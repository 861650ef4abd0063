"""decode_fpga's request handling in plain Python: fpga-mode Generate, and hybrid mode.

In hybrid mode this engine orchestrates: it looks up how much of the prompt its prefix
cache holds (whole blocks) and asks a `PrefillPeer` (prefill_gpu, over gRPC and the
shared-memory arena in the service; in process in tests) for the rest only: its own, or the one
the request names among those it was configured with (`PrefillPeers`: pools, where the gateway
picks a request's prefill engine and its decode engine separately). Once the
peer admitted the request (its SlotGrant), the engine loop reserves KV blocks: the
cached prefix's and fresh ones for the rest (if the prefix was evicted meanwhile, the
whole prompt is asked for again). Each layer is imported into those blocks as the
message for it arrives (while the peer computes the next), the peer's call is ended
once every layer is on the device (which frees its memory), then the request joins
the running batch and decodes with the others.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Iterator, Protocol

import numpy as np

from services.engine import metrics as m
from services.engine.block_import import BlockImport
from services.engine.token_event import TokenEvent
from services.engine.profile_cache import Profile, sweep_lock
from services.engine.profile_sweep import fitting_lengths
from services.engine.request_stream import RequestStream
from services.engine.requests import Cancellation, EngineRequest, RequestTimings
from services.engine.runtime import EngineRuntime, stream_tokens
from services.engine.sampling import SamplingParams
from services.errors import Cancelled, EngineError, HandoffFailed, InvalidRequest
from services.kv.handoff import HandoffEvent, KVReceiver, PrefillDone, SlotChanged, SlotGrant
from services.kv.header import HeaderMismatch, SlotHeader

log = logging.getLogger(__name__)


class PrefillPeer(Protocol):
    """The engine that prefills for hybrid mode, as the decoding engine sees it."""

    def wire_dtype(self) -> str:
        """The dtype its KV arrives in (PeerUnavailable if it cannot be asked)."""

    def receiver(self, engine, seq, expected: SlotHeader) -> KVReceiver:
        """The receiving half of the hand-off on this peer's transport."""

    def prefill(self, request: EngineRequest, wire_dtype: str, cancel: Cancellation,
                skip_tokens: int = 0) -> Iterator[HandoffEvent]:
        """The hand-off's messages, for the prompt's positions from `skip_tokens` on (the ones before
        are in this engine's prefix cache); closing the iterator ends the peer's call (it frees its
        memory). Raises the typed errors of services/errors.py."""

    def close(self) -> None: ...


class PrefillPeers:
    """The prefill engines this decode engine may pull KV from: `default` (its prefill_address), and
    the `allowed` addresses a request may name, each connected on first use by `connect(address)`.
    A request naming any other address is refused: the address comes from the gateway, but an engine
    only ever dials the peers its own settings list."""

    def __init__(self, default: PrefillPeer, default_address: str = "", allowed: tuple[str, ...] = (),
                 connect: Callable[[str], PrefillPeer] | None = None):
        self.default, self.default_address = default, default_address
        self.allowed, self.connect = frozenset(allowed) - {default_address}, connect
        self._peers: dict[str, PrefillPeer] = {}
        self._lock = threading.Lock()

    def for_request(self, request: EngineRequest) -> PrefillPeer:
        address = request.prefill_address
        if not address or address == self.default_address:
            return self.default
        if address not in self.allowed or self.connect is None:
            raise InvalidRequest(f"prefill_address {address!r} is not one of this engine's prefill engines "
                                 f"({', '.join(sorted({self.default_address, *self.allowed} - {''})) or 'none'})")
        with self._lock:
            peer = self._peers.get(address)
            if peer is None:
                peer = self._peers[address] = self.connect(address)
            return peer

    def close(self) -> None:
        self.default.close()
        with self._lock:
            for peer in self._peers.values():
                peer.close()
            self._peers.clear()


class DecodeRuntime(EngineRuntime):
    device_label = "fpga"
    engine_name = "opencl"
    default_mode = "fpga"

    def __init__(self, engine, loaded, settings, peer: PrefillPeer | PrefillPeers):
        super().__init__(engine, loaded, settings, engine.max_context)
        self.peers = peer if isinstance(peer, PrefillPeers) else PrefillPeers(peer)
        self.peer = self.peers.default  # its own prefill engine: the profile's hand-off samples
        self.modes = {"fpga": self.local_generation, "hybrid": self.hybrid_generation}

    def info_fields(self) -> dict:
        return {**super().info_fields(), "kv_dtype": "fp32",
                "stored_weight_types": self.engine.stored_weight_types}

    def hybrid_generation(self, request: EngineRequest, timings: RequestTimings,
                          cancel: Cancellation) -> Iterator[TokenEvent]:
        peer = self.peers.for_request(request)
        # what this engine's prefix cache holds of the prompt now: prefill_gpu is asked for the rest
        skip = self.loop.peek_cached_tokens(list(request.prompt_ids))
        try:
            stream, first = self._hand_over(peer, request, timings, cancel, skip)
        except PrefixEvicted as exc:
            log.info("%s; asking prefill_gpu for the whole prompt", exc)
            stream, first = self._hand_over(peer, request, timings, cancel, 0)
        try:
            prompt_logprobs = first.prompt_logprobs if request.params.prompt_logprobs is not None else None
            self.loop.activate_remote(stream, first.first_token, first.first_logprob, prompt_logprobs)
            yield from stream_tokens(stream, timings, cancel)
        finally:
            stream.cancel()  # a no-op once it finished

    def _hand_over(self, peer: PrefillPeer, request: EngineRequest, timings: RequestTimings, cancel: Cancellation,
                   skip: int) -> tuple[RequestStream, PrefillDone]:
        """The prompt's KV from position `skip` on, prefilled by the peer and imported into blocks
        reserved here once the peer admitted the request (its SlotGrant), never before: a request the
        peer refuses or queues holds nothing here. The stream (blocks reserved, KV in them) and the
        peer's PrefillDone (the first token, its logprobs); PrefixEvicted when the cached prefix was
        evicted between the peek and the grant."""
        cfg, prompt, bs = self.loaded.config, list(request.prompt_ids), self.engine.block_size
        wire = peer.wire_dtype()
        blocks = BlockImport(self.engine)
        reserved: list[RequestStream] = []

        def reserve_blocks() -> None:
            stream = self.loop.reserve_remote(prompt, request.params, max_cached_tokens=skip)
            reserved.append(stream)
            table = stream.wait_reserved(cancel.is_cancelled)
            if stream.seq.num_cached_tokens < skip:
                raise PrefixEvicted(f"{skip - stream.seq.num_cached_tokens} of the {skip} cached prompt positions "
                                    f"were evicted before prefill_gpu admitted the request")
            blocks.block_table = table[skip // bs:]

        expected = SlotHeader(wire, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, len(prompt) - skip, cfg.model_id)
        try:
            first = self._pull_kv(peer, peer.receiver(blocks, None, expected), request, wire, timings, cancel,
                                  skip, on_grant=reserve_blocks)
        except BaseException:
            if reserved:
                blocks.settle()  # its layers already enqueued land before the blocks can be reused
                reserved[0].cancel()  # frees the blocks of a failed hand-off
            raise
        return reserved[0], first

    def _pull_kv(self, peer: PrefillPeer, receiver: KVReceiver, request: EngineRequest, wire: str,
                 timings: RequestTimings, cancel: Cancellation, skip_tokens: int = 0,
                 on_grant: Callable[[], None] = lambda: None) -> PrefillDone:
        events = peer.prefill(request, wire, cancel, skip_tokens)
        try:
            try:
                d = receiver.consume(_calling_on_grant(events, on_grant), lambda: not cancel.is_cancelled())
            except (HeaderMismatch, SlotChanged) as exc:
                # the rest of the call is at most a message a layer and its PrefillDone
                raise _why_the_call_ended(events, self.loaded.config.n_layers + 1) or exc
            if d is None:
                if cancel.is_cancelled():
                    raise Cancelled("client went away during the KV hand-off")
                raise HandoffFailed("the prefill stream ended before PrefillDone")
            timings.queue_s += d.queue_s
            timings.prefill_s = d.prefill_s
            timings.handoff_total_s, timings.handoff_exposed_s = handoff_seconds(
                receiver.first_written_at, d.compute_done_at, receiver.on_device_at)
            timings.handoff_bytes = receiver.bytes
            m.HANDOFF_SECONDS.observe(timings.handoff_total_s)
            m.HANDOFF_EXPOSED_SECONDS.observe(timings.handoff_exposed_s)
            m.HANDOFF_BYTES.inc(receiver.bytes)
            return d
        finally:
            events.close()  # ends the peer's call: it frees the request's memory now

    def profile_samples(self, refresh: bool = False) -> Profile:
        own = super().profile_samples(refresh)
        samples = [s for s in own if s["stage"] != "handoff"]
        with sweep_lock(self.settings.profile_cache):  # timed in turn with prefill_gpu's own sweep
            return Profile(samples + self._handoff_samples(), quiet=own.quiet)

    def _handoff_samples(self) -> list[dict]:
        """Exposed hand-off time for a few prompt lengths, measured now if the peer answers."""
        out = []
        # prompts of their own each time: a repeat would find its prefix in both engines' caches and
        # hand over one block (the router then believed the hand-off ~100x cheaper than serving's)
        rng = np.random.default_rng()
        params = SamplingParams(max_tokens=1, temperature=0)
        # capped as the sweep's (a small model's context): else the router never had hybrid data
        for n_in in fitting_lengths((16, 64, 256), self.loop.config.max_model_len, decode_tokens=1):
            request = EngineRequest(tuple(rng.integers(3, self.loaded.config.vocab_size, n_in).tolist()), params,
                                    "hybrid")
            timings = RequestTimings()
            try:
                for _ in self.hybrid_generation(request, timings, Cancellation()):
                    pass
            except Exception as exc:  # the peer down: the router then has no hybrid data, and says so
                log.warning("no hand-off samples: %s", exc)
                return []
            out.append({"stage": "handoff", "n_in": n_in, "seconds": timings.handoff_exposed_s})
        return out

    def close(self) -> None:
        super().close()
        self.peers.close()


class PrefixEvicted(Exception):
    """The prompt's cached prefix that prefill_gpu was told to skip is gone from this engine's cache."""


def handoff_seconds(first_written_at: float, compute_done_at: float, on_device_at: float) -> tuple[float, float]:
    """(total, exposed) seconds of a hand-off. Exposed: from the prefill's compute ending to the KV on
    this device (what the request waits for). Total: from the first KV written, or the compute's end
    if no KV had been written by then, to the KV on the device, so it always holds the exposed part:
    over TCP under load the first frame can arrive after the compute ended (nothing overlapped), and
    timed from that arrival the total came out shorter than the exposed wait (48 against 42 ms)."""
    return on_device_at - min(first_written_at, compute_done_at), max(0.0, on_device_at - compute_done_at)


def _calling_on_grant(events: Iterator[HandoffEvent], on_grant: Callable[[], None]) -> Iterator[HandoffEvent]:
    """`events`, with `on_grant()` called as the SlotGrant (the peer admitted the request) comes through."""
    for msg in events:
        if isinstance(msg, SlotGrant):
            on_grant()
        yield msg


def _why_the_call_ended(events: Iterator[HandoffEvent], most: int) -> EngineError | None:
    """The error the Prefill call ended with, read from what is left of its stream (`most` messages:
    all a call can still send), or None if it ended cleanly. A slot read as freed or changed under a
    hand-off is mostly the peer giving it up because the call ended: its deadline passed (or it was
    cancelled) between the grant and the read, or its prefill failed. Raised as the slot's error, that
    was an engine failure (500) where the request had timed out (504): test_handoff_deadline.py's 1 ms
    call failed so once in CI; and FAILED_PRECONDITION where prefill_gpu had failed (INTERNAL), when
    the layers it had sent before failing were more than the 4 messages read then (make test,
    2026-11-27: test_a_failed_prefill_is_internal_on_both_engines_never_unavailable)."""
    try:
        for _, _msg in zip(range(most), events):
            pass
    except EngineError as exc:
        return exc
    return None
