"""decode_fpga's request handling in plain Python: fpga-mode Generate, and hybrid mode.

In hybrid mode this engine orchestrates: its `PrefillPeer` (prefill_gpu, over gRPC
and the shared-memory arena in the service; in process in tests) prefills, each
layer is imported into this engine's device KV as the message for it arrives
(while the peer computes the next), the peer's call is ended once every layer is
on the device (which frees its memory), then the decode runs here.
"""
from __future__ import annotations

import logging
from typing import Iterator, Protocol

import numpy as np

from services.engine import metrics as m
from services.engine.generation import Generation, TokenEvent
from services.engine.request_state import RequestState
from services.engine.requests import Cancellation, Cancelled, EngineRequest, HandoffFailed, RequestTimings
from services.engine.profile_cache import sweep_lock
from services.engine.runtime import EngineRuntime
from services.engine.sampling import Sampler, SamplingParams
from services.kv.handoff import HandoffEvent, KVReceiver
from services.kv.header import SlotHeader

log = logging.getLogger(__name__)


class PrefillPeer(Protocol):
    """The engine that prefills for hybrid mode, as the decoding engine sees it."""

    def wire_dtype(self) -> str:
        """The dtype its KV arrives in (PeerUnavailable if it cannot be asked)."""

    def receiver(self, engine, seq, expected: SlotHeader) -> KVReceiver:
        """The receiving half of the hand-off on this peer's transport."""

    def prefill(self, request: EngineRequest, wire_dtype: str, cancel: Cancellation) -> Iterator[HandoffEvent]:
        """The hand-off's messages; closing the iterator ends the peer's call (it frees its memory).
        Raises the typed errors of services/engine/requests.py."""

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

    def hybrid_generation(self, gen: Generation, request: EngineRequest, timings: RequestTimings,
                          cancel: Cancellation) -> Iterator[TokenEvent]:
        cfg = self.loaded.config
        prompt, params = request.prompt_ids, request.params
        wire = self.peer.wire_dtype()
        seq = self.engine.new_sequence(min(len(prompt) + params.max_tokens, self.max_context))
        try:
            expected = SlotHeader(wire, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, len(prompt), cfg.model_id)
            gen.state = RequestState.WAITING_FOR_REMOTE_KV
            first = self._pull_kv(self.peer.receiver(self.engine, seq, expected), request, wire, timings, cancel)
            sampler = Sampler(params)
            sampler.advance()  # the first token was sampled by the peer with the same seed
            yield from gen.decode_from(seq, first, sampler)
        except Exception:
            gen.state = RequestState.FINISHED_ERROR
            raise
        finally:
            self.engine.release(seq)

    def _pull_kv(self, receiver: KVReceiver, request: EngineRequest, wire: str, timings: RequestTimings,
                 cancel: Cancellation) -> int:
        events = self.peer.prefill(request, wire, cancel)
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
            gen = Generation(self.engine, list(request.prompt_ids), params, self.max_context)
            try:
                for _ in self.hybrid_generation(gen, request, timings, Cancellation()):
                    pass
            except Exception as exc:  # the peer down: the router then has no hybrid data, and says so
                log.warning("no hand-off samples: %s", exc)
                return []
            out.append({"stage": "handoff", "n_in": n_in, "seconds": timings.handoff_exposed_s})
        return out

    def close(self) -> None:
        self.peer.close()
