"""The prefill_gpu gRPC service: the PyTorch engine, GPU-only Generate, and Prefill into the arena."""
from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from services.engine import metrics as m
from services.engine.service import Admission, EngineServicer, QueueFull, RequestAborted, sampling_from_proto
from services.kv.arena import Arena, ArenaFull, SlotHeader
from services.kv.handoff import KVSender
from services.kv.layout import WireLayout
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.engine.sampling import Sampler

log = logging.getLogger(__name__)


class PrefillCancelled(Exception):
    """Raised inside the prefill's layer callback to stop computing for a gone client."""


class PrefillServicer(EngineServicer):
    device_label = "gpu"
    engine_name = "torch"
    default_mode = pb.MODE_GPU

    def __init__(self, engine, loaded, settings, arena: Arena):
        super().__init__(engine, loaded, settings, loaded.config.max_context)
        self.arena = arena
        self.modes = {pb.MODE_GPU: self.local_generation}
        # prefills get their own admission: they are short, and a hybrid decode must
        # never wait behind gpu-mode generations for its prefill
        self.prefill_admission = Admission(settings.prefill_max_concurrency, settings.prefill_queue_depth)

    def info_fields(self) -> dict:
        return {**super().info_fields(), "kv_dtype": self.settings.wire_dtype, "arena_name": self.arena.name,
                "arena_size": self.arena.size}

    def _update_arena_gauges(self) -> None:
        m.ARENA_USED_BYTES.set(self.arena.used_bytes)
        m.ARENA_SLOTS_IN_USE.set(self.arena.slots_in_use)

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext):
        ended = threading.Event()
        context.add_callback(ended.set)  # fires when the call ends for any reason: done, cancel, deadline
        params = sampling_from_proto(request.sampling, context)
        prompt = list(request.prompt_token_ids)
        cfg = self.loaded.config
        if not prompt or len(prompt) >= self.max_context or max(prompt) >= cfg.vocab_size:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"prompt must have 1..{self.max_context - 1} token ids below {cfg.vocab_size}")
        wire = request.wire_dtype or self.settings.wire_dtype
        if wire not in ("fp32", "fp16"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"wire_dtype must be fp32 or fp16, not {wire!r}")
        layout = WireLayout.for_model(cfg, len(prompt), wire)
        try:
            with self.prefill_admission.admit(context) as queue_s:
                try:
                    slot = self.arena.allocate(layout.nbytes, timeout=self.settings.arena_wait_s)
                except ArenaFull as exc:
                    m.REQUESTS.labels(status="rejected").inc()
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
                try:
                    self._update_arena_gauges()
                    yield from self._prefill_into(slot, layout, prompt, params, queue_s, context, ended)
                finally:
                    self.arena.free(slot)
                    self._update_arena_gauges()
        except QueueFull as exc:
            m.REQUESTS.labels(status="rejected").inc()
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RequestAborted:
            m.REQUESTS.labels(status="cancelled").inc()

    def _prefill_into(self, slot, layout, prompt, params, queue_s, context, ended):
        cfg = self.loaded.config
        self.arena.write_header(slot, SlotHeader(layout_dtype_name(layout), cfg.n_layers, cfg.n_kv_heads,
                                                 cfg.head_dim, len(prompt), cfg.model_id))
        yield pb.PrefillResponse(slot=pb.SlotGranted(offset=slot.offset, size=slot.size, n_tokens=len(prompt),
                                                     dtype=layout_dtype_name(layout)))
        seq = self.engine.new_sequence(len(prompt) + 1)
        sender = KVSender(self.arena, slot, layout, self.engine, seq)
        events: queue.Queue = queue.Queue()

        def on_layer(layer: int) -> None:
            if ended.is_set():
                raise PrefillCancelled()
            sender.write_layer(layer)
            events.put(("layer", layer))

        def work() -> None:
            try:
                t0 = time.perf_counter()
                logits = self.engine.prefill(seq, prompt, on_layer)
                events.put(("done", logits, time.perf_counter() - t0, time.time()))
            except PrefillCancelled:
                events.put(("cancelled",))
            except Exception as exc:  # reported to the client below, never lost
                log.exception("prefill failed")
                events.put(("error", exc))

        worker = threading.Thread(target=work, name="prefill", daemon=True)
        worker.start()
        try:
            while True:
                try:
                    ev = events.get(timeout=0.05)
                except queue.Empty:
                    if ended.is_set():
                        return
                    continue
                if ev[0] == "layer":
                    written_at = sender.wait_layer(ev[1])
                    yield pb.PrefillResponse(layer=pb.LayerReady(
                        layer=ev[1], offset=slot.data_offset + layout.layer_offset(ev[1]),
                        nbytes=layout.layer_nbytes, written_at=written_at))
                elif ev[0] == "done":
                    _, logits, prefill_s, done_at = ev
                    m.STAGE_SECONDS.labels(stage="prefill", device="gpu").observe(prefill_s)
                    first = Sampler(params).sample(logits)
                    yield pb.PrefillResponse(done=pb.PrefillDone(first_token=first, prefill_s=prefill_s,
                                                                 queue_s=queue_s, compute_done_at=done_at))
                    m.REQUESTS.labels(status="ok").inc()
                    # keep the slot until the reader ends the call (its layers are on its device)
                    remaining = context.time_remaining()
                    ended.wait(min(self.settings.slot_hold_s, remaining if remaining is not None else 1e9))
                    return
                elif ev[0] == "cancelled":
                    return
                else:
                    context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {ev[1]}")
        finally:
            ended.set()  # stops the worker at its next layer if it is still computing
            worker.join()  # the slot may be freed only once nothing writes into it
            self.engine.release(seq)


def layout_dtype_name(layout: WireLayout) -> str:
    return "fp16" if layout.dtype.itemsize == 2 else "fp32"
