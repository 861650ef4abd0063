"""Opening a one-launch step's gate and reading its results with the GIL released.

A one-launch step (kernels/decode_layers.cl) is enqueued whole behind a user event, the gate, and its
work-groups then spin at their barriers on every core until the step ends. pyopencl holds the GIL
while it sets a user event's status (clSetUserEventStatus is not one of the calls it lets go for),
and the Python of the reads that followed (pyopencl's enqueue_copy, the host arrays) held it too. On
a host whose cores something else also wants (prefill_gpu's torch threads beside decode_fpga, with no
GPU), the thread that opened the gate was taken off its core by the work-groups it had just woken,
still holding the GIL, and got a core back only tens of ms later; every other thread of the process
(the gRPC threads sending the last step's tokens, a hand-off's imports) waited for the GIL meanwhile.
A stream's token then left the engine 46-82 ms after its step (py-spy: 433 of 744 of the process's
GIL samples on that line; bench/long_prompt_gaps.py's trace).

So everything a step reads back is prepared before the gate opens (host arrays, pointers), and the
gate is opened and the reads done by ctypes calls into the OpenCL library pyopencl loaded: ctypes lets
the GIL go for each call, and between them the thread runs a few bytecodes. (The reads cannot be
enqueued before the gate opens: PoCL's clEnqueueReadBuffer waits, even non-blocking, while the
commands before it wait on a user event.) Where that library cannot be found, pyopencl does it all,
holding the GIL as before.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import pyopencl as cl

log = logging.getLogger(__name__)

CL_COMPLETE, CL_TRUE, CL_FALSE = 0, 1, 0


def _opencl_library() -> ctypes.CDLL | None:
    """The OpenCL ICD loader this process has mapped (pyopencl's: the wheel carries its own), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libOpenCL" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.clSetUserEventStatus.argtypes = (ctypes.c_void_p, ctypes.c_int32)
            lib.clSetUserEventStatus.restype = ctypes.c_int32
            lib.clEnqueueReadBuffer.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_size_t,
                                                ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p,
                                                ctypes.c_void_p)
            lib.clEnqueueReadBuffer.restype = ctypes.c_int32
            lib.clFinish.argtypes = (ctypes.c_void_p,)
            lib.clFinish.restype = ctypes.c_int32
            return lib
        except (OSError, AttributeError):
            continue
    return None


@dataclass(frozen=True)
class Read:
    """A device buffer's first host.nbytes bytes into `host` (C-contiguous)."""

    host: np.ndarray
    buffer: cl.Buffer


class StepGate:
    """open_and_read(queue, gate, reads): the gate set complete, then every read done (the last one waited
    for, which on an in-order queue is the step's end), the GIL let go for each OpenCL call."""

    def __init__(self):
        self._lib = _opencl_library()
        if self._lib is None:
            log.info("no OpenCL library found among this process's mappings: a one-launch step is opened and "
                     "read with the GIL held")

    @property
    def releases_gil(self) -> bool:
        return self._lib is not None

    def open_and_read(self, queue: cl.CommandQueue, gate: cl.UserEvent, reads: list[Read]) -> None:
        if self._lib is None:
            self.open(gate)
            for i, r in enumerate(reads):
                cl.enqueue_copy(queue, r.host, r.buffer, is_blocking=i == len(reads) - 1)
            if not reads:
                queue.finish()
            return
        # everything the calls take, before the gate opens (plain ints: argtypes convert them)
        q = queue.int_ptr
        args = [(r.buffer.int_ptr, r.host.nbytes, r.host.ctypes.data) for r in reads]
        status = self._lib.clSetUserEventStatus(gate.int_ptr, CL_COMPLETE)
        if status != 0:  # the step must not stay queued behind a shut gate: pyopencl's call, then the error
            self.open(gate)
            _check(status, "clSetUserEventStatus")
        for i, (buf, nbytes, ptr) in enumerate(args):
            blocking = CL_TRUE if i == len(args) - 1 else CL_FALSE
            _check(self._lib.clEnqueueReadBuffer(q, buf, blocking, 0, nbytes, ptr, 0, None, None),
                   "clEnqueueReadBuffer")
        if not args:
            _check(self._lib.clFinish(q), "clFinish")

    @staticmethod
    def open(gate: cl.UserEvent) -> None:
        """Let a gated step run without reading it (after a failure to enqueue it whole)."""
        gate.set_status(cl.command_execution_status.COMPLETE)


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with OpenCL status {status}")
