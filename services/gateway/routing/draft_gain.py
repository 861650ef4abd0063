"""What speculative decoding does to a decode's time, for the router: a decode sample's time as if it had run
without drafts (what the correction and the batch term learn from), and the gain recent decodes saw (what
the estimate is multiplied by).

The decode correction is the smallest measured / base ratio over a stage's recent requests (router.py): a
floor, because interference only ever adds time. Drafts break that. A request whose output repeats text it
holds decodes 2-3x faster than its neighbours because of what it says, not because of how fast the engine
is, and as the smallest ratio it made decode_fpga look 2-3x cheaper for every request
(tests/gateway/test_router_drafts.py: one such request took a decode's estimate from 2.15 to 0.72 s). With
decode_fpga's drafts on, auto at 8 clients of the serve mix (outputs of 64-256 forced tokens, which often
repeat themselves) gave 0.88x drafts off under that rule (bench/results/serve_8_32_spec_default_s10.json),
and 1.10x and 1.24x with this module and drafts from long matches at 3-8 sequences (speculation.py), one
run each (serve_8_32_spec_default_s10b.json, serve_auto_8_32_poll_s10.json): the two changes' shares are
not told apart.

So a sample with accepted drafts teaches the correction and the batch term its time scaled to the steps
it took: seconds x n_out / (n_out - accepted). A verify step costs at least what a one-row step does, so the
scaled time is never below the time without drafts: the floor stays a floor. What drafts give is learned
apart: the median, over the engine's last WINDOW decodes, of measured seconds / the estimate without
drafts, at most 1. That is a typical request's gain: a few copy-heavy requests do not move it, traffic
that mostly repeats itself does, and under a load where no sequence drafts it returns to 1.
"""
from __future__ import annotations

import statistics
from collections import deque

WINDOW = 16  # recent decodes of one engine behind its gain
MIN_SAMPLES = 3  # fewer: no gain assumed
FLOOR = 0.1  # the largest speed-up one engine's estimate takes from drafts (k drafts give at most k + 1)


def plain_seconds(sample: dict) -> float:
    """A sample's seconds scaled to the steps it took without its accepted drafts (its own seconds, at
    least 1e-9, when none were accepted, as for every stage but decode)."""
    seconds = max(float(sample["seconds"]), 1e-9)
    n_out, accepted = int(sample.get("n_out") or 0), int(sample.get("accepted") or 0)
    if accepted <= 0 or n_out <= 0:
        return seconds
    return seconds * n_out / max(1, n_out - accepted)


class DraftGain:
    """One decode engine's gain from drafts: the median of recent measured / estimated-without-drafts."""

    def __init__(self, window: int = WINDOW):
        self._ratios: deque[float] = deque(maxlen=window)

    def add(self, measured: float, estimated_without_drafts: float) -> None:
        self._ratios.append(max(measured, 1e-9) / max(estimated_without_drafts, 1e-9))

    @property
    def samples(self) -> int:
        return len(self._ratios)

    def factor(self) -> float:
        """What a decode estimate is multiplied by: 1 (no gain) until MIN_SAMPLES, then the median ratio
        within [FLOOR, 1]: a decode slower than its estimate is the correction's business, not a gain's."""
        if len(self._ratios) < MIN_SAMPLES:
            return 1.0
        return min(1.0, max(FLOOR, statistics.median(self._ratios)))
