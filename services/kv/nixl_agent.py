"""One NIXL agent per process for the `nixl` KV transport (nixl.py): created on first use, shared by
every hand-off, closed with the service.

NIXL is the KV transfer library of Dynamo, vLLM, SGLang and llm-d; it moves registered memory between
agents over UCX (RDMA where the hosts have it, the kernel's cross-memory copy on one host, TCP
otherwise). It is an optional install (`pip install 'hybridserve[nixl]'`): `load_api` names the extra
when it is missing, so choosing the transport without it is a start-up error, not a request's.

Why the agent is wrapped:
* Its own progress thread spins a whole core (its delay is fixed at 0 in nixl 1.5.1), so it is created
  without one. A READ only completes while *both* agents make progress (measured: with the target not
  progressing, a 256 MiB READ stayed "in progress" for 15 s on UCX's cma and tcp transports alike), so
  the reading side polls its own transfer, and the side being read runs a light progress loop (a sleep
  of `poll_s` between calls) only while a READ of its memory may be in flight: `want_progress()` /
  `drop_progress()` (nixl.py calls them around each control frame the receiver answers once its READ
  is done), else the loop blocks. Not for the whole hand-off: on a 2-core host a loop waking every
  100 µs for a prefill's ~10 s slowed that prefill by 20-40 % (bench/micro/nixl_probe.py), which was
  the 4.2 s of "exposed" hand-off the first one-host bench run charged to nixl.
* The agent is created with no locking (thread-sync NONE: no listener thread), and hand-offs run on
  several threads: every call goes through one lock here.
* Remote agents are counted: the first hand-off from a peer loads its metadata (which connects), every
  further one merges its own memory's descriptors, and the last one to end removes the peer (which
  disconnects) — no connection outlives the hand-offs that use it. Reconnecting measured ~1 ms on
  loopback after the process's first connection (~110 ms, UCX's own start-up).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import time
from typing import Iterator

from services.errors import HandoffFailed

EXTRA = "nixl"
INSTALL_HINT = f"pip install 'hybridserve[{EXTRA}]'"
DEFAULT_POLL_S = 100e-6  # between two progress calls while memory is out (and between two polls of a READ)
SPIN_S = 200e-6  # a READ is polled without sleeping this long first: most layers land within it on one host
KEEP_BYTES = 256 << 20  # buffers kept registered between hand-offs (Buffers), at most, per agent


class NixlUnavailable(RuntimeError):
    """The nixl extra is not installed, or its UCX backend cannot start here."""


class TransferFailed(HandoffFailed):
    """A NIXL transfer failed or did not complete in time: the peer went away or stopped progressing."""


def load_api():
    """nixl's Python API (the CUDA 12 build's module: the `nixl` meta package would also want the CUDA 13
    build, ~230 MB more for nothing on host memory). NixlUnavailable naming the extra when missing.
    Its INFO lines (on stdout) stay off unless NIXL_LOG_LEVEL asks for them."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        from nixl_cu12 import _api
    except ImportError:
        try:
            from nixl import _api
        except ImportError as exc:
            raise NixlUnavailable(f"the nixl KV transport needs the optional NIXL install: {INSTALL_HINT} "
                                  f"(nixl-cu12 1.5.1); it is not installed ({exc})") from None
    return _api


