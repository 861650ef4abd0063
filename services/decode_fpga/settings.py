"""Settings of the OpenCL (decode_fpga) engine and its service: HYBRIDSERVE_DECODE_* variables, plus the shared ones."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from services.engine.batching_settings import BatchingSettings
from services.kv.address import WILDCARD_HOSTS, parse_address
from services.kv.transports import check_name as check_transport
from services.settings import CommonSettings

# output rows per work-item of the paged step's block GEMVs on a CPU or an FPGA (gemv_quant_tiles, each
# row of x read once for all of them); 0 keeps the kernel before it (gemv_quant_rows: one output row a
# work-item), for A/B runs (bench/micro/paged_step.py --gemv-tiles)
GEMV_TILES = (0, 1, 2, 4)
GEMV_TILE = 2


def check_lanes(lanes: int) -> int:
    """lanes, when it is 0 (by device type) or a power of two up to 256; else ValueError."""
    if lanes and (lanes & (lanes - 1) or not 1 <= lanes <= 256):
        raise ValueError(f"OpenCL lanes per row must be 0 (by device type) or a power of two from 1 to 256, "
                         f"got {lanes}")
    return lanes


class DecodeSettings(CommonSettings, BatchingSettings):
    service: ClassVar[str] = "decode_fpga"
    own_prefix: ClassVar[str] = "HYBRIDSERVE_DECODE_"

    # device
    opencl_platform: str | None = None  # substring of the platform name (e.g. "Portable", "Intel(R) FPGA")
    opencl_device: str | None = None  # substring of the device name
    opencl_binary_dir: str | None = None  # prebuilt programs (<kernel>.bin) for platforms that cannot compile
    # work-items per output row of the block GEMVs and per head of decode attention: 0 picks by
    # device type (on a GPU 32 per GEMV row and 128 per head, 1 on a CPU or an FPGA)
    opencl_lanes: int = 0
    # output rows per work-item of the batched block GEMVs (the paged step's) on a CPU or an FPGA: each
    # row of x is read once for them; 0: the kernel before it, one output row a work-item (for A/B runs)
    opencl_gemv_tile: int = GEMV_TILE
    # on a CPU device: hold a 0 µs PM QoS wake-up latency (/dev/cpu_dma_latency, needs root) while
    # steps run, so cores poll instead of halting between kernels (cpu_wake.py)
    opencl_keep_cores_awake: bool = True
    # on a CPU device with block-format weights: a one-sequence decode step's layers in one launch,
    # its phases separated by barriers across work-groups (decode_layers.cl); false: five per layer
    opencl_layer_kernels: bool = True
    # the paged step's block GEMVs: fp32 activations (exact) or int8, x quantized per block (32 values a
    # scale; 64 for the K-quants, int8_super.h) and integer dot products (every block format on a CPU
    # device: int8_gemv.py). int8 changes logits and sometimes tokens (docs/decode-kernels.md has its
    # divergence), and turns the one-launch decode step off
    activations: Literal["fp32", "int8"] = "fp32"
    # logprobs of plain greedy rows (and echo's prompt logprobs) by a log-softmax + top-k kernel on the
    # device, 2 + 2k words a row read back (kernels/logprobs.cl); false: the row's logits are read back
    # and the host computes them (rows with penalties, logit_bias, a grammar or sampling always are)
    opencl_logprobs: bool = True
    # weights and KV
    # auto: the checkpoint's GGUF blocks when it has them (exactly the reference's weight values,
    # a fifth of the bytes), else fp32; fp16 is the opt-in speed setting that changes the values
    weights_dtype: Literal["auto", "fp32", "fp16", "gguf"] = "auto"
    # gguf storage: a quantized tensor type without a device kernel (e.g. Q3_K, IQ4_XS), or a q|k|v or
    # gate|up stack with a part in none, is refused at start; true stores it as f32 instead (the same
    # values, 4 bytes a weight). Stacks of mixed block formats need no fallback (stacked_matrix.py)
    allow_dense_fallback: bool = False
    max_context: int = 4096  # positions per sequence (capped by the model's own context)
    # read by nothing since the per-sequence slot path retired (issue 54): the paged pool is one buffer
    # and its sequences are the scheduler's (max_num_seqs); kept so environments that set them still start
    kv_channels: int = 1
    max_sequences: int = 4
    # service
    host: str = "127.0.0.1"
    port: int = 50062
    metrics_port: int = 9102
    prefill_address: str = "127.0.0.1:50061"  # prefill_gpu, for hybrid mode
    # pools: further prefill_gpu engines ("host:port,host:port") a hybrid request may name (the gateway
    # picks a request's prefill engine and decode engine separately); no others are ever dialled
    prefill_addresses: str = ""
    queue_depth: int = 16  # requests waiting beyond max_num_seqs running; more → RESOURCE_EXHAUSTED
    max_concurrency: int = 4  # no longer limits anything: the batch holds max_num_seqs (kept for old envs)
    handoff_timeout_s: float = 120.0  # deadline of the Prefill call in hybrid mode for a request without its own
    # how hybrid mode's KV comes from prefill_gpu, a name of services/kv/transports.py: "shm", its
    # shared-memory arena (same host, shared /dev/shm); "tcp", a connection prefill_gpu opens to this
    # service's KV port (two pods or hosts); "nixl", NIXL READs out of prefill_gpu's memory, offered
    # through the same KV port (the nixl extra; docs/kv-transports.md says which to choose where)
    kv_transport: str = "shm"
    kv_listen: str = "127.0.0.1:0"  # tcp, nixl: host:port the KV port binds (port 0: any free one)
    # tcp, nixl: the host:port prefill_gpu is told to connect to; unset, the bound address (which must then
    # be a real one, not 0.0.0.0); in Kubernetes the pod's IP from the downward API
    kv_advertise: str | None = None
    # tokens one step computes: on a CPU device a 512-token prefill chunk is a ~1.4 s step that stalls every
    # running stream (serve.py's long-prompts variant: ITL p99 1415 ms); 64 keeps a step near 0.2 s. A
    # queue of prompts stretches it toward stretched_batched_tokens (services/engine/step_pacer.py)
    max_num_batched_tokens: int = Field(64, ge=16)
    profile_cache: str = "~/.cache/hybridserve/profile"
    profile_at_start: bool = True
    # sweeps a busy machine gets before the least noisy one serves this run uncached (profile_cache.py)
    profile_attempts: int = Field(2, ge=1)
    # cache a busy sweep too (apart, never called quiet): for machines that are never quiet, e.g. a test
    # suite starting dozens of engines, where a rough profile beats a ~20 s sweep at every start
    profile_keep_busy: bool = False

    @field_validator("opencl_lanes")
    @classmethod
    def _lanes(cls, v: int) -> int:
        return check_lanes(v)

    @field_validator("opencl_gemv_tile")
    @classmethod
    def _gemv_tile(cls, v: int) -> int:
        if v not in GEMV_TILES:
            raise ValueError(f"opencl_gemv_tile must be one of {GEMV_TILES} (output rows per work-item), got {v}")
        return v

    @field_validator("kv_transport")
    @classmethod
    def _transport(cls, v: str) -> str:
        return check_transport(v)

    @field_validator("kv_listen", "kv_advertise")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        if v is not None:
            parse_address(v)
        return v

    @field_validator("prefill_addresses")
    @classmethod
    def _addresses(cls, v: str) -> str:
        for a in (a.strip() for a in v.split(",")):
            if a:
                parse_address(a)
        return v

    def prefill_address_list(self) -> tuple[str, ...]:
        """The prefill engines a hybrid request may name besides prefill_address."""
        return tuple(a.strip() for a in self.prefill_addresses.split(",") if a.strip())

    @model_validator(mode="after")
    def _advertised_address(self) -> "DecodeSettings":
        listen_host, _ = parse_address(self.kv_listen)
        if self.kv_transport != "shm" and self.kv_advertise is None and listen_host in WILDCARD_HOSTS:
            raise ValueError(f"kv_listen {self.kv_listen!r} binds every interface: set kv_advertise to the "
                             f"address prefill_gpu should connect to")
        if self.kv_advertise is not None and parse_address(self.kv_advertise)[0] in WILDCARD_HOSTS:
            raise ValueError(f"kv_advertise {self.kv_advertise!r} is not an address to connect to")
        return self
