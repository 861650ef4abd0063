"""The first exchange after a cold start, as a new user meets it: `hybridserve up` from an empty profile cache,
/health polled until it answers 200, then at once a stream and, beside it, a long prompt (the exchange of
harness/first_exchange.py). Each round is a fresh stack and a fresh cache; a round per mode given.

Reports per round: seconds until ready, the stream's largest gap while the long prompt ran, the share of
its gaps over 150 ms, the long prompt's time in the stack, and whether any calibration request ran after
readiness (it must not). Prints a table, writes bench/results/cold_start.json and cold_start.png.

    python -m bench.cold_start                        # auto, 2 rounds, 2,000-token prompt
    python -m bench.cold_start --modes auto,fpga,hybrid --rounds 1 --long-prompt-tokens 512
    python -m bench.cold_start --env HYBRIDSERVE_PREFILL_CPU_GROUP_NICE=   # a setting's effect
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench._common import RESULTS, progress, table, write_json

from harness.first_exchange import calibration_checks_ran, first_exchange, get_json, wait_ready
from harness.stack import launch_stack

SMOOTH_S = 0.150


def one_round(mode: str, long_tokens: int, stream_tokens: int, seed: int, env: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="hybridserve-cold-") as tmp:
        cache = {"HYBRIDSERVE_PROFILE_CACHE": str(Path(tmp) / "profile")}
        stack = launch_stack(Path(tmp) / "up.log", {**(env or {}), **cache})
        try:
            ready = wait_ready(stack.url, 900, alive=lambda: stack.process.proc.poll() is None)
            checks = calibration_checks_ran(stack.url)
            model = get_json(stack.url + "/v1/models")[1]["data"][0]["id"]
            x = first_exchange(stack.url, model, long_tokens, stream_tokens, None if mode == "auto" else mode, seed)
            gaps = [b - a for a, b in zip(x.arrivals, x.arrivals[1:])]
            during = x.gaps_during_long
            return {"mode": mode, "ready_s": ready.seconds, "ready_body": ready.body,
                    "max_gap_during_long_s": max(during) if during else None,
                    "gaps_over_150ms": sum(g > SMOOTH_S for g in gaps) / len(gaps) if gaps else None,
                    "gap_p50_s": statistics.median(gaps) if gaps else None,
                    "long_s": x.long_done - x.long_sent, "long_mode": x.long_body.get("hybridserve", {}).get("mode"),
                    "checks_after_ready": calibration_checks_ran(stack.url) - checks, "stream_events": len(x.arrivals)}
        finally:
            stack.stop()


def plot(rounds: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['mode']} #{i + 1}" for i, r in enumerate(rounds)]
    ax.bar(labels, [1000 * (r["max_gap_during_long_s"] or 0) for r in rounds], color="tab:blue")
    ax.axhline(1000 * SMOOTH_S, color="tab:red", linestyle="--", label="150 ms")
    ax.set_ylabel("largest stream gap while the long prompt ran (ms)")
    ax.set_title("First exchange after a cold start, at the first /health 200")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="auto", help="comma-separated: auto, gpu, fpga, hybrid")
    ap.add_argument("--rounds", type=int, default=2, help="fresh stacks per mode")
    ap.add_argument("--long-prompt-tokens", type=int, default=2000)
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the stack (repeatable)")
    ap.add_argument("--name", default="cold_start")
    args = ap.parse_args()
    env = dict(e.split("=", 1) for e in args.env)
    rounds = []
    for r in range(args.rounds):
        for mode in args.modes.split(","):
            progress(f"round {r + 1}/{args.rounds}: {mode}, a fresh stack from an empty profile cache")
            rounds.append(one_round(mode, args.long_prompt_tokens, args.stream_tokens, seed=58 + r, env=env))
    ms = lambda s: "-" if s is None else f"{1000 * s:.0f}"  # noqa: E731
    print(table(["mode", "ready after s", "largest gap ms", "gaps > 150 ms %", "gap p50 ms", "long prompt s",
                 "its mode", "checks after ready"],
                [[r["mode"], f"{r['ready_s']:.0f}", ms(r["max_gap_during_long_s"]),
                  f"{100 * (r['gaps_over_150ms'] or 0):.1f}", ms(r["gap_p50_s"]), f"{r['long_s']:.2f}",
                  r["long_mode"], f"{r['checks_after_ready']:.0f}"] for r in rounds]))
    write_json(args.name, {"args": vars(args), "rounds": rounds})
    plot(rounds, RESULTS / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
