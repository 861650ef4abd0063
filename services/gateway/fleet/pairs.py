"""The engine pairs behind the gateway: each pair's clients, which pairs can serve a mode, the pair
a request goes to (pair_load.py), and the set of pairs changing as discovery finds pods come and go.

A pair is one prefill_gpu and one decode_fpga that share a KV arena (one host, one pod). Pairs
are alike (same model, same devices), so the router learns per mode for all of them; what differs
between pairs is their load and whether they are up.

Pairs are keyed by a small int, their metrics label: the settings' order, or for discovered pairs
the lowest index free when the pair appears (so the label stays bounded by the most pairs at once).
"""
from __future__ import annotations

import asyncio
from typing import Callable, Protocol

from services.gateway.fleet.pair_load import PairLoads
from services.gateway.fleet.prefix_routing import Placement, PrefixPolicy, place
from services.modes import ENGINES, MODES
from services.rpc.hybridserve.v1 import engine_pb2 as pb


class Engines(Protocol):
    """What the gateway uses of one pair's engine_client.EngineClients (tests pass a fake)."""

    up: dict[str, bool]  # engine -> up at the last health check
    blocks: dict  # engine -> kv_index.EngineBlocks: what it holds in its prefix cache

    def context_of(self, engine: str) -> int: ...

    async def check(self, engine: str) -> bool: ...

    def generate(self, engine: str, request: pb.GenerateRequest, timeout: float): ...


Address = tuple[str, str]  # (prefill_gpu's host:port, decode_fpga's host:port)


def parse_pairs(text: str) -> list[Address]:
    """"prefill1:port,decode1:port;prefill2:port,decode2:port" → [(prefill, decode), ...]."""
    pairs = []
    for item in (p.strip() for p in text.split(";")):
        if not item:
            continue
        parts = [a.strip() for a in item.split(",")]
        if len(parts) != 2 or not all(_is_address(a) for a in parts):
            raise ValueError(f"a pair is 'prefill_host:port,decode_host:port', not {item!r}")
        pairs.append((parts[0], parts[1]))
    if not pairs:
        raise ValueError("the list of pairs is empty")
    return pairs


