"""`python -m services.decode_fpga`: the decode_fpga service."""
from __future__ import annotations

import sys


def main() -> int:
    from services.decode_fpga.server import build, load
    from services.decode_fpga.settings import DecodeSettings
    from services.engine.main import run_engine_service

    return run_engine_service("decode_fpga", DecodeSettings, build, load)


if __name__ == "__main__":
    sys.exit(main())
