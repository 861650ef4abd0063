"""RoPE's inverse frequencies kept on disk (services/model/rope_cache.py): torch's values bit for bit,
one entry per everything they depend on, a damaged entry replaced, and a process that finds them
cached (decode_fpga's start) never imports torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from services.model.architecture import RopeScaling, rope_inv_freq
from services.model.rope_cache import cached_inv_freq

ROOT = Path(__file__).resolve().parents[2]
LLAMA3 = RopeScaling("llama3", 8.0, 1.0, 4.0, 64)


def test_the_cached_values_are_torchs_and_each_input_has_its_own_entry(tmp_path):
    cases = [(10000.0, 64, RopeScaling(), None), (500000.0, 64, RopeScaling(), None), (10000.0, 32, RopeScaling(), None),
             (10000.0, 64, LLAMA3, None), (10000.0, 64, RopeScaling("linear", 2.0), None),
             (10000.0, 64, RopeScaling(), np.linspace(1, 4, 32, dtype=np.float32))]
    for theta, dim, scaling, factors in cases:
        want = rope_inv_freq(theta, dim, scaling, factors)
        first = cached_inv_freq(theta, dim, scaling, factors, cache_dir=str(tmp_path))
        again = cached_inv_freq(theta, dim, scaling, factors, cache_dir=str(tmp_path))
        assert first.dtype == again.dtype == np.float32
        np.testing.assert_array_equal(first, want)
        np.testing.assert_array_equal(again, want)
    assert len(list(tmp_path.glob("*.npy"))) == len(cases)
    assert not list(tmp_path.glob("*.tmp"))


def test_a_damaged_or_misshapen_entry_is_computed_again_and_replaced(tmp_path):
    want = rope_inv_freq(10000.0, 64)
    cached_inv_freq(10000.0, 64, cache_dir=str(tmp_path))
    (entry,) = tmp_path.glob("*.npy")
    for damage in (b"not a numpy file", None):
        if damage is None:
            np.save(entry, np.zeros(7, np.float32))  # readable, the wrong shape
        else:
            entry.write_bytes(damage)
        np.testing.assert_array_equal(cached_inv_freq(10000.0, 64, cache_dir=str(tmp_path)), want)
        np.testing.assert_array_equal(np.load(entry), want)


def test_a_cache_that_cannot_be_written_only_costs_the_computation(tmp_path):
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    np.testing.assert_array_equal(cached_inv_freq(10000.0, 64, cache_dir=str(blocked / "rope")),
                                  rope_inv_freq(10000.0, 64))
    np.testing.assert_array_equal(cached_inv_freq(10000.0, 64, cache_dir=None), rope_inv_freq(10000.0, 64))


SCRIPT = r"""
import json, sys
import numpy as np
from services.model.loading import load_model
cfg = load_model(None).config
print(json.dumps({"inv_freq": cfg.inv_freq().tolist(), "torch": "torch" in sys.modules}))
"""


def test_a_process_that_finds_the_default_models_frequencies_cached_never_imports_torch(tmp_path):
    """decode_fpga's path: the model's config read, its frequencies asked for. The first process
    computes them (importing torch); the next reads them. HOME is the test's: the cache is ~/.cache's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}

    def run() -> dict:
        r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["torch"] and not second["torch"]
    assert second["inv_freq"] == first["inv_freq"] and len(first["inv_freq"]) == 32
    assert len(list((tmp_path / ".cache/hybridserve/rope").glob("*.npy"))) == 1


def test_changed_frequency_code_is_never_answered_from_an_older_entry(tmp_path, monkeypatch):
    """The entry's name covers rope_inv_freq's source: a fix to it must not be hidden by the values an
    older version cached."""
    from services.model import rope_cache

    cached_inv_freq(10000.0, 64, cache_dir=str(tmp_path))

    def fixed_rope_inv_freq(theta, head_dim, scaling=RopeScaling(), freq_factors=None):
        return np.full(head_dim // 2, 0.5, np.float32)

    monkeypatch.setattr(rope_cache, "rope_inv_freq", fixed_rope_inv_freq)
    np.testing.assert_array_equal(cached_inv_freq(10000.0, 64, cache_dir=str(tmp_path)), np.full(32, 0.5, np.float32))
    assert len(list(tmp_path.glob("*.npy"))) == 2


def test_without_the_codes_source_nothing_is_cached(tmp_path, monkeypatch):
    from services.model import rope_cache

    def no_source(_):
        raise OSError("could not get source code")

    monkeypatch.setattr(rope_cache.inspect, "getsource", no_source)
    np.testing.assert_array_equal(cached_inv_freq(10000.0, 64, cache_dir=str(tmp_path)), rope_inv_freq(10000.0, 64))
    assert not list(tmp_path.iterdir())
