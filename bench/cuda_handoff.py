"""The hand-off on CUDA: prefill_gpu on the GPU writes layers into its pinned arena from a side stream.

Starts prefill_gpu (CUDA) as a process, pulls the KV of prompts of 64-1024 tokens
through its Prefill stream into a CPU engine exactly as decode_fpga does, checks
the KV that arrived against a CPU prefill of the same prompt, and reports the
exposed and total hand-off. Uses the default model when installed, else a
SmolLM2-shaped checkpoint with random weights (see cuda_check.py).

    python bench/cuda_handoff.py [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from _common import table, write_json  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    import grpc

    from cuda_check import smollm2_shaped_checkpoint
    from services.engine.handoff_wire import handoff_from_proto
    from services.kv.arena import ArenaReader
    from services.kv.header import SlotHeader
    from services.kv.shm import ShmReceiver
    from services.lifetime import launch_env
    from services.model.loading import load_model
    from services.prefill_gpu.engine import TorchEngine
    from services.rpc.hybridserve.v1 import engine_pb2 as pb
    from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc

    try:
        loaded, model_env = load_model(), {}
    except Exception:
        path = smollm2_shaped_checkpoint(Path(tempfile.mkdtemp()))
        loaded, model_env = load_model(str(path)), {"HYBRIDSERVE_MODEL": str(path)}
    cfg = loaded.config
    port = free_port()
    env = {**os.environ, **model_env, "HYBRIDSERVE_DEVICE": "cuda", "HYBRIDSERVE_PORT": str(port),
           "HYBRIDSERVE_METRICS_PORT": str(free_port()), "HYBRIDSERVE_PROFILE_AT_START": "false",
           "HYBRIDSERVE_ARENA_BYTES": str(512 << 20), **launch_env()}  # it stops if this script dies
    log = open(Path(args.out) / "cuda_handoff_server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "services.prefill_gpu"], env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(ch).result(timeout=300)
        stub = pb_grpc.EngineStub(ch)
        time.sleep(1)
        info = stub.Info(pb.InfoRequest(), timeout=10)
        print(f"prefill_gpu on {info.device}, arena {info.arena_name} ({info.arena_size >> 20} MiB)")
        reader = ArenaReader(info.arena_name)
        cpu = TorchEngine(cfg, loaded.weights, device="cpu")
        rng = np.random.default_rng(0)
        rows, results = [], {}
        for n in (64, 256, 512, 1024):
            runs = []
            for rep in range(4):
                prompt = rng.integers(3, cfg.vocab_size, n).tolist()
                seq = cpu.new_sequence(n + 1)
                expected = SlotHeader(info.kv_dtype, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n, cfg.model_id)
                rx = ShmReceiver(reader, cpu, seq, expected)
                call = stub.Prefill(pb.PrefillRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=1),
                                                      wire_dtype=info.kv_dtype), timeout=120)
                done = rx.consume(handoff_from_proto(msg) for msg in call)
                call.cancel()
                ref = cpu.new_sequence(n + 1)
                cpu.prefill(ref, prompt)
                err = max(float((seq.k[:, :, :n] - ref.k[:, :, :n]).abs().max()),
                          float((seq.v[:, :, :n] - ref.v[:, :, :n]).abs().max()))
                if rep:  # the first request of each size warms up
                    runs.append({"prefill_s": done.prefill_s, "total_s": rx.on_device_at - rx.first_written_at,
                                 "exposed_s": max(0.0, rx.on_device_at - done.compute_done_at), "bytes": rx.bytes,
                                 "kv_max_abs_err_vs_cpu": err})
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            results[n] = {"median": med, "runs": runs}
            rows.append([n, f"{med['bytes'] / 1e6:.1f}", f"{med['prefill_s'] * 1e3:.1f}", f"{med['total_s'] * 1e3:.2f}",
                         f"{med['exposed_s'] * 1e3:.2f}", f"{med['kv_max_abs_err_vs_cpu']:.1e}"])
        print(table(["prompt", "MB", "prefill ms (GPU)", "hand-off total ms", "exposed ms", "KV max|GPU-CPU|"], rows))
        write_json("cuda_handoff", {"device": info.device, "results": results}, out_dir=Path(args.out))
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
