"""The request as the gateway routes it: ids, sampling, a forced mode or none, a timeout; and the requests a
migration and a choice of n > 1 continue from (`continuation`, `choice`). Built from a validated body
(`RoutedRequest.of`); the dispatcher turns it into a Generate call."""
from __future__ import annotations

from dataclasses import dataclass, replace

from services.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from services.modes import AUTO
from services.rpc.hybridserve.v1 import engine_pb2 as pb


@dataclass(frozen=True)
class RoutedRequest:
    """What a request asks of the engines, whichever mode serves it: the gateway's own request type (the
    engines have theirs, services/engine/requests.py's `EngineRequest`, which the Generate call becomes)."""

    request_id: str  # also the response's id: it ties the client's answer to the logs
    prompt_ids: list[int]
    max_tokens: int
    sampling: pb.SamplingParams
    forced: str | None  # a mode the client named, or None for the router's choice
    timeout_s: float

    @classmethod
    def of(cls, body: CompletionRequest | ChatCompletionRequest, request_id: str, prompt_ids: list[int],
           max_tokens: int, max_timeout_s: float, allow_fence: bool = False) -> "RoutedRequest":
        """From a validated completion or chat body; its own `timeout` may only shorten the gateway's.
        `allow_fence`: JSON output may come in a markdown fence (schemas.py's `fenced_grammar`)."""
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                     top_k=body.top_k, ignore_eos=body.ignore_eos,
                                     no_speculation=not body.speculative,
                                     frequency_penalty=body.frequency_penalty or 0.0,
                                     presence_penalty=body.presence_penalty or 0.0,
                                     repetition_penalty=body.repetition_penalty or 1.0,
                                     logit_bias=body.bias_pairs(), min_tokens=body.min_tokens or 0,
                                     stop_token_ids=body.stop_token_ids or [],
                                     **({"seed": body.seed} if body.seed is not None else {}))
        if body.top_logprobs_asked is not None:
            sampling.logprobs = body.top_logprobs_asked
        if getattr(body, "prompt_logprobs_asked", None) is not None:
            sampling.prompt_logprobs = body.prompt_logprobs_asked
        sampling.n = body.choices_generated
        grammar = body.fenced_grammar(allow_fence)
        if grammar:
            sampling.grammar = grammar
        if sampling.n > body.n and not sampling.HasField("logprobs"):
            sampling.logprobs = 0  # best_of ranks the choices by their cumulative logprob
        return cls(request_id, prompt_ids, max_tokens, sampling, None if body.mode == AUTO else body.mode,
                   min(body.timeout or max_timeout_s, max_timeout_s))

    def choice(self, index: int) -> "RoutedRequest":
        """Choice `index` of this request (n > 1) as a request of its own: one choice, drawing that choice's
        random numbers (`first_choice`); what a migration continues that choice from."""
        sampling = pb.SamplingParams()
        sampling.CopyFrom(self.sampling)
        sampling.n, sampling.first_choice = 1, index
        sampling.ClearField("prompt_logprobs")  # the client has the prompt's already
        return replace(self, request_id=f"{self.request_id}-c{index}", sampling=sampling)

    def continuation(self, generated: list[int], timeout_s: float, n: int) -> "RoutedRequest":
        """The rest of this request once `generated` are out: they join the prompt and leave max_tokens.

        `n`: the how-many-th migration, in the engine-side request id (the dead call's id may still
        name KV or an arena slot on the engine that lives).
        """
        rest = self.max_tokens - len(generated)
        sampling = pb.SamplingParams()
        sampling.CopyFrom(self.sampling)
        sampling.max_tokens = rest
        # the tokens out so far are the new call's prompt: the engine still counts them as output
        # (frequency and presence penalties, min_tokens); `self` is always the request as first sent
        sampling.prior_output_tokens = len(generated)
        sampling.ClearField("prompt_logprobs")  # the client has the prompt's already
        return replace(self, request_id=f"{self.request_id}-m{n}", prompt_ids=self.prompt_ids + generated,
                       max_tokens=rest, sampling=sampling, forced=None, timeout_s=timeout_s)
