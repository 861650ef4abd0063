"""Continuous batching: which sequences an engine step computes, how many tokens each, in which blocks.
(Past 300 lines on purpose: see the next paragraph.)

The scheduling code is one admission, one chunking and one preemption rule and the queue's wait the
step pacer reads, kept together because they share the waiting/running queues; what it is sized by is
scheduler_config.py, the data it hands out is sequence.py.

Pure Python (no torch, no OpenCL). One engine loop owns the device and runs

    batch = scheduler.schedule()            # SchedulerOutput
    sampled = engine.step(batch)            # {seq_id: token} for each chunk with samples=True
    finished = scheduler.update(batch, sampled)

calling add() and abort() only between steps, and update() after every
schedule(), even one whose output is_empty. Each step takes every running
decode (one token each) and then prefill chunks up to max_num_batched_tokens
(more, up to stretched_batched_tokens, while a queue of prompts stretches the
step: step_pacer.py), so a long prompt is split across steps and never stalls
the running streams.
A waiting sequence is admitted (oldest first) only when the blocks for all its
tokens fit. When a decode needs a block and none is left, the newest running
sequence is preempted: its blocks are freed and it goes back to the head of
the waiting queue, to be prefilled again (prompt + tokens generated so far).

What engine.step(batch) must do for each ScheduledChunk c of batch.chunks
(decodes and prefills in one device call where it can):
  * compute positions [c.start, c.start + c.num_tokens) of sequence c.seq_id from
    c.token_ids, attending to every position before them;
  * read and write K/V through c.block_table: position p lives in slot
    p % block_size of block c.block_table[p // block_size] (the table may hold
    more blocks than this step touches);
  * if c.samples, sample one token from the last position's logits with
    c.sampling_params and return it under c.seq_id;
  * if c.all_logits (the request wants its prompt's logprobs), give every row's logits.
The engine keeps no per-sequence KV state of its own; batch.preempted lists
sequences whose blocks were taken away (drop any other per-sequence state).
"""
from __future__ import annotations

import heapq
import time
from collections import deque
from typing import Callable, Mapping

from services.engine.block_manager import BlockManager
from services.engine.kv_events import KVEventLog
from services.engine.request_state import RequestState, state_after_token
# the scheduler's config and data, imported from here too by the engines, tests and benchmarks
from services.engine.scheduler_config import SchedulerConfig
from services.engine.sequence import ScheduledChunk, SchedulerOutput, Sequence
from services.engine.speculation import Speculator
from services.engine.step_pacer import StepPacer

__all__ = ["RequestTooLarge", "ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput", "Sequence"]


class RequestTooLarge(ValueError):
    """The request can never run: no room in the context window, or more KV blocks than exist."""


