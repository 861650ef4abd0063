"""The decode_fpga gRPC service: the shared servicer over DecodeRuntime (hybrid.py), its
prefill_gpu peer over gRPC and the KV hand-off (the transport its settings name, services/kv/transports.py:
the shared-memory arena, or TCP or NIXL through this service's KV inbox when the two do not share
/dev/shm), and its start-up."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Iterator

import grpc

from services.engine.handoff_wire import handoff_from_proto
from services.engine.requests import Cancellation, EngineRequest
from services.errors import PeerMismatch, PeerUnavailable
from services.engine.service import EngineServicer, sampling_to_proto
from services.engine.status import error_from_peer
from services.kv import transports
from services.kv.arena import ArenaReader
from services.kv.handoff import HandoffEvent, SlotGrant
from services.kv.header import SlotHeader, request_nonce
from services.kv.shm import ShmReceiver
from services.kv.tcp_inbox import KVInbox
from services.kv.transports import Transport
from services.rpc.engine_token import engine_channel
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class GrpcPrefillPeer:
    """prefill_gpu as hybrid mode's PrefillPeer: its Prefill RPC, and its arena mapped by name or,
    with a network `transport` and its `inbox`, the KV over the network (the Prefill call names the
    inbox's address; the arena is never mapped).

    The arena is mapped again when the mapped segment is gone (prefill_gpu stopped, or its
    successor removed a killed one's) or when a grant does not fit it (the receiver's `remap`):
    then Info names the arena prefill_gpu uses now."""

    def __init__(self, address: str, model_id: str, timeout_s: float, token: str | None = None,
                 inbox: KVInbox | None = None, transport: Transport | None = None):
        self.address, self.model_id, self.timeout_s = address, model_id, timeout_s
        self.inbox, self.transport = inbox, transport
        self._channel = engine_channel(address, token)  # sends the shared token when there is one
        self._stub = pb_grpc.EngineStub(self._channel)
        self._reader: ArenaReader | None = None
        self._wire_dtype = ""
        self._lock = threading.Lock()

    def _arena(self) -> ArenaReader:
        """The mapped arena, mapped (again) by the name Info gives if there is none or it is gone."""
        with self._lock:
            if self._reader is None or not self._reader.is_current():
                self._map_current()
            return self._reader

    def _remap(self, seen: ArenaReader) -> ArenaReader:
        """The arena prefill_gpu uses now; `seen` (what a receiver read) when Info still names it."""
        with self._lock:
            if self._reader is seen:
                self._map_current()
            return self._reader

    def _ask_info(self) -> pb.InfoResponse:
        """prefill_gpu's Info, checked to serve this engine's model; notes its wire dtype."""
        try:
            info = self._stub.Info(pb.InfoRequest(), timeout=5)
        except grpc.RpcError as exc:
            raise PeerUnavailable(f"prefill_gpu at {self.address} is unavailable: {exc.code().name}") from None
        if info.model_id != self.model_id:
            raise PeerMismatch(f"prefill_gpu serves {info.model_id!r}, this engine {self.model_id!r}")
        self._wire_dtype = info.kv_dtype
        return info

    def _map_current(self) -> None:
        info = self._ask_info()
        old = self._reader
        if old is not None and old.name == info.arena_name and old.is_current():
            return
        try:
            self._reader = ArenaReader(info.arena_name)
        except FileNotFoundError as exc:
            raise PeerMismatch(str(exc)) from None
        # the old mapping goes when the last receiver reading it lets go
        log.info("mapped KV arena %s (%d MiB)%s", info.arena_name, self._reader.size >> 20,
                 f", replacing {old.name}" if old is not None else "")

    def wire_dtype(self) -> str:
        if self.inbox is not None:
            if not self._wire_dtype:  # asked once; the KV's header is checked against it every time
                with self._lock:
                    self._ask_info()
            return self._wire_dtype
        self._arena()
        return self._wire_dtype

    def receiver(self, engine, seq, expected: SlotHeader):
        if self.inbox is not None:
            return self.transport.receiver(self.inbox, engine, seq, expected, self.timeout_s)
        return ShmReceiver(self._arena(), engine, seq, expected, remap=self._remap)

    def prefill(self, request: EngineRequest, wire_dtype: str, cancel: Cancellation,
                skip_tokens: int = 0) -> Iterator[HandoffEvent]:
        nonce = request_nonce(request.request_id)
        with self.inbox.expecting(nonce) if self.inbox is not None else contextlib.nullcontext() as waiting:
            if waiting is not None:
                cancel.add_callback(waiting.abort)  # a cancelled request stops reading its connection at once
            yield from self._prefill_call(request, wire_dtype, skip_tokens, nonce, self.call_timeout(cancel))

    def call_timeout(self, cancel: Cancellation) -> float:
        """The Prefill call's deadline: what is left of the request's own, or `timeout_s` when it has
        none. A fixed 120 s cut requests that waited legitimately in prefill_gpu's queue under load (14
        of 256 hybrid requests at 64 clients answered 504 while their own deadline was 600 s): a hybrid
        request waits as long as its client allows, like the other modes."""
        if cancel.deadline is None:
            return self.timeout_s
        return max(0.001, cancel.deadline - time.monotonic())

    def _prefill_call(self, request: EngineRequest, wire_dtype: str, skip_tokens: int,
                      nonce: int, timeout_s: float) -> Iterator[HandoffEvent]:
        call = self._stub.Prefill(pb.PrefillRequest(request_id=request.request_id, prompt_token_ids=request.prompt_ids,
                                                    sampling=sampling_to_proto(request.params),
                                                    wire_dtype=wire_dtype, skip_tokens=skip_tokens,
                                                    kv_address=self.inbox.advertised if self.inbox else ""),
                                  timeout=timeout_s)
        try:
            for msg in call:
                ev = handoff_from_proto(msg)
                # the nonce the slot must carry is the one of the request sent, not what came back
                yield dataclasses.replace(ev, nonce=nonce) if isinstance(ev, SlotGrant) else ev
        except grpc.RpcError as exc:
            raise error_from_peer("prefill_gpu", exc) from None
        finally:
            call.cancel()  # ends the Prefill call: prefill_gpu frees the slot now

    def close(self) -> None:
        self._channel.close()


def load(settings):
    """The model; a GGUF file's matrices stay in it unless the device stores them dense (fp32, fp16):
    the gguf storage ("auto" on a GGUF file) uploads the file's own blocks, never the fp32 copy."""
    from services.model.loading import load_model

    return load_model(settings.model, gguf_matrices=settings.weights_dtype in ("fp32", "fp16"))