class NixlAgent:
    """The process's agent, behind a lock; `role` names it ("prefill", "decode") with host, pid and a
    random suffix, so a restarted process is never taken for the old one."""

    def __init__(self, role: str, poll_s: float = DEFAULT_POLL_S):
        api = load_api()
        self.name = f"hybridserve-{role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.poll_s = poll_s
        self._lock = threading.Lock()
        try:
            self._agent = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False,
                                                                          backends=["UCX"]))
        except Exception as exc:  # the binding's own error types
            raise NixlUnavailable(f"NIXL could not start its UCX backend: {exc}") from None
        if "UCX" not in self._agent.backends:
            raise NixlUnavailable("NIXL has no UCX backend plugin here (its wheel is incomplete)")
        self._remotes: dict[str, int] = {}  # remote agent -> hand-offs using it
        self._serving = 0  # transfers of our memory a peer may be running now
        self.progress_calls = 0  # the progress loop's calls, for tests and probes
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self.buffers = Buffers(self)  # the hand-offs' registered memory, kept for the next ones
        self._progress = threading.Thread(target=self._progress_loop, name="nixl-progress", daemon=True)
        self._progress.start()

    # ---- memory ----------------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int):
        """Register host memory [addr, addr + nbytes); returns the handle `deregister` takes."""
        with self._lock:
            return self._agent.register_memory([(addr, nbytes, 0, "")], "DRAM")

    def deregister(self, reg) -> None:
        with self._lock:
            self._agent.deregister_memory(reg)

    def metadata(self, reg) -> bytes:
        """What a peer needs to read `reg`: the agent's connection info and that memory's keys only."""
        with self._lock:
            return bytes(self._agent.get_partial_agent_metadata(reg, inc_conn_info=True))

    def want_progress(self) -> None:
        """A peer may READ our memory from now on: the progress loop runs until the matching drop."""
        with self._lock:
            self._serving += 1
            self._wake.notify()

    def drop_progress(self) -> None:
        with self._lock:
            self._serving -= 1

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """While inside, the progress loop runs (want_progress / drop_progress around a block)."""
        self.want_progress()
        try:
            yield
        finally:
            self.drop_progress()

    # ---- peers -----------------------------------------------------------------------------------
    def add_remote(self, metadata: bytes) -> str:
        """Load (or merge) a peer's metadata; its name. Each call is matched by one `release_remote`."""
        with self._lock:
            try:
                name = self._agent.add_remote_agent(metadata)
            except Exception as exc:
                raise TransferFailed(f"could not connect to the KV sender's NIXL agent: {exc}") from None
            name = name.decode() if isinstance(name, bytes) else name
            self._remotes[name] = self._remotes.get(name, 0) + 1
            return name

    def release_remote(self, name: str) -> None:
        """One hand-off with `name` ended; the last one disconnects from it."""
        with self._lock:
            left = self._remotes.get(name, 0) - 1
            if left > 0:
                self._remotes[name] = left
                return
            self._remotes.pop(name, None)
            with contextlib.suppress(Exception):  # a peer that died is gone already
                self._agent.remove_remote_agent(name)

    @property
    def remotes(self) -> dict[str, int]:
        with self._lock:
            return dict(self._remotes)

    # ---- transfers -------------------------------------------------------------------------------
    def read(self, remote: str, pairs: list[tuple[int, int, int]], timeout_s: float) -> None:
        """READ from `remote` each (local address, remote address, nbytes) and wait until all landed.
        TransferFailed when the peer disconnects, the transfer errs, or it is not done in `timeout_s`.
        The wait polls this thread's own transfer (no spinning thread): no sleep for SPIN_S, then one
        of `poll_s` between polls."""
        with self._lock:
            local = self._agent.get_xfer_descs([(a, n, 0) for a, _, n in pairs], "DRAM")
            far = self._agent.get_xfer_descs([(b, n, 0) for _, b, n in pairs], "DRAM")
            try:
                handle = self._agent.initialize_xfer("READ", local, far, remote)
                state = self._agent.transfer(handle)
            except Exception as exc:
                raise TransferFailed(f"a NIXL READ from {remote} could not start: {exc}") from None
        try:
            start = time.monotonic()
            while state == "PROC":
                now = time.monotonic()
                if now - start > timeout_s:
                    raise TransferFailed(f"a NIXL READ of {sum(n for *_, n in pairs)} bytes from the KV sender "
                                         f"did not complete within {timeout_s:g} s")
                if now - start > SPIN_S:
                    time.sleep(self.poll_s)
                with self._lock:
                    try:
                        state = self._agent.check_xfer_state(handle)
                    except Exception as exc:  # NIXL_ERR_REMOTE_DISCONNECT when the sender died
                        raise TransferFailed(f"the KV sender's NIXL agent went away mid-READ: {exc}") from None
            if state != "DONE":
                raise TransferFailed(f"a NIXL READ from the KV sender failed ({state})")
        finally:
            with self._lock, contextlib.suppress(Exception):
                self._agent.release_xfer_handle(handle)

    # ---- progress and life -----------------------------------------------------------------------
    def _progress_loop(self) -> None:
        while True:
            with self._lock:
                while not self._serving and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                with contextlib.suppress(Exception):
                    self._agent.get_new_notifs()  # progresses the worker: the peer's READs complete
                self.progress_calls += 1
            time.sleep(self.poll_s)

    def close(self) -> None:
        """Stop the progress loop, forget every peer, let the kept buffers go (the agent goes with the process)."""
        self.buffers.close()
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            names, self._remotes = list(self._remotes), {}
            for name in names:
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)
        self._progress.join(timeout=5)


