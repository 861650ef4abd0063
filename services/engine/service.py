"""The gRPC layer over an engine runtime: protos in and out, typed errors to statuses, serve().

Shaped like grpc's route_guide: module-level translations, and a thin servicer
whose methods turn a request proto into plain objects (requests.py), call the
runtime (runtime.py), and turn what comes back into protos. A call that ends for
any reason cancels the request's `Cancellation`; a typed error becomes its status
through the one table in status.py.

The server's edge (`build_server`): one worker thread for every call the admissions
can hold (running or queued) plus `CONTROL_CALLS` for health, Info and Profile, and
`maximum_concurrent_rpcs` at that same number, so a flood is refused at once instead
of queueing for threads that health checks then wait behind; the shared token checked
when one is set (services/rpc/engine_token.py); reflection only when a setting asks.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from services import token_trace
from services.engine.token_event import TokenEvent
from services.engine.handoff_wire import logprob_to_proto
from services.engine.requests import Cancellation, EngineRequest, RequestTimings
from services.errors import InvalidRequest
from services.engine.runtime import EngineRuntime
from services.engine.sampling import SamplingParams
from services.engine.status import abort
from services.modes import mode_name_of_proto
from services.rpc.engine_token import TokenCheck
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
ENGINE_SERVICE = pb.DESCRIPTOR.services_by_name["Engine"].full_name


# ---- proto ↔ plain ------------------------------------------------------------------------
def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=s.max_tokens or 16, temperature=s.temperature, top_p=s.top_p or 1.0,
                              top_k=s.top_k, seed=s.seed if s.HasField("seed") else None,
                              stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
                              logprobs=s.logprobs if s.HasField("logprobs") else None,
                              prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
                              frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
                              repetition_penalty=s.repetition_penalty or 1.0,
                              logit_bias=tuple(sorted(s.logit_bias.items())), min_tokens=s.min_tokens,
                              n=s.n or 1, prior_output_tokens=s.prior_output_tokens, grammar=s.grammar,
                              first_choice=s.first_choice, speculative=not s.no_speculation)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    optional = {name: getattr(p, name) for name in ("seed", "logprobs", "prompt_logprobs")
                if getattr(p, name) is not None}
    return pb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                             stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
                             frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
                             repetition_penalty=p.repetition_penalty, logit_bias=dict(p.logit_bias),
                             min_tokens=p.min_tokens, n=p.n, prior_output_tokens=p.prior_output_tokens,
                             grammar=p.grammar, first_choice=p.first_choice, no_speculation=not p.speculative,
                             **optional)


def request_id_of(request) -> str:
    return request.request_id or uuid.uuid4().hex


def request_from_proto(request: pb.GenerateRequest, default_mode: str) -> EngineRequest:
    mode = mode_name_of_proto(request.mode) if request.mode else default_mode
    return EngineRequest(tuple(request.prompt_token_ids), sampling_from_proto(request.sampling), mode,
                         request_id_of(request), request.prefill_address)


def timings_to_proto(t: RequestTimings) -> pb.Timings:
    return pb.Timings(**t.__dict__)


MAX_TOKENS_PER_MESSAGE = 64  # a bound on one message's tokens when the reader is far behind


def response_of(events: list[TokenEvent]) -> pb.GenerateResponse:
    """One message for consecutive events of one choice: their tokens (and logprobs), the first's
    prompt logprobs, the last's finish_reason and timings."""
    msg = pb.GenerateResponse(token_ids=[ev.token for ev in events], index=events[0].index)
    for ev in events:
        if ev.logprob is not None:
            msg.logprobs.append(logprob_to_proto(ev.logprob))
        if ev.prompt_logprobs is not None:
            msg.prompt_logprobs.extend(logprob_to_proto(lp) for lp in ev.prompt_logprobs)
    last = events[-1]
    if last.finish_reason is not None:
        msg.finish_reason = last.finish_reason
        if last.timings is not None:
            msg.timings.CopyFrom(timings_to_proto(last.timings))
    return msg


def messages_of(events: Iterator[TokenEvent], request_id: str = "") -> Iterator[pb.GenerateResponse]:
    """The Generate call's messages: one per token while the call keeps up, and all the tokens that
    were ready together in one message when it is behind (the engine's step made them faster than
    gRPC took the messages: `TokenEvent.more`), so a slow reader catches up instead of falling back
    a message's cost per token."""
    pending: list[TokenEvent] = []
    n = 0  # the request's tokens so far (token_trace's count)
    events = iter(events)
    while True:
        try:
            ev = next(events)
        except StopIteration:
            break
        except Exception:
            if pending:  # the tokens made before the failure still reach the reader, as one by one they would
                yield response_of(pending)
            raise
        if pending and ev.index != pending[0].index:
            yield response_of(pending)
            pending = []
        pending.append(ev)
        n += 1
        if token_trace.ON:
            token_trace.mark(request_id, "step_end", n, ev.at)
            token_trace.mark(request_id, "got", n)
        if ev.more and ev.finish_reason is None and len(pending) < MAX_TOKENS_PER_MESSAGE:
            continue
        msg = response_of(pending)
        pending = []
        if token_trace.ON:
            token_trace.mark(request_id, "sent", n)
        yield msg
        if token_trace.ON:
            token_trace.mark(request_id, "resumed", n)
    if pending:  # only when the events ended on a hint (a choice cut short): send what came
        yield response_of(pending)