def build(loaded, settings, resources: contextlib.ExitStack) -> EngineServicer:
    """The OpenCL engine and the servicer over it (the runtime closes its peer on the way out)."""
    from services.decode_fpga.engine import OpenCLEngine
    from services.decode_fpga.hybrid import DecodeRuntime, PrefillPeers

    log.info("building kernels and uploading weights")
    engine = OpenCLEngine.from_settings(loaded, settings)
    token = settings.engine_token.get_secret_value() if settings.engine_token else None
    transport = transports.get(settings.kv_transport)
    inbox = None
    if transport.open_inbox is not None:
        inbox = transport.open_inbox(settings, token)  # with a token, only its holders' KV
        resources.callback(inbox.close)  # after the runtime (closed first): no hand-off is running then
        log.info("KV over %s: listening on %s, prefill_gpu connects to %s", transport.name, inbox.address,
                 inbox.advertised)

    def connect(address: str) -> GrpcPrefillPeer:
        return GrpcPrefillPeer(address, loaded.config.model_id, settings.handoff_timeout_s, token, inbox, transport)

    peers = PrefillPeers(connect(settings.prefill_address), settings.prefill_address,
                         settings.prefill_address_list(), connect)
    return EngineServicer(DecodeRuntime(engine, loaded, settings, peers), "decode_fpga")
