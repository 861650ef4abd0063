"""Batch-invariant fp32 matmuls on the CPU: MKL's strict reproducibility mode, and the fewest rows
from which a row of x @ W has the same bits whatever the row count and the other rows.

gpu mode's greedy tokens must not depend on what else shares the step (batched_step.py). That
rests on the BLAS: on an AMD EPYC (Zen 4) MKL's default sgemm gave a row the same bits at every
row count from 4 up, so the step padded smaller batches to 4 rows. On an Intel Xeon (Emerald
Rapids, 2026-11-27) it did not: for the default model's down projection (K 1536) rows changed
their last bits at M = 24-128 and agreed again from 200, so a decode row's logits differed
between a step alone and a step beside a 40-token prefill chunk. MKL's conditional numerical
reproducibility in strict mode (MKL_CBWR=AUTO,STRICT) fixes the summation order per output: there
every row count from 1 gave a row the same bits, so nothing needs padding. Its cost there, the
default model's engine steps in alternate processes, medians of 3 rounds each: a lone decode 51.6 ms
(unpadded) against 60.7 ms (default mode, padded to 4 rows), 8 decodes 74.9 against 89.1 ms, a
256-token prefill 343 against 368 ms, a 512-token one 704 against 702 ms: none.

Strict mode can only be chosen before MKL's first call in the process (mkl_cbwr_set answers
MKL_CBWR_ERR_MODE_CHANGE_FAILURE after), and the environment variable is read at MKL's start,
which torch's import may already have passed; so `request_strict_mkl` calls MKL's own setter in
torch's library, as early as the service can (before the model loads). Whatever the mode, the
engine then checks the property itself on its own matrices (`invariant_floor`) and pads to what it
found, so a BLAS that keeps it from 4 rows, 1 row or neither is each served as measured.
"""
from __future__ import annotations

import ctypes
import logging
import os
from typing import Callable, Iterable

import torch

log = logging.getLogger(__name__)

# mkl_cbwr.h: MKL_CBWR_AUTO | MKL_CBWR_STRICT; the setter's answer when MKL already ran
CBWR_AUTO_STRICT = 2 | 0x10000
CBWR_MODE_CHANGE_FAILURE = -8
FLOORS = (1, 4)  # the row floors tried, fewest first: 4 is the default MKL's on Zen 4
ROWS_CHECKED = (1, 2, 3, 4, 5, 9, 24, 64, 128)  # row counts a row's bits are compared across

_strict: str | None = None  # what request_strict_mkl found, once
_floors: dict[tuple, int | None] = {}  # invariant_floor's answers by the products' shapes: a BLAS property


def _mkl_setter() -> Callable[[int], int] | None:
    """MKL's mkl_cbwr_set inside torch's CPU library, or None (a build without MKL)."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        setter = lib.mkl_serv_cbwr_set
    except (OSError, AttributeError):
        return None
    setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
    return setter


def request_strict_mkl() -> str:
    """Put MKL in strict reproducibility mode for this process, once: "strict", or why not ("too
    late": MKL had run already; "no MKL": torch was built without it; "refused (N)")."""
    global _strict
    if _strict is None:
        if not torch.backends.mkl.is_available():
            _strict = "no MKL"
        else:
            setter = _mkl_setter()
            code = None if setter is None else setter(CBWR_AUTO_STRICT)
            _strict = {None: "no MKL", 0: "strict", CBWR_MODE_CHANGE_FAILURE: "too late"}.get(code, f"refused ({code})")
    return _strict


def _rows_keep_bits(product: Callable[[torch.Tensor], torch.Tensor], k: int, dtype: torch.dtype, floor: int,
                    gen: torch.Generator) -> bool:
    """Rows 0 .. floor-1 of product(x) have the same bits at every checked row count >= floor, and
    placed last among other rows."""
    x = torch.randn(max(ROWS_CHECKED) + floor, k, generator=gen).to(dtype)
    base = product(x[:floor])
    if any(not torch.equal(product(x[:m])[:floor], base) for m in ROWS_CHECKED if m > floor):
        return False
    moved = torch.cat([x[floor:floor + 23], x[:floor]])  # the same rows after 23 others
    return torch.equal(product(moved)[23:], base)


@torch.inference_mode()
def invariant_floor(products: Iterable[tuple[Callable[[torch.Tensor], torch.Tensor], int]], dtype: torch.dtype,
                    key: tuple | None = None) -> int | None:
    """The fewest rows (of FLOORS) from which every product keeps a row's bits whatever the rows
    beside it; None when none does. `products`: (x -> the model's own product with one matrix, its
    input width). `key`: what the answer depends on (the matrices' shapes and how they are applied);
    a process asks once per key (the suite builds many engines of one model)."""
    if key is not None and key in _floors:
        return _floors[key]
    products = list(products)
    found = None
    for floor in FLOORS:
        gen = torch.Generator().manual_seed(0)
        if all(_rows_keep_bits(p, k, dtype, floor, gen) for p, k in products):
            found = floor
            break
    if key is not None:
        _floors[key] = found
    return found
