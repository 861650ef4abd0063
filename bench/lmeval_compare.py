"""A real evaluation client against the stack: lm-evaluation-harness's `local-completions` model on a
small multiple-choice task written for this project (bench/lmeval/), in each mode (gpu, fpga, hybrid),
against lm-eval's own `hf` backend on the same checkpoint. Same accuracy, and every (question, choice)
loglikelihood within 1e-3 of hf's, is what the OpenAI API's echo + logprobs must give.

lm-eval lives in a venv of its own (it must not change the project's): make it once with

    python -m venv ~/.cache/hybridserve/lmeval-venv
    ~/.cache/hybridserve/lmeval-venv/bin/pip install -c bench/lmeval/constraints.txt 'lm-eval[api]==0.4.13' \
        torch==2.13.0 transformers gguf accelerate sentencepiece

then, from the project's venv:

    python -m bench.lmeval_compare [--lm-eval ~/.cache/hybridserve/lmeval-venv/bin/lm_eval]
                                   [--modes gpu,fpga,hybrid] [--batch-size 8] [--url http://127.0.0.1:8000]

* The `hf` side reads the default model as a Hugging Face directory that this script writes once from
  the GGUF (transformers dequantizes it; the engines compute on the same numbers from the GGUF's blocks).
* The stack is started (`hybridserve up` on free ports) unless `--url` names a running gateway. lm-eval
  sends no extra body fields, so each mode is forced by a small loopback proxy that adds `"mode"` to
  every request body on its way to the gateway.
* `--batch-size` > 1 makes lm-eval send that many prompts in one request (`prompt` as a list).
* Per-request loglikelihoods come from lm-eval's `--log_samples` output; the table and
  bench/results/lmeval_compare.json give each backend's accuracy and the largest difference from hf's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from bench._common import ROOT, progress, table, write_json

TASK_DIR = ROOT / "bench" / "lmeval"
TASK = "hybridserve_mc"
TOL = 1e-3
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}


def hf_directory(out: Path) -> tuple[Path, str]:
    """The default model as a Hugging Face directory (weights + tokenizer), written once; its model id."""
    from services.model.checkpoint import locate

    ckpt = locate(None)
    target = out / ckpt.model_id
    if not (target / "config.json").exists():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        progress(f"writing {ckpt.path.name} as a Hugging Face directory in {target}")
        kw = {"gguf_file": ckpt.path.name}
        loaded = AutoModelForCausalLM.from_pretrained(str(ckpt.path.parent), dtype=torch.float32, **kw)
        # transformers will not save a model it loaded from a GGUF: the same numbers into a plain one
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(target, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(ckpt.path.parent), **kw).save_pretrained(target)
        del model, loaded
    return target, ckpt.model_id


class ModeProxy:
    """Loopback HTTP proxy: every POST body gets `"mode": mode` and goes to the gateway; the answer comes back."""

    def __init__(self, gateway: str, mode: str):
        client = httpx.Client(base_url=gateway, timeout=600)
        self.requests, self.prompts = 0, 0  # what lm-eval sent: HTTP requests, prompts in them
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body.get("prompt")
                proxy.requests += 1
                proxy.prompts += len(prompt) if isinstance(prompt, list) and not isinstance(prompt[0], int) else 1
                # lm-eval sends "Bearer " with no key set: passed on only when it carries one
                auth = (self.headers.get("Authorization") or "").strip()
                r = client.post(self.path, json={**body, "mode": mode},
                                headers={"Authorization": auth} if auth.lower() != "bearer" and auth else {})
                self.send_response(r.status_code)
                self.send_header("Content-Type", r.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def run_lm_eval(lm_eval: str, model: str, model_args: str, out: Path, batch_size: int) -> Path:
    """One lm-eval run of the task; the directory of its results and samples."""
    cmd = [lm_eval, "--model", model, "--model_args", model_args, "--tasks", TASK, "--include_path", str(TASK_DIR),
           "--output_path", str(out), "--log_samples", "--batch_size", str(batch_size)]
    if model == "hf":
        cmd += ["--device", "cpu"]
    progress(" ".join(cmd))
    started = time.perf_counter()
    # the task's data_files are relative to the task directory
    subprocess.run(cmd, check=True, cwd=TASK_DIR, env={**os.environ, **OFFLINE})
    progress(f"lm-eval {model} took {time.perf_counter() - started:.0f} s")
    return out


def read_run(out: Path) -> dict:
    """accuracy and each (doc, choice)'s loglikelihood from one lm-eval output directory."""
    [results] = sorted(out.rglob("results_*.json"))[-1:]
    [samples] = sorted(out.rglob(f"samples_{TASK}_*.jsonl"))[-1:]
    metrics = json.loads(results.read_text())["results"][TASK]
    loglik = {}
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        for j, resp in enumerate(s["resps"]):
            loglik[(s["doc_id"], j)] = float(resp[0][0])
    return {"acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"], "loglik": loglik}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval", default=str(Path.home() / ".cache/hybridserve/lmeval-venv/bin/lm_eval"),
                    help="lm-eval's command, from its own venv")
    ap.add_argument("--modes", default="gpu,fpga,hybrid")
    ap.add_argument("--batch-size", type=int, default=8, help="prompts per completions request")
    ap.add_argument("--url", help="a running gateway (default: start the stack)")
    ap.add_argument("--hf-output", help="an earlier run's hf output directory to read instead of running hf again "
                                        "(it depends only on the checkpoint and the task)")
    ap.add_argument("--work", default=str(Path.home() / ".cache/hybridserve/lmeval"),
                    help="where the HF directory and lm-eval's outputs go")
    args = ap.parse_args()
    if not Path(args.lm_eval).exists():
        sys.exit(f"{args.lm_eval} not found: make lm-eval's venv as the module docstring says")
    work = Path(args.work)
    hf_dir, model_id = hf_directory(work / "hf")
    runs_dir = Path(tempfile.mkdtemp(prefix="lmeval-", dir=work))

    hf_out = Path(args.hf_output) if args.hf_output else run_lm_eval(
        args.lm_eval, "hf", f"pretrained={hf_dir},dtype=float32", runs_dir / "hf", 1)
    runs = {"hf": read_run(hf_out)}
    stack = None
    try:
        if args.url:
            url = args.url
        else:
            from bench._stack import start_stack

            stack = start_stack(runs_dir / "stack.log")
            url = stack.url
        served = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        for mode in args.modes.split(","):
            proxy = ModeProxy(url, mode)
            try:
                model_args = (f"base_url={proxy.url}/v1/completions,model={served},tokenizer={hf_dir},"
                              f"tokenized_requests=True,max_retries=1,timeout=600")
                started = time.perf_counter()
                runs[mode] = read_run(run_lm_eval(args.lm_eval, "local-completions", model_args, runs_dir / mode,
                                                  args.batch_size))
                runs[mode].update(http_requests=proxy.requests, prompts_sent=proxy.prompts,
                                  lm_eval_s=round(time.perf_counter() - started, 1))
            finally:
                proxy.close()
    finally:
        if stack is not None:
            stack.stop()

    ref = runs["hf"]["loglik"]
    rows, report = [], {}
    for name, run in runs.items():
        keys = set(ref) | set(run["loglik"])
        missing = [k for k in keys if k not in ref or k not in run["loglik"]]
        diff = max((abs(run["loglik"][k] - ref[k]) for k in keys if k not in missing), default=0.0)
        report[name] = {"acc": run["acc"], "acc_norm": run["acc_norm"], "loglikelihoods": len(run["loglik"]),
                        **{k: run[k] for k in ("http_requests", "prompts_sent", "lm_eval_s") if k in run},
                        "missing": len(missing), "max_abs_loglik_diff_vs_hf": diff,
                        "same_accuracy_as_hf": run["acc"] == runs["hf"]["acc"]
                        and run["acc_norm"] == runs["hf"]["acc_norm"]}
        rows.append([name, run["acc"], run["acc_norm"], len(run["loglik"]), run.get("http_requests", "-"), diff,
                     "yes" if report[name]["same_accuracy_as_hf"] and diff <= TOL and not missing else "NO"])
    print(table(["backend", "acc", "acc_norm", "loglikelihoods", "HTTP requests", "max |diff| vs hf",
                 "matches hf (1e-3)"], rows))
    write_json("lmeval_compare", {
        "task": TASK, "questions": len({k[0] for k in ref}), "model": model_id, "tolerance": TOL,
        "batch_size": args.batch_size, "lm_eval": "0.4.13", "backends": report,
        "hf_output_reused": bool(args.hf_output),
        # this machine's paths (the lm-eval venv, an earlier hf output) left out of the record
        "command": " ".join(["python -m bench.lmeval_compare", *(a for a in sys.argv[1:] if not a.startswith("/"))])})


if __name__ == "__main__":
    main()