def cancellation_of(context: grpc.ServicerContext) -> Cancellation:
    """A token cancelled when the call ends for any reason (done, client gone, deadline)."""
    remaining = context.time_remaining()
    cancel = Cancellation(time.monotonic() + remaining if remaining is not None and remaining < 1e8 else None)
    if not context.add_callback(cancel.cancel):
        cancel.cancel()  # the call has already ended
    return cancel


# ---- the servicer --------------------------------------------------------------------------
class EngineServicer(pb_grpc.EngineServicer):
    """Generate, Info and Profile over one runtime; prefill_gpu's servicer adds Prefill."""

    def __init__(self, runtime: EngineRuntime, process: str):
        self.runtime, self.process = runtime, process  # process: "prefill_gpu" | "decode_fpga", for messages

    def admitted_calls(self, settings) -> int:
        """The most Generate calls the engine loop holds at once, batched or queued (each holds a server
        thread): max_num_seqs + queue_depth (engine_loop.py's back-pressure)."""
        return settings.max_num_seqs + settings.queue_depth

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        cancel, request_id = cancellation_of(context), request_id_of(request)
        try:
            plain = request_from_proto(request, self.runtime.default_mode)
            yield from messages_of(self.runtime.generate(plain, cancel), request_id)
        except Exception as exc:
            abort(context, exc, self.process, request_id)
        finally:
            if token_trace.ON:
                token_trace.flush(request_id)

    def Info(self, request, context):
        reply = pb.InfoResponse(**self.runtime.info_fields())
        events = self.runtime.loop.scheduler.kv_events
        if events is not None:
            d = events.since(request.kv_events_epoch, request.kv_events_since)
            reply.kv_events.CopyFrom(pb.KVEvents(epoch=d.epoch, seq=d.seq, snapshot=d.snapshot, stored=d.stored,
                                                 removed=d.removed, partial=d.partial))
        return reply

    def Profile(self, request, context):
        samples = self.runtime.profile_samples(request.refresh)
        return pb.ProfileResponse(samples=[pb.StageSample(**s) for s in samples],
                                  quiet=bool(getattr(samples, "quiet", False)))


CONTROL_CALLS = 8  # threads beyond the admissions: health checks, Info, Profile


def build_server(servicer: EngineServicer, settings) -> tuple[grpc.Server, health.HealthServicer]:
    """The gRPC server (bound, not started) and its health servicer (every service NOT_SERVING yet)."""
    threads = servicer.admitted_calls(settings) + CONTROL_CALLS
    token = settings.engine_token.get_secret_value() if settings.engine_token else ""
    # no SO_REUSEPORT (gRPC sets it by default): a second engine on a port one already serves would bind
    # too and silently take a share of its connections (a test stack that drew another's port answered
    # with the other stack's model); it must fail to start instead
    server = grpc.server(ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc"),
                         interceptors=[TokenCheck(token)] if token else [], maximum_concurrent_rpcs=threads,
                         options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_EngineServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", ENGINE_SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if settings.engine_reflection:
        reflection.enable_server_reflection((ENGINE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{settings.host}:{settings.port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # what grpcio raises when the bind fails
        raise OSError(f"cannot listen on {address} (is another process listening there?): {exc}") from None
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    return server, health_servicer


def serve(servicer: EngineServicer, settings, on_shutdown: Callable[[], None] = lambda: None,
          grace_s: float = 10.0) -> None:
    """Run the gRPC server (+ health, metrics, reflection when asked for) until SIGTERM/SIGINT."""
    server, health_servicer = build_server(servicer, settings)
    start_http_server(settings.metrics_port, addr=settings.host)
    server.start()
    for name in ("", ENGINE_SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s serving gRPC on %s:%d (%s), metrics on http://%s:%d/metrics", servicer.process, settings.host,
             settings.port, "token required" if settings.engine_token else "no token", settings.host,
             settings.metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down: finishing in-flight requests (up to %.0fs)", grace_s)
    for name in ("", ENGINE_SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    server.stop(grace_s).wait()
    on_shutdown()
    log.info("stopped")
