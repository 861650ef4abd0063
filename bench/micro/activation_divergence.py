"""What the opt-in int8 activations (HYBRIDSERVE_DECODE_ACTIVATIONS=int8) cost in fidelity and buy in
speed, against the exact fp32 path on the same GGUF file, in one process.

Divergence, as llama.cpp's `llama-perplexity --kl-divergence` measures a quantization against its
base: a text of 2,000+ tokens (bench/data/public_domain_us.txt: the Declaration of Independence, the
Gettysburg Address and Lincoln's second inaugural, public domain) teacher-forced through both engines
in windows of --ctx tokens (each from an empty context, --chunk rows a paged step, every row's
logits), and per predicted position: KL(exact || int8) of the next-token distributions, whether both
rank the same token first, and each path's log-likelihood of the text's next token. Reported: mean,
median, 99th percentile and max KL, the same-top-1 share, perplexity both ways.

Speed: greedy paged decode steps at a context of --context tokens (random KV imported, as
bench/micro/paged_step.py), batch 1 and 8, the engines in turn round by round: `fp32` (the default:
at batch 1 the one-launch step when the engine's choice takes it), `fp32-LbL` (launch by launch, as
int8 always runs) and `int8`. Wall and process CPU ms per step, medians; the load average beside.

With --only NAMES (comma-separated substrings of GGUF tensor names, e.g. attn_q,ffn_down,token_embd)
the divergence is measured again for each, int8 on the matrices so named alone: which inputs cost what.
With --k-blocks 32,64 it is measured again for each, the K-quant matrices on x quantized per that many
values (int8_gemv.K_X_BLOCK; 32 is the kernel before per-256; other formats are per 32 either way), for
int8 everywhere and on each --only name: what the K-quants' x block costs.

    python -m bench.micro.activation_divergence [--model PATH.gguf] [--ctx 512] [--chunk 64]
        [--rounds 5] [--steps 12] [--context 128] [--skip-speed | --skip-divergence] [--only NAMES]
        [--k-blocks 32,64]
        [--name activation_divergence]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import time
from pathlib import Path

from bench._common import progress, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "data" / "public_domain_us.txt"


def build_engines(model: str | None, speed: bool, max_batch: int, context: int):
    """The model, its tokenizer and {path name: engine}, every engine on the file's own blocks."""
    from services.decode_fpga.config import EngineConfig
    from services.decode_fpga.device import select_device
    from services.decode_fpga.engine import OpenCLEngine
    from services.model.gguf_blocks import read_block_tensors
    from services.model.loading import load_model
    from services.model.tokenizer import load_tokenizer

    loaded = load_model(model) if model else load_model()
    cfg = loaded.config
    blocks = read_block_tensors(loaded.checkpoint, cfg)
    per_seq = -(-max(context + 64, 1024) // 16) + 1
    kv_mb = int(max(max_batch, 2) * per_seq * 16 * cfg.n_layers * 2 * cfg.kv_dim * 4 / 2**20 * 1.2) + 16
    common = dict(weights_dtype="gguf", max_context=max(1024, context + 64), max_num_seqs=64,
                  kv_cache_mb=kv_mb)
    dev = select_device()
    engines = {"fp32": OpenCLEngine.create(cfg, loaded.weights, dev, EngineConfig(**common), blocks),
               "int8": OpenCLEngine.create(cfg, loaded.weights, dataclasses.replace(dev, activations="int8"),
                                           EngineConfig(**common), blocks)}
    if speed:
        engines["fp32-LbL"] = OpenCLEngine.create(cfg, loaded.weights, dev, EngineConfig(**common, layer_kernels=False),
                                                  blocks)
    return cfg, loaded.checkpoint, load_tokenizer(loaded.checkpoint), engines


def only_named(name: str):
    """A context in which the int8 engines built take int8 only on matrices whose name holds `name`
    (QuantMatrix.bind_gemv_rows wrapped for the measurement; nothing in the engine changes)."""
    from services.decode_fpga import int8_gemv, quant_gemv

    @contextlib.contextmanager
    def ctx():
        real = quant_gemv.QuantMatrix.bind_gemv_rows

        def bind(self, x, y, n_rows, accumulate=False, x_sums=None):
            if name in self.name and int8_gemv.takes_int8(self._dev, self.fmt, self.lanes):
                return int8_gemv.bind_int8_gemv_rows(self, x, y, n_rows, accumulate, x_sums)
            saved, self._dev = self._dev, dataclasses.replace(self._dev, activations="fp32")
            try:
                return real(self, x, y, n_rows, accumulate, x_sums)
            finally:
                self._dev = saved

        quant_gemv.QuantMatrix.bind_gemv_rows = bind
        try:
            yield
        finally:
            quant_gemv.QuantMatrix.bind_gemv_rows = real

    return ctx()


@contextlib.contextmanager
def k_block_of(block: int | None):
    """A context in which the int8 engines built quantize a K-quant matrix's x per `block` (None: as
    int8_gemv.K_X_BLOCK is)."""
    from services.decode_fpga import int8_gemv

    saved = int8_gemv.K_X_BLOCK
    int8_gemv.K_X_BLOCK = block or saved
    try:
        yield
    finally:
        int8_gemv.K_X_BLOCK = saved


def int8_engine_like(engine):
    """Another int8 engine on engine's model, device and config (for --only)."""
    from services.decode_fpga.engine import OpenCLEngine

    return OpenCLEngine(engine.cfg, engine.dev, engine.config, engine.weights)


def teacher_forced(engine, tokens: list[int], ctx: int, chunk: int) -> np.ndarray:
    """Every position's next-token logits, float32 [n - windows, vocab]: windows of ctx tokens, each
    from an empty context, `chunk` rows a step; row i of a window predicts its token i + 1."""
    from services.engine.scheduler import ScheduledChunk

    table_ = tuple(range(-(-ctx // engine.block_size)))
    out = []
    for w0 in range(0, len(tokens) - 1, ctx):
        window = tokens[w0:w0 + ctx]
        rows = []
        for s in range(0, len(window), chunk):
            part = tuple(window[s:s + chunk])
            rows.append(engine.step([ScheduledChunk(0, s, part, table_, True, None, all_logits=True)], greedy=False))
        out.append(np.concatenate(rows)[:len(window) - 1])
    return np.concatenate(out)


def targets_of(tokens: list[int], ctx: int) -> np.ndarray:
    """The token each row of teacher_forced predicts."""
    return np.concatenate([np.asarray(tokens[w0 + 1:w0 + ctx]) for w0 in range(0, len(tokens) - 1, ctx)])


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def divergence(exact: np.ndarray, int8: np.ndarray, targets: np.ndarray) -> dict:
    kl, nll_e, nll_q = [], [], []
    for s in range(0, len(exact), 256):  # in slices: [n, vocab] float64 twice is large
        lp, lq = log_softmax(exact[s:s + 256]), log_softmax(int8[s:s + 256])
        kl.append((np.exp(lp) * (lp - lq)).sum(axis=-1))
        t = targets[s:s + 256]
        nll_e.append(-lp[np.arange(len(t)), t])
        nll_q.append(-lq[np.arange(len(t)), t])
    kl, nll_e, nll_q = np.concatenate(kl), np.concatenate(nll_e), np.concatenate(nll_q)
    same = exact.argmax(axis=-1) == int8.argmax(axis=-1)
    return {"positions": int(len(kl)), "kl_mean": float(kl.mean()), "kl_median": float(np.median(kl)),
            "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
            "same_top1": float(same.mean()), "differing_top1": int((~same).sum()),
            "ppl_exact": float(np.exp(nll_e.mean())), "ppl_int8": float(np.exp(nll_q.mean())),
            "max_abs_logit_diff": float(np.abs(exact - int8).max())}


def speed(engines: dict, cfg, rounds: int, steps: int, context: int, batches=(1, 8)) -> list[dict]:
    from bench.micro.paged_step import time_paged

    runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
    loads = []
    for r in range(rounds):
        for batch in batches:
            for name, engine in engines.items():
                runs.setdefault((name, batch), []).extend(time_paged(engine, cfg, batch, context, steps))
        loads.append(os.getloadavg()[0])
        progress(f"round {r + 1}/{rounds}: load {loads[-1]:.1f}")
    out = []
    for (name, batch), times in runs.items():
        wall = statistics.median(t for t, _ in times) * 1e3
        cpu = statistics.median(c for _, c in times) * 1e3
        out.append({"path": name, "batch": batch, "ms_per_step": wall, "cpu_ms_per_step": cpu,
                    "ms_per_token": wall / batch, "tokens_per_s": batch / wall * 1e3, "steps": len(times),
                    "load_min": min(loads), "load_max": max(loads)})
    return out


def measure_divergence(args, ckpt, tok, engines) -> tuple[dict, dict]:
    """The divergence table (and --only's): {metrics}, {name: metrics}."""
    from services.model.tokenizer import text_ids

    tokens = text_ids(tok, TEXT.read_text())
    progress(f"{ckpt.path.name}: {len(tokens)} tokens; teacher-forced, windows of {args.ctx}")
    t0 = time.perf_counter()
    logits = {name: teacher_forced(engines[name], tokens, args.ctx, args.chunk) for name in ("fp32", "int8")}
    div = {"model": ckpt.path.name, "text": TEXT.name, "tokens": len(tokens), "ctx": args.ctx,
           **divergence(logits["fp32"], logits["int8"], targets_of(tokens, args.ctx))}
    progress(f"divergence in {time.perf_counter() - t0:.0f} s")
    print(table(["model", "positions", "KL mean", "KL p99", "KL max", "same top-1", "PPL exact", "PPL int8"],
                [[div["model"], div["positions"], f"{div['kl_mean']:.5f}", f"{div['kl_p99']:.5f}",
                  f"{div['kl_max']:.4f}", f"{100 * div['same_top1']:.2f}%", f"{div['ppl_exact']:.3f}",
                  f"{div['ppl_int8']:.3f}"]]))
    targets = targets_of(tokens, args.ctx)
    only = {}
    names = [n for n in args.only.split(",") if n]
    variants = [(n, n, None) for n in names]  # (label, int8 on names holding it (None: all), K-quant x block)
    for kb in (int(v) for v in args.k_blocks.split(",") if v):
        variants += [(f"all/k{kb}", None, kb)] + [(f"{n}/k{kb}", n, kb) for n in names]
    for label, name, k_block in variants:
        with only_named(name) if name else contextlib.nullcontext(), k_block_of(k_block):
            engine = int8_engine_like(engines["int8"])  # its launches bound under the wrappers
        only[label] = divergence(logits["fp32"], teacher_forced(engine, tokens, args.ctx, args.chunk), targets)
        del engine
        progress(f"int8 on {label}: KL mean {only[label]['kl_mean']:.5f}, "
                 f"same top-1 {100 * only[label]['same_top1']:.2f}%")
    if only:
        print(table(["int8 on", "KL mean", "KL p99", "same top-1", "PPL int8"],
                    [[k, f"{v['kl_mean']:.5f}", f"{v['kl_p99']:.5f}", f"{100 * v['same_top1']:.2f}%",
                      f"{v['ppl_int8']:.3f}"] for k, v in only.items()]))
    return div, only


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    ap.add_argument("--ctx", type=int, default=512, help="tokens a teacher-forced window")
    ap.add_argument("--chunk", type=int, default=64, help="rows a paged step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--context", type=int, default=128, help="context of the timed decode steps")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-divergence", action="store_true", help="the decode speed alone")
    ap.add_argument("--only", default="", help="comma-separated tensor-name parts: int8 on those alone, each")
    ap.add_argument("--k-blocks", default="", help="again with the K-quants' x per these (e.g. 32,64)")
    ap.add_argument("--name", default="activation_divergence")
    args = ap.parse_args()
    cfg, ckpt, tok, engines = build_engines(args.model, not args.skip_speed, 8, args.context)
    div, only = {}, {}
    if not args.skip_divergence:
        div, only = measure_divergence(args, ckpt, tok, engines)
    rows = [] if args.skip_speed else speed(engines, cfg, args.rounds, args.steps, args.context)
    if rows:
        print(table(["path", "batch", "ms/step", "CPU ms/step", "ms/token", "tokens/s"],
                    [[r["path"], r["batch"], f"{r['ms_per_step']:.1f}", f"{r['cpu_ms_per_step']:.1f}",
                      f"{r['ms_per_token']:.1f}", f"{r['tokens_per_s']:.1f}"] for r in rows]))
    dev = engines["fp32"].dev.device
    write_json(args.name, {"divergence": div, "only": only, "speed": rows, "context": args.context,
                           "rounds": args.rounds, "device": dev.name,
                           "integer_dot_product_extension": "cl_khr_integer_dot_product" in dev.extensions,
                           "loadavg_end": os.getloadavg()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
