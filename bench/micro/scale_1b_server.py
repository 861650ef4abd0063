"""llama-server's decode step on a GGUF file, for scale_1b.py where llama-batched-bench is absent (the
cached llama-server binary, bench/llama_server.py, is what this host has).

The server starts once on loopback with `threads` threads and `slots` slots; each measurement sends
`batch` concurrent streamed /completion requests, each a prompt of `context` random token ids (no
prompt cache) and `steps` generated tokens (ignore_eos, greedy). A request's step time is the median
interval between its streamed tokens (the first, after the prompt, left out), as our engine's figure is
the median of its steps: a pause of the whole machine (another process's latency measurement freezing
niced processes, a busy core) lands in one interval, not in the figure, as it would in the server's own
per-request mean (`predicted_per_token_ms`, recorded beside it). The median over the batch's requests
is the figure.
"""
from __future__ import annotations

import json
import socket
import statistics
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama-server process on `gguf` (close() ends it)."""

    def __init__(self, binary: Path, gguf: Path, slots: int, ctx_per_slot: int, threads: int, timeout: float = 300):
        from bench.llama_server import library_env, serve_command

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = serve_command(binary, gguf, slots, ctx_per_slot, threads, self.port)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=library_env(binary))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}): {self.proc.stderr.read()[-2000:]!r}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"llama-server not healthy within {timeout:.0f} s")

    def _one(self, prompt: list[int], steps: int) -> tuple[float, float]:
        """(median seconds between streamed tokens, the server's own mean seconds a token)."""
        body = {"prompt": prompt, "n_predict": steps, "ignore_eos": True, "temperature": 0.0, "cache_prompt": False,
                "stream": True}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        arrivals, last = [], {}
        with urllib.request.urlopen(req, timeout=1800) as r:  # a paused machine (minutes) is not an error
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                arrivals.append(time.perf_counter())
                last = json.loads(line[6:])
                if last.get("stop"):
                    break
        timings = last.get("timings", {})
        if int(timings.get("predicted_n", -1)) != steps:
            raise RuntimeError(f"llama-server generated {timings.get('predicted_n')} tokens, not {steps}")
        gaps = np.diff(arrivals[:steps])  # token i's arrival after token i - 1's (the last event: the summary)
        return float(np.median(gaps)), float(timings["predicted_per_token_ms"]) / 1e3

    def step_seconds(self, batch: int, context: int, steps: int, seed: int = 0) -> tuple[float, float]:
        """(seconds per decode step at `batch` sequences, the server's own figure): medians over the requests."""
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(100, 30000, size=context).tolist() for _ in range(batch)]
        with ThreadPoolExecutor(batch) as pool:
            got = list(pool.map(lambda p: self._one(p, steps), prompts))
        return statistics.median(g for g, _ in got), statistics.median(o for _, o in got)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
