"""Figures from a run's per-request results: percentiles, one run's summary, medians over rounds, ratios."""
from __future__ import annotations

import statistics

import numpy as np

TOTALS = ("tokens", "requests", "errors", "short_outputs")


def pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile (numpy's linear interpolation), None for no samples."""
    return float(np.percentile(xs, q)) if len(xs) else None


def first_distinct(messages, n: int = 3) -> list[str]:
    return list(dict.fromkeys(messages))[:n]


def summarize(results: list[dict], wall: float) -> dict:
    """One run (a target at a level): throughput over the run's wall time, latency percentiles, errors."""
    ok = [r for r in results if r["error"] is None]
    itl = [g for r in ok for g in r["itl"]]
    tokens = sum(r["tokens"] for r in ok)
    out = {"output_tok_s": tokens / wall, "req_s": len(ok) / wall, "wall_s": wall, "tokens": tokens,
           "requests": len(ok), "errors": len(results) - len(ok), "short_outputs": sum(r["short"] for r in ok),
           "error_messages": first_distinct(r["error"] for r in results if r["error"])}
    # time per output token after the first: unlike ITL, it does not depend on how tokens are chunked
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    # ITL is per text chunk: a server that sends k tokens per chunk shows gaps k tokens long
    chunks = sum(len(r["itl"]) + 1 for r in ok)
    out["tokens_per_chunk"] = tokens / chunks if chunks else None
    for key, xs in (("ttft", [r["ttft"] for r in ok]), ("itl", itl), ("tpot", tpot), ("e2e", [r["e2e"] for r in ok])):
        out[f"{key}_p50"], out[f"{key}_p99"] = pct(xs, 50), pct(xs, 99)
    return out


def over_rounds(rounds: list[dict]) -> dict:
    """One (target, level): the median of each figure over rounds, the totals, the first error messages."""
    med = {}
    for key, v in rounds[0].items():
        if key not in TOTALS and (isinstance(v, (int, float)) or v is None):
            xs = [r[key] for r in rounds if r.get(key) is not None]
            med[key] = statistics.median(xs) if xs else None
    return {"median": med, "totals": {k: sum(r[k] for r in rounds) for k in TOTALS if k in rounds[0]},
            "error_messages": first_distinct(m for r in rounds for m in r.get("error_messages", [])), "rounds": rounds}


def ratios_to(runs: dict, baseline: str, key: str = "output_tok_s") -> dict:
    """Per target and level, the median of per-round ratios: round r of each ran beside the other's."""
    out = {}
    for name, per_c in runs.items():
        out[name] = {}
        for c, rs in per_c.items():
            pairs = [a[key] / b[key] for a, b in zip(rs, runs[baseline][c]) if a[key] is not None and b[key]]
            out[name][c] = statistics.median(pairs) if pairs else None
    return out


def merge_peaks(into: dict, new: dict) -> None:
    for key, v in new.items():
        into[key] = max(v, into.get(key, float("-inf")))
