"""`python -m services.gateway`: the HTTP gateway (uvicorn, configured in server.py; SIGTERM drains)."""
from __future__ import annotations

import logging
import sys


def main() -> int:
    from services.gateway.server import server
    from services.gateway.settings import GatewaySettings

    settings = GatewaySettings()
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s gateway %(name)s: %(message)s")
    server(settings).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
