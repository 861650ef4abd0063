"""Request lifecycle states and how finished ones map to OpenAI's finish_reason."""
from __future__ import annotations

import enum


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    DECODING = "decoding"
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token
    FINISHED_LENGTH = "finished_length"  # max_tokens or the context window
    FINISHED_ABORTED = "finished_aborted"  # cancelled by the client or the server
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASON


_FINISH_REASON = {
    RequestState.FINISHED_STOPPED: "stop",
    RequestState.FINISHED_LENGTH: "length",
    RequestState.FINISHED_ABORTED: "abort",
    RequestState.FINISHED_ERROR: "error",
}


def finish_reason(state: RequestState) -> str:
    """OpenAI's finish_reason for a finished state."""
    return _FINISH_REASON[state]


def state_after_token(token: int, n_generated: int, max_tokens: int, stop_ids: frozenset[int],
                      context_left: int) -> RequestState:
    """The state of a sequence after it emitted `token` as its n_generated-th token."""
    if token in stop_ids:
        return RequestState.FINISHED_STOPPED
    if n_generated >= max_tokens or context_left <= 0:
        return RequestState.FINISHED_LENGTH
    return RequestState.DECODING
