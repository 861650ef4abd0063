"""cross_host.py's per-transport ends: the sender prefill would make, and the receiving side of one hand-off,
for `tcp` (our stream, services/kv/tcp.py) and `nixl` (services/kv/nixl.py: a control connection to an
inbox, the bytes READ through UCX). One host (`OneHost`) runs both ends in the host's own namespace on
loopback, where UCX takes the kernel's cross-memory copy; across the namespaces the bench pins UCX to its
tcp transport on the veth (UCX_TLS=tcp; cma would copy between the processes and skip the link)."""
from __future__ import annotations

import os

TIMEOUT_S = 60.0
TRANSPORTS = ("tcp", "nixl")


class OneHost:
    """Netns's stand-in for the one-host runs: no namespaces, no shaping, loopback addresses."""

    tx = rx = None
    delay, no_delay_reason = None, "one host: loopback, no link to shape"

    @staticmethod
    def exec_in(ns) -> list[str]:
        return []

    def shape(self, rate) -> None:
        pass

    def __enter__(self) -> "OneHost":
        return self

    def __exit__(self, *exc) -> None:
        pass


def ucx_env(device: str | None) -> dict[str, str]:
    """UCX's settings for a process of the bench: pinned to `device` over its tcp transport across the
    namespaces; on one host, loopback and UCX's own choice (cma for the bytes)."""
    if device is None:
        return {"UCX_NET_DEVICES": "lo"}
    return {"UCX_NET_DEVICES": device, "UCX_TLS": "tcp"}


def make_sender(transport: str, address: tuple[str, int], header):
    from services.kv.tcp import TcpSender

    if transport == "tcp":
        return TcpSender(address, header, timeout_s=TIMEOUT_S)
    from services.kv.nixl import NixlSender
    from services.kv.nixl_agent import shared_agent

    return NixlSender(address, header, shared_agent("prefill"), timeout_s=TIMEOUT_S)


class Receivers:
    """The receiving process's ends: a TCP listener on port, a NIXL inbox on port + 1 (when installed)."""

    def __init__(self, host: str, port: int):
        from services.kv.tcp_frames import TcpListener

        self.tcp = TcpListener(host, port, timeout_s=TIMEOUT_S)
        self.nixl = None
        try:
            from services.kv.nixl import NixlInbox
            from services.kv.nixl_agent import NixlAgent, NixlUnavailable

            self.nixl = NixlInbox(NixlAgent("bench-decode"), host, port + 1, read_timeout_s=TIMEOUT_S)
        except (ImportError, NixlUnavailable) as exc:
            self.nixl_missing = str(exc)

    def receive(self, transport: str, importer, expected):
        """One hand-off into `importer`: (imported_at, bytes)."""
        from services.kv.handoff import PrefillDone, SlotGrant
        from services.kv.tcp import TcpReceiver

        if transport == "tcp":
            rx = TcpReceiver(self.tcp.accept(), importer, None, expected)
            rx.run()
            return rx.on_device_at, rx.bytes
        if self.nixl is None:
            raise RuntimeError(self.nixl_missing)
        from services.kv.nixl import NixlReceiver

        with self.nixl.expecting(expected.nonce):
            rx = NixlReceiver(self.nixl, importer, None, expected, TIMEOUT_S)
            grant = SlotGrant(0, 0, expected.n_tokens, expected.dtype, nonce=expected.nonce)
            if rx.consume([grant, PrefillDone(-1, 0.0, 0.0, 0.0)]) is None:
                raise RuntimeError("the NIXL hand-off ended early")
            return rx.on_device_at, rx.bytes


def port_of(transport: str, port: int) -> int:
    """Where the sender connects for `transport`: the TCP listener at `port`, the NIXL inbox at port + 1."""
    return port + TRANSPORTS.index(transport)


os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
