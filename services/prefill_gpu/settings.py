"""Settings of the prefill_gpu service: HYBRIDSERVE_PREFILL_* variables, plus the shared ones."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from services.engine.batching_settings import BatchingSettings
from services.kv.transports import check_name as check_transport
from services.settings import CommonSettings, empty_is_none


class PrefillSettings(CommonSettings, BatchingSettings):
    service: ClassVar[str] = "prefill_gpu"
    own_prefix: ClassVar[str] = "HYBRIDSERVE_PREFILL_"
    # two RPCs, two admissions: Generate (gpu mode) and Prefill (the hybrid hand-off). The variables say
    # which; HYBRIDSERVE_PREFILL_MAX_CONCURRENCY was the hand-off's and stays so while old names work
    variable_names: ClassVar[dict[str, str]] = {
        "max_concurrency": "generate_max_concurrency", "queue_depth": "generate_queue_depth",
        "prefill_max_concurrency": "handoff_max_concurrency", "prefill_queue_depth": "handoff_queue_depth"}

    host: str = "127.0.0.1"
    port: int = 50061
    metrics_port: int = 9101
    device: str = "auto"  # "auto" (CUDA when present) | "cpu" | "cuda" | "cuda:N"
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = "auto"  # auto = fp32, for parity across modes
    cuda_graphs: bool = True  # on CUDA: decode steps and lone prefill chunks replay captured graphs
    # fused RMSNorm and residual adds in the GEMMs: fewer kernels a step; "auto" = on CUDA only (the CPU
    # keeps transformers' bits). Greedy tokens and logit differences measured by bench/micro/gpu_engine.py
    fused_ops: Literal["auto", "on", "off"] = "auto"
    # matrices [in, out] (MKL's fast layout) or [out, in] (F.linear, cuBLAS's); "auto": out_in on CUDA only
    weight_layout: Literal["auto", "in_out", "out_in"] = "auto"
    # the CPU scheduling class of the process's threads once it serves, on the CPU: "idle" (SCHED_IDLE) lets
    # the decode engine's threads on the same cores preempt the prefill at once, for a host that runs the stack
    # alone; on a busy host the prefill starves, hence opt-in (cpu_priority.py, docs/readiness.md)
    cpu_priority: Literal["normal", "idle"] = "normal"
    # the nice value of its autogroup once it serves on the CPU, where it leads its session (as under `up`): the
    # fair scheduler shares the cores between groups by their weights, and at 0 a prefill keeps half of them while
    # a decode step's token-sending threads wait; at 10 its group weighs ~1/10 of the decode engine's. Opt-in: hybrid
    # streams' largest gaps steadied (<= 88 ms), long prompts' first tokens came ~25% later, auto's tail unchanged
    # (services/autogroup.py, docs/readiness.md); None (unset or empty): the group is left alone
    cpu_group_nice: int | None = Field(None, ge=-20, le=19)
    arena_bytes: int = 256 * 1024 * 1024
    # a hand-off outside the admission (none in the service any more: it waits for memory in the
    # admission's queue, bounded by the call's deadline) waits this long for a slot; kept for old envs
    arena_wait_s: float = 2.0
    slot_hold_s: float = 30.0  # longest a finished Prefill without a deadline keeps its slot for a silent reader
    wire_dtype: Literal["fp32", "fp16"] = "fp32"  # fp32 = the KV cache's own dtype on the CPU: identical tokens
    max_concurrency: int = 2  # no longer limits anything: the batch holds max_num_seqs (kept for old envs)
    queue_depth: int = 16  # generations waiting beyond max_num_seqs running; more → RESOURCE_EXHAUSTED
    # hybrid hand-offs in flight at once: "auto" = as many as their KV fits the arena (each admitted when its
    # slot can be reserved, services/prefill_gpu/handoff_admission.py), at most max_num_seqs; an integer
    # caps the count as well
    prefill_max_concurrency: int | Literal["auto"] = "auto"
    prefill_queue_depth: int = 64  # hand-offs waiting for memory; more → RESOURCE_EXHAUSTED
    # the KV transport prepared at start (services/kv/transports.py): "nixl" creates the NIXL agent then (and
    # without the nixl extra the start fails). Whatever it says, each Prefill call's kv_address picks the
    # transport of that hand-off (the decode engine's choice): shm and tcp need nothing prepared
    kv_transport: str = "shm"

    @field_validator("kv_transport")
    @classmethod
    def _transport(cls, v: str) -> str:
        return check_transport(v)

    @field_validator("cpu_group_nice", mode="before")
    @classmethod
    def _empty_is_none(cls, v):
        # HYBRIDSERVE_PREFILL_CPU_GROUP_NICE= means "leave the group alone"
        return empty_is_none(v)

    @property
    def handoff_max_running(self) -> int:
        """The most hand-offs in flight at once (each also needs its memory)."""
        return self.max_num_seqs if self.prefill_max_concurrency == "auto" else self.prefill_max_concurrency
    profile_cache: str = "~/.cache/hybridserve/profile"
    profile_at_start: bool = True
    # sweeps a busy machine gets before the least noisy one serves this run uncached (profile_cache.py)
    profile_attempts: int = Field(2, ge=1)
    # cache a busy sweep too (apart, never called quiet): for machines that are never quiet, e.g. a test
    # suite starting dozens of engines, where a rough profile beats a ~20 s sweep at every start
    profile_keep_busy: bool = False
