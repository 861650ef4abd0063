"""A request as the scheduler sees it (`Sequence`), and what one step computes of it (`ScheduledChunk`, in a
`SchedulerOutput`): the plain data the scheduler hands the engine loop and the engine's step (scheduler.py
says what step must do with each chunk)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.engine.request_state import RequestState


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it: token_ids = prompt + generated tokens."""

    seq_id: int
    token_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()  # EOS included unless the request ignores it
    sampling_params: Any = None  # opaque here; travels to the engine with each chunk
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0  # positions whose KV is in the blocks
    num_cached_tokens: int = 0  # of those, how many the prefix cache gave at the last admission
    status: RequestState = RequestState.WAITING
    # every prompt position's logits are wanted (prompt logprobs): the prompt is computed whole, never
    # taken from the prefix cache, in chunks of at most config.prompt_logit_rows; off once it has its first token
    all_logits: bool = False
    # the token about to be appended ends the sequence (its grammar is complete: engine_loop.py sets it)
    stop_requested: bool = False
    arrived_s: float = 0.0  # the scheduler's clock when it was added: how long its first token is waited for

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        if not self.token_ids:
            raise ValueError("the prompt must contain at least one token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens


@dataclass(frozen=True)
class ScheduledChunk:
    """Positions [start, start + num_tokens) of one sequence, computed this step."""

    seq_id: int
    start: int  # the sequence's num_computed_tokens when scheduled
    token_ids: tuple[int, ...]  # the tokens at those positions; a decode has one
    block_table: tuple[int, ...]  # block ids; position p is in block_table[p // block_size]
    samples: bool  # the chunk ends at the sequence's last token: sample the next one
    sampling_params: Any
    all_logits: bool = False  # the engine gives the logits of every row (the last one samples, if it does)
    # a decode's draft tokens, after its newest one in token_ids: every row's logits verify them (speculation.py)
    num_drafts: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """One engine step. Decodes come first, oldest sequence first."""

    decodes: tuple[ScheduledChunk, ...]
    prefills: tuple[ScheduledChunk, ...]  # prompt chunks, or a preempted sequence's recompute
    preempted: tuple[int, ...]  # seq ids whose blocks were freed this step

    @property
    def chunks(self) -> tuple[ScheduledChunk, ...]:
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills
