"""What one engine's scheduler is sized by: its KV blocks, its batch, its step's tokens, its pacing and its
speculation; checked once, at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.speculation import SpeculationConfig


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int  # from blocks_for_budget(...) over the KV memory budget
    block_size: int = 16
    max_num_seqs: int = 64  # running sequences at most
    max_num_batched_tokens: int = 512  # tokens computed per step, decodes included
    max_model_len: int = 2048  # context window: prompt + generated tokens
    enable_prefix_caching: bool = True
    step_target_s: float = 0.0  # with decodes running, prompt tokens per step cut to fit it (step_pacer.py)
    # a prompt queued behind another longer than this stretches that target, up to step_max_s
    ttft_target_s: float = 0.0  # 0: it never stretches
    step_max_s: float = 0.0
    # ...and the tokens a step may compute grow with it, from max_num_batched_tokens to this (0: they
    # do not grow): decode_fpga's 64 kept a queue of 32 clients' prompts to ~34 tokens a step
    stretched_batched_tokens: int = 0
    host_kv_cache_mb: int = 0  # evicted prefix blocks kept in host memory (host_kv_tier.py); 0 = none
    # logit rows one step may give a prompt's every position (prompt logprobs, `Sequence.all_logits`)
    # beyond the one row each sampling chunk takes: the engine's head holds max_num_seqs + this many
    prompt_logit_rows: int = 64
    # speculative decoding (speculation.py): a decoding sequence's drafts verified in its chunk; k=0: off.
    # Drafts take logit rows from prompt_logit_rows and tokens from max_num_batched_tokens
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)

    @property
    def most_batched_tokens(self) -> int:
        """The tokens one step computes at most, stretched or not: what the engine's rows must hold."""
        return max(self.max_num_batched_tokens, self.stretched_batched_tokens)

    def __post_init__(self) -> None:
        checks = {
            "num_blocks >= 1": self.num_blocks >= 1,
            "block_size >= 1": self.block_size >= 1,
            "max_num_seqs >= 1": self.max_num_seqs >= 1,
            "max_num_batched_tokens >= block_size": self.max_num_batched_tokens >= self.block_size,
            # every running decode fits in one step
            "max_num_batched_tokens >= max_num_seqs": self.max_num_batched_tokens >= self.max_num_seqs,
            "max_model_len >= 2": self.max_model_len >= 2,
            "prompt_logit_rows >= 1": self.prompt_logit_rows >= 1,
        }
        failed = [rule for rule, ok in checks.items() if not ok]
        if failed:
            raise ValueError(f"invalid scheduler config {self}: need {', '.join(failed)}")
