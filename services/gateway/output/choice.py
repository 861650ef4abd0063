"""One choice of a request (n > 1 gives several): its text as the engine's tokens arrive (detokenized,
a JSON answer's markdown fence taken off, stop strings applied), its logprobs, its echoed prompt, its
finish, and its cumulative logprob (for best_of). serving.py's `Run` holds a request's choices and
routes each engine message to its own.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.gateway.output.detokenizer import IncrementalDetokenizer
from services.gateway.output.fence import FenceStripper
from services.gateway.output.logprobs_format import LogprobsWriter
from services.gateway.output.stops import StopMatcher
from services.rpc.hybridserve.v1 import engine_pb2 as pb


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, given back before its completion (`echo`): its text and its token ids."""

    text: str
    prompt_ids: list[int]


class Choice:
    def __init__(self, index: int, detok: IncrementalDetokenizer, stops: StopMatcher,
                 logprobs: LogprobsWriter | None = None, echo: Echo | None = None, show_output: bool = True,
                 fence: FenceStripper | None = None):
        self.index, self.detok, self.stops = index, detok, stops
        self.fence = fence  # JSON output whose grammar allows a markdown fence: the fence is not shown
        self.logprobs = logprobs  # None: the request did not ask for them
        self.entries: list = []  # (token id, pb.TokenLogprob) not yet handed out, when asked for
        self.echo = echo  # the prompt, given back before the first token's text (then None)
        self.show_output = show_output  # False: max_tokens 0, the one token the engine made is not shown
        self.n_out = 0
        self.cumulative_logprob = 0.0  # of the tokens shown, when the engine sent logprobs (best_of)
        self.finish_reason: str | None = None

    def take(self, msg: pb.GenerateResponse, prompt_logprobs=()) -> str:
        """Account for one engine message of this choice; the text it adds (after stop strings).
        `prompt_logprobs`: the prompt's (choice 0's first message brings them, for every choice)."""
        text = ""
        if self.echo is not None:
            text, ids = self.echo.text, self.echo.prompt_ids
            if self.logprobs is not None:  # the first prompt token has nothing before it: no logprob
                self.entries += [(ids[0], None), *zip(ids[1:], prompt_logprobs)]
            self.echo = None
        if not self.show_output:
            if msg.finish_reason:
                self.finish_reason = "length"
            return text
        if not self.stops.stopped:
            self.cumulative_logprob += sum(lp.logprob for lp in msg.logprobs)
            if self.logprobs is not None:
                self.entries.extend(zip(msg.token_ids, msg.logprobs))
        for t in msg.token_ids:
            self.n_out += 1
            text += self.stops.feed(self._unfenced(self.detok.add(t)))
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
            end = self._unfenced(self.detok.flush()) + (self.fence.flush() if self.fence else "")
            text += self.stops.feed(end) + self.stops.flush()
        if self.stops.stopped:
            self.finish_reason = "stop"
        return text

    def _unfenced(self, text: str) -> str:
        return self.fence.feed(text) if self.fence is not None else text

    def take_logprobs(self, none_if_empty: bool = False):
        """The logprobs of the tokens taken since the last call, in the endpoint's shape; None if not asked
        (or, `none_if_empty`, if no token came since)."""
        if self.logprobs is None or (none_if_empty and not self.entries):
            return None
        entries, self.entries = self.entries, []
        return self.logprobs.format(entries)
