"""Benchmarks' whole stack (`hybridserve up` on free ports): harness/stack.py, with bench's progress lines."""
from __future__ import annotations

from functools import partial

from bench._common import progress

from harness.stack import Stack, start_stack as _start_stack

start_stack = partial(_start_stack, progress=progress)

__all__ = ["Stack", "start_stack"]
