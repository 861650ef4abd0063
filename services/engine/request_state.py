"""Request lifecycle states, who sets each, and how finished ones map to OpenAI's finish_reason.

    state                  set by (scheduler.py)                                      when
    WAITING                Scheduler.add / preemption                                 queued for blocks and a batch place
    PREFILLING             Scheduler admission                                        this engine computes the prompt's KV
    WAITING_FOR_REMOTE_KV  Scheduler.reserve_remote (hybrid)                          prefill_gpu computes it, the KV arrives
    DECODING               state_after_token                                          generating after the first token
    FINISHED_STOPPED       state_after_token                                          EOS or a stop token
    FINISHED_LENGTH        state_after_token                                          max_tokens or the context window
    FINISHED_ABORTED       Scheduler.abort                                            cancelled: the client went away
    FINISHED_ERROR         (none: the loop fails a stream with a typed error)         failed: an error status ends the call

Only STOPPED and LENGTH reach a client as a finish_reason (`OPENAI_FINISH_REASON`, the one
table); an aborted or failed request ends its call with a status instead.
"""
from __future__ import annotations

import enum


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    DECODING = "decoding"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestState.FINISHED_STOPPED, RequestState.FINISHED_LENGTH,
                       RequestState.FINISHED_ABORTED, RequestState.FINISHED_ERROR})

OPENAI_FINISH_REASON = {
    RequestState.FINISHED_STOPPED: "stop",
    RequestState.FINISHED_LENGTH: "length",
}


def finish_reason(state: RequestState) -> str:
    """OpenAI's finish_reason for a request that finished by generating (stopped or at its length)."""
    if state not in OPENAI_FINISH_REASON:
        raise ValueError(f"a {state.value} request has no finish_reason; it ends with a status")
    return OPENAI_FINISH_REASON[state]


def state_after_token(token: int, n_generated: int, max_tokens: int, stop_ids: frozenset[int],
                      context_left: int) -> RequestState:
    """The state of a sequence after it emitted `token` as its n_generated-th token."""
    if token in stop_ids:
        return RequestState.FINISHED_STOPPED
    if n_generated >= max_tokens or context_left <= 0:
        return RequestState.FINISHED_LENGTH
    return RequestState.DECODING
