"""What the OpenCL engine is asked for (EngineConfig), and what that comes to on one device (DeviceFit).

`EngineConfig` is frozen and checked when it is made: a bad value fails at start,
not at the first request. `DeviceFit` holds what is derived from it, the model's
shape and the device once, at start-up (the context actually served, the rows the
scratch buffers hold, whether a decode step may run as one launch); the config
itself is never rewritten.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyopencl as cl

from services.decode_fpga.arch_parts import one_launch_takes
from services.decode_fpga.device import DeviceContext
from services.decode_fpga.device_weights import WEIGHT_FORMATS
from services.decode_fpga.settings import DecodeSettings
from services.engine.batching_settings import DEFAULT_KV_CACHE_MB
from services.model.config import ModelConfig


@dataclass(frozen=True)
class EngineConfig:
    """How the OpenCL engine stores weights and KV and how it runs its steps."""

    weights_dtype: str = "fp32"  # one of WEIGHT_FORMATS: the layer matrices' storage on the device
    max_context: int = 4096  # positions per sequence (capped by the model's own context)
    keep_cores_awake: bool = True  # on a CPU device: hold a 0 µs wake-up latency while steps run (cpu_wake.py)
    layer_kernels: bool = True  # on a CPU device with block weights: a one-sequence step in one launch
    device_logprobs: bool = True  # plain greedy rows' logprobs by kernels/logprobs.cl, not from logits read back
    # gguf storage: a matrix without a device kernel (its type, or a stack of mixed types) stored as f32
    # instead of refused at start
    allow_dense_fallback: bool = False
    # continuous batching (step over the paged pool, services/engine/batching_settings.py)
    kv_cache_mb: int = DEFAULT_KV_CACHE_MB  # the paged KV pool's budget, MiB
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # chunks (sequences) one step computes at most
    max_num_batched_tokens: int = 512  # rows one step computes at most

    def __post_init__(self) -> None:
        if self.weights_dtype not in WEIGHT_FORMATS:
            raise ValueError(f"weights_dtype must be one of {WEIGHT_FORMATS}, got {self.weights_dtype!r}")
        for name in ("max_context", "kv_cache_mb", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @classmethod
    def from_settings(cls, settings: DecodeSettings, checkpoint_kind: str) -> "EngineConfig":
        """The settings' engine part; weights_dtype "auto" is the checkpoint's own blocks when it has
        them (same values, a fifth of the bytes), else fp32."""
        fmt = settings.weights_dtype
        if fmt == "auto":
            fmt = "gguf" if checkpoint_kind == "gguf" else "fp32"
        return cls(weights_dtype=fmt, max_context=settings.max_context,
                   keep_cores_awake=settings.opencl_keep_cores_awake,
                   layer_kernels=settings.opencl_layer_kernels, device_logprobs=settings.opencl_logprobs,
                   allow_dense_fallback=settings.allow_dense_fallback,
                   kv_cache_mb=settings.kv_cache_mb,
                   block_size=settings.block_size, max_num_seqs=settings.max_num_seqs,
                   max_num_batched_tokens=settings.step_rows())


@dataclass(frozen=True)
class DeviceFit:
    """What an EngineConfig comes to for one model on one device, decided once at start-up."""

    max_context: int  # positions per sequence: the config's, capped by the model's
    max_rows: int  # rows the scratch buffers hold: the most a step computes
    keep_cores_awake: bool  # asked for, and the device is a CPU
    one_launch_layers: bool  # a one-sequence decode step's layers may run as one launch (decode_layers.cl)
    layer_groups: int  # work-groups of that launch: one per compute unit (worker thread)

    @classmethod
    def of(cls, config: EngineConfig, cfg: ModelConfig, dev: DeviceContext) -> "DeviceFit":
        if cfg.hidden % 16 or cfg.intermediate % 16 or cfg.head_dim % 4:
            raise ValueError("the OpenCL kernels need hidden and intermediate sizes divisible by 16")
        cpu = bool(dev.device.type & cl.device_type.CPU)
        # decode_layers.cl: one work-item per row (a CPU's kernels), one KV channel, whole 32-column blocks,
        # and Llama's layer, with q/k/v biases and q/k norms or not: it has no other biases, LayerNorm, GELU
        # or position table (an architecture with one of them runs launch by launch, arch_parts.py)
        whole_blocks = not (cfg.hidden % 32 or cfg.intermediate % 32 or cfg.q_dim % 32 or cfg.head_dim % 32)
        return cls(max_context=min(config.max_context, cfg.max_context),
                   max_rows=config.max_num_batched_tokens,
                   keep_cores_awake=config.keep_cores_awake and cpu,
                   # (not with int8 activations: decode_layers.cl computes fp32 ones, and a row's result must
                   # not depend on whether its step had one row)
                   one_launch_layers=(config.layer_kernels and cpu and dev.lanes_per_row == 1
                                      and whole_blocks and one_launch_takes(cfg.arch)
                                      and dev.activations == "fp32"),
                   layer_groups=dev.device.max_compute_units)
