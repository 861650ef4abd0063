"""Who may call the gateway: the API key, and a warning when the gateway is open to a network.

With a key set, every route but the probes (`/health`, `/readyz`, `/livez`) needs
`Authorization: Bearer <key>`: the API, the documents (`/openapi.json`, `/docs`, `/redoc`) and
`/metrics`, unless `metrics_open` leaves `/metrics` to a scraper on a private network. The key is
compared in constant time, so the time of a refusal says nothing about how much of a guess was right.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging

from fastapi import Request
from pydantic import SecretStr

from services.gateway.protocol.errors import APIError

log = logging.getLogger(__name__)


class ApiKey:
    """A FastAPI dependency: raises 401 unless the request carries the key (no key set: anyone passes)."""

    def __init__(self, key: SecretStr | None):
        self._key = key.get_secret_value().encode() if key is not None else None

    def __call__(self, request: Request) -> None:
        if self._key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # both sides hashed first, so neither the length nor the bytes of the key leak through timing
        if scheme.lower() != "bearer" or not hmac.compare_digest(_digest(token.encode()), _digest(self._key)):
            raise APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")


def _digest(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def warn_if_exposed(host: str, key: SecretStr | None) -> None:
    """Log a warning when the gateway listens beyond loopback and anyone may call it."""
    if key is None and not is_loopback(host):
        log.warning("the gateway listens on %s with no API key: anyone who can reach it may use it "
                    "(set HYBRIDSERVE_GATEWAY_API_KEY)", host)
