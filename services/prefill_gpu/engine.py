"""The PyTorch engine: CUDA when present, else the CPU, same code.

BatchEngine (services/engine/api.py): `step` over the scheduler's chunks, whose KV lives in a
paged pool (batched_step.py and kv_pool.py); hand-offs export and import whole layers of blocks.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from services.engine.batching_settings import BatchingSettings
from services.model.config import ModelConfig
from services.model.weights import ModelWeights
from services.prefill_gpu.batched_step import MIN_GEMM_ROWS, plan_step, run_step
from services.prefill_gpu.cpu_matmul import invariant_floor, request_strict_mkl
from services.prefill_gpu.cuda_graphs import StepGraphs
from services.prefill_gpu.kv_pool import PagedKVPool
from services.prefill_gpu.model import LlamaTorch

if TYPE_CHECKING:
    from services.engine.scheduler import ScheduledChunk

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


def pick_fused(name: str, device: torch.device) -> bool:
    """Whether the model runs its fused kernels (LlamaTorch's `fused`): "auto" = on CUDA only.

    On CUDA a step of a small model is bound by its kernel count, and its rows agree with
    transformers to rounding already (cuBLAS picks kernels by shape); on the CPU the unfused
    forward is bit for bit transformers', which the tests hold it to."""
    if name not in ("auto", "on", "off"):
        raise ValueError(f"fused_ops must be 'auto', 'on' or 'off', got {name!r}")
    return device.type == "cuda" if name == "auto" else name == "on"


def pick_layout(name: str, device: torch.device) -> str:
    """How the matrices are stored: "in_out" (MKL's faster GEMV layout on the CPU) or "out_in"
    (the checkpoint's, applied by F.linear as nn.Linear is: cuBLAS's); "auto" picks by device."""
    if name not in ("auto", "in_out", "out_in"):
        raise ValueError(f"weight_layout must be 'auto', 'in_out' or 'out_in', got {name!r}")
    return ("out_in" if device.type == "cuda" else "in_out") if name == "auto" else name


class TorchEngine:
    """BatchEngine (services/engine/api.py) over LlamaTorch.

    `batching` sizes the paged pool (kv_cache_mb, block_size) and the step (max_num_batched_tokens);
    default: BatchingSettings()'s. The pool is allocated with torch.empty, so on the CPU its pages
    cost nothing until blocks are written.
    """

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, device: str = "auto", dtype: str = "auto",
                 batching: BatchingSettings | None = None, cuda_graphs: bool = True, fused_ops: str = "auto",
                 weight_layout: str = "auto"):
        self.cfg = cfg
        dev = pick_device(device)
        self.model = LlamaTorch(cfg, weights, dev, pick_dtype(dtype, dev), fused=pick_fused(fused_ops, dev),
                                out_in=pick_layout(weight_layout, dev) == "out_in")
        self.device = dev
        self.device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        batching = batching or BatchingSettings()
        self.kv_pool = PagedKVPool(cfg, batching.kv_cache_mb, batching.block_size, dev, self.model.dtype)
        self.block_size = self.kv_pool.block_size
        self.num_blocks = self.kv_pool.num_blocks
        self.max_num_batched_tokens = batching.step_rows()  # a queue of prompts may stretch a step to it
        self.max_num_seqs = batching.max_num_seqs
        # on CUDA, decode-only steps and lone prefill chunks replay captured graphs (cuda_graphs.py)
        self.graphs = (StepGraphs(self.model, self.kv_pool, self.max_num_batched_tokens, self.max_num_seqs,
                                  cfg.max_context) if cuda_graphs and dev.type == "cuda" else None)
        self.min_gemm_rows = self._row_floor()
        log.info("torch engine on %s (%s), %d threads; KV pool %d blocks of %d tokens (%d MiB); matmuls of %d+ rows",
                 self.device_name, self.model.dtype, torch.get_num_threads(), self.num_blocks, self.block_size,
                 self.kv_pool.nbytes >> 20, self.min_gemm_rows)

    def _row_floor(self) -> int:
        """Rows every matmul of a step gets at least, so a row's bits never depend on its batch: on the
        CPU what this process's BLAS keeps on the model's own matrices (cpu_matmul.py), measured once
        per shape; 1 on CUDA (batched_step.min_gemm_rows)."""
        if self.device.type == "cuda":
            return 1
        mkl = request_strict_mkl()
        products, key = self.model.row_products()
        floor = invariant_floor(products, self.model.dtype, key)
        if floor is None:
            log.warning("no row count keeps a row's bits on this CPU (MKL: %s): gpu mode's greedy tokens may "
                        "depend on the requests that share their step; padding to %d rows", mkl, MIN_GEMM_ROWS)
            return MIN_GEMM_ROWS
        log.info("batch invariance on this CPU (MKL: %s): a row keeps its bits from %d rows up", mkl, floor)
        return floor

    @classmethod
    def from_settings(cls, loaded, settings) -> "TorchEngine":
        """From a loaded model and PrefillSettings (device, dtype and the batching knobs)."""
        batching = BatchingSettings(**{name: getattr(settings, name) for name in BatchingSettings.model_fields})
        return cls(loaded.config, loaded.weights, device=settings.device, dtype=settings.dtype, batching=batching,
                   cuda_graphs=settings.cuda_graphs, fused_ops=settings.fused_ops,
                   weight_layout=settings.weight_layout)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.model.dtype

    # ---- BatchEngine: steps over the paged pool ---------------------------------------------
    def step(self, chunks: Sequence["ScheduledChunk"], greedy: bool,
             on_layer: Callable[[int], None] | None = None) -> list[int] | np.ndarray:
        """Every chunk's rows in one forward; ValueError on rows past max_num_batched_tokens, a
        position past a block table, a block id outside the pool or a token id outside the vocab."""
        if self.graphs is not None and on_layer is None:
            out = self.graphs.step(chunks, greedy)
            if out is not None:
                return out
        plan = plan_step(chunks, self.kv_pool, self.max_num_batched_tokens, self.cfg.vocab_size, self.min_gemm_rows)
        return run_step(self.model, self.kv_pool, plan, greedy, on_layer)

    def import_kv_blocks(self, block_table: Sequence[int], layer: int, kv: np.ndarray) -> None:
        self.kv_pool.import_layer(block_table, layer, kv)

    def finish_import_blocks(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def read_kv_blocks(self, block_table: Sequence[int], n_tokens: int) -> np.ndarray:
        return self.kv_pool.read(block_table, n_tokens)

    def export_kv_blocks(self, block_table: Sequence[int], layer: int, n_tokens: int) -> torch.Tensor:
        """Layer `layer` of positions [0, n_tokens) in wire layout, [2, n_kv_heads, n_tokens, head_dim], on the
        device in the engine's dtype (what a hand-off sends)."""
        return self.kv_pool.export_layer(block_table, layer, n_tokens)