def parse_pool(text: str) -> list[str]:
    """"host:port,host:port" → the engines' addresses (each once, in order)."""
    pool = list(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    bad = [a for a in pool if not _is_address(a)]
    if bad or not pool:
        raise ValueError(f"a pool is 'host:port,host:port,...', not {text!r}")
    return pool


def _is_address(a: str) -> bool:
    host, sep, port = a.rpartition(":")
    return bool(host) and bool(sep) and port.isdigit()


class Pairs:
    """Every pair's clients, and the load book the pair choice reads."""

    def __init__(self, members: dict[int, Engines] | list[Engines], addresses: dict[int, Address] | None = None,
                 prefix_policy: PrefixPolicy | None = None, pools: bool = False):
        self.members: dict[int, Engines] = dict(enumerate(members)) if isinstance(members, list) else dict(members)
        self.addresses: dict[int, Address] = dict(addresses or {})
        # pools: the pairs are every (prefill, decode) combination, and a hybrid call names its prefill
        # engine to the decode engine (which otherwise pulls from its own)
        self.pools = pools
        # engines being removed from a pool, as (side, address) (side 0: prefill, 1: decode): their pairs
        # take no new call
        self.draining: set[tuple[int, str]] = set()
        self.loads = PairLoads()
        self.prefix_policy = prefix_policy or PrefixPolicy()

    def __len__(self) -> int:
        return len(self.members)

    def serving(self, mode: str, exclude: frozenset = frozenset()) -> list[int]:
        """Pairs whose engines for `mode` are all up, but those in `exclude` as (pair, mode)."""
        return [p for p, c in self.members.items()
                if all(c.up.get(e) for e in MODES[mode].engines) and (p, mode) not in exclude
                and not self.is_draining(p)]

    def is_draining(self, pair: int) -> bool:
        address = self.addresses.get(pair)
        return bool(self.draining) and address is not None and any(
            (side, a) in self.draining for side, a in enumerate(address))

    def choose(self, mode: str, exclude: frozenset = frozenset()) -> int:
        return self.loads.choose(mode, self.serving(mode, exclude))

    def place(self, mode: str, prompt_ids: list[int], exclude: frozenset = frozenset()) -> Placement:
        """The pair for a request of `mode`: where its prompt's prefix is cached, and load
        (prefix_routing.py). LookupError when no pair can serve the mode."""
        candidates = self.serving(mode, exclude)
        least = self.loads.choose(mode, candidates)
        chains: dict[int, list[bytes]] = {}  # the prompt's block hashes per block size, computed once
        hits, loads = {}, {}
        for p in candidates:
            blocks = getattr(self.members[p], "blocks", None)
            hits[p] = max((blocks[e].hit_tokens(prompt_ids, chains) for e in MODES[mode].engines),
                          default=0) if blocks and len(candidates) > 1 else 0
            loads[p] = self.loads.queued(p, mode)
        return place(candidates, least, loads, hits, len(prompt_ids), self.prefix_policy)

    def prefill_address(self, pair: int, mode: str) -> str:
        """What a call of `mode` on `pair` tells the decode engine about the prefill engine to pull
        from: with pools, the pair's own (hybrid only); "" otherwise (the decode engine's own)."""
        return self.addresses[pair][0] if self.pools and mode == "hybrid" and pair in self.addresses else ""

    def engine_up_anywhere(self, engine: str) -> bool:
        return any(c.up.get(engine) for c in self.members.values())

    def context_of(self, engine: str) -> int:
        """The engine's context window (pairs are alike: any pair's Info says it; 0 before any)."""
        return max((c.context_of(engine) for c in self.members.values()), default=0)

    async def check_all(self) -> dict[int, dict[str, bool]]:
        """Health-check every engine of every pair: pair → engine → up."""
        members = list(self.members.items())
        ups = await asyncio.gather(*(asyncio.gather(*(c.check(e) for e in ENGINES)) for _, c in members))
        return {p: dict(zip(ENGINES, up)) for (p, _), up in zip(members, ups)}

    # ---- pools changing at run time (pool_admin.py: `hybridserve up --autoscale`) ----------------
    def pool(self, side: int) -> list[str]:
        """The engines of a pool (side 0: prefill, 1: decode), in the order of their first pair."""
        return list(dict.fromkeys(a[side] for _, a in sorted(self.addresses.items())))

    def pairs_with(self, side: int, address: str) -> list[int]:
        return [p for p, a in sorted(self.addresses.items()) if a[side] == address]

    def join_pool(self, side: int, address: str, connect: Callable[[Address], Engines]) -> list[int]:
        """The engine at `address` joins its pool: a pair with every engine of the other pool; one
        already there that was draining serves again. Its pairs."""
        self.draining.discard((side, address))
        if address in self.pool(side):
            return self.pairs_with(side, address)
        for other in self.pool(1 - side):
            pair = (address, other) if side == 0 else (other, address)
            p = next(i for i in range(len(self.members) + 1) if i not in self.members)
            self.members[p], self.addresses[p] = connect(pair), pair
        return self.pairs_with(side, address)

    def drain_pool_member(self, side: int, address: str) -> list[int]:
        """No new call goes to the engine at `address`; those open go on. Its pairs."""
        self.draining.add((side, address))
        return self.pairs_with(side, address)

    def calls_on(self, side: int, address: str) -> int:
        """Calls this gateway has open on the pairs of the engine at `address` (any mode: a gpu call on
        pair (p, d) runs through that pair's channel, closed with it)."""
        return sum(self.loads.calls(p) for p in self.pairs_with(side, address))

    def leave_pool(self, side: int, address: str) -> list[Engines]:
        """The engine's pairs leave; the caller closes the clients returned."""
        removed = []
        for p in self.pairs_with(side, address):
            removed.append(self.members.pop(p))
            del self.addresses[p]
            self.loads.forget(p)
        self.draining.discard((side, address))
        return removed

    def sync(self, wanted: list[Address], connect: Callable[[Address], Engines]) -> tuple[list, list]:
        """Make the pairs those at `wanted` (discovery's answer): new ones get the lowest free index,
        gone ones leave. (added indices, removed clients): the caller closes the removed ones' channels."""
        have = {a: p for p, a in self.addresses.items()}
        removed = []
        for address, p in have.items():
            if address not in wanted:
                removed.append(self.members.pop(p))
                del self.addresses[p]
                self.loads.forget(p)
        added = []
        for address in wanted:
            if address in have:
                continue
            p = next(i for i in range(len(self.members) + 1) if i not in self.members)
            self.members[p], self.addresses[p] = connect(address), address
            added.append(p)
        return added, removed
