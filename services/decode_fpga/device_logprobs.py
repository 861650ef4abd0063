"""Logprobs of a paged step's logit rows computed on the device (kernels/logprobs.cl), so a greedy
step with logprobs reads back 2 + 2k words a row instead of the row's vocabulary of floats.

The rows are the paged step's logits (paged_plans.py's `logits`): each row's argmax (the greedy
pick, argmax_rows' rule: the step needs no argmax launch), its log-sum-exp, the logprob of its
target (a prompt's next token for prompt logprobs, else its pick) and its k best (id, logprob), the
numbers and order of services/engine/logprobs.py's token_logprob. One kernel object is bound per k
(setting an argument costs ~40 µs in pyopencl, launch.py), on first use.
"""
from __future__ import annotations

import numpy as np
import pyopencl as cl

from services.decode_fpga.device import DeviceContext
from services.decode_fpga.launch import RowLaunch, bind_rows
from services.engine.logprobs import MAX_TOP_LOGPROBS, LogprobsAsked, StepLogprobs

LP_WG = 128  # work-items per row: local memory of 128 x 20 (id, logprob) lists, 20 KiB, fits a GPU's too


class DeviceLogprobs:
    """The logprobs kernel over `logits` [max_rows, vocab] (filled by the step before it), its targets
    uploaded per step and its words read back."""

    def __init__(self, dev: DeviceContext, logits: cl.Buffer, vocab: int, max_rows: int):
        self.dev, self.vocab, self.max_rows = dev, vocab, max_rows
        self._logits = logits
        self._program = dev.build("logprobs.cl", {"LP_WG": LP_WG, "TOPK_MAX": MAX_TOP_LOGPROBS})
        self.targets = cl.Buffer(dev.context, cl.mem_flags.READ_ONLY, max_rows * 4)
        self.words = cl.Buffer(dev.context, cl.mem_flags.READ_WRITE, max_rows * (2 + 2 * MAX_TOP_LOGPROBS) * 4)
        self._launches: dict[int, RowLaunch] = {}

    def check(self, asked: LogprobsAsked, n_rows: int) -> np.ndarray:
        """The targets of a step of n_rows logit rows as int32, checked (ValueError)."""
        targets = np.asarray(asked.targets, np.int32)
        if targets.shape != (n_rows,):
            raise ValueError(f"{targets.size} logprob targets for a step of {n_rows} logit rows")
        if n_rows and (targets.min() < -1 or targets.max() >= self.vocab):
            raise ValueError(f"a logprob target outside [0, {self.vocab}) (or -1, the row's pick)")
        if asked.k > self.vocab:
            raise ValueError(f"{asked.k} top logprobs of a vocabulary of {self.vocab}")
        return targets

    def upload(self, targets: np.ndarray, keep: list) -> None:
        """Enqueue the targets' copy (keep holds the host array until the step's wait)."""
        if not targets.size:
            return
        keep.append(targets)
        cl.enqueue_copy(self.dev.queue, self.targets, targets, is_blocking=False)

    def enqueue(self, queue: cl.CommandQueue, n_rows: int, k: int) -> None:
        """The kernel over rows [0, n_rows), after the step's head."""
        launch = self._launches.get(k)
        if launch is None:
            launch = self._launches[k] = bind_rows(
                self._program, "logprobs_rows", (LP_WG,), self._logits, np.int32(self.vocab), self.targets,
                np.int32(k), self.words, rows_scale=LP_WG, local_size=(LP_WG,))
        launch.enqueue(queue, 0, n_rows)

    @staticmethod
    def host_words(n_rows: int, k: int) -> np.ndarray:
        """The host array the rows' words are read into (StepLogprobs.from_words)."""
        return np.empty((n_rows, 2 + 2 * k), np.int32)

    def read(self, queue: cl.CommandQueue, n_rows: int, k: int) -> StepLogprobs:
        """The rows' words read now, as StepLogprobs (the kernel alone; a step reads them with its own wait)."""
        words = self.host_words(n_rows, k)
        if n_rows:
            cl.enqueue_copy(queue, words, self.words, is_blocking=True)
        return StepLogprobs.from_words(words, k)
