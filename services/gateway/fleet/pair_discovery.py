"""Finding the pairs through DNS: in Kubernetes, the pods behind a headless Service.

A headless Service's name resolves to one address per ready pod; each pod is a pair, its two
engines on the ports the settings give (those of prefill_address and decode_address). The name
is resolved again every `refresh_s`, so pods that come and go join and leave the gateway's pairs.
A failed lookup keeps the pairs as they were (a DNS hiccup must not take every pair out).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Awaitable, Callable

from services.gateway.fleet.pairs import Address, Engines, Pairs

log = logging.getLogger(__name__)

Resolver = Callable[[str], Awaitable[list[str]]]


async def resolve_addresses(name: str) -> list[str]:
    """Every address `name` resolves to (IPv4 and IPv6), sorted, each once."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class DnsPairs:
    """Keeps `pairs` to the pods `name` resolves to; `await refresh()` every health interval."""

    def __init__(self, pairs: Pairs, name: str, prefill_port: int, decode_port: int,
                 connect: Callable[[Address], Engines], refresh_s: float, resolver: Resolver = resolve_addresses):
        self.pairs, self.name, self.ports = pairs, name, (prefill_port, decode_port)
        self.connect, self.refresh_s, self.resolver = connect, refresh_s, resolver
        self._next_at = 0.0

    async def refresh(self) -> None:
        """Resolve when due, and add and remove pairs to match."""
        if time.monotonic() < self._next_at:
            return
        self._next_at = time.monotonic() + self.refresh_s
        try:
            hosts = await self.resolver(self.name)
        except OSError as exc:
            log.warning("pairs: %s did not resolve (%s); keeping the %d pairs known", self.name, exc, len(self.pairs))
            return
        wanted = [(_host_port(h, self.ports[0]), _host_port(h, self.ports[1])) for h in hosts]
        added, removed = self.pairs.sync(wanted, self.connect)
        for p in added:
            log.info("pairs: pair %d at %s joined", p, self.pairs.addresses[p])
        if removed:
            log.info("pairs: %d pair(s) left", len(removed))
        await asyncio.gather(*(c.close() for c in removed if hasattr(c, "close")))
