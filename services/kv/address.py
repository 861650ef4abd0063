"""'host:port' strings for the TCP hand-off's addresses (settings, the Prefill call's kv_address).

No imports beyond the standard library: settings classes check their values with it.
"""
from __future__ import annotations

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "*", ""})  # listen on every interface: not an address to connect to


def parse_address(text: str) -> tuple[str, int]:
    """'host:port' (IPv6: '[addr]:port') as (host, port); ValueError naming what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not host:port (an IPv6 address in brackets)")
    return host, int(port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
