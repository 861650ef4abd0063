"""Request handling both engine services share, in plain Python: a request in, token events out.

`EngineRuntime.generate(request, cancel)` admits the request (admission.py), runs it
in the mode it asks for and yields `TokenEvent`s, the last one with its
finish_reason and timings. It raises the typed errors of requests.py and knows
nothing of gRPC: the servicer (service.py) is a thin layer over it, and in-process
callers (the profile sweep's hand-off samples, tests) call it directly.

Each service's runtime subclasses this one and fills `modes`: mode name → a handler
`(generation, request, timings, cancel) → TokenEvents` (the local token loop here;
hybrid mode in decode_fpga/hybrid.py).
"""
from __future__ import annotations

import threading
from typing import Callable, Iterator

from services.engine import metrics as m
from services.engine.admission import Admission
from services.engine.generation import Generation, TokenEvent
from services.engine.profile_cache import sweep_lock
from services.engine.profile_sweep import code_fingerprint, profile_engine, run_sweep
from services.engine.request_state import RequestState
from services.engine.requests import Cancellation, Cancelled, EngineRequest, InvalidRequest, QueueFull, RequestTimings

ModeHandler = Callable[[Generation, EngineRequest, RequestTimings, Cancellation], Iterator[TokenEvent]]


class EngineRuntime:
    device_label = ""  # "gpu" | "fpga"
    engine_name = ""  # "torch" | "opencl"
    default_mode = ""  # the mode of a request that names none

    def __init__(self, engine, loaded, settings, max_context: int):
        self.engine, self.loaded, self.settings, self.max_context = engine, loaded, settings, max_context
        self.admission = Admission(settings.max_concurrency, settings.queue_depth)
        self.modes: dict[str, ModeHandler] = {}
        self._profile: list[dict] | None = None
        self._profile_lock = threading.Lock()

    # ---- Generate -------------------------------------------------------------
    def generate(self, request: EngineRequest, cancel: Cancellation) -> Iterator[TokenEvent]:
        """Run one request. Raises InvalidRequest/PromptTooLong before admission, QueueFull when the
        queue is full, Cancelled once `cancel` fires, and the mode's own typed errors."""
        if request.mode not in self.modes:
            raise InvalidRequest(f"{self.device_label} engine does not serve mode {request.mode}; "
                                 f"it serves {sorted(self.modes)}")
        gen = Generation(self.engine, list(request.prompt_ids), request.params, self.max_context)
        status = "error"
        try:
            with self.admission.admit(cancel) as queue_s:
                timings = RequestTimings(queue_s=queue_s, prompt_tokens=len(request.prompt_ids))
                events = self.modes[request.mode](gen, request, timings, cancel)
                try:
                    n = 0
                    for ev in events:
                        n += 1
                        if cancel.is_cancelled():
                            status, gen.state = "cancelled", RequestState.FINISHED_ABORTED
                            return
                        if ev.finish_reason is None:
                            yield ev
                            continue
                        timings.prefill_s = timings.prefill_s or gen.timings.prefill_s
                        timings.decode_s, timings.generated_tokens = gen.timings.decode_s, n
                        self.observe(request.mode, timings)
                        status = "ok"
                        yield TokenEvent(ev.token, ev.finish_reason, timings)
                finally:
                    events.close()
        except QueueFull:
            status, gen.state = "rejected", RequestState.FINISHED_ERROR
            raise
        except Cancelled:
            status, gen.state = "cancelled", RequestState.FINISHED_ABORTED
            raise
        except Exception:
            gen.state = RequestState.FINISHED_ERROR
            raise
        finally:
            m.REQUESTS.labels(status=status).inc()

    def local_generation(self, gen: Generation, request: EngineRequest, timings: RequestTimings,
                         cancel: Cancellation) -> Iterator[TokenEvent]:
        """Prefill and decode on this engine."""
        return iter(gen)

    def observe(self, mode: str, t: RequestTimings) -> None:
        m.STAGE_SECONDS.labels(stage="prefill", device="gpu" if mode in ("gpu", "hybrid") else "fpga").observe(
            t.prefill_s)
        m.STAGE_SECONDS.labels(stage="decode", device=self.device_label).observe(t.decode_s)

    # ---- Info / Profile ----------------------------------------------------------
    def info_fields(self) -> dict:
        cfg = self.loaded.config
        return dict(model_id=cfg.model_id, engine=self.engine_name, device=self.engine.device_name,
                    kv_layout="layer,kv,head,token,dim", max_context=self.max_context,
                    max_concurrency=self.settings.max_concurrency, n_layers=cfg.n_layers,
                    n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size)

    def profile_samples(self, refresh: bool = False) -> list[dict]:
        with self._profile_lock:
            if refresh:
                with sweep_lock(self.settings.profile_cache):  # the engines take turns timing
                    self._profile = run_sweep(self.engine, self.device_label)
            elif self._profile is None:
                # cached and checked by a quick probe, or measured in turn with the other engine
                self._profile = profile_engine(self.engine, self.device_label, self.settings.profile_cache,
                                               self._profile_key())
            return self._profile

    def _profile_key(self) -> str:
        """What the cached timings depend on: model, engine, device, storage format, code."""
        storage = getattr(self.engine, "weights_dtype", None) or str(getattr(self.engine, "kv_dtype", ""))
        return (f"{self.loaded.config.model_id}-{self.engine_name}-{self.engine.device_name}-{storage}-"
                f"{code_fingerprint()}")

    def close(self) -> None:
        """Let go of what the runtime holds beyond the engine (connections, mappings)."""
