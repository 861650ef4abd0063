"""A one-launch step's gate (services/decode_fpga/step_gate.py): opened and read through the OpenCL library
pyopencl loaded, with the GIL let go; the kernel behind it runs only once it opens; the reads are the
kernel's output, the same as pyopencl's; another Python thread runs while the step does."""
from __future__ import annotations

import threading
import time

import numpy as np
import pyopencl as cl
import pytest

from services.decode_fpga.step_gate import Read, StepGate

MF = cl.mem_flags

SOURCE = """
__kernel void fill(__global int *out, __global int *flag, const int spins)
{
    const int i = get_global_id(0);
    int v = i;
    for (int s = 0; s < spins; ++s) v = v * 1103515245 + 12345;  // a kernel that takes a while
    out[i] = 3 * i;
    if (i == 0) {
        flag[0] = spins + 1;
        flag[1] = v;  // the loop's result is kept, so the loop is
    }
}
"""


@pytest.fixture(scope="module")
def program(cl_dev):
    return cl.Program(cl_dev.context, SOURCE).build()


def gated_fill(dev, program, n: int, spins: int):
    """`fill` enqueued behind a fresh gate: (gate, kernel event, out buffer, flag buffer)."""
    out = cl.Buffer(dev.context, MF.READ_WRITE, 4 * n)
    flag = cl.Buffer(dev.context, MF.READ_WRITE, 64)
    gate = cl.UserEvent(dev.context)
    event = program.fill(dev.queue, (n,), None, out, flag, np.int32(spins), wait_for=[gate])
    return gate, event, out, flag


def test_the_gate_is_opened_and_read_through_the_loaded_opencl_library():
    assert StepGate().releases_gil  # pyopencl's libOpenCL is among this process's mappings


@pytest.mark.parametrize("through_ctypes", [True, False])
def test_the_kernel_behind_the_gate_runs_once_it_opens_and_the_reads_are_its_output(cl_dev, program,
                                                                                    through_ctypes):
    gate_reader = StepGate()
    if not through_ctypes:
        gate_reader._lib = None  # pyopencl's calls, the fallback
    gate, event, out, flag = gated_fill(cl_dev, program, 1000, 10)
    time.sleep(0.05)
    assert event.command_execution_status != cl.command_execution_status.COMPLETE  # held by the gate
    host_out, host_flag = np.full(1000, -1, np.int32), np.zeros(1, np.int32)
    gate_reader.open_and_read(cl_dev.queue, gate, [Read(host_flag, flag), Read(host_out, out)])
    assert event.command_execution_status == cl.command_execution_status.COMPLETE
    assert host_flag[0] == 11
    np.testing.assert_array_equal(host_out, 3 * np.arange(1000, dtype=np.int32))


def test_a_step_with_nothing_to_read_is_waited_for(cl_dev, program):
    gate, event, _out, _flag = gated_fill(cl_dev, program, 64, 10)
    StepGate().open_and_read(cl_dev.queue, gate, [])
    assert event.command_execution_status == cl.command_execution_status.COMPLETE


def test_another_python_thread_runs_while_the_gated_step_does(cl_dev, program):
    """The thread waiting for the step holds no GIL: a counting thread keeps counting all along."""
    gate, event, out, flag = gated_fill(cl_dev, program, 2, 150_000_000)  # ~0.15-1 s of a core
    counts, stop = [], threading.Event()

    def count():
        n = 0
        while not stop.is_set():
            n += 1
            if n % 1000 == 0:
                counts.append(time.perf_counter())

    counter = threading.Thread(target=count)
    counter.start()
    try:
        time.sleep(0.02)
        start = time.perf_counter()
        host_flag = np.zeros(1, np.int32)
        StepGate().open_and_read(cl_dev.queue, gate, [Read(host_flag, flag)])
        end = time.perf_counter()
    finally:
        stop.set()
        counter.join()
    assert host_flag[0] == 150_000_001
    during = [t for t in counts if start <= t <= end]
    assert end - start > 0.05, "the kernel ran too briefly to tell"
    # the counter's largest pause while the step ran: the switch interval (5 ms) and scheduling, not the step
    pauses = np.diff([start, *during, end])
    assert len(during) > 10 and pauses.max() < 0.5 * (end - start), (len(during), pauses.max(), end - start)
