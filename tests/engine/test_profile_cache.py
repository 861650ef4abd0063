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


def test_a_kept_busy_sweep_serves_while_busy_is_never_quiet_and_a_quiet_sweep_replaces_it(tmp_path):
    from services.engine.profile_sweep import MAX_SPREAD, Sweep

    def sweep(seconds: float, busy: bool) -> Sweep:
        s = Sweep([{"stage": "prefill", "device": "gpu", "n_in": 16, "seconds": seconds}])
        s.spread = MAX_SPREAD * 2 if busy else 0.0
        return s

    runs = []

    def run(seconds, busy):
        return lambda: runs.append(seconds) or sweep(seconds, busy)

    # without keep_busy (the default) a busy sweep leaves nothing behind
    assert cached_sweep(str(tmp_path), "k", run(0.3, True), attempts=1).quiet is False
    assert not list(tmp_path.glob("*.json"))
    # with it, the least noisy one is kept apart, and served while a probe finds the machine busy
    first = cached_sweep(str(tmp_path), "k", run(0.2, True), attempts=1, keep_busy=True)
    assert first.quiet is False and [p.name for p in tmp_path.glob("*.json")] == ["k.busy.json"]
    again = cached_sweep(str(tmp_path), "k", run(0.9, True), probe=lambda cached: "busy", attempts=1,
                         keep_busy=True)
    assert again == first and again.quiet is False and runs == [0.3, 0.2]
    # it is never read as the quiet cache, nor without keep_busy
    assert cached_sweep(str(tmp_path), "k", run(0.4, True), probe=lambda cached: "agrees",
                        attempts=1).quiet is False and runs[-1] == 0.4
    # once a probe can tell (here: a quiet machine agreeing), a sweep replaces it; quiet, it is the cache
    replaced = cached_sweep(str(tmp_path), "k", run(0.1, False), probe=lambda cached: "agrees", attempts=1,
                            keep_busy=True)
    assert replaced.quiet is True and replaced[0]["seconds"] == 0.1
    assert [p.name for p in tmp_path.glob("*.json")] == ["k.json"]
    assert json.loads((tmp_path / "k.json").read_text()) == list(replaced)
