"""`python -m services.gateway`: the HTTP gateway (uvicorn, configured in server.py; SIGTERM drains,
as does the end of the process named by HYBRIDSERVE_PARENT_PID: lifetime.py)."""
from __future__ import annotations

import logging
import sys


def main() -> int:
    from services.gateway import cpu_priority
    from services.gateway.api.server import server
    from services.gateway.settings import GatewaySettings
    from services.lifetime import exit_with_parent
    from services import token_trace

    settings = GatewaySettings()
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s gateway %(name)s: %(message)s")
    exit_with_parent(settings.parent_pid, "gateway")
    token_trace.configure(settings.token_trace, "gateway")
    # here, not in create_app: tests build apps in pytest's own process, whose priority stays as it is
    # a refused default is said at info level: an unprivileged `make run` cannot take it, and nothing is wrong
    nice = cpu_priority.apply(settings.cpu_nice, asked="cpu_nice" in settings.model_fields_set)
    if nice is not None:
        logging.getLogger("services.gateway").info(
            "gateway threads at nice %d%s", nice, "" if settings.cpu_nice is not None else
            " (HYBRIDSERVE_GATEWAY_CPU_NICE empty: left as started)")
    server(settings).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
