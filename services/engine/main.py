"""The start-up both engine services share: `python -m services.<engine>` is `run_engine_service`.

Settings, logging, the model, then the service's own `build` (its engine, runtime
and servicer), the profile sweep when asked for, serve() until SIGTERM, and the
service's resources released in reverse order on the way out: a SIGTERM that comes
before serve() (while the model loads, the arena is made or the profile sweep runs)
unwinds them too, so prefill_gpu's KV arena never outlives it. With
HYBRIDSERVE_PARENT_PID set the service stops once that process is gone (lifetime.py).
"""
from __future__ import annotations

import contextlib
import logging
import signal
import sys
from typing import Callable

# build(loaded model, settings, resources) → the servicer; resources.callback(...) for what must be released
Build = Callable[[object, object, contextlib.ExitStack], object]
# load(settings) → the loaded model (services.model.loading.LoadedModel); None: load_model(settings.model)
Load = Callable[[object], object]


def run_engine_service(process: str, settings_cls: type, build: Build, load: Load | None = None) -> int:
    settings = settings_cls()
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {process} %(name)s: %(message)s")
    from services.engine.service import serve
    from services.lifetime import exit_with_parent
    from services.model.checkpoint import CheckpointError
    from services.model.loading import load_model
    from services import token_trace

    log = logging.getLogger(f"services.{process}")
    # until serve() takes SIGTERM over: leave through the `with` below, releasing what is built so far
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_before_serving)
    exit_with_parent(settings.parent_pid, process)
    token_trace.configure(settings.token_trace, process)
    log.info("loading the model")
    with contextlib.ExitStack() as resources:
        try:
            loaded = load(settings) if load is not None else load_model(settings.model)
            servicer = build(loaded, settings, resources)
        except CheckpointError as exc:  # a model this engine cannot serve: one line saying why, not a traceback
            log.error("cannot serve %s: %s", settings.model or "the default model", exc)
            return 2
        resources.callback(servicer.runtime.close)
        if settings.profile_at_start:
            log.info("profiling (cached after the first run)")
            servicer.runtime.profile_samples()
        serve(servicer, settings)
    return 0


def _exit_before_serving(sig, frame) -> None:
    raise SystemExit(128 + sig)
