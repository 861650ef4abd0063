"""The KV hand-off in hybrid mode: bytes, total and exposed time, against prefill time and memcpy.

For prompts of 64, 256, 512 and 1024 tokens, several hybrid requests (one
output token) through the real services; plus, in the same run, the GB/s of a
copy into the shared-memory arena against a plain memcpy of the same size.

    python -m bench.micro.handoff [--reps N]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench._common import RESULTS, progress, stats, table, write_json
from bench._stack import start_stack

import numpy as np  # noqa: E402


def copy_gbs(nbytes: int, reps: int = 7) -> dict:
    """GB/s of writing one prompt's KV into an arena slot vs into private memory (memcpy)."""
    from services.kv.arena import Arena

    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    arena = Arena(nbytes + (1 << 20))
    try:
        slot = arena.allocate(nbytes, timeout=0)
        dst_arena = arena.data_view(slot, nbytes)
        dst_private = np.empty_like(src)
        out = {}
        for name, dst in (("arena", dst_arena), ("memcpy", dst_private)):
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                np.copyto(dst, src)
                times.append(time.perf_counter() - t)
            out[name] = nbytes / statistics.median(times) / 1e9
        return out
    finally:
        arena.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes", default="64,256,512,1024")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    import grpc

    from services.rpc.hybridserve.v1 import engine_pb2 as pb
    from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc

    stack = start_stack(Path(args.out) / "handoff_stack.log")
    rows, results = [], {}
    try:
        stub = pb_grpc.EngineStub(grpc.insecure_channel(stack.decode_address))
        rng = np.random.default_rng(0)
        for n in (int(s) for s in args.sizes.split(",")):
            per = {"total": [], "exposed": [], "prefill": [], "bytes": 0}
            for r in range(args.reps + 1):
                progress(f"{n} tokens: request {r + 1}/{args.reps + 1}")
                req = pb.GenerateRequest(prompt_token_ids=rng.integers(3, 49152, n).tolist(), mode=pb.MODE_HYBRID,
                                         sampling=pb.SamplingParams(max_tokens=1))
                last = list(stub.Generate(req, timeout=300))[-1]
                if r == 0:
                    continue  # warm-up
                t = last.timings
                per["total"].append(t.handoff_total_s)
                per["exposed"].append(t.handoff_exposed_s)
                per["prefill"].append(t.prefill_s)
                per["bytes"] = t.handoff_bytes
            cp = copy_gbs(per["bytes"])
            exp, tot, pre = (statistics.median(per[k]) for k in ("exposed", "total", "prefill"))
            results[n] = {"bytes": per["bytes"], "total_s": stats(per["total"]), "exposed_s": stats(per["exposed"]),
                          "prefill_s": stats(per["prefill"]), "exposed_fraction_of_prefill": exp / pre,
                          "arena_copy_gbs": cp["arena"], "memcpy_gbs": cp["memcpy"]}
            rows.append([n, f"{per['bytes'] / 1e6:.1f}", f"{tot * 1e3:.1f}", f"{exp * 1e3:.2f}", f"{pre * 1e3:.0f}",
                         f"{100 * exp / pre:.2f}%", f"{cp['arena']:.1f}", f"{cp['memcpy']:.1f}"])
    finally:
        stack.stop()
    print(table(["prompt", "MB", "total ms", "exposed ms", "prefill ms", "exposed/prefill", "arena GB/s",
                 "memcpy GB/s"], rows))
    print(f"medians of {args.reps} hybrid requests per size (fp32 on the wire)")
    write_json("handoff", {"reps": args.reps, "results": results}, out_dir=Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
