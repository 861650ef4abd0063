"""Speculative decoding at one client, side by side in one run: our stack with n-gram drafts on and off (the same
stack: `speculative: false` turns them off per request), and llama-server on the same GGUF with and without its
own n-gram speculation (`--spec-type ngram-simple`).

Two workloads, greedy, one client, each prompt's output ignore_eos to the same length everywhere:
* copy-heavy: repeat a paragraph, rewrite code with a rename, copy a table (the text is the repository's own);
* chat: ordinary questions, where drafts are rarely accepted.
Figures: the median decode tokens/s of each target over prompts and interleaved rounds ((tokens - 1) /
(end - first token)), the ratio of drafts on to off per mode, and ours against llama-server's n-gram run.
Our texts with drafts on and off are compared prompt by prompt (greedy: they must be equal).

    python -m bench.speculation                    # fpga and hybrid, k=8, 2 rounds, llama-server if built
    python -m bench.speculation --modes fpga --k 4 --rounds 3 --tokens 160
    python -m bench.speculation --k 3 --env HYBRIDSERVE_DECODE_ACTIVATIONS=int8   # our opt-in int8 path
    python -m bench.speculation --k 3 --clients 8 --llama-server none   # 8 requests at once, summed tokens/s
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from bench._common import RESULTS, progress, table, write_json
from bench.serving.client import Target, async_client, one_request, served_model
from bench.serving.servers import Servers, resolve_llama_server

ROOT = Path(__file__).resolve().parents[1]
LLAMA_NGRAM = ("--spec-type", "ngram-simple")  # as llama-server ships it (its default n-gram sizes)
CHAT = ["Write a short story about a dragon who learns to cook.", "What are three good ways to learn a language?",
        "Explain how a bicycle stays upright.", "Give me a plan for a rainy Sunday afternoon."]


def copy_prompts() -> list[str]:
    """Requests whose answers repeat their input, cut from the repository's own text and code."""
    docs = (ROOT / "docs" / "architecture.md").read_text().split("\n\n")
    para = next(p for p in docs if 400 < len(p) < 900 and not p.startswith(("|", "#", "`")))
    code = (ROOT / "services" / "engine" / "ngram_proposer.py").read_text().split("\n\n\n")[2][:1200]
    rows = [line for line in (ROOT / "docs" / "configuration.md").read_text().splitlines() if line.startswith("|")]
    return [f"Repeat the following paragraph exactly, word for word:\n\n{para}",
            f"Rewrite this Python code with the class renamed to DraftIndex, changing nothing else:\n\n{code}",
            "Copy this table, keeping every row as it is:\n\n" + "\n".join(rows[:8])]


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer(rendered, add_special_tokens=False).input_ids


async def one(client, url: str, model: str, prompt: list[int], tokens: int, extra: dict) -> dict:
    """One streamed greedy request (bench.serving.client's): its text, decode tokens/s and accepted drafts."""
    r = await one_request(client, Target("speculation", url, extra, model), prompt, tokens)
    if r["error"]:
        raise RuntimeError(f"{url}: {r['error']}")
    n, decoding = r["tokens"], r["last_token"] - r["ttft"]
    return {"text": r["text"], "tokens": n, "ttft": r["ttft"],
            "decode_tok_s": (n - 1) / decoding if decoding > 0 else None,
            "accepted": (r["usage"].get("completion_tokens_details") or {}).get("accepted_prediction_tokens")}


def run(targets: dict[str, tuple[str, dict]], work: dict[str, list[list[int]]], tokens: int, rounds: int,
        clients: int = 1) -> tuple[dict, dict]:
    """Per target, per workload: every request's result, rounds interleaved (targets in turn each round), and
    with `clients` > 1 the summed decode tokens/s of each set of `clients` requests sent at once (the
    workload's prompts in turn)."""
    results = {t: {w: [] for w in work} for t in targets}
    together = {t: {w: [] for w in work} for t in targets}

    async def go():
        async with async_client(max(2, clients)) as client:
            models = {t: served_model(url) for t, (url, _) in targets.items()}
            for r in range(rounds):
                order = list(targets) if r % 2 == 0 else list(reversed(targets))
                for t in order:
                    url, extra = targets[t]
                    progress(f"round {r + 1}/{rounds}: {t}")
                    for w, prompts in work.items():
                        if clients == 1:
                            for p in prompts:
                                results[t][w].append(await one(client, url, models[t], p, tokens, extra))
                            continue
                        sent = [prompts[i % len(prompts)] for i in range(clients)]
                        rs = await asyncio.gather(*(one(client, url, models[t], p, tokens, extra) for p in sent))
                        results[t][w].extend(rs)
                        together[t][w].append(sum(x["decode_tok_s"] or 0.0 for x in rs))

    asyncio.run(go())
    return results, together


