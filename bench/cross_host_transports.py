"""cross_host.py's per-transport ends: the sender prefill would make, and the receiving side of one hand-off,
for `tcp` (our stream, services/kv/tcp.py), `nixl` (services/kv/nixl.py: a control connection to an
inbox, the bytes READ through UCX) and, on one host, `shm` (services/kv/shm.py: the arena; the messages
the Prefill RPC carries - grant, each LayerReady, PrefillDone - go as JSON lines over loopback here).
One host (`OneHost`) runs both ends in the host's own namespace on loopback, where UCX takes the kernel's
cross-memory copy (cma); across the namespaces each end is a process of its namespace (`ip netns exec`,
so UCX lists that namespace's interfaces) and the bench pins UCX to the veth and its tcp transport
(UCX_TLS=tcp; cma would copy between the processes and skip the link)."""
from __future__ import annotations

import json
import os
import socket
import time

import numpy as np

TIMEOUT_S = 60.0
TRANSPORTS = ("tcp", "nixl", "shm")
# the nixl sender as it was before its agent rested between READs: progressing from open to close (the
# bench's side-by-side of the fix; its receiving end is nixl's)
BUSY = "nixl-busy"
ARENA_BYTES = 256 << 20  # the bench's shm arena: one hand-off at a time, 2,000 tokens take 92 MB


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


