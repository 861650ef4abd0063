"""`python -m services.decode_fpga`: the decode_fpga service."""
from __future__ import annotations

import logging
import sys


def main() -> int:
    from services.decode_fpga.settings import DecodeSettings

    settings = DecodeSettings()
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s decode_fpga %(name)s: %(message)s")
    from services.decode_fpga.engine import OpenCLEngine
    from services.decode_fpga.server import DecodeServicer
    from services.engine.service import serve
    from services.model.loading import load_model

    log = logging.getLogger("services.decode_fpga")
    log.info("loading the model")
    loaded = load_model(settings.model)
    log.info("building kernels and uploading weights")
    engine = OpenCLEngine.from_settings(loaded, settings)
    servicer = DecodeServicer(engine, loaded, settings)
    if settings.profile_at_start:
        log.info("profiling (cached after the first run)")
        servicer.profile_samples()
    serve(servicer, settings, on_shutdown=servicer.close)
    return 0


if __name__ == "__main__":
    sys.exit(main())
