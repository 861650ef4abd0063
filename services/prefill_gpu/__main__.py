"""`python -m services.prefill_gpu`: the prefill_gpu service."""
from __future__ import annotations

import logging
import sys


def main() -> int:
    from services.prefill_gpu.settings import PrefillSettings

    settings = PrefillSettings()
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s prefill_gpu %(name)s: %(message)s")
    from services.engine.service import serve
    from services.kv.arena import Arena
    from services.model.loading import load_model
    from services.prefill_gpu.engine import TorchEngine
    from services.prefill_gpu.server import PrefillServicer

    log = logging.getLogger("services.prefill_gpu")
    log.info("loading the model")
    loaded = load_model(settings.model)
    engine = TorchEngine(loaded.config, loaded.weights, device=settings.device, dtype=settings.dtype)
    arena = Arena(settings.arena_bytes, pin_cuda=engine.device.type == "cuda")
    log.info("KV arena %s: %d MiB, pre-faulted%s", arena.name, arena.size >> 20, ", pinned" if arena.pinned else "")
    try:
        servicer = PrefillServicer(engine, loaded, settings, arena)
        if settings.profile_at_start:
            log.info("profiling (cached after the first run)")
            servicer.profile_samples()
        serve(servicer, settings)
    finally:
        arena.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
