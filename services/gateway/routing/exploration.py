"""Which mode an auto request runs instead of the cheapest, to learn (router.py's exploration).

An auto request may run a mode that is not the cheapest, (a) while one of its stages is unconfirmed:
measured by fewer than CONFIRMING requests and not timed by a quiet profile (an engine's sweep whose
repeats agreed with no other load, or a cached one a quiet probe confirmed at this start: such a
profile is trusted like requests, so a fresh start on a quiet machine does not run a mode its profile
shows far slower just to check it; the gateway checks an unquiet one with short requests of its own
first, calibration_check.py), or timed by one that the one request measuring it since found over
DISAGREE x slow (router.py's _confirmed); at most 5 stages x 2: a start on a busy machine learns the stages of
every mode within a few requests, and a first request timed on a busy machine is checked by a second,
(b) to refresh a stage not measured for `stale_after` auto decisions, from a credit of `explore_share`
per auto request (so at most that share; the router keeps the credit). A request explores only where
it measures something (a one-token request no decode). A stage not yet confirmed does not count in
the guard (its estimate is the unverified profile); otherwise a mode is explored only within
`explore_limit` x the best estimate. Never for a forced mode, never with explore_share=0.
"""
from __future__ import annotations

from typing import Callable

from services.gateway.routing.cost_model import CostModel, StageKey


def exploration(est: dict[str, float], best: str, n_out: int, stale_ok: bool, stale_after: int, limit: float,
                confirmed: Callable[[StageKey], bool], staleness: Callable[[list[StageKey]], int],
                unconfirmed_seconds: Callable[[list[StageKey]], float]) -> tuple[str, bool] | None:
    """(mode, whether it measures a stage never measured) worth running instead of `best`, or None.

    `est`: each candidate mode's estimate; `stale_ok`: the credit allows a refresh; `staleness(keys)`:
    auto decisions since the longest unmeasured of `keys`; `unconfirmed_seconds(keys)`: what those
    stages add to their mode's estimate."""
    candidates = []
    for mode in est:
        if mode == best:
            continue
        keys = CostModel.stage_keys(mode)
        unconfirmed = [k for k in keys if not confirmed(k)]
        # what this request would measure: a one-token request reports no decode step
        teaches = [k for k in keys if k[0] != "decode" or n_out >= 2]
        new = [k for k in teaches if not confirmed(k)]
        stale = staleness(teaches)
        if not new and not (stale_ok and stale >= stale_after):
            continue
        # an unconfirmed stage's estimate is only the profile's word: it does not count against exploring
        trusted = est[mode] - unconfirmed_seconds(unconfirmed)
        if trusted <= limit * est[best]:
            candidates.append((-len(new), -stale, est[mode], mode))
    if not candidates:
        return None
    chosen = min(candidates)
    return chosen[-1], chosen[0] < 0


def most_unconfirmed(modes: list[str], n_out: int, confirmed: Callable[[StageKey], bool]) -> str | None:
    """Of `modes`, the one whose request of `n_out` tokens would measure the most stages not yet
    confirmed (the first such in order on a tie), or None once every stage they run is confirmed."""
    best, most = None, 0
    for mode in modes:
        new = [k for k in CostModel.stage_keys(mode) if (k[0] != "decode" or n_out >= 2) and not confirmed(k)]
        if len(new) > most:
            best, most = mode, len(new)
    return best
