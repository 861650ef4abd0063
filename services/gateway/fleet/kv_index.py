"""The gateway's picture of which prompt prefixes each engine has in its KV cache.

Every engine's Info answer carries the prefix cache's events since this gateway's cursor
(services/engine/kv_events.py): block hashes stored and removed, or a snapshot. `EngineBlocks`
follows one engine's events into a set of hashes; `prompt_hashes` chains a prompt's full blocks
with the engines' own hash (services/engine/block_manager.hash_block), so the number of leading
blocks an engine holds is a walk along the chain. The picture is as old as the last health
interval: a hint for routing, never a promise (the engine looks the prefix up itself).
"""
from __future__ import annotations

from typing import Sequence

from services.engine.block_manager import hash_block
from services.rpc.hybridserve.v1 import engine_pb2 as pb


def prompt_hashes(prompt_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The prefix-cache keys of the prompt's full blocks, in order."""
    keys, parent = [], b""
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        parent = hash_block(parent, prompt_ids[start:start + block_size])
        keys.append(parent)
    return keys


class EngineBlocks:
    """One engine's cached block hashes, kept up to date from its KVEvents."""

    def __init__(self):
        self.epoch, self.seq, self.block_size = "", 0, 0
        self.hashes: set[bytes] = set()

    def cursor(self) -> pb.InfoRequest:
        """The Info request that asks for what this picture has not seen."""
        return pb.InfoRequest(kv_events_epoch=self.epoch, kv_events_since=self.seq)

    def apply(self, info: pb.InfoResponse) -> None:
        if not info.HasField("kv_events"):
            self.clear()
            return
        ev = info.kv_events
        if ev.snapshot or ev.epoch != self.epoch:
            self.hashes = set(ev.stored)
        else:
            self.hashes.update(ev.stored)
        self.hashes.difference_update(ev.removed)
        self.epoch, self.seq, self.block_size = ev.epoch, ev.seq, info.block_size

    def snapshot(self) -> dict:
        """What this picture holds, for `GET /debug/kv_index` (router_debug.py)."""
        return {"epoch": self.epoch, "seq": self.seq, "block_size": self.block_size, "blocks": len(self.hashes)}

    def clear(self) -> None:
        """The engine is gone (or keeps no cache): nothing of its is known any more."""
        self.epoch, self.seq = "", 0
        self.hashes.clear()

    def hit_tokens(self, prompt_ids: Sequence[int], chains: dict[int, list[bytes]]) -> int:
        """Leading prompt tokens this engine holds; `chains` caches prompt_hashes per block size."""
        if not self.hashes or self.block_size < 1:
            return 0
        chain = chains.get(self.block_size)
        if chain is None:
            chain = chains[self.block_size] = prompt_hashes(prompt_ids, self.block_size)
        n = 0
        for key in chain:
            if key not in self.hashes:
                break
            n += 1
        return n * self.block_size
