"""decode_fpga's request handling in plain Python: fpga-mode Generate, and hybrid mode.

In hybrid mode this engine orchestrates: the engine loop reserves KV blocks for the
prompt (the blocks of its longest cached prefix, and fresh ones for the rest: only the
rest is asked for and handed over), its `PrefillPeer` (prefill_gpu, over gRPC and the shared-memory arena in the
service; in process in tests) prefills, each layer is imported into those blocks as
the message for it arrives (while the peer computes the next), the peer's call is
ended once every layer is on the device (which frees its memory), then the request
joins the running batch and decodes with the others.
"""
from __future__ import annotations

import logging
from typing import Iterator, Protocol

import numpy as np

from services.engine import metrics as m
from services.engine.generation import TokenEvent
from services.engine.requests import Cancellation, Cancelled, EngineRequest, HandoffFailed, RequestTimings
from services.engine.profile_cache import sweep_lock
from services.engine.runtime import EngineRuntime, stream_tokens
from services.engine.sampling import SamplingParams
from services.kv.handoff import HandoffEvent, KVReceiver
from services.kv.header import SlotHeader

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
        memory). Raises the typed errors of services/engine/requests.py."""

    def close(self) -> None: ...


class DecodeRuntime(EngineRuntime):
    device_label = "fpga"
    engine_name = "opencl"
    default_mode = "fpga"

    def __init__(self, engine, loaded, settings, peer: PrefillPeer):
        super().__init__(engine, loaded, settings, engine.max_context)
        self.peer = peer
        self.modes = {"fpga": self.local_generation, "hybrid": self.hybrid_generation}

    def info_fields(self) -> dict:
        return {**super().info_fields(), "kv_dtype": "fp32"}

    def hybrid_generation(self, request: EngineRequest, timings: RequestTimings,
                          cancel: Cancellation) -> Iterator[TokenEvent]:
        cfg = self.loaded.config
        prompt = request.prompt_ids
        wire = self.peer.wire_dtype()
        stream = self.loop.reserve_remote(list(prompt), request.params)
        try:
            table = stream.wait_reserved(cancel.is_cancelled)
            # the prompt's cached prefix (whole blocks) is here already: only the rest comes over
            skip = stream.seq.num_cached_tokens
            blocks = BlockImport(self.engine, table[skip // self.engine.block_size:])
            expected = SlotHeader(wire, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, len(prompt) - skip, cfg.model_id)
            first = self._pull_kv(self.peer.receiver(blocks, None, expected), request, wire, timings, cancel, skip)
            self.loop.activate_remote(stream, first)
            yield from stream_tokens(stream, timings, cancel)
        finally:
            stream.cancel()  # a no-op once it finished; frees the blocks of a failed hand-off

    def _pull_kv(self, receiver: KVReceiver, request: EngineRequest, wire: str, timings: RequestTimings,
                 cancel: Cancellation, skip_tokens: int = 0) -> int:
        events = self.peer.prefill(request, wire, cancel, skip_tokens)
        try:
            d = receiver.consume(events, lambda: not cancel.is_cancelled())
            if d is None:
                if cancel.is_cancelled():
                    raise Cancelled("client went away during the KV hand-off")
                raise HandoffFailed("the prefill stream ended before PrefillDone")
            timings.queue_s += d.queue_s
            timings.prefill_s = d.prefill_s
            timings.handoff_total_s = receiver.on_device_at - receiver.first_written_at
            timings.handoff_exposed_s = max(0.0, receiver.on_device_at - d.compute_done_at)
            timings.handoff_bytes = receiver.bytes
            m.HANDOFF_SECONDS.observe(timings.handoff_total_s)
            m.HANDOFF_EXPOSED_SECONDS.observe(timings.handoff_exposed_s)
            m.HANDOFF_BYTES.inc(receiver.bytes)
            return d.first_token
        finally:
            events.close()  # ends the peer's call: it frees the request's memory now

    def profile_samples(self, refresh: bool = False) -> list[dict]:
        samples = [s for s in super().profile_samples(refresh) if s["stage"] != "handoff"]
        with sweep_lock(self.settings.profile_cache):  # timed in turn with prefill_gpu's own sweep
            return samples + self._handoff_samples()

    def _handoff_samples(self) -> list[dict]:
        """Exposed hand-off time for a few prompt lengths, measured now if the peer answers."""
        out = []
        rng = np.random.default_rng(1)
        params = SamplingParams(max_tokens=1, temperature=0)
        for n_in in (16, 64, 256):
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
        self.peer.close()


class BlockImport:
    """The receiving half's view of an engine (import_kv_layer / finish_import) over the blocks the
    loop reserved for one request: the hand-off seam stays the same for slots and blocks."""

    def __init__(self, engine, block_table: tuple[int, ...]):
        self.engine, self.block_table = engine, block_table

    def import_kv_layer(self, seq, layer: int, kv: np.ndarray) -> None:
        self.engine.import_kv_blocks(self.block_table, layer, kv)

    def finish_import(self, seq, n_tokens: int) -> None:
        self.engine.finish_import_blocks()
