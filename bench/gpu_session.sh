#!/usr/bin/env bash
# Everything the CUDA measurement needs, in one call on a lent GPU machine (it is lent for minutes).
#
# Prepare here, once (the GPU machine reaches no package index and cannot receive the 98 MB GGUF):
#   .gpu/whl/        wheels of what its image lacks (fastapi, pydantic(-settings), uvicorn, gguf,
#                    pyopencl, grpcio(-health-checking, -reflection), protobuf, llguidance and their
#                    small deps),
#                    for CPython 3.12: `pip download --no-deps --only-binary=:all: --python-version 3.12 ...`
#   .gpu/tokenizer/  the default model's tokenizer (`load_tokenizer(...).save_pretrained(...)`)
# Then run it there from the repo root with .gpu carried: `bash bench/gpu_session.sh` (OUT names
# where results go; default bench/results). Steps, most wanted first: bench/gpu_engine.py (engine
# parity and step timings against transformers), the `cuda` tests, bench/serve.py over the whole
# stack at 1, 8 and 64 clients in every mode, bench/gpu_compile.py (a torch.compile probe). The model is a SmolLM2-shaped checkpoint with random weights and the
# real tokenizer.
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi -L
python3 -c "import pyopencl as cl; print([(p.name, [d.name for d in p.get_devices()]) for p in cl.get_platforms()])"
MODEL=/tmp/smollm2-shaped
python3 - "$MODEL" <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "bench")
from cuda_check import smollm2_shaped_checkpoint
smollm2_shaped_checkpoint(Path(sys.argv[1]))
EOF
cp .gpu/tokenizer/* "$MODEL"/
export HYBRIDSERVE_MODEL=$MODEL
STEPS=" ${STEPS:-engine test serve compile} "  # a rerun can do some: STEPS=serve
# the engine's figures first: if the lease runs out, the later steps are the ones lost
[[ $STEPS == *" engine "* ]] && timeout "${ENGINE_S:-170}" python3 bench/gpu_engine.py --out "$OUT" 2>&1 | tee "$OUT/gpu_engine.log"
[[ $STEPS == *" test "* ]] && TEST_CHECKPOINT=$MODEL timeout "${TEST_S:-70}" python3 -m pytest -q -p no:cacheprovider -m cuda tests/prefill_gpu 2>&1 | tail -15 | tee "$OUT/gpu_pytest.log"
[[ $STEPS == *" serve "* ]] && timeout "${SERVE_S:-240}" python3 bench/serve.py --start-stack --concurrency 1,8,64 --rounds 1 \
  --output-range 32,96 --no-long-prompts --name serve_gpu --out "$OUT" 2>&1 | tail -60 | tee "$OUT/serve_gpu.log"
[[ $STEPS == *" compile "* ]] && timeout "${COMPILE_S:-90}" python3 bench/gpu_compile.py --out "$OUT" 2>&1 | tail -40 | tee "$OUT/gpu_compile.log"
true
