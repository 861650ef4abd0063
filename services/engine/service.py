"""What both engine services share: admission, Generate streaming, Info, Profile, serve().

A thin servicer over the Engine: each RPC runs in a thread of the server's pool;
`Admission` bounds how many run and how many wait (beyond that: RESOURCE_EXHAUSTED,
which the gateway maps to 429). A client that goes away stops its generation at
the next token and frees everything it held.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from services.engine import metrics as m
from services.engine.api import EngineFull
from services.engine.generation import Generation, PromptTooLong, TokenEvent
from services.kv.arena import ArenaFull, HeaderMismatch
from services.engine.profile_sweep import cached_sweep, code_fingerprint, run_sweep
from services.modes import mode_name_of_proto
from services.rpc.hybridserve.v1 import engine_pb2 as pb
from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc
from services.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

class RequestAborted(Exception):
    """The client went away while the request waited."""


class QueueFull(Exception):
    """More requests wait than the queue holds: RESOURCE_EXHAUSTED."""


class Admission:
    """At most `max_running` requests run; at most `queue_depth` wait for them."""

    def __init__(self, max_running: int, queue_depth: int):
        self._sem = threading.Semaphore(max_running)
        self._depth = queue_depth
        self._waiting = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def admit(self, context: grpc.ServicerContext) -> Iterator[float]:
        start = time.perf_counter()
        if not self._sem.acquire(blocking=False):
            with self._lock:
                if self._waiting >= self._depth:
                    raise QueueFull(f"engine queue full ({self._depth} waiting); retry later")
                self._waiting += 1
                m.QUEUE_DEPTH.set(self._waiting)
            try:
                while not self._sem.acquire(timeout=0.05):
                    if not context.is_active():
                        raise RequestAborted("cancelled while queued")
            finally:
                with self._lock:
                    self._waiting -= 1
                    m.QUEUE_DEPTH.set(self._waiting)
        try:
            yield time.perf_counter() - start
        finally:
            self._sem.release()


def sampling_from_proto(s: pb.SamplingParams, context: grpc.ServicerContext) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=s.max_tokens or 16, temperature=s.temperature, top_p=s.top_p or 1.0,
                              top_k=s.top_k, seed=s.seed if s.HasField("seed") else None,
                              stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos)
    except ValueError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class EngineServicer(pb_grpc.EngineServicer):
    """Generate/Info/Profile over one engine. Subclasses say which modes they serve."""

    device_label = ""  # "gpu" | "fpga"
    engine_name = ""  # "torch" | "opencl"
    default_mode = pb.MODE_UNSPECIFIED

    def __init__(self, engine, loaded, settings, max_context: int):
        self.engine, self.loaded, self.settings, self.max_context = engine, loaded, settings, max_context
        self.admission = Admission(settings.max_concurrency, settings.queue_depth)
        self._profile: list[dict] | None = None
        self._profile_lock = threading.Lock()
        # mode → handler(gen, request, params, timings, context) returning TokenEvents
        self.modes: dict[int, Callable] = {}

    # ---- Generate -------------------------------------------------------------
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        mode = request.mode or self.default_mode
        if mode not in self.modes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{self.device_label} engine does not serve mode {mode_name_of_proto(mode)}; "
                          f"it serves {sorted(mode_name_of_proto(m) for m in self.modes)}")
        params = sampling_from_proto(request.sampling, context)
        prompt = list(request.prompt_token_ids)
        try:
            gen = Generation(self.engine, prompt, params, self.max_context)
        except PromptTooLong as exc:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        status = "error"
        try:
            with self.admission.admit(context) as queue_s:
                timings = pb.Timings(queue_s=queue_s, prompt_tokens=len(prompt))
                events = self.modes[mode](gen, request, params, timings, context)
                n = 0
                try:
                    for ev in self._guard(events, context):
                        n += 1
                        if not context.is_active():
                            status = "cancelled"
                            return
                        if ev.finish_reason is None:
                            yield pb.GenerateResponse(token_ids=[ev.token])
                            continue
                        timings.prefill_s = timings.prefill_s or gen.timings.prefill_s
                        timings.decode_s, timings.generated_tokens = gen.timings.decode_s, n
                        self._observe(mode_name_of_proto(mode), timings)
                        status = "ok"
                        yield pb.GenerateResponse(token_ids=[ev.token], finish_reason=ev.finish_reason, timings=timings)
                finally:
                    events.close()
        except QueueFull as exc:
            status = "rejected"
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RequestAborted:
            status = "cancelled"
        finally:
            m.REQUESTS.labels(status=status).inc()

    def _guard(self, events: Iterator[TokenEvent], context: grpc.ServicerContext) -> Iterator[TokenEvent]:
        """Turn the engine side's typed failures into precise gRPC statuses."""
        try:
            yield from events
        except (ArenaFull, EngineFull) as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except HeaderMismatch as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    def _observe(self, mode: str, t: pb.Timings) -> None:
        m.STAGE_SECONDS.labels(stage="prefill", device="gpu" if mode in ("gpu", "hybrid") else "fpga").observe(
            t.prefill_s)
        m.STAGE_SECONDS.labels(stage="decode", device=self.device_label).observe(t.decode_s)

    def local_generation(self, gen, request, params, timings, context):
        return iter(gen)

    # ---- Info / Profile ----------------------------------------------------------
    def info_fields(self) -> dict:
        cfg = self.loaded.config
        return dict(model_id=cfg.model_id, engine=self.engine_name, device=self.engine.device_name,
                    kv_layout="layer,kv,head,token,dim", max_context=self.max_context,
                    max_concurrency=self.settings.max_concurrency, n_layers=cfg.n_layers,
                    n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size)

    def Info(self, request, context):
        return pb.InfoResponse(**self.info_fields())

    def profile_samples(self, refresh: bool = False) -> list[dict]:
        with self._profile_lock:
            if refresh:
                self._profile = run_sweep(self.engine, self.device_label)
            elif self._profile is None:
                self._profile = cached_sweep(self.settings.profile_cache, self._profile_key(),
                                             lambda: run_sweep(self.engine, self.device_label))
            return self._profile

    def _profile_key(self) -> str:
        """What the cached timings depend on: model, engine, device, storage format, code."""
        storage = getattr(self.engine, "weights_dtype", None) or str(getattr(self.engine, "kv_dtype", ""))
        return (f"{self.loaded.config.model_id}-{self.engine_name}-{self.engine.device_name}-{storage}-"
                f"{code_fingerprint()}")

    def Profile(self, request, context):
        samples = self.profile_samples(request.refresh)
        return pb.ProfileResponse(samples=[pb.StageSample(**s) for s in samples])


def serve(servicer: EngineServicer, settings, on_shutdown: Callable[[], None] = lambda: None,
          grace_s: float = 10.0) -> None:
    """Run the gRPC server (+ health, reflection, metrics) until SIGTERM/SIGINT."""
    server = grpc.server(ThreadPoolExecutor(max_workers=settings.max_concurrency + settings.queue_depth + 8))
    pb_grpc.add_EngineServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (pb.DESCRIPTOR.services_by_name["Engine"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    address = f"{settings.host}:{settings.port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen on {address}")
    start_http_server(settings.metrics_port, addr=settings.host)
    server.start()
    for name in ("", names[0]):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s engine serving gRPC on %s, metrics on http://%s:%d/metrics", servicer.device_label, address,
             settings.host, settings.metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down: finishing in-flight requests (up to %.0fs)", grace_s)
    for name in ("", names[0]):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    server.stop(grace_s).wait()
    on_shutdown()
    log.info("stopped")
