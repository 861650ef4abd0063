"""The engines' start-up profile cache: reused while nothing changed, rerun when the code changes."""
import json

from services.engine.profile_sweep import cached_sweep, code_fingerprint


def test_sweep_runs_once_then_comes_from_the_cache(tmp_path):
    calls = []

    def run():
        calls.append(1)
        return [{"stage": "decode", "seconds": 0.01}]

    first = cached_sweep(str(tmp_path), "m-opencl-dev/x", run)
    second = cached_sweep(str(tmp_path), "m-opencl-dev/x", run)
    assert first == second and len(calls) == 1
    (only,) = tmp_path.glob("*.json")  # "/" in the key does not make a directory
    only.write_text("{not json")
    assert cached_sweep(str(tmp_path), "m-opencl-dev/x", run) == first and len(calls) == 2
    assert json.loads(only.read_text()) == first


def test_fingerprint_follows_kernels_and_code_only(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "engine.py").write_text("x = 1\n")
    (tmp_path / "kernels" / "gemv.cl").write_text("__kernel void k() {}\n")
    before = code_fingerprint(tmp_path)
    assert before == code_fingerprint(tmp_path) and len(before) == 12
    (tmp_path / "notes.txt").write_text("not code")
    assert code_fingerprint(tmp_path) == before
    (tmp_path / "kernels" / "gemv.cl").write_text("__kernel void k() { }\n")
    assert code_fingerprint(tmp_path) != before