class ShmRelay:
    """prefill's side of an shm hand-off: a ShmSender in this process's arena, and the messages the Prefill
    RPC would carry, as JSON lines on a loopback connection to the receiving process."""

    arena = None

    def __init__(self, address: tuple[str, int], header):
        from services.kv.arena import Arena
        from services.kv.shm import ShmSender

        if ShmRelay.arena is None:
            ShmRelay.arena = Arena(ARENA_BYTES)  # pre-faulted; removed at exit (close_arena)
        self.tx = ShmSender(ShmRelay.arena, header, wait_s=TIMEOUT_S)
        self.address, self.lines, self.sock = address, None, None

    def _send(self, msg: dict) -> None:
        self.lines.write(json.dumps(msg) + "\n")
        self.lines.flush()

    def open(self):
        self.sock = socket.create_connection(self.address, timeout=TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.lines = self.sock.makefile("rw")
        g = self.tx.open()
        self._send({"arena": self.arena.name, "grant": [g.offset, g.size, g.n_tokens, g.dtype]})
        return g

    def layer_buffer(self, layer: int):
        return self.tx.layer_buffer(layer)

    def layer_written(self, layer: int):
        m = self.tx.layer_written(layer)
        self._send({"layer": [m.layer, m.offset, m.nbytes, m.written_at]})
        return m

    def send_slice(self, *_):
        raise NotImplementedError("the arena carries whole layers: shm has no token slices")

    def finish(self, done) -> float:
        self.tx.finish()
        self._send({"done": [done.first_token, done.prefill_s, done.queue_s, done.compute_done_at]})
        return json.loads(self.lines.readline())["imported_at"]

    def __enter__(self) -> "ShmRelay":
        return self

    def __exit__(self, *exc) -> None:
        self.tx.close()
        if self.sock is not None:
            self.lines.close()
            self.sock.close()


def close_arena() -> None:
    if ShmRelay.arena is not None:
        ShmRelay.arena.close()
        ShmRelay.arena = None


def make_sender(transport: str, address: tuple[str, int], header):
    from services.kv.tcp import TcpSender

    if transport == "tcp":
        return TcpSender(address, header, timeout_s=TIMEOUT_S)
    if transport == "shm":
        return ShmRelay(address, header)
    from services.kv.nixl import NixlSender
    from services.kv.nixl_agent import shared_agent

    if transport == BUSY:
        return BusyNixlSender(address, header, shared_agent("prefill"), timeout_s=TIMEOUT_S)
    return NixlSender(address, header, shared_agent("prefill"), timeout_s=TIMEOUT_S)


def _busy_class():
    from services.kv.nixl import NixlSender

    class Busy(NixlSender):
        """NixlSender whose agent progresses for the whole hand-off (its behaviour until 2026-11-29)."""

        def _open(self):
            self.agent.want_progress()
            self._busy = True
            return super()._open()

        def _close(self):
            super()._close()
            if getattr(self, "_busy", False):
                self._busy = False
                self.agent.drop_progress()
    return Busy


def BusyNixlSender(*args, **kw):  # noqa: N802 (a class made on first use: nixl is an optional import)
    return _busy_class()(*args, **kw)


class Receivers:
    """The receiving process's ends: a TCP listener on port, a NIXL inbox on port + 1 (when installed), the
    shm messages' listener on port + 2 (on one host)."""

    def __init__(self, host: str, port: int):
        from services.kv.tcp_frames import TcpListener

        self.tcp = TcpListener(host, port, timeout_s=TIMEOUT_S)
        self.shm = socket.create_server((host, port + 2))
        self.shm.settimeout(TIMEOUT_S)
        self.readers: dict = {}  # arena name -> its mapping
        self.nixl = None
        try:
            from services.kv.nixl import NixlInbox
            from services.kv.nixl_agent import NixlAgent, NixlUnavailable

            self.nixl = NixlInbox(NixlAgent("bench-decode"), host, port + 1, read_timeout_s=TIMEOUT_S)
        except (ImportError, NixlUnavailable) as exc:
            self.nixl_missing = str(exc)

    def receive(self, transport: str, importer, expected, ready):
        """One hand-off into `importer`: (imported_at, bytes). `ready()` is called once the sender may come."""
        from services.kv.handoff import PrefillDone, SlotGrant
        from services.kv.tcp import TcpReceiver

        transport = "nixl" if transport == BUSY else transport
        if transport != "nixl" or self.nixl is None:
            ready()  # the listeners are up already; a connection waits in their backlog
        if transport == "tcp":
            rx = TcpReceiver(self.tcp.accept(), importer, None, expected)
            rx.run()
            return rx.on_device_at, rx.bytes
        if transport == "shm":
            return self._receive_shm(importer, expected)
        if self.nixl is None:
            raise RuntimeError(self.nixl_missing)
        from services.kv.nixl import NixlReceiver

        with self.nixl.expecting(expected.nonce):
            ready()
            rx = NixlReceiver(self.nixl, importer, None, expected, TIMEOUT_S)
            grant = SlotGrant(0, 0, expected.n_tokens, expected.dtype, nonce=expected.nonce)
            if rx.consume([grant, PrefillDone(-1, 0.0, 0.0, 0.0)]) is None:
                raise RuntimeError("the NIXL hand-off ended early")
            return rx.on_device_at, rx.bytes


    def _receive_shm(self, importer, expected):
        from services.kv.arena import ArenaReader
        from services.kv.handoff import LayerReady, PrefillDone, SlotGrant
        from services.kv.shm import ShmReceiver

        conn, _ = self.shm.accept()
        with conn, conn.makefile("rw") as lines:
            first = json.loads(lines.readline())
            name = first["arena"]
            if name not in self.readers:
                self.readers[name] = ArenaReader(name)
            rx = ShmReceiver(self.readers[name], importer, None, expected)

            def events():
                yield SlotGrant(*first["grant"], nonce=expected.nonce)
                for line in lines:
                    msg = json.loads(line)
                    if "layer" in msg:
                        yield LayerReady(*msg["layer"])
                    else:
                        yield PrefillDone(*msg["done"])
                        return
            if rx.consume(events()) is None:
                raise RuntimeError("the shm hand-off ended early")
            lines.write(json.dumps({"imported_at": rx.on_device_at}) + "\n")
            lines.flush()
        return rx.on_device_at, rx.bytes


def receive(host: str, port: int) -> None:
    """Serve hand-offs until the control connection ends: per request, a JSON line {n_tokens, request,
    dtype, transport} on the control connection, 'ready', the hand-off, then a JSON line with the outcome."""
    from services.kv.header import SlotHeader, request_nonce
    from services.kv.handoff import layout_of
    from services.model.config import read_config
    from services.model.checkpoint import locate

    from bench.cross_host_net import HostImporter

    cfg = read_config(locate(None))
    ends = Receivers(host, port + 1)
    with socket.create_server((host, port)) as control_server:
        control_server.settimeout(TIMEOUT_S)
        print("listening", flush=True)
        control, _ = control_server.accept()
        control.settimeout(None)
        lines = control.makefile("rw")
        for line in lines:
            req = json.loads(line)
            expected = SlotHeader(req["dtype"], cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, req["n_tokens"],
                                  cfg.model_id, nonce=request_nonce(req["request"]))
            importer = HostImporter(layout_of(expected))
            importer.kv.fill(0)  # touch the pages now, as a decode engine's preallocated pool would be
            cpu0 = time.process_time()
            try:  # "ready" once this hand-off's end listens (nixl: the inbox expects its nonce)
                imported_at, nbytes = ends.receive(req.get("transport", "tcp"), importer, expected,
                                                   lambda: (lines.write("ready\n"), lines.flush()))
                out = {"ok": True, "imported_at": imported_at, "bytes": nbytes,
                       "checksum": float(importer.kv[:, :, :, :: max(1, req["n_tokens"] // 7)].sum(dtype=np.float64))}
            except Exception as exc:  # reported to the sending side, which fails the bench
                out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            out["cpu_s"] = time.process_time() - cpu0  # this process's, for the hand-off
            lines.write(json.dumps(out) + "\n")
            lines.flush()


def port_of(transport: str, port: int) -> int:
    """Where the sender connects for `transport`: the TCP listener at `port`, the NIXL inbox at port + 1."""
    return port + TRANSPORTS.index("nixl" if transport == BUSY else transport)


os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
