"""The PyTorch engine on CUDA: parity with transformers on the same GPU, and timings.

Runs where a CUDA device is present (a lent GPU machine). The default GGUF is
used when installed; otherwise a checkpoint of the same shape with random weights
is written as safetensors (the GPU machine cannot receive the 98 MB file), which
still exercises every kernel path of the engine at the real sizes.

    python bench/cuda_check.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.model.loading import load_model  # noqa: E402
from services.prefill_gpu.engine import TorchEngine  # noqa: E402


def smollm2_shaped_checkpoint(directory: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(directory, safe_serialization=True)
    return directory


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    from transformers import AutoModelForCausalLM

    tmp = tempfile.mkdtemp()
    try:
        loaded = load_model()
        ref_path = loaded.checkpoint.path
        ref = AutoModelForCausalLM.from_pretrained(str(ref_path.parent), gguf_file=ref_path.name, dtype=torch.float32)
    except Exception as exc:  # the default package is not installed there
        print(f"default model unavailable ({type(exc).__name__}); using a SmolLM2-shaped random checkpoint")
        path = smollm2_shaped_checkpoint(Path(tmp))
        loaded = load_model(str(path))
        ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ref = ref.cuda().eval()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "parity": {}, "timings": {}}
    rng = np.random.default_rng(0)
    for dtype in ("fp32", "bf16"):
        eng = TorchEngine(loaded.config, loaded.weights, device="cuda", dtype=dtype)
        ref_d = ref.to(eng.model.dtype)
        for n in (1, 17, 128, 512):
            ids = rng.integers(3, loaded.config.vocab_size, n).tolist()
            seq = eng.new_sequence(n + 17)
            ours = eng.prefill(seq, ids)
            with torch.no_grad():
                out = ref_d(torch.tensor([ids], device="cuda"), use_cache=True)
            theirs = out.logits[0, -1].float().cpu().numpy()
            errs = [float(np.abs(ours - theirs).max())]
            same = [int(np.argmax(ours)) == int(np.argmax(theirs))]
            past = out.past_key_values
            for _ in range(16):
                tok = int(np.argmax(theirs))
                ours = eng.decode([seq], [tok])[0]
                with torch.no_grad():
                    out = ref_d(torch.tensor([[tok]], device="cuda"), past_key_values=past, use_cache=True)
                past = out.past_key_values
                theirs = out.logits[0, -1].float().cpu().numpy()
                errs.append(float(np.abs(ours - theirs).max()))
                same.append(int(np.argmax(ours)) == int(np.argmax(theirs)))
            report["parity"][f"{dtype}/n={n}"] = {"max_abs_logit_err": max(errs), "argmax_agree": sum(same) / len(same)}
            print(f"{dtype} n={n:4d}: max |logit diff| {max(errs):.2e}, argmax agree {sum(same)}/{len(same)}")
        for n in (64, 256, 512, 1024):
            ids = rng.integers(3, loaded.config.vocab_size, n).tolist()
            ts = timed(lambda: eng.prefill(eng.new_sequence(n + 1), ids), 7)[2:]
            report["timings"][f"{dtype}/prefill/{n}"] = statistics.median(ts)
            print(f"{dtype} prefill {n:5d} tokens: {statistics.median(ts) * 1e3:7.2f} ms  ({n / statistics.median(ts):9.0f} tok/s)")
        for batch in (1, 4, 16):
            seqs = [eng.new_sequence(300) for _ in range(batch)]
            for i, s in enumerate(seqs):
                eng.prefill(s, rng.integers(3, 1000, 20 + 7 * i).tolist())
            toks = [5] * batch
            ts = timed(lambda: eng.decode_greedy(seqs, toks), 40)[5:]
            report["timings"][f"{dtype}/decode/b{batch}"] = statistics.median(ts)
            print(f"{dtype} decode batch {batch:2d}: {statistics.median(ts) * 1e3:6.2f} ms/step")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "cuda_check.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
