"""`python -m services.gateway`: the HTTP gateway (uvicorn)."""
from __future__ import annotations

import logging
import sys


def main() -> int:
    import uvicorn

    from services.gateway.app import create_app
    from services.gateway.settings import GatewaySettings

    settings = GatewaySettings()
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s gateway %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level=settings.log_level.lower(), timeout_graceful_shutdown=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
