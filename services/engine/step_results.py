"""A step's logit rows back into tokens and logprobs (the engine loop's, engine_loop.py): which rows give
logits, what a device that computes logprobs itself is asked for, and each sampling row's pick, a
verify chunk's drafts checked in turn (speculation.py), and the prompt logprobs of all_logits chunks.
`streams`: the loop's running streams by sequence id (a chunk whose stream is gone picks a placeholder)."""
from __future__ import annotations

from typing import Iterator

from services.engine import metrics as m
from services.engine.logprobs import LogprobsAsked, StepLogprobs, TokenLogprob, token_logprob
from services.engine.request_stream import RequestStream
from services.engine.sequence import SchedulerOutput
from services.engine.speculation import verify


def logit_rows(out: SchedulerOutput) -> Iterator[tuple]:
    """(chunk, its first logit row, its number of logit rows) of every chunk that gives logits, in
    the step's row order: an all_logits chunk's every row, a sampling chunk's last."""
    row = 0
    for c in out.chunks:
        if c.samples or c.all_logits:
            n = c.num_tokens if c.all_logits else 1
            yield c, row, n
            row += n


def logprobs_asked(chunks, streams: dict[int, RequestStream]) -> LogprobsAsked:
    """What the device computes for a step of plain greedy rows that wants logprobs: per logit row the
    token it predicts (the prompt's next token for prompt logprobs, -1: the row's greedy pick) and
    the largest k any of them asks for."""
    targets, k = [], 0
    for c in chunks:
        p = c.sampling_params
        if c.samples and p.logprobs is not None:
            k = max(k, p.logprobs)
        if c.all_logits:
            k = max(k, p.prompt_logprobs or 0)
            stream = streams.get(c.seq_id)
            for i in range(c.num_tokens):
                predicted = c.start + i + 1
                in_prompt = stream is not None and predicted < stream.seq.num_prompt_tokens
                targets.append(stream.seq.token_ids[predicted] if in_prompt else -1)
        elif c.samples:
            targets.append(-1)
    return LogprobsAsked(k, targets)


def take_device_logprobs(out: SchedulerOutput, result: StepLogprobs, logprobs: dict[int, TokenLogprob | None],
                         streams: dict[int, RequestStream]) -> dict[int, int]:
    """A step whose logprobs the device computed: each sampling row's pick (its argmax: these rows are
    plain greedy) and logprob, and the prompt logprobs of all_logits chunks."""
    sampled = {}
    for c, first, n in logit_rows(out):
        stream = streams.get(c.seq_id)
        if stream is None:
            sampled[c.seq_id] = 0
            continue
        if c.all_logits:
            kept = stream.keep_prompt_logprobs(c.start, n, lambda i, _token, k: result.at(first + i, k))
            m.LOGPROB_ROWS.labels("device").inc(kept)
        if c.samples:
            last, p = first + n - 1, stream.seq.sampling_params
            sampled[c.seq_id] = int(result.picks[last])
            if p.logprobs is not None:
                logprobs[c.seq_id] = result.at(last, p.logprobs)
                m.LOGPROB_ROWS.labels("device").inc()
    return sampled


def take_logits(out: SchedulerOutput, result, logprobs: dict[int, TokenLogprob | None],
                streams: dict[int, RequestStream]) -> dict[int, int]:
    """A step that read its logit rows back: each sampling row picked by its sampler (controls, grammar,
    sampling) with its logprob, and the prompt logprobs of all_logits chunks, on the host."""
    sampled = {}
    for c, first, n in logit_rows(out):
        block = result[first:first + n]
        stream = streams.get(c.seq_id)
        if stream is None:
            sampled[c.seq_id] = [0] if c.num_drafts else 0
            continue
        seq = stream.seq
        if c.num_drafts:
            sampled[c.seq_id], logprobs[c.seq_id] = verify_drafts(stream, c, block)
            continue
        if c.all_logits:
            kept = stream.keep_prompt_logprobs(c.start, n, lambda i, token, k: token_logprob(block[i], token, k))
            m.LOGPROB_ROWS.labels("host").inc(kept)
        if c.samples:
            sampled[c.seq_id], logprobs[c.seq_id] = stream.sampler.pick(
                block[-1], seq.token_ids, seq.num_prompt_tokens, seq.stop_token_ids)
            if logprobs[c.seq_id] is not None:
                m.LOGPROB_ROWS.labels("host").inc()
            if stream.sampler.grammar is not None:  # a complete grammar ends the sequence at this token
                seq.stop_requested = stream.sampler.grammar.stopped
    return sampled


def verify_drafts(stream: RequestStream, c, block) -> tuple[list[int], list]:
    """A verify chunk's rows picked in turn by the request's sampler, as decoding one token at a time
    would pick them (speculation.py): the tokens it emits and their logprobs."""
    seq, sampler, logprobs = stream.seq, stream.sampler, []
    history = list(seq.token_ids)  # one copy per chunk, the picks appended: what each row's pick sees

    def pick(i: int) -> int:
        token, logprob = sampler.pick(block[i], history, seq.num_prompt_tokens, seq.stop_token_ids)
        history.append(token)
        logprobs.append(logprob)
        return token

    def ends(token: int) -> bool:
        return token in seq.stop_token_ids or (sampler.grammar is not None and sampler.grammar.stopped)

    tokens = verify(c.token_ids[1:], pick, ends)
    if sampler.grammar is not None:  # a complete grammar ends the sequence at its last token
        seq.stop_requested = sampler.grammar.stopped
    return tokens, logprobs
