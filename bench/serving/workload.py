"""What the serving benchmarks send: token-id prompts cut from the repository's own prose.

Prompts are windows of real text tokenized with the served model's tokenizer, sent as token ids so
every server gets exactly the same prompt lengths (each would tokenize text its own way).
"""
from __future__ import annotations

import hashlib
import random

import numpy as np

from bench._common import ROOT

# real text, shipped with the repo: the front page and every docs page (the README alone is too short since
# the docs left it), in a fixed order; the corpus' sha256 goes into each result for the record
CORPUS_FILES = ("README.md", "docs/architecture.md", "docs/api.md", "docs/configuration.md", "docs/deployment.md",
                "docs/observability.md", "bench/README.md")
# a request's first token is replaced by one drawn from here, a different one for every request of a run
SALT_IDS = (1000, 45000)


def corpus_ids() -> tuple[list[int], str]:
    """The repo's own prose tokenized once with the served model's tokenizer; its sha256 for the record."""
    from services.model.checkpoint import locate
    from services.model.tokenizer import load_tokenizer
    from services.settings import CommonSettings

    tok = load_tokenizer(locate(CommonSettings().model))
    text = "\n\n".join((ROOT / f).read_text() for f in CORPUS_FILES if (ROOT / f).is_file())
    ids = tok(text, add_special_tokens=False).input_ids
    return ids, hashlib.sha256(np.asarray(ids, np.int32).tobytes()).hexdigest()[:16]


def window(corpus: list[int], n: int, rng: random.Random) -> list[int]:
    if n > len(corpus):
        raise SystemExit(f"the corpus has {len(corpus)} tokens, fewer than a {n}-token prompt")
    start = rng.randrange(len(corpus) - n + 1)
    return corpus[start:start + n]


def workload(corpus: list[int], n: int, seed: int, prompt_range, output_range) -> list[tuple[list[int], int]]:
    """n requests (prompt ids, output tokens): windows of the corpus at seeded offsets and lengths."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        n_in = rng.randint(*prompt_range)
        reqs.append((window(corpus, n_in, rng), rng.randint(*output_range)))
    return reqs


def salt_seed(given: int | None) -> int:
    """The Salter's seed of a run: the one given, else drawn afresh, so that a run against servers still
    up from an earlier one (`--url`, `--target`) does not send them the earlier run's prompts (their
    prefix caches would answer them: hybrid at 32 clients gave TTFT p50 0.4 s on a repeat, 17 s fresh)."""
    return given if given is not None else random.SystemRandom().randrange(1 << 31)


class Salter:
    """Makes every prompt of a run unique from its first token on, lengths unchanged.

    The same requests go to every target and every round; a server with a prefix cache (llama-server's
    slots, our engines' block hashes, shared between our modes) would serve a repeat from cache and
    skip its prefill. A fresh first token per request (seeded, never repeated in a run) makes the first
    KV block differ, so nothing is reused and every target does the same work.
    """

    def __init__(self, seed: int):
        self._ids = list(range(*SALT_IDS))
        random.Random(seed).shuffle(self._ids)
        self._next = 0

    def __call__(self, prompt: list[int]) -> list[int]:
        if self._next >= len(self._ids):
            raise RuntimeError(f"more than {len(self._ids)} requests in one run: no unique first token left")
        salt = self._ids[self._next]
        self._next += 1
        return [salt, *prompt[1:]]


def chat_workload(corpus: list[int], n: int, seed: int, system_tokens: int, user_range) -> tuple[list[int], list[list[int]]]:
    """A shared system prompt of `system_tokens` ids and n different user turns (a chat load's prompts
    are system + user): windows of the corpus at seeded offsets."""
    rng = random.Random(seed)
    system = window(corpus, system_tokens, rng)
    return system, [window(corpus, rng.randint(*user_range), rng) for _ in range(n)]
