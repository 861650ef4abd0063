"""A hand-off's receiving end writing straight into an engine's KV blocks.

The KV receivers (services/kv/: shared memory, TCP, NIXL, in process) hand each layer to an
`import_kv_layer(seq, layer, kv)` / `finish_import(seq, n_tokens)` seam. `BlockImport` is that seam
over the blocks an engine loop reserved for one request (EngineLoop.reserve_remote): each layer goes
into the block table as it arrives (BatchEngine.import_kv_blocks), with no staging per sequence.
The `seq` argument the receivers pass is not needed: the table is the request's.
"""
from __future__ import annotations

import logging

import numpy as np

from services.errors import HandoffFailed

log = logging.getLogger(__name__)


class BlockImport:
    """The receiving half's view of an engine over one request's blocks. The table is set once the
    blocks are reserved, before the first layer arrives."""

    def __init__(self, engine, block_table: tuple[int, ...] | None = None):
        self.engine, self.block_table = engine, block_table
        self.pending = False  # layers enqueued and not yet waited for

    def import_kv_layer(self, seq, layer: int, kv: np.ndarray) -> None:
        if self.block_table is None:
            raise HandoffFailed("a KV layer arrived before this engine reserved its blocks")
        self.pending = True
        self.engine.import_kv_blocks(self.block_table, layer, kv)

    def finish_import(self, seq, n_tokens: int) -> None:
        self.engine.finish_import_blocks()
        self.pending = False

    def settle(self) -> None:
        """Wait for the layers enqueued so far, before a failed hand-off's blocks are freed. The uploads
        may run on a queue of their own (decode_fpga/paged_kv_store.py), not ahead of the steps on the
        engine's: freed with a write still pending, a block could be given to a prompt whose step writes
        it first."""
        if not self.pending:
            return
        try:
            self.finish_import(None, 0)
        except Exception:  # the hand-off is failing already; its blocks are freed either way
            log.exception("waiting for a failed hand-off's KV uploads")
