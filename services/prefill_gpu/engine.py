"""The PyTorch engine: CUDA when present, else the CPU, same code."""
from __future__ import annotations

import logging

import numpy as np
import torch

from services.model.config import ModelConfig
from services.prefill_gpu.model import LlamaTorch, TorchSequence
from services.model.weights import ModelWeights

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but torch sees no CUDA device")
    return dev


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float32  # parity with the reference and the other engine comes first
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {name!r}")
    if device.type == "cpu" and name != "fp32":
        raise ValueError(f"dtype {name} is for CUDA; the CPU engine computes in fp32")
    return DTYPES[name]


class TorchEngine:
    """Engine (engine_api.py) over LlamaTorch."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, device: str = "auto", dtype: str = "auto"):
        self.cfg = cfg
        dev = pick_device(device)
        self.model = LlamaTorch(cfg, weights, dev, pick_dtype(dtype, dev))
        self.device = dev
        self.device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        log.info("torch engine on %s (%s), %d threads", self.device_name, self.model.dtype, torch.get_num_threads())

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.model.dtype

    def new_sequence(self, capacity: int) -> TorchSequence:
        return self.model.new_sequence(capacity)

    def prefill(self, seq: TorchSequence, token_ids: list[int], on_layer=None) -> np.ndarray:
        return self.model.prefill(seq, token_ids, on_layer).cpu().numpy()

    def decode(self, seqs: list[TorchSequence], tokens: list[int]) -> np.ndarray:
        return self.model.decode(seqs, tokens).cpu().numpy()

    def decode_greedy(self, seqs: list[TorchSequence], tokens: list[int]) -> list[int]:
        return self.model.decode(seqs, tokens).argmax(dim=-1).tolist()

    def import_kv_layer(self, seq: TorchSequence, layer: int, kv: np.ndarray) -> None:
        n = kv.shape[2]
        src = torch.from_numpy(np.ascontiguousarray(kv)).to(self.device, self.model.dtype)
        seq.k[layer, :, :n] = src[0]
        seq.v[layer, :, :n] = src[1]

    def finish_import(self, seq: TorchSequence, n_tokens: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seq.length = n_tokens

    def export_kv_layer(self, seq: TorchSequence, layer: int, n_tokens: int) -> torch.Tensor:
        """Layer `layer` of the cache in wire layout, [2, n_kv_heads, n_tokens, head_dim], on the device."""
        return torch.stack([seq.k[layer, :, :n_tokens], seq.v[layer, :, :n_tokens]])

    def release(self, seq: TorchSequence) -> None:
        seq.k = seq.v = None  # drop the tensors now, not when the last reference goes
