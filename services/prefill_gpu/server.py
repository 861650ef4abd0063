"""The prefill_gpu gRPC service: a thin layer over PrefillRuntime (runtime.py), and its start-up.

Generate, Info and Profile come from the shared servicer; Prefill translates the
request into plain objects and the hand-off's messages back into protos, and picks the
hand-off's sender: the arena, or the network transport (services/kv/transports.py) the request's
`kv_address` names (host:port: tcp; nixl://host:port: nixl).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import grpc

from services.engine.handoff_wire import handoff_to_proto
from services.engine.requests import EngineRequest
from services.errors import InvalidRequest
from services.engine.service import EngineServicer, cancellation_of, request_id_of, sampling_from_proto
from services.engine.status import abort
from services.kv import transports
from services.kv.header import SlotHeader, request_nonce
from services.rpc.hybridserve.v1 import engine_pb2 as pb

log = logging.getLogger(__name__)


class PrefillServicer(EngineServicer):
    def admitted_calls(self, settings) -> int:
        return super().admitted_calls(settings) + settings.handoff_max_running + settings.prefill_queue_depth

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext):
        cancel, request_id = cancellation_of(context), request_id_of(request)
        try:
            plain = EngineRequest(tuple(request.prompt_token_ids), sampling_from_proto(request.sampling), "hybrid",
                                  request_id)
            nonce = request_nonce(request_id)  # the reader derives the same from the id it sent
            kv_address = _kv_address(request.kv_address)

            def sender(header: SlotHeader):
                header = dataclasses.replace(header, nonce=nonce)
                if kv_address is not None:
                    transport, address = kv_address
                    return transport.sender(self.runtime, address, header, cancel)
                return self.runtime.shm_sender(header)

            for ev in self.runtime.prefill(plain, request.wire_dtype, cancel, new_sender=sender,
                                           skip_tokens=request.skip_tokens):
                yield handoff_to_proto(ev)
        except Exception as exc:
            abort(context, exc, self.process, request_id)


def _kv_address(text: str) -> tuple[transports.Transport, tuple[str, int]] | None:
    """The reader's KV transport and address (None: the arena); InvalidRequest if it is not
    [scheme://]host:port of a network transport."""
    try:
        return transports.parse_kv_address(text)
    except ValueError as exc:
        raise InvalidRequest(f"kv_address: {exc}") from None


def build(loaded, settings, resources: contextlib.ExitStack) -> PrefillServicer:
    """The engine, its arena (removed on the way out) and the servicer over them."""
    from services.kv.arena import Arena, remove_stale_segments
    from services.prefill_gpu.engine import TorchEngine
    from services.prefill_gpu.runtime import PrefillRuntime

    transports.get(settings.kv_transport).prepare()  # e.g. nixl's agent: a missing extra fails the start
    engine = TorchEngine.from_settings(loaded, settings)
    for name in remove_stale_segments():
        log.warning("removed KV arena %s: the prefill_gpu that made it is gone", name)
    arena = Arena(settings.arena_bytes, pin_cuda=engine.device.type == "cuda")
    resources.callback(arena.close)
    log.info("KV arena %s: %d MiB, pre-faulted%s", arena.name, arena.size >> 20, ", pinned" if arena.pinned else "")
    runtime = PrefillRuntime(engine, loaded, settings, arena)
    # the serving CPU class (cpu_priority.py) once the start-up sweep has timed the engine in the class it was
    # started in: a decode engine building its kernels meanwhile must not starve the sweep
    if settings.profile_at_start:
        runtime.after_profile = runtime.take_serving_priority
    else:
        runtime.take_serving_priority()
    return PrefillServicer(runtime, "prefill_gpu")
