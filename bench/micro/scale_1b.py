"""The 1B-class scale point: decode ms/token of a Llama-3.2-1B-shaped Q4_K_M file on the OpenCL engine
and on llama.cpp, side by side, against the memory-bandwidth limit.

The file is scale_1b_checkpoint.py's (random weights, quantized by llama.cpp's `llama-quantize`;
made in a cache directory on the first run). Decode of a 1B model is bound by memory bandwidth:
every step reads every weight once, so the limit is the bytes a step reads / the machine's GB/s
(_common.memory_bandwidth_gbs: a numpy copy, read + write, one thread; the better of a measure
before and after the rounds). Each engine's own bytes:
ours as its device stores them (quant_gemv.py's layout: Q4_K 4.75 bits a weight against the
file's 4.5), llama.cpp's the file's matrices (the tied embedding read whole as the LM head).

Rows, interleaved round by round, medians of every round's steps, 2 threads each:
  * ours        OpenCLEngine on the file's blocks (gguf storage), the paged step (the serving path)
                with greedy picks, at a context of --context tokens (random KV, imported)
  * ours-int8-kN  (--int8 N,N) the same with HYBRIDSERVE_DECODE_ACTIVATIONS=int8 (int8_gemv.py), the
                K-quants' x quantized per N values (int8_gemv.K_X_BLOCK), one engine a value
  * llama.cpp   llama-batched-bench on the same file, -t 2, a shared --context-token prompt, then
                --steps generated tokens for 1 and 8 parallel sequences (its t_tg / steps)
  * llama-server  (--llama-server PATH|auto) the server on the same file, -t 2, one slot a sequence:
                its own per-token timing of --steps generated tokens (scale_1b_server.py)

    python -m bench.micro.scale_1b --llama-bin /tmp/kq_llama/build/bin [--rounds 3] [--steps 16]
    python -m bench.micro.scale_1b --int8 64,256 --llama-server auto    # the scale_1b_checkpoint --numpy file
    python -m bench.micro.scale_1b --llama-bin DIR --launch-cost FILE   # FILE: a Q4_K_M made with
        --tensor-type attn_v=q4_k --tensor-type ffn_down=q4_k (no mixed stacks, so packable)

--launch-cost: what running launch by launch (as a file with mixed q|k|v stacks must) costs at
this scale: batch-1 paged steps on FILE as one launch against launch by launch, interleaved;
written to bench/results/scale_1b_launch_cost.json.

--llama-bin: a llama.cpp build's bin/ holding llama-quantize and llama-batched-bench; without
llama-batched-bench the llama.cpp rows are left out (and the JSON says so). Without --llama-bin (and
--gguf) the file is scale_1b_checkpoint.py's --numpy one.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
from pathlib import Path

from bench._common import memory_bandwidth_gbs, progress, stats, table, write_json

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

BATCHES = (1, 8)
THREADS = 2


def light_weights(path: Path, cfg):
    """ModelWeights with the norms read from the file and every matrix a zero-strided stand-in of its
    shape: gguf storage reads the matrices from the blocks, so the 4.3 GB of f32 that load_model
    would dequantize are never made."""
    import gguf

    from services.model.weights import LayerWeights, ModelWeights

    reader = gguf.GGUFReader(str(path))
    t = {x.name: np.asarray(x.data, np.float32) for x in reader.tensors if len(x.shape) == 1}
    h, q, kv, ff = cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.intermediate

    def stub(*shape):
        return np.broadcast_to(np.float32(0), shape)

    layers = tuple(LayerWeights(attn_norm=t[f"blk.{i}.attn_norm.weight"], wq=stub(q, h), wk=stub(kv, h),
                                wv=stub(kv, h), wo=stub(h, q), ffn_norm=t[f"blk.{i}.ffn_norm.weight"],
                                w_gate=stub(ff, h), w_up=stub(ff, h), w_down=stub(h, ff))
                   for i in range(cfg.n_layers))
    embed = stub(cfg.vocab_size, h)
    return ModelWeights(embed, layers, t["output_norm.weight"], embed)


def our_engine(path: Path, context: int, batches=BATCHES, activations: str = "fp32"):
    import dataclasses

    from services.decode_fpga.config import EngineConfig
    from services.decode_fpga.device import select_device
    from services.decode_fpga.engine import OpenCLEngine
    from services.model.checkpoint import locate
    from services.model.config import read_config
    from services.model.gguf_blocks import read_block_tensors

    ckpt = locate(str(path))
    cfg = read_config(ckpt)
    config = EngineConfig(weights_dtype="gguf", max_context=context, kv_cache_mb=64)
    dev = dataclasses.replace(select_device(), activations=activations)
    return OpenCLEngine.create(cfg, light_weights(path, cfg), dev, config, read_block_tensors(ckpt, cfg))


def file_matrix_bytes(path: Path) -> int:
    """The bytes of the file's 2-D tensors: what llama.cpp reads per step (the tied embedding as the LM head)."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2)


