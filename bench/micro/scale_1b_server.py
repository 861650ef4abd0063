"""llama-server's decode step on a GGUF file, for scale_1b.py where llama-batched-bench is absent (the
cached llama-server binary, bench/llama_server.py, is what this host has).

The server starts once on loopback with `threads` threads and `slots` slots; each measurement sends
`batch` concurrent /completion requests, each a prompt of `context` random token ids (no prompt cache)
and `steps` generated tokens (ignore_eos, greedy), and takes the server's own timing of each request's
generation phase, `predicted_per_token_ms`: a sequence's ms per token, which is the step time when the
batch's sequences decode together. The median over the batch's requests is the figure.
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

    def _one(self, prompt: list[int], steps: int) -> float:
        body = {"prompt": prompt, "n_predict": steps, "ignore_eos": True, "temperature": 0.0, "cache_prompt": False}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        if int(out["timings"]["predicted_n"]) != steps:
            raise RuntimeError(f"llama-server generated {out['timings']['predicted_n']} tokens, not {steps}")
        return float(out["timings"]["predicted_per_token_ms"]) / 1e3

    def step_seconds(self, batch: int, context: int, steps: int, seed: int = 0) -> float:
        """Seconds per decode step at `batch` sequences: the median of the requests' own timings."""
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(100, 30000, size=context).tolist() for _ in range(batch)]
        with ThreadPoolExecutor(batch) as pool:
            return statistics.median(pool.map(lambda p: self._one(p, steps), prompts))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
