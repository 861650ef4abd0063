"""Both halves of a hybrid hand-off in process, on the engines' paged steps, as the services run them:
the prefilling engine's loop exports the prompt's KV from its blocks (engine_loop's `export` hook),
the decoding engine's loop reserves blocks, the KV is imported into them and the request decodes on
from the first token (decode_fpga/hybrid.py's path, without a transport between the two)."""
from __future__ import annotations

import numpy as np

from services.engine.one_request import local_loop
from services.engine.sampling import SamplingParams


def prefilled_kv(engine, prompt: list[int]) -> tuple[int, np.ndarray]:
    """The prompt prefilled by `engine`: its first greedy token and the prompt's KV in wire layout,
    [n_layers, 2, n_kv_heads, n, head_dim] float32, read from the blocks once the last layer is in."""
    got: dict = {}

    def export(layer: int, block_table: tuple[int, ...], n_tokens: int) -> None:
        if layer == engine.cfg.n_layers - 1:  # every layer of the prompt is in the pool now
            got["kv"] = engine.read_kv_blocks(block_table, n_tokens)

    with local_loop(engine) as loop:
        stream = loop.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), export=export)
        first = [ev.token for ev in stream]
    return first[0], got["kv"]


def decode_imported(engine, prompt: list[int], first: int, kv: np.ndarray, n_new: int) -> list[int]:
    """`first` and the n_new greedy tokens after it, decoded by `engine` from the imported KV (any
    dtype the wire carries)."""
    with local_loop(engine) as loop:
        stream = loop.reserve_remote(prompt, SamplingParams(max_tokens=n_new + 1, temperature=0.0, ignore_eos=True))
        table = stream.wait_reserved(lambda: False)
        for layer in range(engine.cfg.n_layers):
            engine.import_kv_blocks(table, layer, kv[layer])
        engine.finish_import_blocks()
        loop.activate_remote(stream, first)
        return [ev.token for ev in stream]
