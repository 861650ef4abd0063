"""The decode_fpga gRPC service: the shared servicer over DecodeRuntime (hybrid.py), its
prefill_gpu peer over gRPC and the shared-memory arena, and its start-up."""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

import grpc

from services.engine.handoff_wire import handoff_from_proto
from services.engine.requests import Cancellation, EngineRequest, PeerMismatch, PeerUnavailable
from services.engine.service import EngineServicer, sampling_to_proto
from services.engine.status import error_from_peer
from services.kv.arena import ArenaReader
from services.kv.handoff import HandoffEvent
from services.kv.header import SlotHeader
from services.kv.shm import ShmReceiver
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class GrpcPrefillPeer:
    """prefill_gpu as hybrid mode's PrefillPeer: its Prefill RPC, its arena mapped by name."""

    def __init__(self, address: str, model_id: str, timeout_s: float):
        self.address, self.model_id, self.timeout_s = address, model_id, timeout_s
        self._channel = grpc.insecure_channel(address)
        self._stub = pb_grpc.EngineStub(self._channel)
        self._reader: ArenaReader | None = None
        self._wire_dtype = ""
        self._lock = threading.Lock()

    def _connect(self) -> ArenaReader:
        """Map prefill_gpu's arena once, by the name its Info gives."""
        with self._lock:
            if self._reader is None:
                try:
                    info = self._stub.Info(pb.InfoRequest(), timeout=5)
                except grpc.RpcError as exc:
                    raise PeerUnavailable(f"prefill_gpu at {self.address} is unavailable: {exc.code().name}") from None
                if info.model_id != self.model_id:
                    raise PeerMismatch(f"prefill_gpu serves {info.model_id!r}, this engine {self.model_id!r}")
                try:
                    self._reader = ArenaReader(info.arena_name)
                except FileNotFoundError as exc:
                    raise PeerMismatch(str(exc)) from None
                self._wire_dtype = info.kv_dtype
                log.info("mapped KV arena %s (%d MiB)", info.arena_name, self._reader.size >> 20)
            return self._reader

    def wire_dtype(self) -> str:
        self._connect()
        return self._wire_dtype

    def receiver(self, engine, seq, expected: SlotHeader) -> ShmReceiver:
        return ShmReceiver(self._connect(), engine, seq, expected)

    def prefill(self, request: EngineRequest, wire_dtype: str, cancel: Cancellation) -> Iterator[HandoffEvent]:
        call = self._stub.Prefill(pb.PrefillRequest(request_id=request.request_id, prompt_token_ids=request.prompt_ids,
                                                    sampling=sampling_to_proto(request.params),
                                                    wire_dtype=wire_dtype),
                                  timeout=self.timeout_s)
        try:
            for msg in call:
                yield handoff_from_proto(msg)
        except grpc.RpcError as exc:
            raise error_from_peer("prefill_gpu", exc) from None
        finally:
            call.cancel()  # ends the Prefill call: prefill_gpu frees the slot now

    def close(self) -> None:
        self._channel.close()


def build(loaded, settings, resources: contextlib.ExitStack) -> EngineServicer:
    """The OpenCL engine and the servicer over it (the runtime closes its peer on the way out)."""
    from services.decode_fpga.engine import OpenCLEngine
    from services.decode_fpga.hybrid import DecodeRuntime

    log.info("building kernels and uploading weights")
    engine = OpenCLEngine.from_settings(loaded, settings)
    peer = GrpcPrefillPeer(settings.prefill_address, loaded.config.model_id, settings.handoff_timeout_s)
    return EngineServicer(DecodeRuntime(engine, loaded, settings, peer), "decode_fpga")
