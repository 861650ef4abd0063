"""Which pair serves a request once its mode is known: where its prompt's prefix is cached, and load.

Pure Python. For each candidate pair: `hit`, the prompt's leading tokens the pair's engines hold
in their prefix caches (the gateway's index, kv_index.py; for hybrid mode the larger of the two
engines', since decode_fpga skips what it holds and prefill_gpu computes only the rest), and
`queued`, the requests on the busier of the mode's engines (pair_load.py: running and waiting as
last reported, plus the calls this gateway opened since). Then

    score = prefix_weight x (1 - hit / prompt tokens) + queued          (lowest wins)

so a whole prompt cached is worth `prefix_weight` requests of queue (its prefill saved against
waiting behind them). The balance guard: when the busiest and the least busy candidates differ by
more than `balance_guard` requests, load wins and the least loaded pair serves, whatever it has
cached: affinity alone piles a hot prefix onto one pair (the complaint users of KV-aware routers
make) until its hit rate collapses under load. SGLang's cache-aware policy has the same absolute
threshold. With no hit anywhere it is the least-loaded choice of before.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixPolicy:
    enabled: bool = True
    prefix_weight: float = 2.0  # requests of queue a whole prompt cached is worth
    balance_guard: float = 4.0  # requests between the busiest and the least busy pair


@dataclass(frozen=True)
class Placement:
    pair: int
    reason: str  # "only" | "load" (no hit anywhere) | "prefix" | "balance" (the guard overrode a hit)
    hit_tokens: int  # of the chosen pair
    best_hit_tokens: int  # the most any candidate had

    def record(self) -> dict:
        return {"pair": self.pair, "reason": self.reason, "prefix_hit_tokens": self.hit_tokens}


def place(candidates: list[int], least_loaded: int, loads: dict[int, float], hits: dict[int, int],
          n_prompt: int, policy: PrefixPolicy) -> Placement:
    """`loads`: requests queued per pair; `least_loaded`: pair_load's choice among `candidates` (its
    tie-breaks included)."""
    if len(candidates) == 1:
        return Placement(candidates[0], "only", hits.get(candidates[0], 0), hits.get(candidates[0], 0))
    best_hit = max((hits.get(p, 0) for p in candidates), default=0)
    if not policy.enabled or best_hit == 0 or n_prompt <= 0:
        return Placement(least_loaded, "load", hits.get(least_loaded, 0), best_hit)
    spread = max(loads[p] for p in candidates) - min(loads[p] for p in candidates)
    if spread > policy.balance_guard:
        return Placement(least_loaded, "balance", hits.get(least_loaded, 0), best_hit)

    def score(p: int) -> tuple[float, int]:
        # ties: the least-loaded choice first (its order knows KV usage and this gateway's calls)
        return policy.prefix_weight * (1.0 - hits.get(p, 0) / n_prompt) + loads[p], p != least_loaded

    chosen = min(candidates, key=score)
    return Placement(chosen, "prefix", hits.get(chosen, 0), best_hit)