def exit_reason(returncode: int) -> str:
    """A child's exit status in words: a signal by name, and what SIGILL means for a llama.cpp build."""
    if returncode >= 0:
        return f"exit status {returncode}"
    name = signal.Signals(-returncode).name
    if name == "SIGILL":
        from bench.llama_server import NO_AMX

        return (f"killed by {name}: the build uses an instruction this CPU or VM does not run; AMX faults on "
                f"the VMs here, so build with {NO_AMX} (bench/llama_server.py)")
    return f"killed by {name}"


def llama_steps(binary: Path, path: Path, context: int, steps: int, batches=BATCHES) -> dict[int, float]:
    """llama-batched-bench: seconds per decode step for each batch (its generation phase)."""
    from bench.llama_server import library_env

    n_ctx = context + max(batches) * (steps + 4)
    cmd = [str(binary), "-m", str(path), "-t", str(THREADS), "-tb", str(THREADS), "-c", str(n_ctx), "-pps",
           "-npp", str(context), "-ntg", str(steps), "-npl", ",".join(map(str, batches)), "--output-format", "jsonl"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=library_env(binary), timeout=900)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({exit_reason(done.returncode)}):\n{done.stderr[-2000:]}")
    out = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[int(r["pl"])] = float(r["t_tg"]) / int(r["tg"])
    return out


def launch_cost(path: Path, rounds: int, steps: int, context: int) -> None:
    """Batch-1 paged steps of one engine on `path` as one launch and launch by launch, interleaved."""
    from bench.micro.paged_step import time_paged_wall

    from services.decode_fpga.one_launch_choice import OneLaunchChoice

    eng = our_engine(path, context + steps + 8)
    if eng.weights.packed is None:
        raise SystemExit(f"{path.name}: its layers are not packed (mixed stacks?): no one-launch step to compare")
    cells: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        progress(f"launch cost round {r + 1}/{rounds}")
        for one in (True, False):
            eng.one_launch_choice = choice = OneLaunchChoice(fixed=one)
            cells[one].extend(time_paged_wall(eng, eng.cfg, 1, context, steps))
            if one and choice.gave_up:
                progress(f"the one launch gave up {choice.gave_up} times (a busy core): redone launch by launch")
    rows = [["one launch" if one else "launch by launch", stats([x * 1e3 for x in xs])["median"]]
            for one, xs in cells.items()]
    print(table(["batch-1 paged step", "ms/step"], rows))
    write_json("scale_1b_launch_cost", {"gguf": path.name, "stored": eng.weights.storage_summary(),
                                        "rounds": rounds, "steps": steps, "context": context,
                                        "loadavg": os.getloadavg(),
                                        "ms_per_step": {r[0]: stats([x * 1e3 for x in cells[r[0] == "one launch"]])
                                                        for r in rows}})


