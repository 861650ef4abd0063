"""What makes a stream's largest gaps while long prompts arrive, on a settled stack, in every mode.

The exchange of harness/first_exchange.py on one stack after it is ready: a stream (600 tokens, to outlast the
long prompts; `covered` says whether it did) and, once it decodes, prompts of 512 or 2,000 random token ids
(fresh each time: no prefix-cache hit), one alone or four at once. The stack runs with HYBRIDSERVE_TOKEN_TRACE,
so every engine's steps are on record (start, end, rows; one clock for all processes): each of the stream's
largest gaps is set beside the longest step of each engine that ended within it. A gap that one step fills is
the step's cost (the pacer's bound, a prompt chunk, a hand-off's upload); a gap no step explains is time outside
the engines' steps (contention for the cores, a thread hop, the HTTP or gRPC path).

Reports, per mode, prompt size and arrival pattern (medians over rounds): the stream's largest gap while the
long prompts ran, the share of its gaps over 150 ms, its gap p50, the long prompts' time in the stack, and for
the largest gap the longest prefill_gpu and decode_fpga steps under it. Writes
bench/results/long_prompt_gaps.json and .png.

    python -m bench.long_prompt_gaps                              # gpu,fpga,hybrid,auto; 512 and 2000; 1 and 4
    python -m bench.long_prompt_gaps --modes fpga --sizes 2000 --at-once 1 --rounds 3
    python -m bench.long_prompt_gaps --env HYBRIDSERVE_DECODE_STEP_TARGET_S=0.08   # a setting's effect
    python -m bench.long_prompt_gaps --merge bench/results/a.json bench/results/b.json --name ab  # rounds run apart
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench._common import RESULTS, machine, progress, table, write_json

from harness.first_exchange import first_exchange, get_json, wait_ready
from harness.stack import launch_stack

SMOOTH_S = 0.150


def read_steps(folder: Path) -> dict[str, list[tuple[float, float, int]]]:
    """Each engine process's steps, by the name its trace file starts with (prefill_gpu, decode_fpga)."""
    steps: dict[str, list] = {}
    for path in folder.glob("*.jsonl"):
        name = path.name.rsplit("-", 1)[0]
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "step" in rec:
                steps.setdefault(name, []).append(tuple(rec["step"]))
    return steps


def under(steps: list, start: float, end: float) -> float:
    """The longest of `steps` that ended within (start, end]: seconds (0 when none)."""
    return max((e - s for s, e, _ in steps if start < e <= end), default=0.0)


def one_exchange(url: str, model: str, mode: str, size: int, at_once: int, seed: int, stream_tokens: int) -> dict:
    x = first_exchange(url, model, size, stream_tokens, None if mode == "auto" else mode, seed, at_once=at_once)
    a = x.arrivals
    during = sorted(((b - p, p, b) for p, b in zip(a, a[1:]) if b >= x.long_sent and p <= x.long_done),
                    reverse=True)
    gaps = [b - p for p, b in zip(a, a[1:])]
    return {"mode": mode, "size": size, "at_once": at_once, "largest": during[:3],
            # where in the long prompts' time each of the largest gaps began (s after they were sent)
            "largest_at_s": [start - x.long_sent for _g, start, _e in during[:3]],
            "max_gap_s": during[0][0] if during else None,
            "over_150ms": sum(g > SMOOTH_S for g in gaps) / len(gaps) if gaps else None,
            "gap_p50_s": statistics.median(gaps) if gaps else None,
            "long_s_p50": statistics.median(x.long_seconds),
            # the share of the long prompts' time the stream was there to feel
            "covered": min(1.0, (a[-1] - x.long_sent) / max(1e-9, x.long_done - x.long_sent)),
            "long_modes": sorted({b.get("hybridserve", {}).get("mode", "?") for b in x.long_bodies})}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['mode']}\n{r['size']}x{r['at_once']}" for r in rows]
    ax.bar(labels, [1000 * r["max_gap_s"] for r in rows], color="tab:blue", label="largest gap")
    ax.bar(labels, [1000 * r["decode_fpga_step_s"] for r in rows], color="tab:orange", width=0.4,
           label="longest decode_fpga step under it")
    ax.bar(labels, [1000 * r["prefill_gpu_step_s"] for r in rows], color="tab:green", width=0.2,
           label="longest prefill_gpu step under it")
    ax.axhline(1000 * SMOOTH_S, color="tab:red", linestyle="--", label="150 ms")
    ax.set_ylabel("ms")
    ax.set_title("A stream's largest gap while long prompts arrive (prompt tokens x at once), settled stack")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def report(cases: list[tuple[str, int, int]], runs: list[dict]) -> list[dict]:
    """Each case's row (medians over its runs, the worst run's steps under its largest gap), printed as a table."""
    rows = []
    for mode, size, at_once in cases:
        mine = [r for r in runs if (r["mode"], r["size"], r["at_once"]) == (mode, size, at_once)]
        med = lambda k: statistics.median(r[k] for r in mine if r[k] is not None)  # noqa: E731
        worst = max(mine, key=lambda r: r["max_gap_s"] or 0)
        rows.append({"mode": mode, "size": size, "at_once": at_once, "max_gap_s": med("max_gap_s"),
                     "max_gap_worst_s": worst["max_gap_s"], "over_150ms": med("over_150ms"),
                     "gap_p50_s": med("gap_p50_s"), "long_s_p50": med("long_s_p50"), "covered": med("covered"),
                     "long_modes": sorted({m for r in mine for m in r["long_modes"]}),
                     "prefill_gpu_step_s": worst["under_largest"][0].get("prefill_gpu", 0.0),
                     "decode_fpga_step_s": worst["under_largest"][0].get("decode_fpga", 0.0)})
    ms = lambda s: f"{1000 * s:.0f}"  # noqa: E731
    print(table(["mode", "prompt", "at once", "largest gap ms (median)", "worst", "gaps > 150 ms %", "gap p50 ms",
                 "long prompt s", "covered %", "served in", "under the worst: prefill_gpu step ms",
                 "decode_fpga step ms"],
                [[r["mode"], r["size"], r["at_once"], ms(r["max_gap_s"]), ms(r["max_gap_worst_s"]),
                  f"{100 * r['over_150ms']:.1f}", ms(r["gap_p50_s"]), f"{r['long_s_p50']:.2f}",
                  f"{100 * r['covered']:.0f}", ",".join(r["long_modes"]), ms(r["prefill_gpu_step_s"]),
                  ms(r["decode_fpga_step_s"])]
                 for r in rows]))
    return rows


