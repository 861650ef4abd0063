"""Keeping the cores of a CPU OpenCL device awake between kernels while decode work runs.

PoCL's worker threads sleep on a condition variable whenever its queue is empty,
which on an in-order queue is after every kernel, and the next kernel's launch
wakes them. On a virtual machine an idle core halts, and waking a halted vCPU
costs tens of µs: measured here (2 vCPUs, KVM, cpuidle `haltpoll` with
`guest_halt_poll_ns` 0), a second worker joined each kernel 25-40 µs late, and
`try_to_wake_up` took 8.6% of all CPU time during decode. A decode step has ~180
kernels.

Linux's PM QoS interface fixes that for as long as a process holds
`/dev/cpu_dma_latency` open with a limit written to it: with 0 µs, idle cores
poll instead of halting, and a wake-up is a flag the polling core sees. That is
what tuned's latency-performance profile does for the whole machine; here it is
held only while steps run and let go `release_after_s` after the last one, since
polling burns an idle core. llama.cpp needs none of it: its threads spin between
operations. Writing the file needs root (or a udev rule granting it); without
it the engine runs as before and says so once.
"""
from __future__ import annotations

import logging
import os
import struct
import threading
import time

log = logging.getLogger(__name__)

PM_QOS_DEVICE = "/dev/cpu_dma_latency"


class CpuWakeLatency:
    """A PM QoS request of 0 µs wake-up latency, held from `touch()` until idle for `release_after_s`."""

    def __init__(self, path: str = PM_QOS_DEVICE, release_after_s: float = 0.5):
        self.path, self.release_after_s = path, release_after_s
        self._fd: int | None = None
        self._last = 0.0
        self._unavailable: str | None = None  # why the request cannot be made; then touch() does nothing
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        return self._fd is not None

    @property
    def unavailable(self) -> str | None:
        return self._unavailable

    def touch(self) -> None:
        """Work is running: hold the request (from now until release_after_s without a touch)."""
        with self._lock:
            self._last = time.monotonic()
            if self._fd is not None or self._unavailable is not None:
                return
            try:
                fd = os.open(self.path, os.O_WRONLY)
            except OSError as exc:
                self._give_up(exc)
                return
            try:
                os.write(fd, struct.pack("i", 0))  # the kernel keeps the request while the file is open
            except OSError as exc:
                os.close(fd)
                self._give_up(exc)
                return
            self._fd = fd
        threading.Thread(target=self._release_when_idle, name="cpu-wake-latency", daemon=True).start()

    def release(self) -> None:
        with self._lock:
            self._close()

    def _give_up(self, exc: OSError) -> None:
        self._unavailable = f"{self.path}: {exc.strerror or exc}"
        log.warning("cannot keep the CPU cores awake between OpenCL kernels (%s); decode on a CPU device runs "
                    "slower on VMs. Run as root, grant write access to %s, or set "
                    "HYBRIDSERVE_DECODE_OPENCL_KEEP_CORES_AWAKE=false to silence this", self._unavailable, self.path)

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file withdraws the request
            self._fd = None

    def _release_when_idle(self) -> None:
        while True:
            with self._lock:
                if self._fd is None:
                    return
                idle = time.monotonic() - self._last
                if idle >= self.release_after_s:
                    self._close()
                    return
            time.sleep(self.release_after_s - idle)
