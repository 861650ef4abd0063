"""cross_host.py's report: the DP-vs-uniform verdict per cell, the table, merging runs split by prompt size,
and the plot. Split from cross_host.py to keep each module under 400 lines."""
from __future__ import annotations

import json
from pathlib import Path

from bench._common import RESULTS, table, write_json


def verdict(cell: list[dict]) -> dict:
    """The DP against the uniform slicing with the lowest median exposed hand-off in one cell."""
    dp = next(r for r in cell if r["mode"] == "dp")
    uni = [r for r in cell if r["mode"].startswith("u")]
    if not uni:
        return {"best_uniform": None, "verdict": "no uniform slicing shorter than the prompt"}
    best = min(uni, key=lambda r: r["exposed_s"])
    diff = dp["exposed_s"] - best["exposed_s"]
    spread = max(dp["exposed_spread_s"], best["exposed_spread_s"])
    word = "yes" if diff <= 0 else "within spread" if diff <= spread else "no"
    same = [r["mode"] for r in uni if r["slices"] == dp["slices"]]  # then the difference is the noise floor
    return {"best_uniform": best["mode"], "dp_exposed_s": dp["exposed_s"], "uniform_exposed_s": best["exposed_s"],
            "difference_s": diff, "spread_s": spread, "verdict": word, "dp_plan_is": same[0] if same else None}


ROW_HEADERS = ["Gbit/s", "tokens", "mode", "slices", "predicted s", "e2e s", "exposed s", "spread s", "% prefill",
               "tail ms", "tx CPU over local s", "rx CPU s"]


def row_of(r: dict) -> list:
    return [f"{r['gbit']:g}", r["n_tokens"], r["mode"], len(r["slices"]) if r["slices"] else 1, r["predicted_s"],
            r["e2e_s"], r["exposed_s"], r["exposed_spread_s"], r["exposed_pct"], r["tail_s"] * 1e3,
            r.get("cpu_over_local_s", ""), r.get("rx_cpu_s", "")]  # runs before 2026-11-29 13:00 lack the CPU


def report(records: list[dict], verdicts: dict) -> None:
    records = sorted(records, key=lambda r: (r["gbit"], r["n_tokens"]))
    print(table(ROW_HEADERS, [row_of(r) for r in records]))
    print()
    print(table(["cell", "best uniform", "its exposed s", "dp exposed s", "dp - uniform s", "spread s", "DP <= uniform",
                 "DP plan is"],
                [[k, v["best_uniform"], v.get("uniform_exposed_s", ""), v.get("dp_exposed_s", ""),
                  v.get("difference_s", ""), v.get("spread_s", ""), v["verdict"], v.get("dp_plan_is") or "its own"]
                 for k, v in verdicts.items()]))


def merge(names: list[str], out: str) -> None:
    """Join the results of runs split by prompt size (and link) into one JSON, table and plot."""
    parts = [json.loads((RESULTS / f"{name}.json").read_text()) for name in names]
    models = {json.dumps(p["costs"]["model"], sort_keys=True) for p in parts}
    if len(models) != 1:
        raise SystemExit(f"the parts used {len(models)} different cost models; merge parts made with one --costs")
    commands = list(dict.fromkeys([parts[0]["costs"]["command"], *(p["command"] for p in parts)]))
    payload = {**parts[0], "results": [r for p in parts for r in p["results"]],
               "dp_plans": {k: v for p in parts for k, v in p["dp_plans"].items()},
               "verdicts": {f"{g:g}/{n}": verdict([r for r in (r for p in parts for r in p["results"])
                                                  if r["gbit"] == g and r["n_tokens"] == n])
                            for g, n in dict.fromkeys((r["gbit"], r["n_tokens"]) for p in parts for r in p["results"])},
               "reps": {name: p["reps"] for name, p in zip(names, parts)},
               "commands": commands + [f"python -m bench.cross_host --merge {','.join(names)} --out {out}"]}
    payload.pop("command", None)
    report(payload["results"], payload["verdicts"])
    write_json(out, payload)
    plot(payload["results"], RESULTS / f"{out}.png")


def plot(records, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gbits = sorted({r["gbit"] for r in records})
    # top: the exposed hand-off, median with the rounds' min..max; bottom: the tail after compute (log)
    fig, axes = plt.subplots(2, len(gbits), figsize=(6 * len(gbits), 7), squeeze=False)
    for col, g in enumerate(gbits):
        for row, key in enumerate(("exposed_s", "tail_s")):
            ax = axes[row][col]
            for mode in dict.fromkeys(r["mode"] for r in records if r["mode"] != "local"):
                rs = sorted((r for r in records if r["gbit"] == g and r["mode"] == mode), key=lambda r: r["n_tokens"])
                if not rs:
                    continue
                x = [r["n_tokens"] for r in rs]
                y = [r[key] * 1e3 for r in rs]
                if key == "exposed_s":
                    lo = [(r[key] - min(u[key] for u in r["runs"])) * 1e3 for r in rs]
                    hi = [(max(u[key] for u in r["runs"]) - r[key]) * 1e3 for r in rs]
                    ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=mode)
                else:
                    ax.plot(x, [max(v, 1e-2) for v in y], marker="o", label=mode)
            ax.set_xscale("log", base=2)
            if row == 0:
                ax.axhline(0, color="grey", lw=0.5)
                ax.set_title(f"{g:g} Gbit/s")
                ax.set_ylabel("exposed hand-off vs local prefill (ms)")
            else:
                ax.set_yscale("log")
                ax.set_ylabel("tail after compute (ms)")
            ax.set_xlabel("prompt tokens")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


