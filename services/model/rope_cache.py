"""RoPE's inverse frequencies kept on disk once computed, so decode_fpga never imports torch.

architecture.rope_inv_freq computes them with torch, step by step as transformers does, which is
what makes both engines' angles the reference's bit for bit (numpy's float32 `power` differs from
torch's in the last bit: 615 values over 8 thetas x 8 head dims). It is the only thing decode_fpga
needs torch for, and `import torch` was ~2.7 s of CPU and ~300 MB of a decode engine's start. The
values are kept as a .npy file named by everything they depend on (theta, head dim, scaling, the
file's frequency factors, torch's version and rope_inv_freq's own source, so a change to it is never
answered from an older entry), written whole or not at all; a cache that cannot be read or written
only costs the import.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import os
import tempfile
from importlib import metadata
from pathlib import Path

import numpy as np

from services.model.architecture import RopeScaling, rope_inv_freq

log = logging.getLogger(__name__)

CACHE = "~/.cache/hybridserve/rope"


def cached_inv_freq(theta: float, head_dim: int, scaling: RopeScaling = RopeScaling(),
                    freq_factors: np.ndarray | None = None, cache_dir: str | None = CACHE) -> np.ndarray:
    """rope_inv_freq's values, from `cache_dir` when computed before (None: always computed)."""
    key = _key(theta, head_dim, scaling, freq_factors) if cache_dir is not None else None
    if key is None:
        return rope_inv_freq(theta, head_dim, scaling, freq_factors)
    path = Path(cache_dir).expanduser() / f"{key}.npy"
    try:
        inv = np.load(path, allow_pickle=False)
        if inv.dtype == np.float32 and inv.shape == (head_dim // 2,):
            return inv
        log.warning("cached RoPE frequencies %s have the wrong shape or type: computing them again", path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:  # a damaged entry: computed again and replaced
        log.warning("cached RoPE frequencies %s unreadable (%s): computing them again", path, exc)
    inv = rope_inv_freq(theta, head_dim, scaling, freq_factors)
    _keep(inv, path)
    return inv


def _key(theta: float, head_dim: int, scaling: RopeScaling, freq_factors: np.ndarray | None) -> str | None:
    """The entry's name; None (no caching) where rope_inv_freq's source cannot be read (an install
    without .py files), since a change to it could then not be told from an older entry."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "none"
    try:
        code = inspect.getsource(rope_inv_freq)
    except (OSError, TypeError):
        return None
    parts = [repr(float(theta)), str(int(head_dim)), repr(dataclasses.astuple(scaling)), torch_version, code]
    factors = b"none" if freq_factors is None else np.ascontiguousarray(freq_factors, np.float32).tobytes()
    return hashlib.sha256("|".join(parts).encode() + b"|" + factors).hexdigest()[:32]


def _keep(inv: np.ndarray, path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, inv, allow_pickle=False)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        log.debug("RoPE frequencies not cached at %s: %s", path, exc)
