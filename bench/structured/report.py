"""The evaluation's figures from its rows: each request scored (structured/score.py), rates per target
and variant, the grammar's ITL against the free replies', the checks against the targets, the table
and the plot."""
from __future__ import annotations

import statistics
from pathlib import Path

from bench._common import table
from bench.serving.stats import pct
from bench.structured.score import schema_errors, score, same_as_free, json_in_reply


def scored(prompts, phases: dict[str, list[dict]]) -> list[dict]:
    """One target's rows (phases: variant -> rows in the prompts' order), each with its score, and for
    the constrained variants whether its object equals the JSON in the free reply to the same request."""
    free = {r["id"]: r for r in phases.get("free", [])}
    schemas = {p.id: p.schema for p in prompts}
    out = []
    for variant, rows in phases.items():
        for r in rows:
            row = {k: v for k, v in r.items() if k != "itl"}
            row["itl_n"] = len(r.get("itl") or [])
            if r["error"] is None:
                if variant == "free":
                    value = json_in_reply(r["text"])
                    row.update(free_json=value is not None,
                               free_schema_valid=value is not None and schema_errors(value, schemas[r["id"]]) is None)
                else:
                    s = score(r["text"], schemas[r["id"]])
                    row.update(valid=s["valid"], schema_valid=s["schema_valid"], schema_error=s["error"],
                               same_as_free=same_as_free(s["value"], free.get(r["id"], {}).get("text")))
            out.append(row)
    return out


def rate(xs) -> float | None:
    xs = list(xs)
    return sum(map(bool, xs)) / len(xs) if xs else None


def summary(rows: list[dict], itl: dict[str, list[float]]) -> dict:
    """Per variant: requests, errors, finish reasons, validity rates, tokens, agreement with the free
    reply, and the ITL p50 over every gap of the variant's requests."""
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == variant]
        ok = [r for r in rs if r["error"] is None]
        stop = [r for r in ok if r["finish_reason"] == "stop"]
        tokens = [r["tokens"] for r in ok if r["tokens"] is not None]
        v = {"requests": len(rs), "errors": len(rs) - len(ok), "stop": len(stop),
             "length": sum(r["finish_reason"] == "length" for r in ok),
             "tokens_median": statistics.median(tokens) if tokens else None,
             "itl_p50": pct(itl.get(variant, []), 50), "itl_p90": pct(itl.get(variant, []), 90)}
        if variant == "free":
            v.update(free_json=rate(r["free_json"] for r in ok),
                     free_schema_valid=rate(r["free_schema_valid"] for r in ok))
        else:
            compared = [r["same_as_free"] for r in ok if r["same_as_free"] is not None]
            v.update(valid=rate(r["valid"] for r in ok), schema_valid=rate(r["schema_valid"] for r in ok),
                     schema_valid_on_stop=rate(r["schema_valid"] for r in stop),
                     tokens_valid_median=statistics.median([r["tokens"] for r in ok if r["schema_valid"]] or [0]),
                     same_as_free=rate(compared), compared_with_free=len(compared))
        out[variant] = v
    return out


def checks(summaries: dict[str, dict], baseline: str | None) -> list[dict]:
    """The issue's targets: every constrained reply that stopped is schema-valid, in every target; and
    ours close schema-valid objects at least as often as the baseline (llama-server), variant by variant."""
    out = []
    for name, s in summaries.items():
        for variant in ("greedy", "sampled"):
            if variant in s:
                r = s[variant]["schema_valid_on_stop"]
                out.append({"check": f"{name} {variant}: schema-valid whenever finish_reason is stop",
                            "value": r, "ok": r == 1.0})
                if baseline and name != baseline and variant in summaries.get(baseline, {}):
                    ours, theirs = s[variant]["schema_valid"], summaries[baseline][variant]["schema_valid"]
                    out.append({"check": f"{name} {variant}: schema-valid at least as often as {baseline}",
                                "value": [ours, theirs], "ok": ours is not None and theirs is not None and ours >= theirs})
    return out


def pc(x) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def eval_table(summaries: dict[str, dict]) -> str:
    headers = ["target", "variant", "n", "err", "stop", "length", "valid", "schema-valid", "valid on stop",
               "tokens p50", "= free", "ITL p50 ms", "free: JSON in reply"]
    rows = []
    for name, s in summaries.items():
        for variant, v in s.items():
            if variant == "free":
                rows.append([name, variant, v["requests"], v["errors"], v["stop"], v["length"], "-", "-", "-",
                             v["tokens_median"], "-", ms(v["itl_p50"]),
                             f"{pc(v['free_json'])} (schema-valid {pc(v['free_schema_valid'])})"])
            else:
                rows.append([name, variant, v["requests"], v["errors"], v["stop"], v["length"], pc(v["valid"]),
                             pc(v["schema_valid"]), pc(v["schema_valid_on_stop"]), v["tokens_median"],
                             f"{pc(v['same_as_free'])} of {v['compared_with_free']}", ms(v["itl_p50"]), ""])
    return table(headers, rows)


def by_shape(rows: list[dict], prompts) -> dict[str, dict[str, float | None]]:
    """Schema-valid rate per prompt shape and constrained variant (the plot's second panel)."""
    shape = {p.id: p.shape for p in prompts}
    out: dict[str, dict] = {}
    for r in rows:
        if r["variant"] != "free" and r["error"] is None:
            out.setdefault(f"{r['variant']}", {}).setdefault(shape[r["id"]], []).append(r["schema_valid"])
    return {v: {s: rate(xs) for s, xs in per.items()} for v, per in out.items()}


def plot(path: Path, summaries: dict[str, dict], title: str) -> Path:
    """Schema-valid replies per target (greedy, sampled; the free replies' JSON beside them), and the
    ITL p50 with the grammar against the free replies'."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(summaries)
    x = np.arange(len(names))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars = (("greedy", "schema_valid", "greedy, schema-valid"), ("sampled", "schema_valid", "sampled, schema-valid"),
            ("free", "free_schema_valid", "free reply's JSON schema-valid"))
    for k, (variant, key, label) in enumerate(bars):
        ys = [(summaries[n].get(variant) or {}).get(key) for n in names]
        a.bar(x + (k - 1) * 0.27, [100 * y if y is not None else 0 for y in ys], 0.27, label=label)
    a.set_xticks(x, names, rotation=20, fontsize=8)
    a.set_ylabel("% of requests")
    a.set_ylim(0, 125)  # room above the bars for the legend
    a.set_title("closed, schema-valid objects within max_tokens")
    a.legend(fontsize=7, loc="upper left", ncol=3)
    for k, variant in enumerate(("free", "greedy", "sampled")):
        ys = [(summaries[n].get(variant) or {}).get("itl_p50") for n in names]
        b.bar(x + (k - 1) * 0.27, [1e3 * y if y is not None else 0 for y in ys], 0.27, label=variant)
    b.set_xticks(x, names, rotation=20, fontsize=8)
    b.set_ylabel("ITL p50 ms")
    b.set_title("inter-token latency: free text vs with the grammar")
    b.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
