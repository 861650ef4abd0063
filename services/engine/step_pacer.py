"""How many prompt tokens a step may prefill while decodes run, from measured step times.

Chunked prefill alone keeps a long prompt from taking a whole step, but a chunk of
max_num_batched_tokens can still be slow: on PoCL a 512-token chunk took over a second, and every
stream decoding beside it waited that long for its next token (a 1262 ms gap where the median was
16 ms). The pacer learns two costs from the engine's own steps: a decode-only step (`base`, an
EWMA) and the marginal seconds per prefilled token (an EWMA of (step - base) / prompt tokens, so
attention over long contexts, which makes later chunks dearer, shows in it). While decodes run, a
step's prompt tokens are capped so that base + cap x per_token stays within `target_s`; at least
`floor` tokens (a block) so a prompt always advances, at most the scheduler's own budget. With no
decode running nothing waits on the step, and the cap is off. target_s = 0 turns it off.
"""
from __future__ import annotations

ALPHA = 0.3  # EWMA weight of the newest step: follows a machine that gets busier within a few steps


class StepPacer:
    def __init__(self, target_s: float, floor: int, ceiling: int):
        self.target_s, self.floor, self.ceiling = target_s, floor, ceiling
        self.base_s: float | None = None  # a decode-only step
        self.per_token_s: float | None = None  # one more prompt token in a step

    def observe(self, n_decodes: int, n_prefill_tokens: int, seconds: float) -> None:
        if n_prefill_tokens == 0:
            if n_decodes:
                self.base_s = seconds if self.base_s is None else (1 - ALPHA) * self.base_s + ALPHA * seconds
            return
        # a step of prompt tokens alone still pays the weights' pass: that part is the base
        sample = max(0.0, seconds - (self.base_s or 0.0)) / n_prefill_tokens
        self.per_token_s = sample if self.per_token_s is None else (1 - ALPHA) * self.per_token_s + ALPHA * sample

    def cap(self) -> int | None:
        """Prompt tokens a step with decodes may take; None: no cap (off, or nothing measured yet)."""
        if self.target_s <= 0 or not self.per_token_s:
            return None
        room = self.target_s - (self.base_s or 0.0)
        return max(self.floor, min(self.ceiling, int(room / self.per_token_s)))
