"""The decode_fpga gRPC service: the OpenCL engine, FPGA-only Generate, and hybrid mode.

In hybrid mode this service orchestrates: it calls prefill_gpu's Prefill, imports
each layer from the shared arena into its device KV as the message for it
arrives (while prefill_gpu computes the next), ends the Prefill call once every
layer is on the device (which frees the slot), then decodes locally.
"""
from __future__ import annotations

import logging
import threading

import grpc

from services.engine import metrics as m
from services.engine.service import EngineServicer
from services.kv.arena import ArenaReader, SlotHeader
from services.kv.handoff import KVReceiver
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc
from services.engine.sampling import Sampler

log = logging.getLogger(__name__)


class DecodeServicer(EngineServicer):
    device_label = "fpga"
    engine_name = "opencl"
    default_mode = pb.MODE_FPGA

    def __init__(self, engine, loaded, settings):
        super().__init__(engine, loaded, settings, engine.max_context)
        self.modes = {pb.MODE_FPGA: self.local_generation, pb.MODE_HYBRID: self.hybrid_generation}
        self._channel = grpc.insecure_channel(settings.prefill_address)
        self._prefill = pb_grpc.EngineStub(self._channel)
        self._reader: ArenaReader | None = None
        self._reader_lock = threading.Lock()

    def info_fields(self) -> dict:
        return {**super().info_fields(), "kv_dtype": "fp32"}

    def _arena(self, refresh: bool = False) -> ArenaReader:
        """Map prefill_gpu's arena once, by the name its Info gives (again if it restarted)."""
        with self._reader_lock:
            if self._reader is None or refresh:
                info = self._prefill.Info(pb.InfoRequest(), timeout=5)
                if info.model_id != self.loaded.config.model_id:
                    raise RuntimeError(f"prefill_gpu serves {info.model_id!r}, this engine {self.loaded.config.model_id!r}")
                self._reader = ArenaReader(info.arena_name)
                log.info("mapped KV arena %s (%d MiB)", info.arena_name, self._reader.size >> 20)
            return self._reader

    def hybrid_generation(self, gen, request, params, timings, context):
        cfg = self.loaded.config
        prompt = list(request.prompt_token_ids)
        try:
            reader = self._arena()
        except grpc.RpcError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill_gpu at {self.settings.prefill_address} is "
                                                       f"unavailable: {exc.code().name}")
        seq = self.engine.new_sequence(min(len(prompt) + params.max_tokens, self.max_context))
        try:
            expected = SlotHeader("fp32", cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, len(prompt), cfg.model_id)
            receiver = KVReceiver(reader, self.engine, seq, expected)
            first = self._pull_kv(receiver, request, context, timings)
            sampler = Sampler(params)
            sampler.advance()  # the first token was sampled by prefill_gpu with the same seed
            yield from gen.decode_from(seq, first, sampler)
        finally:
            self.engine.release(seq)

    def _pull_kv(self, receiver: KVReceiver, request, context, timings) -> int:
        call = self._prefill.Prefill(
            pb.PrefillRequest(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                              sampling=request.sampling),
            timeout=self.settings.handoff_timeout_s)
        try:
            d = receiver.consume(call, context.is_active)
            if d is None:
                context.abort(grpc.StatusCode.CANCELLED, "client went away during the KV hand-off")
            timings.queue_s += d.queue_s
            timings.prefill_s = d.prefill_s
            timings.handoff_total_s = receiver.on_device_at - receiver.first_written_at
            timings.handoff_exposed_s = max(0.0, receiver.on_device_at - d.compute_done_at)
            timings.handoff_bytes = receiver.bytes
            m.HANDOFF_SECONDS.observe(timings.handoff_total_s)
            m.HANDOFF_EXPOSED_SECONDS.observe(timings.handoff_exposed_s)
            m.HANDOFF_BYTES.inc(receiver.bytes)
            return d.first_token
        except grpc.RpcError as exc:
            code = exc.code()
            passthrough = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
                           grpc.StatusCode.DEADLINE_EXCEEDED)
            context.abort(code if code in passthrough else grpc.StatusCode.UNAVAILABLE,
                          f"prefill_gpu: {exc.details() or code.name}")
        finally:
            call.cancel()  # ends the Prefill call: prefill_gpu frees the slot now

    def profile_samples(self, refresh: bool = False) -> list[dict]:
        samples = [s for s in super().profile_samples(refresh) if s["stage"] != "handoff"]
        return samples + self._handoff_samples()

    def _handoff_samples(self) -> list[dict]:
        """Exposed hand-off time for a few prompt lengths, measured now if prefill_gpu answers."""
        import numpy as np

        from services.engine.generation import Generation
        from services.engine.sampling import SamplingParams

        out = []
        rng = np.random.default_rng(1)
        for n_in in (16, 64, 256):
            request = pb.GenerateRequest(prompt_token_ids=rng.integers(3, self.loaded.config.vocab_size, n_in).tolist(),
                                         sampling=pb.SamplingParams(max_tokens=1), mode=pb.MODE_HYBRID)
            timings = pb.Timings()
            gen = Generation(self.engine, list(request.prompt_token_ids), SamplingParams(max_tokens=1, temperature=0),
                             self.max_context)
            try:
                list(self.hybrid_generation(gen, request, gen.params, timings, _LocalContext()))
            except Exception as exc:  # prefill_gpu down: the router then has no hybrid data, and says so
                log.warning("no hand-off samples: %s", exc)
                return []
            out.append({"stage": "handoff", "n_in": n_in, "seconds": timings.handoff_exposed_s})
        return out

    def close(self) -> None:
        self._channel.close()


class _LocalContext:
    """The bits of a ServicerContext hybrid_generation uses, for calls from inside the service."""

    def is_active(self) -> bool:
        return True

    def abort(self, code, details):
        raise RuntimeError(f"{code.name}: {details}")
