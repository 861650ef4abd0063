"""The PM QoS wake-latency request a CPU OpenCL device's engine holds while it works (cpu_wake.py),
read back from the kernel's own /dev/cpu_dma_latency."""
from __future__ import annotations

import logging
import os
import struct
import time
from pathlib import Path

import pytest

from services.decode_fpga.cpu_wake import PM_QOS_DEVICE, CpuWakeLatency
from tests.engine.step_calls import chunk


def current_limit() -> int:
    """The machine's current wake-latency limit in µs: the smallest request any process holds."""
    with open(PM_QOS_DEVICE, "rb") as f:
        return struct.unpack("i", f.read(4))[0]


def holders() -> set[int]:
    """The processes that hold a request open now (the kernel keeps one per open file)."""
    pids = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == PM_QOS_DEVICE:
                pids.add(int(fd.parts[2]))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def let_go(pm_qos: int | None) -> bool:
    """This process holds no request now, and the machine's limit is back to `pm_qos` unless another
    process took one meanwhile (the stacks lane's decode engines hold theirs while they step). With
    `pm_qos` None (another process held 0 µs when the test began, so the free limit was not seen),
    a machine no one holds a request on is just not at 0."""
    now = holders()
    if os.getpid() in now:
        return False
    if now:
        return True
    return current_limit() != 0 if pm_qos is None else current_limit() == pm_qos


@pytest.fixture
def pm_qos() -> int | None:
    """The limit with no 0 µs request held (other engines of this session let theirs go 0.5 s after
    their last step), None if one is still held after 3 s (the stacks lane's engines stepping: the
    tests then check this process's own request, which is what they are about); skipped where the
    file cannot be written (not root)."""
    if not os.access(PM_QOS_DEVICE, os.R_OK | os.W_OK):
        pytest.skip(f"{PM_QOS_DEVICE} is not writable here (needs root)")
    deadline = time.monotonic() + 3
    while current_limit() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    limit = current_limit()
    return None if limit == 0 else limit


def test_held_while_touched_then_let_go(pm_qos):
    wake = CpuWakeLatency(release_after_s=0.3)
    wake.touch()
    assert wake.held and current_limit() == 0 and os.getpid() in holders()
    for _ in range(6):  # touched every 0.1 s for 0.6 s: longer than release_after_s, still held
        time.sleep(0.1)
        wake.touch()
        assert current_limit() == 0
    deadline = time.monotonic() + 3
    while wake.held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not wake.held and let_go(pm_qos)


def test_release_withdraws_the_request_at_once(pm_qos):
    wake = CpuWakeLatency(release_after_s=60)
    wake.touch()
    assert current_limit() == 0
    wake.release()
    assert not wake.held and let_go(pm_qos)


def test_without_the_device_file_the_engine_goes_on_and_says_why_once(tmp_path, caplog):
    wake = CpuWakeLatency(path=str(tmp_path / "no" / "cpu_dma_latency"))
    with caplog.at_level(logging.WARNING, logger="services.decode_fpga.cpu_wake"):
        wake.touch()
        wake.touch()
    assert not wake.held and "cpu_dma_latency" in wake.unavailable
    warnings = [r for r in caplog.records if "awake" in r.getMessage()]
    assert len(warnings) == 1 and "HYBRIDSERVE_DECODE_OPENCL_KEEP_CORES_AWAKE" in warnings[0].getMessage()


def test_a_decode_step_holds_it_on_a_cpu_device(ocl_gguf_engine, pm_qos):
    eng = ocl_gguf_engine
    assert isinstance(eng._wake, CpuWakeLatency)  # PoCL's device is a CPU
    # idle release after a minute, not half a second: a first step that builds its kernels can take
    # longer than that on a busy machine, and the request would be let go before the assert
    idle_s, eng._wake.release_after_s = eng._wake.release_after_s, 60.0
    try:
        tok = eng.step([chunk(0, 0, [1, 2, 3], [0])], greedy=True)[0]
        eng.step([chunk(0, 3, [tok], [0])], greedy=True)
        assert eng._wake.held and current_limit() == 0
    finally:
        eng._wake.release()
        eng._wake.release_after_s = idle_s
    assert let_go(pm_qos)


def test_setting(monkeypatch):
    from services.decode_fpga.settings import DecodeSettings

    assert DecodeSettings().opencl_keep_cores_awake is True
    monkeypatch.setenv("HYBRIDSERVE_DECODE_OPENCL_KEEP_CORES_AWAKE", "false")
    assert DecodeSettings().opencl_keep_cores_awake is False