def merge(paths: list[str]) -> tuple[list, list[dict], dict]:
    """The cases, runs and first args of earlier results (rounds run apart, e.g. one per quiet spell)."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    runs = [run for res in results for run in res["runs"]]
    cases = list(dict.fromkeys((r["mode"], r["size"], r["at_once"]) for r in runs))
    return cases, runs, results[0]["args"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="gpu,fpga,hybrid,auto")
    ap.add_argument("--sizes", default="512,2000")
    ap.add_argument("--at-once", default="1,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--stream-tokens", type=int, default=600,
                    help="long enough to outlast the long prompts (the table's `covered`)")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the stack (repeatable)")
    ap.add_argument("--name", default="long_prompt_gaps")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="no runs: the rows of these results' runs together (rounds run apart), written as --name")
    args = ap.parse_args()
    if args.merge:
        cases, runs, first = merge(args.merge)
        rows = report(cases, runs)
        write_json(args.name, {"machine": machine(), "args": {**first, "merged": args.merge}, "rows": rows,
                               "runs": runs})
        plot(rows, RESULTS / f"{args.name}.png")
        return 0
    env = dict(e.split("=", 1) for e in args.env)
    cases = [(m, int(s), int(n)) for s in args.sizes.split(",") for n in args.at_once.split(",")
             for m in args.modes.split(",")]
    with tempfile.TemporaryDirectory(prefix="hybridserve-gaps-") as tmp:
        trace = Path(tmp) / "trace"
        stack = launch_stack(Path(tmp) / "up.log", {**env, "HYBRIDSERVE_TOKEN_TRACE": str(trace)})
        try:
            wait_ready(stack.url, 900, alive=lambda: stack.process.proc.poll() is None)
            model = get_json(stack.url + "/v1/models")[1]["data"][0]["id"]
            first_exchange(stack.url, model, 256, 20)  # settle: every engine has stepped
            runs = []
            for r in range(args.rounds):
                for i, (mode, size, at_once) in enumerate(cases):
                    progress(f"round {r + 1}/{args.rounds}: {mode}, {at_once} x {size} tokens")
                    runs.append(one_exchange(stack.url, model, mode, size, at_once, 1000 * r + i, args.stream_tokens))
        finally:
            stack.stop()
        steps = read_steps(trace)
    for run in runs:  # the engines' longest step under each of the largest gaps
        run["under_largest"] = [{name: under(s, start, end) for name, s in steps.items()}
                                for _gap, start, end in run["largest"]]
    rows = report(cases, runs)
    write_json(args.name, {"machine": machine(), "args": vars(args), "rows": rows, "runs": runs})
    plot(rows, RESULTS / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
