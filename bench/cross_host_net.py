"""cross_host.py's two "hosts" on one machine: network namespaces joined by a veth pair, shaped with tc;
the bench's own run as a process of the sending namespace (`run_in_tx`: under `ip netns exec`, so a
library that lists /sys/class/net, as UCX does, sees that namespace's veth and not the host's); a thread
entered into one (`_enter`, for sockets only); and the selftest the KV tests run through them (one TCP
hand-off of random bytes across the pair). Split from cross_host.py to keep each module under 400 lines."""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys

import numpy as np

TX_ADDR, RX_ADDR, PREFIX = "10.231.0.1", "10.231.0.2", 30
DELAY = "0.5ms"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Netns:
    """Two namespaces and a veth pair, `rate` (e.g. '1gbit', None: unshaped) and 0.5 ms each way.
    A context manager; deleted on exit, on SIGTERM and at interpreter exit, whatever happened."""

    def __init__(self, rate: str | None, names: str | None = None):
        pid = os.getpid()
        self.tx, self.rx = f"hs-tx-{pid}", f"hs-rx-{pid}"
        self.veth_tx, self.veth_rx = f"hst{pid % 100000}", f"hsr{pid % 100000}"
        self.owner = names is None  # False: another process made them (`names`), and deletes them
        if names:
            self.tx, self.rx, self.veth_tx, self.veth_rx = names.split(",")
        self.rate = rate
        self.delay: str | None = None
        self.no_delay_reason: str | None = None

    @property
    def names(self) -> str:
        return ",".join((self.tx, self.rx, self.veth_tx, self.veth_rx))

    @staticmethod
    def exec_in(ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def __enter__(self) -> "Netns":
        if not self.owner:
            return self
        atexit.register(self.cleanup)
        try:
            _ip("netns", "add", self.tx)
            _ip("netns", "add", self.rx)
            _ip("link", "add", self.veth_tx, "type", "veth", "peer", "name", self.veth_rx)
            for ns, dev, addr in ((self.tx, self.veth_tx, TX_ADDR), (self.rx, self.veth_rx, RX_ADDR)):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            self.shape(self.rate)
        except subprocess.CalledProcessError as exc:
            self.cleanup()
            raise RuntimeError(f"setting up the namespaces failed: {' '.join(exc.cmd)}: {exc.stderr.strip()}") from exc
        except BaseException:
            self.cleanup()
            raise
        return self

    def shape(self, rate: str | None) -> None:
        """Both veth ends: netem's delay (when this kernel has netem) with a tbf at `rate` under it, or
        the tbf alone; replaces what was there. `self.delay` says what delay was really applied."""
        self.rate = rate
        for ns, dev in ((self.tx, self.veth_tx), (self.rx, self.veth_rx)):
            tc = [*self.exec_in(ns), "tc", "qdisc"]
            subprocess.run([*tc, "del", "dev", dev, "root"], capture_output=True)  # none there: fine
            netem = subprocess.run([*tc, "add", "dev", dev, "root", "handle", "1:", "netem", "delay", DELAY,
                                    "limit", "100000"], capture_output=True, text=True)
            self.delay = DELAY if netem.returncode == 0 else None
            self.no_delay_reason = None if self.delay else f"tc netem: {netem.stderr.strip() or netem.returncode}"
            if rate:
                bits = float(rate.removesuffix("gbit")) * 1e9
                burst = str(max(int(bits / 8 * 1e-3), 200_000))  # a millisecond of bytes: GSO packets fit
                where = ["parent", "1:1"] if self.delay else ["root"]
                subprocess.run([*tc, "add", "dev", dev, *where, "handle", "10:", "tbf", "rate", rate, "burst", burst,
                                "latency", "50ms"], capture_output=True, text=True, check=True)

    def cleanup(self) -> None:
        if not self.owner:
            return
        for ns in (self.tx, self.rx):  # deleting a namespace deletes its end of the veth, and so the pair
            _ip("netns", "del", ns, check=False)

    def __exit__(self, *exc) -> None:
        self.cleanup()
        atexit.unregister(self.cleanup)


def run_in_tx(argv: list[str]) -> int:
    """Make the namespaces, run `python -m bench.cross_host argv --in-netns NAMES` as a process of the
    sending namespace (it shapes the link and starts the receiving process in the other), delete them."""
    from bench._common import ROOT

    with Netns(rate=None) as ns:
        child = subprocess.Popen([*ns.exec_in(ns.tx), sys.executable, "-m", "bench.cross_host", *argv,
                                  "--in-netns", ns.names], cwd=ROOT)
        try:
            return child.wait()
        finally:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
                child.wait(timeout=30)


class HostImporter:
    """Imports into host memory as decode would before its device copy: [layers, 2, kv_heads, n, dim]."""

    def __init__(self, layout):
        self.kv = np.empty(layout.shape, layout.dtype)

    def import_kv_layer(self, seq, layer, kv):
        self.kv[layer] = kv

    def import_kv_slice(self, seq, layer, start, kv):
        self.kv[layer, :, :, start:start + kv.shape[2]] = kv

    def finish_import(self, seq, n_tokens):
        pass


def _enter(ns: str) -> None:
    """This thread into network namespace `ns`: sockets made from now on live there (made before: stay put)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # os.setns is Python 3.12+
    with open(f"/var/run/netns/{ns}") as f:
        if libc.setns(f.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {ns} failed")


def selftest(tx_ns: str, rx_ns: str) -> None:
    """For the tests: one hand-off of random bytes over the veth, the listener made in `rx_ns`, the sender's
    socket in `tx_ns` (both in this process: a socket stays in the namespace it was made in)."""
    import threading

    from services.kv.header import SlotHeader
    from services.kv.tcp import TcpReceiver, TcpSender
    from services.kv.tcp_frames import TcpListener
    from services.kv.handoff import layout_of

    header = SlotHeader("fp32", 4, 2, 8, 33, "selftest", nonce=7)
    kv = np.random.default_rng(0).normal(size=layout_of(header).shape).astype(np.float32)
    importer = HostImporter(layout_of(header))
    _enter(rx_ns)
    with TcpListener(RX_ADDR, 0, timeout_s=10) as listener:
        _enter(tx_ns)
        done = {}
        th = threading.Thread(target=lambda: done.update(r=TcpReceiver(listener.accept(), importer, None,
                                                                       header).run()))
        th.start()
        with TcpSender(listener.address, header, timeout_s=10) as tx:
            tx.open()
            for a in range(0, 33, 10):
                for layer in range(4):
                    tx.layer_buffer(layer)[:, :, a:a + 10] = kv[layer][:, :, a:a + 10]
                tx.send_slice(0, 4, a, min(a + 10, 33))
            tx.finish()
        th.join(10)
    if "r" not in done or not np.array_equal(importer.kv, kv):
        raise SystemExit("selftest failed: the KV did not arrive intact")
    print("selftest ok")


