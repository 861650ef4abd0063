"""PoCL builds each kernel's work-group function once: a paged step at a row count the engine has not run
before builds no kernel code, and a GEMV kernel builds one whatever the shapes of the matrices it runs on.

PoCL compiles a kernel's work-group function once per local size; given none, it derives one from the
global size, so every new row count (a chunk of a new length, a new batch size) compiled the step's
row kernels again on its first run (~0.1 s each, a stall of every stream in the step), and every matrix
shape its GEMV kernels (0.5-1.5 s each, at an engine's first start). Checked in a process of its own
with an empty PoCL cache (PoCL reads POCL_CACHE_DIR once, at start): the cache's work-group functions
are counted after steps of some row counts and again after steps of others."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from pathlib import Path
from services.decode_fpga.config import EngineConfig
from services.decode_fpga.device import select_device
from services.decode_fpga.engine import OpenCLEngine
from services.engine.scheduler import ScheduledChunk
from services.model.gguf_blocks import read_block_tensors
from services.model.loading import load_model

cache = Path(sys.argv[1])
model = load_model(None)
dev = select_device()
if "Portable Computing Language" not in dev.device.platform.name:
    print(json.dumps({"skip": dev.device.platform.name}))
    sys.exit(0)
engine = OpenCLEngine.create(model.config, model.weights, dev,
                             EngineConfig(weights_dtype="gguf", max_context=256, kv_cache_mb=16),
                             read_block_tensors(model.checkpoint, model.config))
tables = [list(range(4 * i, 4 * i + 4)) for i in range(3)]  # 64 tokens each


def steps(lengths):
    # a chunk alone; a decode beside a chunk; two decodes around a chunk that samples nothing: spans
    # of rows that start at row 0 and past it (a global offset), as the scheduler makes them
    for n in lengths:
        engine.step([ScheduledChunk(0, 0, tuple(range(5, 5 + n)), tuple(tables[0]), True, None)], greedy=True)
        engine.step([ScheduledChunk(0, n, (7,), tuple(tables[0]), True, None),
                     ScheduledChunk(1, 0, tuple(range(9, 9 + n)), tuple(tables[1]), True, None)], greedy=True)
        engine.step([ScheduledChunk(1, n, (7,), tuple(tables[1]), True, None),
                     ScheduledChunk(2, 0, tuple(range(3, 3 + n)), tuple(tables[2]), False, None),
                     ScheduledChunk(0, n + 1, (8,), tuple(tables[0]), True, None)], greedy=True)


def built():
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*.so"))


steps([3, 30])  # both GEMV kernels of a step (one output row a work-item up to tile_above rows, tiles past)
before = built()
steps([11, 23, 41])
print(json.dumps({"before": before, "after": built()}))
"""


GEMV_KERNELS = ("gemv", "gemv_rows", "gemv_quant", "gemv_quant_rows", "gemv_quant_tiles", "gemv_quant_tiles1")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The cache's work-group functions (program/kernel/local size/file) before and after the new row counts."""
    cache = tmp_path_factory.mktemp("pocl")
    env = {**os.environ, "POCL_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(cache)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"not PoCL ({out['skip']}): its cache is what is counted")
    assert out["before"], "PoCL's cache is not where POCL_CACHE_DIR says: nothing was counted"
    return out


@pytest.mark.slow
def test_steps_of_new_row_counts_build_no_kernel_code(built):
    assert built["after"] == built["before"], sorted(set(built["after"]) - set(built["before"]))


@pytest.mark.slow
def test_a_gemv_kernel_builds_once_whatever_its_matrices_shapes(built):
    # the default model's matrices have 192, 576, 1536 and 49152 rows; a program is one weight format
    local_sizes: dict[tuple[str, str], set[str]] = {}
    for path in built["after"]:
        *program, kernel, local, _ = Path(path).parts
        local_sizes.setdefault(("/".join(program), kernel), set()).add(local)
    gemvs = {key: sizes for key, sizes in local_sizes.items() if key[1] in GEMV_KERNELS}
    assert {kernel for _, kernel in gemvs} >= {"gemv_quant_tiles", "gemv_quant_tiles1"}, sorted(local_sizes)
    assert all(len(sizes) == 1 for sizes in gemvs.values()), gemvs
