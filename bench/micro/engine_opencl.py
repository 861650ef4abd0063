"""The OpenCL engine: each kernel's achieved GB/s, and whole decode steps against memory bandwidth.

Side by side in one run, interleaved round by round: OpenCL decode with fp32,
fp16 and gguf (the checkpoint's blocks) weights at batch 1 and 8, gguf at batch
1 launch by launch (`gguf-launches`: no one-launch layers, cores free to halt),
the torch engine, transformers and llama.cpp (same GGUF file, same threads; installed by
`pip install '.[llamacpp]'`, which builds it from PyPI) at batch 1. Also how
often fp16 and gguf greedy tokens differ from fp32 over 256 tokens.

    python -m bench.micro.engine_opencl [--rounds N] [--quick]
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench._common import RESULTS, memory_bandwidth_gbs, progress, stats, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pyopencl as cl  # noqa: E402

MF = cl.mem_flags


def time_enqueued(dev, enqueue, reps: int) -> float:
    enqueue()
    dev.queue.finish()
    t = time.perf_counter()
    for _ in range(reps):
        enqueue()
    dev.queue.finish()
    return (time.perf_counter() - t) / reps


def block_kernel_lines(dev, cfg, blocks) -> list[dict]:
    """GEMV straight from the checkpoint's GGUF blocks (the real tensors, all 30 layers)."""
    from services.decode_fpga.device_weights import gguf_layer_tensors, gguf_lm_head_tensor
    from services.decode_fpga.quant_gemv import upload_block_matrix

    layers = [gguf_layer_tensors(blocks, i) for i in range(cfg.n_layers)]  # as the engine assembles them
    groups = {"qkv": [ts["qkv"] for ts in layers], "gate_up": [ts["gate_up"] for ts in layers],
              "down": [ts["down"] for ts in layers], "lm_head": [gguf_lm_head_tensor(blocks)]}
    x = cl.Buffer(dev.context, MF.READ_WRITE, 8 * cfg.intermediate * 4)
    xs = cl.Buffer(dev.context, MF.READ_WRITE, 8 * cfg.intermediate // 32 * 4)  # x's block sums (Q4_1 reads them)
    y = cl.Buffer(dev.context, MF.READ_WRITE, 8 * cfg.vocab_size * 4)
    lines = []
    for name, ts in groups.items():
        mats = [upload_block_matrix(dev, t) for t in ts]
        for batch in (1, 8):
            launches = [m.bind_gemv(x, y, batch, x_sums=xs) for m in mats]
            s = time_enqueued(dev, lambda: [la.enqueue(dev.queue) for la in launches], 3) / len(mats)
            lines.append({"kernel": f"gemv {mats[0].fmt} {name} {mats[0].rows}x{mats[0].cols}", "batch": batch,
                          "us": s * 1e6, "gbs": mats[0].nbytes / s / 1e9})
    return lines


def kernel_lines(dev, cfg) -> list[dict]:
    """One line per kernel: bytes it must move per launch / time per launch."""
    from services.decode_fpga.gemv import upload_dense_matrix
    from services.decode_fpga.launch import bind
    from services.decode_fpga.paged_attention import PagedAttention, PagedKVLayout

    rng = np.random.default_rng(0)
    buf = lambda n, dt=np.float32: cl.Buffer(dev.context, MF.READ_WRITE | MF.COPY_HOST_PTR,  # noqa: E731
                                            hostbuf=rng.normal(size=n).astype(dt))
    lines = []
    shapes = {"qkv": (cfg.q_dim + 2 * cfg.kv_dim, cfg.hidden), "gate_up": (2 * cfg.intermediate, cfg.hidden),
              "down": (cfg.hidden, cfg.intermediate), "lm_head": (cfg.vocab_size, cfg.hidden)}
    x, y = buf(8 * cfg.intermediate), buf(8 * cfg.vocab_size)
    for fmt in ("fp32", "fp16"):
        for name, shape in shapes.items():
            copies = 1 if name == "lm_head" else 30  # 30 layers' worth: out of the caches, as in a decode step
            mats = [upload_dense_matrix(dev, rng.normal(size=shape).astype(np.float32), fmt) for _ in range(copies)]
            for batch in (1, 8):
                launches = [m.bind_gemv(x, y, batch) for m in mats]
                s = time_enqueued(dev, lambda: [la.enqueue(dev.queue) for la in launches], 3) / copies
                lines.append({"kernel": f"gemv {fmt} {name} {shape[0]}x{shape[1]}", "batch": batch, "us": s * 1e6,
                              "gbs": mats[0].nbytes / s / 1e9})
            del mats
    hidden, ff = cfg.hidden, cfg.intermediate
    q = dev.queue
    nw, nx, no, sums = buf(hidden), buf(8 * hidden), buf(8 * hidden), buf(8 * ff // 32)
    la = bind(dev.build("norm.cl"), "rms_norm", (1,), nx, nw, no, sums, np.int32(hidden), np.float32(1e-5))
    s = time_enqueued(dev, lambda: la.enqueue(q), 200)
    lines.append({"kernel": "rms_norm", "batch": 1, "us": s * 1e6, "gbs": 3 * hidden * 4 / s / 1e9})
    elem = dev.build("elementwise.cl", {"ARGMAX_WG": 256})
    gu, act = buf(8 * 2 * ff), buf(8 * ff)
    la = bind(elem, "silu_mul", (1, ff // 32), gu, act, sums, np.int32(ff))
    s = time_enqueued(dev, lambda: la.enqueue(q), 200)
    lines.append({"kernel": "silu_mul", "batch": 1, "us": s * 1e6, "gbs": 3 * ff * 4 / s / 1e9})
    logits, out, nxt = buf(cfg.vocab_size), cl.Buffer(dev.context, MF.READ_WRITE, 64), buf(16, np.int32)
    la = bind(elem, "argmax_rows", (256,), logits, np.int32(cfg.vocab_size), out, nxt, local_size=(256,))
    s = time_enqueued(dev, lambda: la.enqueue(q), 100)
    lines.append({"kernel": "argmax_rows", "batch": 1, "us": s * 1e6, "gbs": cfg.vocab_size * 4 / s / 1e9})
    emb = upload_dense_matrix(dev, rng.normal(size=(4096, hidden)).astype(np.float32), "fp32")
    toks = cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.arange(8, dtype=np.int32))
    la = emb.bind_embed(toks, nx, 1)
    s = time_enqueued(dev, lambda: la.enqueue(q), 200)
    lines.append({"kernel": "embed_rows", "batch": 1, "us": s * 1e6, "gbs": 2 * hidden * 4 / s / 1e9})
    ctx, block = 512, 16
    group = cfg.n_heads // cfg.n_kv_heads
    # one sequence of ctx + 1 positions in a pool of one layer, its blocks in order (the kernels' cost
    # does not depend on where they lie)
    layout = PagedKVLayout(1, cfg.n_kv_heads, cfg.head_dim, block, -(-(ctx + 1) // block))
    pa = PagedAttention(dev, layout, cfg.n_heads)
    pool = buf(layout.layer_elems)
    tables = cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR,
                       hostbuf=np.arange(layout.num_blocks, dtype=np.int32))
    qkv = buf(cfg.q_dim + 2 * cfg.kv_dim)
    seq = cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.zeros(1, np.int32))
    pos = cl.Buffer(dev.context, MF.READ_ONLY | MF.COPY_HOST_PTR, hostbuf=np.full(1, ctx, np.int32))
    rope_cs = buf((ctx + 1) * cfg.head_dim)  # the engine's cos|sin table (values do not matter here)
    attn_out = buf(cfg.q_dim)
    la = pa.bind_rope_store(1, qkv, seq, pos, rope_cs, tables, layout.num_blocks, pool, 0)
    s = time_enqueued(dev, lambda: la.enqueue(q), 200)
    lines.append({"kernel": "paged_rope_store_kv", "batch": 1, "us": s * 1e6,
                  "gbs": cfg.n_kv_heads * 4 * cfg.head_dim * 4 / s / 1e9})
    # each query head reads K twice (max, then sum) and V once over ctx positions
    attn_bytes = cfg.n_heads * 3 * (ctx + 1) * cfg.head_dim * 4
    for name, scores in (("", False), ("_scores", True)):
        if scores and not pa.scores_fit(layout.num_blocks):
            continue
        la = pa.bind_attention(1, qkv, seq, pos, tables, layout.num_blocks, pool, 0, attn_out, sums, scores=scores)
        s = time_enqueued(dev, lambda: la.enqueue(q), 100)
        lines.append({"kernel": f"paged_attention{name} ctx {ctx}", "batch": 1, "us": s * 1e6,
                      "gbs": attn_bytes / s / 1e9})
        la = pa.bind_decode(1, qkv, seq, pos, rope_cs, tables, layout.num_blocks, pool, 0, attn_out, sums,
                            scores=scores)
        s = time_enqueued(dev, lambda: la.enqueue(q), 100)
        lines.append({"kernel": f"paged_rope_attention_decode{name} ctx {ctx}", "batch": 1, "us": s * 1e6,
                      "gbs": attn_bytes / s / 1e9})
    return lines


def decode_step_s(engine, batch: int, ctx: int, steps: int, rng) -> float:
    """Seconds a paged decode step of `batch` rows takes at a context of ctx (random KV imported into
    blocks: a step's cost does not depend on its values), the mean of `steps` greedy steps."""
    from bench.micro.paged_step import time_paged_wall

    return float(np.mean(time_paged_wall(engine, engine.cfg, batch, ctx, steps)))


def hf_step_s(model, ctx: int, steps: int, rng) -> float:
    import torch

    with torch.no_grad():
        out = model(torch.tensor([rng.integers(3, 4000, ctx).tolist()]), use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        t = time.perf_counter()
        for _ in range(steps):
            out = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - t) / steps


def llama_cpp_model(path: Path):
    """llama.cpp on the same GGUF file with this machine's threads, or None when it is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        progress("llama.cpp: not installed (pip install '.[llamacpp]' builds it); its line is left out")
        return None
    threads = os.cpu_count() or 1
    # logits_all: llama-cpp-python keeps a step's logits (llm.scores) only then; one 196 KB row per step
    return Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512,
                 logits_all=True, verbose=False)


def llama_step_s(llm, ctx: int, steps: int, rng) -> float:
    """Greedy decode ms/token of llama.cpp after a ctx-token prompt (the argmax of its last logits)."""
    llm.reset()
    llm.eval(rng.integers(3, 4000, ctx).tolist())
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t = time.perf_counter()
    for _ in range(steps):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return (time.perf_counter() - t) / steps


def divergence(a, b, prompt, n: int) -> dict:
    from services.engine.one_request import greedy_tokens

    ta, tb = greedy_tokens(a, prompt, n), greedy_tokens(b, prompt, n)
    first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    return {"tokens": n, "first_difference": first, "differing_fraction": float(np.mean(np.array(ta) != np.array(tb)))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    rounds, steps, ctx = (2, 8, 64) if args.quick else (args.rounds, 24, 64)

    from services.decode_fpga.config import EngineConfig
    from services.decode_fpga.device import select_device
    from services.decode_fpga.engine import OpenCLEngine
    from services.model.loading import load_model
    from services.model.reference import load_reference
    from services.engine.batching_settings import BatchingSettings
    from services.prefill_gpu.engine import TorchEngine

    loaded = load_model()
    cfg = loaded.config
    dev = select_device()
    progress(f"kernels on {dev.name}")
    kernels = kernel_lines(dev, cfg)
    from services.model.gguf_blocks import read_block_tensors

    blocks = read_block_tensors(loaded.checkpoint, cfg)
    kernels += block_kernel_lines(dev, cfg, blocks)
    progress("building the engines (fp32, fp16), the torch engine and transformers")
    engines = {f: OpenCLEngine.create(cfg, loaded.weights, dev, EngineConfig(f, max_context=1024, kv_cache_mb=64),
                                      blocks) for f in ("fp32", "fp16", "gguf")}
    # the same gguf step launch by launch, without the engine's CPU-device measures: what the one-launch
    # layers (decode_layers.cl) and holding the cores awake (cpu_wake.py) are worth, side by side
    launches = OpenCLEngine.create(cfg, loaded.weights, dev, EngineConfig(
        "gguf", max_context=1024, kv_cache_mb=64, layer_kernels=False, keep_cores_awake=False), blocks)
    torch_engine = TorchEngine(cfg, loaded.weights, device="cpu", batching=BatchingSettings(kv_cache_mb=64))
    ck = loaded.checkpoint
    hf = load_reference(ck)
    llm = llama_cpp_model(ck.path)
    bandwidth = []
    runs: dict[str, list[float]] = {}
    rng = np.random.default_rng(1)
    for r in range(rounds):
        progress(f"decode round {r + 1}/{rounds}")
        bandwidth.append(memory_bandwidth_gbs())
        for f, eng in engines.items():
            for batch in (1, 8):
                runs.setdefault(f"opencl {f} b{batch}", []).append(decode_step_s(eng, batch, ctx, steps, rng))
        runs.setdefault("opencl gguf-launches b1", []).append(decode_step_s(launches, 1, ctx, steps, rng))
        runs.setdefault("torch engine b1", []).append(decode_step_s(torch_engine, 1, ctx, steps, rng))
        runs.setdefault("transformers b1", []).append(hf_step_s(hf, ctx, steps, rng))
        if llm is not None:
            runs.setdefault("llama.cpp b1", []).append(llama_step_s(llm, ctx, steps, rng))
    kv_bytes_per_token = cfg.n_layers * 2 * cfg.kv_dim * 4  # fp32 KV, read for every cached position
    matrices = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    file_block_bytes = (sum(blocks[f"blk.{i}.{m}.weight"].raw.nbytes for i in range(cfg.n_layers) for m in matrices)
                        + blocks.get("output.weight", blocks["token_embd.weight"]).raw.nbytes)
    rows, decode = [], {}
    bw = float(np.median(bandwidth))
    for name, ts in runs.items():
        st = stats(ts)
        batch = int(name.rsplit("b", 1)[1])
        if name.startswith("llama"):  # the file's blocks as they are (ours widen the scales to fp32)
            weights = file_block_bytes
        else:
            weights = engines[name.split()[1].split("-")[0] if name.startswith("opencl") else "fp32"].weights_nbytes
        bytes_step = weights + batch * (ctx + steps / 2) * kv_bytes_per_token
        gbs = bytes_step / st["median"] / 1e9
        decode[name] = {**{k + "_s": v for k, v in st.items() if k != "n"}, "rounds": st["n"], "bytes_per_step": bytes_step,
                        "gbs": gbs, "tokens_per_s": batch / st["median"]}
        rows.append([name, f"{st['median'] * 1e3:.2f}", f"{st['min'] * 1e3:.2f}-{st['max'] * 1e3:.2f}",
                     f"{batch / st['median']:.1f}", f"{gbs:.1f}", f"{100 * gbs / bw:.0f}%"])
    progress("fp16 and gguf vs fp32 greedy divergence over 256 tokens")
    prompt = rng.integers(3, 4000, 32).tolist()
    n_div = 256 if not args.quick else 64
    div = divergence(engines["fp16"], engines["fp32"], prompt, n_div)
    div_gguf = divergence(engines["gguf"], engines["fp32"], prompt, n_div)
    print(table(["kernel", "batch", "us/launch", "GB/s"],
                [[k["kernel"], k["batch"], f"{k['us']:.1f}", f"{k['gbs']:.1f}"] for k in kernels]))
    print()
    print(table(["decode step", "ms (median)", "ms min-max", "tokens/s", "GB/s", "of memory bw"], rows))
    print(f"memory bandwidth (numpy copy, read+write, median of {rounds}): {bw:.1f} GB/s; context {ctx} tokens; "
          f"{rounds} interleaved rounds of {steps} steps")
    versus = None
    if "llama.cpp b1" in runs:  # round by round: the machine's speed drifts over minutes
        ours, theirs = np.array(runs["opencl gguf b1"]), np.array(runs["llama.cpp b1"])
        versus = {"rounds": len(ours), "gguf_faster_rounds": int((ours < theirs).sum()),
                  "ratio_median": float(np.median(theirs / ours))}
        print(f"opencl gguf b1 vs llama.cpp b1: faster in {versus['gguf_faster_rounds']}/{versus['rounds']} rounds, "
              f"llama.cpp/ours time ratio median {versus['ratio_median']:.2f}")
    for name, d in (("fp16", div), ("gguf", div_gguf)):
        print(f"{name} vs fp32 greedy: first difference at token {d['first_difference']}, "
              f"{100 * d['differing_fraction']:.1f}% of {d['tokens']} tokens differ")
    write_json("engine_opencl", {"device": dev.name, "memory_bandwidth_gbs": bandwidth, "kernels": kernels,
                                 "decode": decode, "fp16_divergence": div, "gguf_divergence": div_gguf, "context": ctx, "steps": steps,
                                 "gguf_vs_llama_cpp": versus},
               out_dir=Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