def summary(results: dict, together: dict) -> dict:
    """Per target and workload: the median decode tokens/s of a request (one client) or of a set of requests
    sent at once (summed over them), and the median accepted drafts of a request."""
    return {t: {w: {"decode_tok_s_median": statistics.median(together[t][w]) if together[t][w] else
                    statistics.median(x["decode_tok_s"] for x in rs if x["decode_tok_s"]),
                    "accepted_median": statistics.median(x["accepted"] or 0 for x in rs)}
                for w, rs in per.items()} for t, per in results.items()}


def plot(s: dict, path: Path, clients: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, workloads = list(s), ["copy", "chat"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for i, t in enumerate(names):
        ax.bar([w + i * width for w in range(len(workloads))], [s[t][w]["decode_tok_s_median"] for w in workloads],
               width, label=t)
    ax.set_xticks([w + 0.4 - width / 2 for w in range(len(workloads))], workloads)
    ax.set_ylabel(f"decode tokens/s, {clients} client{'s' if clients > 1 else ''} (median)")
    ax.set_title("n-gram speculative decoding")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="fpga,hybrid")
    ap.add_argument("--k", type=int, default=8, help="our drafts per step (HYBRIDSERVE_*_SPECULATIVE_K)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llama-server", default="auto", help="PATH, auto (bench/llama_server.py's build) or none")
    ap.add_argument("--llama-threads", type=int, default=2,
                    help="llama-server's threads (1 where other work shares the cores: 2 spinning threads beside "
                         "it give void figures)")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for our stack (repeatable)")
    ap.add_argument("--clients", type=int, default=1,
                    help="requests sent at once, each set's decode tokens/s summed (ours only: --llama-server none)")
    ap.add_argument("--name", default="speculation")
    args = ap.parse_args()
    if args.clients > 1 and args.llama_server != "none":
        ap.error("--clients > 1 measures our stack alone: add --llama-server none")
    from services.model.checkpoint import locate
    from services.model.tokenizer import load_tokenizer
    from services.settings import CommonSettings

    tokenizer = load_tokenizer(locate(CommonSettings().model))
    work = {"copy": [chat_ids(tokenizer, p) for p in copy_prompts()], "chat": [chat_ids(tokenizer, p) for p in CHAT]}
    servers, targets = Servers(), {}
    with tempfile.TemporaryDirectory(prefix="hybridserve-spec-") as tmp:
        try:
            env = {**{f"HYBRIDSERVE_{e}_SPECULATIVE_K": str(args.k) for e in ("PREFILL", "DECODE")},
                   **dict(e.split("=", 1) for e in args.env)}
            url = servers.start_stack(Path(tmp) / "stack.log", extra_env=env)
            for mode in args.modes.split(","):
                targets[f"{mode} drafts"] = (url, {"mode": mode})
                targets[f"{mode} no drafts"] = (url, {"mode": mode, "speculative": False})
            binary = None if args.llama_server == "none" else resolve_llama_server(args.llama_server)
            if binary:
                ctx = max(len(p) for ps in work.values() for p in ps) + args.tokens + 16
                for name, extra in (("llama-server", ()), ("llama-server ngram", LLAMA_NGRAM)):
                    log = Path(tmp) / f"{name}.log"
                    targets[name] = (servers.start_llama_server(binary, 1, ctx, args.llama_threads, log, name=name,
                                                                extra=extra), {})
            results, together = run(targets, work, args.tokens, args.rounds, args.clients)
        finally:
            servers.stop()
    s = summary(results, together)
    same = {m: all(a["text"] == b["text"] for w in work
                   for a, b in zip(results[f"{m} drafts"][w], results[f"{m} no drafts"][w]))
            for m in args.modes.split(",")}
    rows = []
    for t, per in s.items():
        mode = t.split()[0]
        base = s.get(f"{mode} no drafts") if t.endswith(" drafts") and not t.endswith("no drafts") else None
        llama = s.get("llama-server ngram")
        for w, v in per.items():
            rows.append([t, w, f"{v['decode_tok_s_median']:.1f}",
                         f"{v['decode_tok_s_median'] / base[w]['decode_tok_s_median']:.2f}" if base else "-",
                         f"{v['decode_tok_s_median'] / llama[w]['decode_tok_s_median']:.2f}" if llama else "-",
                         f"{v['accepted_median']:.0f}"])
    print(table(["target", "workload", "decode tok/s (median)", "x no drafts", "x llama ngram", "accepted (median)"],
                rows))
    print("texts with drafts equal to without, per mode:", same)
    plot(s, RESULTS / f"{args.name}.png", args.clients)
    write_json(args.name, {"args": vars(args), "summary": s, "same_text": same,
                           "results": {t: {w: [{k: v for k, v in x.items() if k != "text"} for x in rs]
                                           for w, rs in per.items()} for t, per in results.items()}})
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
