from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_GPU: _ClassVar[Mode]
    MODE_FPGA: _ClassVar[Mode]
    MODE_HYBRID: _ClassVar[Mode]
MODE_UNSPECIFIED: Mode
MODE_GPU: Mode
MODE_FPGA: Mode
MODE_HYBRID: Mode

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens", "n", "prior_output_tokens", "grammar", "first_choice", "no_speculation")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRIOR_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHOICE_FIELD_NUMBER: _ClassVar[int]
    NO_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    n: int
    prior_output_tokens: int
    grammar: str
    first_choice: int
    no_speculation: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., n: _Optional[int] = ..., prior_output_tokens: _Optional[int] = ..., grammar: _Optional[str] = ..., first_choice: _Optional[int] = ..., no_speculation: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "mode", "prefill_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    mode: Mode
    prefill_address: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., mode: _Optional[_Union[Mode, str]] = ..., prefill_address: _Optional[str] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "handoff_total_s", "handoff_exposed_s", "decode_s", "prompt_tokens", "generated_tokens", "handoff_bytes", "cached_tokens", "draft_tokens", "accepted_draft_tokens")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_EXPOSED_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    handoff_total_s: float
    handoff_exposed_s: float
    decode_s: float
    prompt_tokens: int
    generated_tokens: int
    handoff_bytes: int
    cached_tokens: int
    draft_tokens: int
    accepted_draft_tokens: int
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., handoff_total_s: _Optional[float] = ..., handoff_exposed_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., handoff_bytes: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "timings", "logprobs", "prompt_logprobs", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    timings: Timings
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "wire_dtype", "skip_tokens", "kv_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    wire_dtype: str
    skip_tokens: int
    kv_address: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., wire_dtype: _Optional[str] = ..., skip_tokens: _Optional[int] = ..., kv_address: _Optional[str] = ...) -> None: ...

class SlotGranted(_message.Message):
    __slots__ = ("offset", "size", "n_tokens", "dtype")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    size: int
    n_tokens: int
    dtype: str
    def __init__(self, offset: _Optional[int] = ..., size: _Optional[int] = ..., n_tokens: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class LayerReady(_message.Message):
    __slots__ = ("layer", "offset", "nbytes", "written_at")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_AT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    offset: int
    nbytes: int
    written_at: float
    def __init__(self, layer: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., written_at: _Optional[float] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("first_token", "prefill_s", "queue_s", "compute_done_at", "finish_reason", "first_logprob", "prompt_logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DONE_AT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    prefill_s: float
    queue_s: float
    compute_done_at: float
    finish_reason: str
    first_logprob: TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, first_token: _Optional[int] = ..., prefill_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., compute_done_at: _Optional[float] = ..., finish_reason: _Optional[str] = ..., first_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("slot", "layer", "done")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    slot: SlotGranted
    layer: LayerReady
    done: PrefillDone
    def __init__(self, slot: _Optional[_Union[SlotGranted, _Mapping]] = ..., layer: _Optional[_Union[LayerReady, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("kv_events_epoch", "kv_events_since")
    KV_EVENTS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_SINCE_FIELD_NUMBER: _ClassVar[int]
    kv_events_epoch: str
    kv_events_since: int
    def __init__(self, kv_events_epoch: _Optional[str] = ..., kv_events_since: _Optional[int] = ...) -> None: ...

class KVEvents(_message.Message):
    __slots__ = ("epoch", "seq", "snapshot", "stored", "removed", "partial")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    partial: bool
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., partial: _Optional[bool] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_id", "engine", "device", "kv_layout", "kv_dtype", "arena_name", "arena_size", "max_context", "max_concurrency", "n_layers", "n_kv_heads", "head_dim", "vocab_size", "max_num_seqs", "block_size", "num_kv_blocks", "num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio", "stored_weight_types", "kv_events")
    class StoredWeightTypesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ARENA_NAME_FIELD_NUMBER: _ClassVar[int]
    ARENA_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    N_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_RATIO_FIELD_NUMBER: _ClassVar[int]
    STORED_WEIGHT_TYPES_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    engine: str
    device: str
    kv_layout: str
    kv_dtype: str
    arena_name: str
    arena_size: int
    max_context: int
    max_concurrency: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    max_num_seqs: int
    block_size: int
    num_kv_blocks: int
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_ratio: float
    stored_weight_types: _containers.ScalarMap[str, int]
    kv_events: KVEvents
    def __init__(self, model_id: _Optional[str] = ..., engine: _Optional[str] = ..., device: _Optional[str] = ..., kv_layout: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., arena_name: _Optional[str] = ..., arena_size: _Optional[int] = ..., max_context: _Optional[int] = ..., max_concurrency: _Optional[int] = ..., n_layers: _Optional[int] = ..., n_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., num_requests_running: _Optional[int] = ..., num_requests_waiting: _Optional[int] = ..., kv_cache_usage_ratio: _Optional[float] = ..., stored_weight_types: _Optional[_Mapping[str, int]] = ..., kv_events: _Optional[_Union[KVEvents, _Mapping]] = ...) -> None: ...

class ProfileRequest(_message.Message):
    __slots__ = ("refresh",)
    REFRESH_FIELD_NUMBER: _ClassVar[int]
    refresh: bool
    def __init__(self, refresh: _Optional[bool] = ...) -> None: ...

class StageSample(_message.Message):
    __slots__ = ("stage", "device", "n_in", "n_out", "seconds")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    N_IN_FIELD_NUMBER: _ClassVar[int]
    N_OUT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    device: str
    n_in: int
    n_out: int
    seconds: float
    def __init__(self, stage: _Optional[str] = ..., device: _Optional[str] = ..., n_in: _Optional[int] = ..., n_out: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ProfileResponse(_message.Message):
    __slots__ = ("samples", "quiet")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    QUIET_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[StageSample]
    quiet: bool
    def __init__(self, samples: _Optional[_Iterable[_Union[StageSample, _Mapping]]] = ..., quiet: _Optional[bool] = ...) -> None: ...
