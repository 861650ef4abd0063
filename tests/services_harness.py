"""The process harness as tests import it; the code lives in harness/ (shared with bench/)."""
from __future__ import annotations

from harness.process import ROOT, free_port
from harness.services import Service, engine_pair, start_gateway, wait_http_ok

__all__ = ["ROOT", "Service", "engine_pair", "free_port", "start_gateway", "wait_http_ok"]
