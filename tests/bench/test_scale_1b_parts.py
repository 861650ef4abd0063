"""bench/micro/scale_1b.py's llama.cpp side without a build: a crashed llama-batched-bench is reported with
its signal by name (the native build's AMX faulted on this project's VMs as SIGILL, first seen as a bare
"failed (-4)")."""
from __future__ import annotations

import stat

import pytest

from bench.micro import scale_1b


def fake_bench(tmp_path, body: str):
    exe = tmp_path / "llama-batched-bench"
    exe.write_text(f"#!/bin/sh\necho 'some log line' >&2\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_a_bench_killed_by_sigill_is_named_with_the_amx_hint(tmp_path):
    exe = fake_bench(tmp_path, "kill -ILL $$")
    with pytest.raises(RuntimeError, match=r"killed by SIGILL.*-mno-amx-tile") as err:
        scale_1b.llama_steps(exe, tmp_path / "m.gguf", context=16, steps=4, batches=(1,))
    assert "some log line" in str(err.value)


def test_a_plain_failure_keeps_its_exit_status(tmp_path):
    exe = fake_bench(tmp_path, "exit 3")
    with pytest.raises(RuntimeError, match=r"exit status 3"):
        scale_1b.llama_steps(exe, tmp_path / "m.gguf", context=16, steps=4, batches=(1,))


def test_the_steps_are_read_from_its_jsonl(tmp_path):
    exe = fake_bench(tmp_path, """echo '{"pl": 1, "tg": 4, "t_tg": 0.2}'\necho '{"pl": 8, "tg": 4, "t_tg": 0.8}'""")
    assert scale_1b.llama_steps(exe, tmp_path / "m.gguf", context=16, steps=4, batches=(1, 8)) == {1: 0.05, 8: 0.2}