class Scheduler:
    """Waiting and running queues over one BlockManager; the step protocol is in the module docstring."""

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic):
        self.config, self._clock = config, clock
        # what the prefix cache holds, for a router to follow (through Info)
        self.kv_events = KVEventLog() if config.enable_prefix_caching else None
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                          self.kv_events)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: newest last
        self.num_preemptions = 0
        self._seqs: dict[int, Sequence] = {}  # every waiting or running sequence
        self._in_flight: SchedulerOutput | None = None  # scheduled, not yet updated
        self.pacer = StepPacer(config.step_target_s, config.block_size, config.most_batched_tokens,
                               config.ttft_target_s, config.step_max_s)
        self._logit_rows = config.prompt_logit_rows  # what the step being scheduled has left of them
        self.speculator = Speculator(config.speculation)
        self._draft_room = 0  # tokens the step being scheduled has left for drafts

    # ---- metrics ---------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_for_remote_kv(self) -> int:
        return sum(1 for seq in self._seqs.values() if seq.status is RequestState.WAITING_FOR_REMOTE_KV)

    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        bm = self.block_manager
        return bm.num_hit_tokens / bm.num_queried_tokens if bm.num_queried_tokens else 0.0

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    # ---- requests join and leave (between steps) -------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._check_new(seq)
        seq.arrived_s = self._clock()
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def prompt_queue(self) -> tuple[float, int]:
        """(wait, count): the seconds the oldest prompt queued behind another has been here (the second oldest
        without a first token, waiting or part-prefilled), and how many prompts have no first token yet: what
        stretches the pacer's step target (step_pacer.py). The oldest is left out of the wait: a lone long
        prompt takes long by itself, and stretching for it would stall the streams it runs beside.
        Part-prefilled prompts count: with max_num_seqs at least the clients (64) every prompt is admitted at
        once and the queue is inside `running`."""
        if self.pacer.ttft_target_s <= 0:
            return 0.0, 0  # the target never stretches: no pass over the queues each step
        pending = [seq.arrived_s for seq in self.waiting if not seq.num_generated]
        pending += [seq.arrived_s for seq in self.running
                    if seq.status is RequestState.PREFILLING and not seq.num_generated]
        if len(pending) < 2:
            return 0.0, len(pending)
        return self._clock() - heapq.nsmallest(2, pending)[1], len(pending)

    def _check_new(self, seq: Sequence) -> None:
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} is already scheduled")
        if seq.status is not RequestState.WAITING or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} is not new: {seq.status}")
        limit = self.config.max_model_len
        if seq.num_tokens >= limit:
            raise RequestTooLarge(f"prompt of {seq.num_tokens} tokens leaves no room in the {limit}-token context")
        # the KV it may hold at most: every token but the last one generated
        max_kv_tokens = min(seq.num_tokens + seq.max_tokens, limit) - 1
        if self.block_manager.blocks_needed(max_kv_tokens) > self.config.num_blocks:
            raise RequestTooLarge(f"{max_kv_tokens} tokens of KV exceed the {self.config.num_blocks}-block cache")

    def reserve_remote(self, seq: Sequence, max_cached_tokens: int | None = None) -> list[int] | None:
        """Hybrid mode: blocks for the prompt of `seq`, whose KV another engine computes: the blocks of
        its longest cached prefix, at most `max_cached_tokens` positions (their KV is here already:
        `seq.num_cached_tokens` positions, whole blocks) and fresh ones for the rest, which the caller
        imports; None when they do not fit now (try again after a step). The sequence waits outside
        the queues (WAITING_FOR_REMOTE_KV) until activate_remote or abort."""
        self._check_new(seq)
        bm = self.block_manager
        if not bm.can_allocate(seq.token_ids, max_cached_tokens=max_cached_tokens):
            return None
        seq.num_cached_tokens = bm.allocate(seq.seq_id, seq.token_ids, max_cached_tokens=max_cached_tokens)
        seq.status = RequestState.WAITING_FOR_REMOTE_KV
        self._seqs[seq.seq_id] = seq
        return self.block_manager.block_table(seq.seq_id)

    def activate_remote(self, seq_id: int, first_token: int) -> Sequence:
        """The prompt's KV is in the reserved blocks and `first_token` was sampled from its logits:
        its full blocks enter the prefix cache and the sequence joins the running decodes (or
        finishes now, returned with a finished status)."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.status is not RequestState.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"sequence {seq_id} is not waiting for remote KV")
        seq.num_computed_tokens = seq.num_tokens
        self.block_manager.cache_full_blocks(seq_id, seq.token_ids, seq.num_computed_tokens)
        self._append_token(seq, first_token)
        if seq.status.finished:
            self.block_manager.free(seq_id)
            del self._seqs[seq_id]
        else:
            self.running.append(seq)
        return seq

    def abort(self, seq_id: int) -> Sequence | None:
        """Cancel a waiting, running or remote-KV sequence and free its blocks; None if it is not here."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is RequestState.WAITING:
            self.waiting.remove(seq)
        else:
            if seq.status is not RequestState.WAITING_FOR_REMOTE_KV:
                self.running.remove(seq)
            self.block_manager.free(seq_id)
        seq.status = RequestState.FINISHED_ABORTED
        self.speculator.forget(seq_id)
        return seq

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before update() of the previous step")
        preempted: list[int] = []
        self._logit_rows = self.config.prompt_logit_rows
        decodes = self._schedule_decodes(preempted)
        waited, queued = self.prompt_queue()
        decode_rows = sum(c.num_tokens for c in decodes)  # drafts included
        budget = max(0, self._step_tokens(waited, decode_rows if decodes else None, queued) - decode_rows)
        cap = self.pacer.cap(waited, decode_rows, queued) if decodes else None
        if cap is not None:  # streams wait on this step: no more prompt than fits the step target
            budget = min(budget, cap)
        prefills, budget = self._schedule_running_prefills(budget)
        if not preempted:  # blocks ran short this step: admitting more would only thrash
            prefills += self._admit_waiting(budget)
        self._in_flight = SchedulerOutput(tuple(decodes), tuple(prefills), tuple(preempted))
        return self._in_flight

    def _step_tokens(self, waited: float, decode_rows: int | None, queued: int) -> int:
        """The tokens this step may compute: max_num_batched_tokens, grown toward
        stretched_batched_tokens as far as the queue stretches the step (step_pacer.py)."""
        calm = self.config.max_num_batched_tokens
        return calm + int(self.pacer.stretch(waited, decode_rows, queued) * (self.config.most_batched_tokens - calm))

    def update(self, output: SchedulerOutput, sampled_tokens: Mapping[int, int]) -> list[Sequence]:
        """Record the step's computed tokens and sampled ones; return the sequences it finished."""
        if output is not self._in_flight:
            raise ValueError("update() needs the output of the latest schedule()")
        self._in_flight = None
        finished = []
        for chunk in output.chunks:
            seq = self._seqs.get(chunk.seq_id)
            if seq is None or seq.status is RequestState.WAITING:
                continue  # aborted (and maybe added anew) since schedule(); its blocks are already free
            if chunk.num_drafts:
                self._take_verified(seq, chunk, sampled_tokens)
            else:
                seq.num_computed_tokens += chunk.num_tokens
                self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
                if not chunk.samples:
                    continue
                if chunk.seq_id not in sampled_tokens:
                    raise ValueError(f"the engine sampled no token for sequence {chunk.seq_id}")
                self._append_token(seq, sampled_tokens[chunk.seq_id])
            if seq.status.finished:
                self._finish(seq)
                finished.append(seq)
        return finished

    def _take_verified(self, seq: Sequence, chunk: ScheduledChunk, sampled_tokens: Mapping) -> None:
        """A verify chunk's tokens (speculation.verify: the accepted drafts, then the target's own): the
        newest token's and the accepted drafts' KV is kept, the rest of the drafts' positions cut back."""
        tokens = sampled_tokens.get(chunk.seq_id)
        if not tokens:
            raise ValueError(f"the engine verified no token for sequence {chunk.seq_id}")
        tokens = list(tokens)
        if tokens[:-1] != list(chunk.token_ids[1:len(tokens)]):
            raise ValueError(f"sequence {chunk.seq_id}: {tokens} is not an accepted prefix of its drafts")
        seq.num_computed_tokens += len(tokens)  # the newest token's row, and one per accepted draft
        grammar_ends = seq.stop_requested  # a grammar completes at the last token verified, not before
        for i, token in enumerate(tokens):
            seq.stop_requested = grammar_ends and i == len(tokens) - 1
            self._append_token(seq, token)
            if seq.status.finished:
                break
        self.speculator.observe(seq.seq_id, chunk.num_drafts, len(tokens) - 1)
        if not seq.status.finished:
            self.block_manager.truncate(seq.seq_id, seq.num_tokens)
        self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """How long the engine took for `output`: what the pacer sizes later steps' prompt chunks by."""
        self.pacer.observe(sum(c.num_tokens for c in output.decodes), sum(c.num_tokens for c in output.prefills),
                           seconds)

    # ---- internals -------------------------------------------------------------------------
    def _schedule_decodes(self, preempted: list[int]) -> list[ScheduledChunk]:
        chunks, i = [], 0
        decoding = sum(1 for seq in self.running if seq.status is RequestState.DECODING)
        # drafts only in the calm budget's room beside one row per decode
        self._draft_room = self.config.max_num_batched_tokens - decoding
        while i < len(self.running):  # preemption shortens the list from its end
            seq = self.running[i]
            if seq.status is RequestState.DECODING and self._make_room(seq, preempted):
                drafts = self._drafts(seq, decoding)
                self.block_manager.append_slots(seq.seq_id, seq.num_tokens + len(drafts))
                chunks.append(self._chunk(seq, 1, drafts))
            i += 1
        return chunks

    def _drafts(self, seq: Sequence, decoding: int) -> list[int]:
        """The drafts `seq` verifies this step (speculation.py): within its max_tokens and context, this
        step's logit rows and token room, and the blocks free now less one for every decode's next token
        (drafts never preempt anyone, this step or by leaving a later decode short)."""
        if not self.config.speculation.on:
            return []
        room = min(seq.max_tokens - seq.num_generated - 1, self.config.max_model_len - seq.num_tokens - 1,
                   self._logit_rows, self._draft_room)
        wanted = getattr(seq.sampling_params, "speculative", True)
        drafts = self.speculator.drafts(seq.seq_id, seq.token_ids, room, decoding, wanted)
        bm = self.block_manager
        spare = bm.num_free_blocks - decoding
        while drafts and bm.blocks_needed(seq.num_tokens + len(drafts)) - len(bm.block_table(seq.seq_id)) > spare:
            drafts.pop()
        self._logit_rows -= len(drafts)
        self._draft_room -= len(drafts)
        return drafts

    def _make_room(self, seq: Sequence, preempted: list[int]) -> bool:
        """Preempt the newest running sequences until `seq` can hold its newest token.
        False when `seq` itself had to go."""
        while not self.block_manager.can_append(seq.seq_id, seq.num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.seq_id)
            if victim is seq:
                return False
        return True

    def _schedule_running_prefills(self, budget: int) -> tuple[list[ScheduledChunk], int]:
        chunks = []
        for seq in self.running:
            if budget == 0:
                break
            if seq.status is RequestState.PREFILLING:
                n = self._chunk_length(seq, budget)
                if n:
                    chunks.append(self._chunk(seq, n))
                    budget -= n
        return chunks, budget

    def _chunk_length(self, seq: Sequence, budget: int) -> int:
        """The tokens of `seq` this step computes: what is left of it, within the budget and, for a
        sequence that wants every row's logits, within this step's logit rows (0: not this step)."""
        n = min(seq.num_uncomputed_tokens, budget)
        if seq.all_logits:
            n = min(n, self._logit_rows)
            self._logit_rows -= n
        return n

    def _admit_waiting(self, budget: int) -> list[ScheduledChunk]:
        chunks, bm = [], self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # prompt logprobs are recomputed, not kept: a cached prefix's logits are gone
            most_cached = 0 if seq.all_logits else None
            if not bm.can_allocate(seq.token_ids, max_cached_tokens=most_cached):
                break  # first come, first served: no overtaking the head
            if seq.all_logits and self._logit_rows == 0:
                break  # this step's logit rows are taken: next step
            self.waiting.popleft()
            seq.num_cached_tokens = bm.allocate(seq.seq_id, seq.token_ids, max_cached_tokens=most_cached)
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = RequestState.PREFILLING
            self.running.append(seq)
            n = self._chunk_length(seq, budget)
            chunks.append(self._chunk(seq, n))
            budget -= n
        return chunks

    def _chunk(self, seq: Sequence, num_tokens: int, drafts: list[int] | tuple = ()) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(
            seq_id=seq.seq_id,
            start=start,
            token_ids=tuple(seq.token_ids[start:start + num_tokens]) + tuple(drafts),
            block_table=tuple(self.block_manager.block_table(seq.seq_id)),
            samples=start + num_tokens == seq.num_tokens,
            sampling_params=seq.sampling_params,
            all_logits=(seq.all_logits and num_tokens > 0) or bool(drafts),
            num_drafts=len(drafts),
        )

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        context_left = self.config.max_model_len - seq.num_tokens
        seq.status = state_after_token(token, seq.num_generated, seq.max_tokens, seq.stop_token_ids, context_left)
        if seq.stop_requested and not seq.status.finished:
            seq.status = RequestState.FINISHED_STOPPED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = seq.num_cached_tokens = 0
        seq.status = RequestState.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _finish(self, seq: Sequence) -> None:
        self.speculator.forget(seq.seq_id)
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        del self._seqs[seq.seq_id]
