"""`hybridserve generate` as a user runs it: a real subprocess on the real model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _run(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "services.launcher.cli", "generate", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_generate_json(tokenizer):
    r = _run("--engine", "torch", "--chat", "What is the capital of France?", "--temperature", "0",
             "--max-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"text", "token_ids", "finish_reason", "timings"}
    assert "Paris" in out["text"]
    assert out["text"] == tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    assert out["finish_reason"] in ("stop", "length")
    t = out["timings"]
    assert t["decode_tokens"] == len(out["token_ids"]) - 1 and t["prefill_s"] > 0


def test_bad_model_path_is_a_clear_error(tmp_path):
    r = _run("--model", str(tmp_path / "missing.gguf"), "--prompt", "hi")
    assert r.returncode == 2
    assert "does not exist" in r.stderr and "Traceback" not in r.stderr
