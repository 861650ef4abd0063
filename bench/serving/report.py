"""The serving benchmarks' output: the terminal table and the plots against concurrency."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

import numpy as np

from bench._common import ROOT, table

# (figure key, title, unit scale, log y axis) per panel
THROUGHPUT_PANELS = (("output_tok_s", "output tokens/s", 1.0, False), ("req_s", "requests/s", 1.0, False))
LATENCY_PANELS = (("ttft_p50", "TTFT p50 ms", 1e3, True), ("itl_p50", "ITL p50 ms", 1e3, True),
                  ("itl_p99", "ITL p99 ms", 1e3, True))


def command_line() -> str:
    """The exact command as it can be typed again from the repository root (the interpreter is in `machine`):
    `python -m bench.MODULE ...` for a module run by itself, `python -m bench NAME ...` through the registry."""
    first = sys.argv[0]
    if not first.endswith(".py"):  # bench/cli.py set it to "PROG NAME"
        return shlex.join(["python", "-m", "bench", first.split()[-1], *sys.argv[1:]])
    script = Path(first).resolve()
    if script.is_relative_to(ROOT):
        return shlex.join(["python", "-m", ".".join(script.relative_to(ROOT).with_suffix("").parts), *sys.argv[1:]])
    return shlex.join(["python", str(script), *sys.argv[1:]])


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def serve_table(results: dict, ratios: dict, baseline: str | None) -> str:
    """One row per (target, level): the medians over rounds, the total errors, the ratio to the baseline."""
    headers = ["target", "c", "tok/s", "req/s", "TTFT p50 ms", "p99", "ITL p50 ms", "p99", "tok/chunk", "TPOT p50 ms",
               "E2E p50 s", "p99", "errors"] + ([f"x {baseline}"] if baseline else [])
    rows = []
    for name, per_c in results.items():
        for c, v in per_c.items():
            m = v["median"]
            ratio = ratios.get(name, {}).get(c)
            rows.append([name, c, f"{m['output_tok_s']:.1f}", f"{m['req_s']:.2f}", ms(m["ttft_p50"]),
                         ms(m["ttft_p99"]), ms(m["itl_p50"]), ms(m["itl_p99"]),
                         "-" if m.get("tokens_per_chunk") is None else f"{m['tokens_per_chunk']:.2f}",
                         ms(m.get("tpot_p50")), secs(m["e2e_p50"]),
                         secs(m["e2e_p99"]), v["totals"]["errors"]]
                        + ([f"{ratio:.2f}" if ratio else "-"] if baseline else []))
    return table(headers, rows)


def plot_against_concurrency(path: Path, results: dict, levels, panels, title: str) -> Path:
    """One panel per figure, one line per target, the medians over rounds against concurrent clients."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (key, label, scale, log_y) in zip(axes[0], panels):
        for name, per_c in results.items():
            ys = [per_c[c]["median"].get(key) if c in per_c else None for c in levels]
            ax.plot(levels, [y * scale if y is not None else np.nan for y in ys], "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(f"{label} (median over rounds)")
        if log_y:
            ax.set_yscale("log")
            plain = matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}")
            ax.yaxis.set_major_formatter(plain)
            low, high = ax.get_ylim()
            # within about a decade there may be no power of ten on the axis: label the minor ticks then
            ax.yaxis.set_minor_formatter(plain if high / low < 30 else matplotlib.ticker.NullFormatter())
        else:
            ax.set_ylim(bottom=0)
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