def main() -> int:
    from bench.micro.paged_step import time_paged_wall
    from bench.micro.scale_1b_checkpoint import ensure, ensure_numpy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-bin", type=Path, default=None, help="a llama.cpp build's bin/ (llama-quantize, ...)")
    ap.add_argument("--llama-server", default=None, help="llama-server's path, or auto (bench/llama_server.py's)")
    ap.add_argument("--int8", default="", help="also our engine with int8 activations, per K-quant x block (64,256)")
    ap.add_argument("--gguf", type=Path, default=None, help="the Q4_K_M file (default: made in the cache)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per engine, batch and round")
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--batches", default="1,8", help="decode batch sizes, comma separated")
    ap.add_argument("--name", default="scale_1b", help="the results file's name (bench/results/NAME.json)")
    ap.add_argument("--launch-cost", type=Path, default=None, metavar="FILE",
                    help="instead: one launch against launch by launch on FILE (see above)")
    args = ap.parse_args()
    if args.launch_cost:
        launch_cost(args.launch_cost, args.rounds, args.steps, args.context)
        return 0
    path = args.gguf or (ensure(args.llama_bin / "llama-quantize") if args.llama_bin else ensure_numpy())
    batches = tuple(int(b) for b in args.batches.split(","))
    batched = args.llama_bin / "llama-batched-bench" if args.llama_bin else None
    have_llama = batched is not None and batched.is_file()
    progress(f"loading {path.name} on the OpenCL engine")
    eng = our_engine(path, args.context + args.steps + 8, batches)
    cfg = eng.cfg
    progress(f"stored: {eng.weights.storage_summary()}")
    ours = {"ours": eng}
    for kb in filter(None, args.int8.split(",")):
        from services.decode_fpga import int8_gemv

        saved, int8_gemv.K_X_BLOCK = int8_gemv.K_X_BLOCK, int(kb)  # read as the engine binds its GEMVs
        try:
            ours[f"ours-int8-k{kb}"] = our_engine(path, args.context + args.steps + 8, batches, "int8")
        finally:
            int8_gemv.K_X_BLOCK = saved
    server, server_own = None, {}  # llama-server's own per-request mean ms a token, by batch
    if args.llama_server:
        from bench.llama_server import find
        from bench.micro.scale_1b_server import LlamaServer

        binary = find() if args.llama_server == "auto" else Path(args.llama_server)
        if binary is None:
            raise SystemExit("no llama-server built: python -m bench.llama_server")
        server = LlamaServer(binary, path, max(batches), args.context + args.steps + 16, THREADS)
    gbs = memory_bandwidth_gbs()
    load_before = os.getloadavg()  # the machine is shared: say how busy it was
    cells: dict[tuple[str, int], list[float]] = {}
    rounds: dict[tuple[str, int], list[float]] = {}  # each round's median step (llama.cpp: its one value)
    try:  # the server is ended whatever happens (a request timing out while the machine is paused)
        for r in range(args.rounds):
            progress(f"round {r + 1}/{args.rounds}")
            for batch in batches:
                for name, engine in ours.items():
                    times = time_paged_wall(engine, cfg, batch, args.context, args.steps)
                    cells.setdefault((name, batch), []).extend(times)
                    rounds.setdefault((name, batch), []).append(stats(times)["median"])
                if server is not None:
                    s, own = server.step_seconds(batch, args.context, args.steps, seed=r)
                    cells.setdefault(("llama-server", batch), []).append(s)
                    rounds.setdefault(("llama-server", batch), []).append(s)
                    server_own.setdefault(batch, []).append(own * 1e3)
            if have_llama:
                for batch, s in llama_steps(batched, path, args.context, args.steps, batches).items():
                    # llama-batched-bench reports the phase's total: one value a round, weighted as such
                    cells.setdefault(("llama.cpp", batch), []).append(s)
                    rounds.setdefault(("llama.cpp", batch), []).append(s)
    finally:
        if server is not None:
            server.close()
    gbs_after = memory_bandwidth_gbs()
    load_after = os.getloadavg()
    nbytes = {name: eng.weights_nbytes for name in ours}
    nbytes["llama.cpp"] = file_matrix_bytes(path)
    nbytes["llama-server"] = nbytes["llama.cpp"]
    best_gbs = max(gbs, gbs_after)  # the limit: the best the (shared) machine gave
    rows, lines = [], []
    names = [*ours, *(("llama.cpp",) if have_llama else ()), *(("llama-server",) if server else ())]
    for name in names:
        limit_ms = nbytes[name] / (best_gbs * 1e9) * 1e3
        for batch in batches:
            ms = stats([x * 1e3 for x in cells[(name, batch)]])
            rows.append([name, batch, nbytes[name] / 1e6, ms["median"], ms["median"] / batch, limit_ms,
                         ms["median"] / limit_ms, nbytes[name] / (ms["median"] / 1e3) / 1e9])
            lines.append({"engine": name, "batch": batch, "context": args.context, "ms_per_step": ms,
                          "ms_per_token": ms["median"] / batch, "mb_per_step": nbytes[name] / 1e6,
                          "bandwidth_limit_ms_per_step": limit_ms, "x_limit": ms["median"] / limit_ms,
                          "round_medians_ms": [x * 1e3 for x in rounds[(name, batch)]]})
    print(table(["engine", "batch", "MB/step", "ms/step", "ms/token", "limit ms/step", "x limit", "GB/s"], rows))
    print(f"memory bandwidth (numpy copy, 1 thread) {gbs:.2f} GB/s before, {gbs_after:.2f} after; load average "
          f"before {load_before}, after {load_after}; {args.rounds} rounds x {args.steps} steps, context "
          f"{args.context}, {THREADS} threads")
    faster = {}
    for base in [n for n in names if n.startswith("llama")]:
        for name in ours:
            for batch in batches:
                mine, theirs = (stats(cells[(n, batch)])["median"] for n in (name, base))
                # rounds ran interleaved: a round where ours was faster compares the two under the same load
                won = sum(o < t for o, t in zip(rounds[(name, batch)], rounds[(base, batch)]))
                faster[f"{name} vs {base}, batch {batch}"] = {"rounds_ours_faster": won, "rounds": args.rounds,
                                                              "speed_ratio": theirs / mine}
                print(f"batch {batch}: {name} {mine * 1e3:.1f} ms/step, {base} {theirs * 1e3:.1f}: at "
                      f"{theirs / mine:.2f}x {base}'s speed; faster in {won} of {args.rounds} rounds")
    write_json(args.name, {"gguf": path.name, "shape": {"hidden": cfg.hidden, "layers": cfg.n_layers,
                                                        "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads,
                                                        "intermediate": cfg.intermediate, "vocab": cfg.vocab_size},
                            "stored": eng.weights.storage_summary(), "stored_weight_types": eng.stored_weight_types,
                            "one_launch_packed": eng.weights.packed is not None, "device": eng.device_name,
                            "threads": THREADS, "rounds": args.rounds, "steps": args.steps,
                            "memory_bandwidth_gbs": [gbs, gbs_after], "loadavg_before": load_before,
                            "loadavg_after": load_after, "llama_cpp": [n for n in names if n.startswith("llama")],
                            "rounds_ours_faster": faster, "lines": lines,
                            "llama_server_own_ms_per_token": server_own})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
