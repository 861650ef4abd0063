"""`python -m services.prefill_gpu`: the prefill_gpu service."""
from __future__ import annotations

import sys


def main() -> int:
    from services.prefill_gpu.cpu_matmul import request_strict_mkl

    request_strict_mkl()  # before anything runs a matmul: MKL takes its mode only then (cpu_matmul.py)
    from services.engine.main import run_engine_service
    from services.prefill_gpu.server import build
    from services.prefill_gpu.settings import PrefillSettings

    return run_engine_service("prefill_gpu", PrefillSettings, build)


if __name__ == "__main__":
    sys.exit(main())
