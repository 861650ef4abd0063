"""The continuous-batching settings both engine services share (their own prefix in front).

HYBRIDSERVE_DECODE_KV_CACHE_MB, HYBRIDSERVE_PREFILL_MAX_NUM_SEQS, ...: the same knobs, per
engine, because the two engines' memory and step costs differ.
"""
from __future__ import annotations

from pydantic import BaseModel, Field

# 64 sequences of 512 tokens of SmolLM2-135M's fp32 KV (46 KiB a token) need 1440 MiB
DEFAULT_KV_CACHE_MB = 1536


class BatchingSettings(BaseModel):
    kv_cache_mb: int = Field(DEFAULT_KV_CACHE_MB, ge=1)  # the paged KV pool's memory budget
    block_size: int = Field(16, ge=1, le=256)  # tokens per KV block
    max_num_seqs: int = Field(64, ge=1)  # sequences running in one batch at most
    max_num_batched_tokens: int = Field(512, ge=16)  # tokens per engine step, decodes included
    enable_prefix_caching: bool = True  # reuse the KV blocks of a cached prompt prefix
    # while decodes run, a step's prompt tokens are cut so the step stays within this (measured costs,
    # services/engine/step_pacer.py): a long prompt arriving never stalls the streams for long. 0 = off
    step_target_s: float = Field(0.1, ge=0.0)
    # ...unless prompts queue: once the oldest prompt queued behind another has waited this long, the
    # step target stretches with its wait, up to step_max_s, and the tokens a step may compute grow from
    # max_num_batched_tokens to stretched_batched_tokens (a closed loop of many clients trades ITL for
    # TTFT; step_pacer.py says why). 0 = never
    ttft_target_s: float = Field(0.5, ge=0.0)
    step_max_s: float = Field(2.0, ge=0.0)
    stretched_batched_tokens: int = Field(512, ge=16)
    # prefix-cache blocks the KV pool evicts, kept in host memory and loaded back on a hit instead of
    # recomputed (services/engine/host_kv_tier.py); 0 = no host tier
    host_kv_cache_mb: int = Field(0, ge=0)
    # speculative decoding with n-gram drafts (services/engine/speculation.py): up to this many drafts a
    # decoding sequence checks per step (0 = off, the default: at 8 clients drafts double a stream's ITL p99,
    # docs/speculation.md "The default"; 3 is the measured best), from n-grams of n_min..n_max
    # tokens, longest first (8 rather than 4 picks the right one of a table's or a code's repeated short
    # phrases: 1.65-1.78x -> 1.88-2.19x on copy-heavy prompts), while at most
    # speculative_max_batch sequences decode (beyond, drafts from short matches cost the batch more than they
    # give: with k=3 on PoCL here chat drafts lost 4% at 2 sequences and 14% at 4), and, drafts from a match of
    # the whole n_max only (95% of them accepted on copy-heavy prompts, against ~50% from 2-4 tokens), while at
    # most speculative_max_batch_long do (8: decode alone gains up to 32 (copy-heavy 1.22x at 16, 1.01-1.16x at
    # 32, chat 0.99-1.05x), but in the serve mix at 32 clients the longer steps held the prompts back: TTFT p50
    # 11.3 s against 6.0 s, 0.97x tokens/s). bench/micro/speculation_batch.py, docs/speculation.md
    speculative_k: int = Field(0, ge=0, le=16)
    speculative_n_min: int = Field(2, ge=1)
    speculative_n_max: int = Field(8, ge=1)
    speculative_max_batch: int = Field(2, ge=1)
    speculative_max_batch_long: int = Field(8, ge=1)

    def step_rows(self) -> int:
        """The tokens one step computes at most, stretched or not: the rows an engine is built for."""
        if self.ttft_target_s > 0 and self.step_target_s > 0:
            return max(self.max_num_batched_tokens, self.stretched_batched_tokens)
        return self.max_num_batched_tokens
