"""The contract every engine implements, so generation, services and tests treat them alike.

An engine owns a device and the model's weights on it. It does not sample
(except greedy argmax, which a device may do to avoid reading back logits) and
knows nothing of text or requests: token ids in, logits or token ids out.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

from services.model.config import ModelConfig


class EngineFull(RuntimeError):
    """The engine holds as many sequences as it can; a later request may fit (back-pressure)."""


class Engine(Protocol):
    cfg: ModelConfig
    device_name: str  # human-readable device, for Info and logs

    def new_sequence(self, capacity: int) -> Any:
        """Allocate KV for one sequence of up to `capacity` positions."""

    def prefill(self, seq: Any, token_ids: list[int], on_layer: Callable[[int], None] | None = None) -> np.ndarray:
        """Fill `seq` with the prompt; float32 logits of its last position, [vocab]."""

    def decode(self, seqs: list[Any], tokens: list[int]) -> np.ndarray:
        """Append one token to each sequence; float32 logits [B, vocab]."""

    def decode_greedy(self, seqs: list[Any], tokens: list[int]) -> list[int]:
        """As decode, but return each row's argmax (first index on ties), possibly computed on the device."""

    def import_kv_layer(self, seq: Any, layer: int, kv: np.ndarray) -> None:
        """Hybrid mode, receiving side: write one layer of wire-layout KV into positions [0, n_tokens).

        kv: [2 (k|v), n_kv_heads, n_tokens, head_dim], float32 or float16 (services/kv/layout.py).
        May only enqueue the copy; `finish_import` waits for all of them.
        """

    def finish_import(self, seq: Any, n_tokens: int) -> None:
        """All layers imported: wait until they are on the device and mark `n_tokens` positions filled."""

    def release(self, seq: Any) -> None:
        """Free the sequence's KV."""