class Buffers:
    """Registered host buffers, kept for the next hand-off: the sender's KV (what the peer READs) and the
    receiver's import buffer (what it READs into). A fresh buffer per hand-off paid a page fault per 4 KiB
    page at its first touch (a receiver's READ of a 2,000-token layer, 3 MB: 8.6 ms against 0.3 ms warm,
    ~0.25 s of decode's CPU per hand-off: bench/micro/nixl_probe.py; on the sender, in the prefill's own
    copies) and a registration each time (page pinning, where UCX has RDMA). At most `keep_bytes` stay
    idle, the newest first; a buffer comes back only from a hand-off that ended cleanly (a failed one's
    peer may still be READing it, or a READ still landing in it)."""

    def __init__(self, agent: NixlAgent, keep_bytes: int = KEEP_BYTES):
        self.agent, self.keep_bytes = agent, keep_bytes
        self._idle: list[tuple] = []  # (buffer, registration), oldest first
        self._lock = threading.Lock()

    def take(self, nbytes: int):
        """(a writable uint8 array of `nbytes`, the lease `give` takes back): an idle buffer that fits
        (at most twice the size: a small prompt does not hold a long one's), else a new registered one."""
        import numpy as np

        with self._lock:
            fits = [i for i, (buf, _) in enumerate(self._idle) if nbytes <= buf.nbytes <= 2 * nbytes + (1 << 20)]
            lease = self._idle.pop(min(fits, key=lambda i: self._idle[i][0].nbytes)) if fits else None
        if lease is None:
            buf = np.empty(nbytes, np.uint8)
            lease = (buf, self.agent.register(buf.ctypes.data, buf.nbytes))
        return lease[0][:nbytes], lease

    def give(self, lease, reuse: bool) -> None:
        drop = [lease]
        if reuse:
            with self._lock:
                self._idle.append(lease)
                drop = []
                while self._idle and self.idle_bytes > self.keep_bytes:
                    drop.append(self._idle.pop(0))
        for _, reg in drop:
            self.agent.deregister(reg)

    @property
    def idle_bytes(self) -> int:
        return sum(buf.nbytes for buf, _ in self._idle)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for _, reg in idle:
            self.agent.deregister(reg)


_shared: dict[str, NixlAgent] = {}
_shared_lock = threading.Lock()


def shared_agent(role: str) -> NixlAgent:
    """The process's agent for `role`, created on first use (~0.5 s: UCX's start-up)."""
    with _shared_lock:
        if role not in _shared:
            _shared[role] = NixlAgent(role)
        return _shared[role]


def close_shared() -> None:
    with _shared_lock:
        agents = list(_shared.values())
        _shared.clear()
    for agent in agents:
        agent.close()
