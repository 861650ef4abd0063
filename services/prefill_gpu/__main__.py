"""`python -m services.prefill_gpu`: the prefill_gpu service."""
from __future__ import annotations

import sys


def main() -> int:
    from services.engine.main import run_engine_service
    from services.prefill_gpu.server import build
    from services.prefill_gpu.settings import PrefillSettings

    return run_engine_service("prefill_gpu", PrefillSettings, build)


if __name__ == "__main__":
    sys.exit(main())
