"""One call that turns a model setting into (checkpoint, config, weights)."""
from __future__ import annotations

from dataclasses import dataclass

from services.model.checkpoint import Checkpoint, locate
from services.model.config import ModelConfig, read_config
from services.model.weights import ModelWeights, load_weights


@dataclass(frozen=True)
class LoadedModel:
    checkpoint: Checkpoint
    config: ModelConfig
    weights: ModelWeights


def load_model(model: str | None = None, gguf_matrices: bool = True) -> LoadedModel:
    """gguf_matrices=False: a GGUF file's matrices are not dequantized (weights.load_weights)."""
    ckpt = locate(model)
    cfg = read_config(ckpt)
    return LoadedModel(ckpt, cfg, load_weights(ckpt, cfg, gguf_matrices))
