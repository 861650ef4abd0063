"""Kernel launches with their arguments bound once, enqueued many times.

pyopencl's `Kernel.set_args` costs ~40 µs per call here (measured: 41 µs for a
nine-argument kernel, against ~3-9 µs for `enqueue_nd_range_kernel` alone), so
setting arguments on every launch made the host, not the device, the
bottleneck of a decode step: ~270 launches per token, ~11 ms of Python. A
`Launch` owns its own kernel object with the arguments already set; the engine
builds the list of a step's launches once per batch size and replays it.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import pyopencl as cl


@dataclass(frozen=True)
class Launch:
    kernel: cl.Kernel
    global_size: tuple[int, ...]
    local_size: tuple[int, ...] | None = None

    def enqueue(self, queue: cl.CommandQueue) -> None:
        cl.enqueue_nd_range_kernel(queue, self.kernel, self.global_size, self.local_size)


def row_groups(program: cl.Program, global_size: tuple[int, ...]) -> tuple[int, ...] | None:
    """The local size of a launch whose first dimension counts independent items (a step's rows, a
    GEMV's output rows or tiles of them), for a kernel without barriers: on a CPU device one item per
    work-group, the other dimensions whole (or one work-item each where they would pass the device's
    limits); elsewhere None, the driver's choice.

    PoCL compiles a kernel's work-group function once per local size, and given none it takes one
    from the global size: each row count a step had not had before (a chunk of a new length, a new
    batch size) compiled every such kernel again the first time it ran (rms_norm alone: 110-140 ms,
    then 0.1-0.5 ms; a paged step at a new row count: 546-741 ms, now 56-259 ms), a stall of every
    stream in the step; and each matrix shape compiled its GEMV again (0.5-1.5 s each). A fixed
    local size is one compile per kernel, whatever the rows. It costs no speed: PoCL runs one
    work-group after another on each core, and the kernels vectorize within a work-item."""
    device = program.get_info(cl.program_info.DEVICES)[0]
    if not device.type & cl.device_type.CPU:
        return None
    local = (1, *global_size[1:])
    fits = all(n <= m for n, m in zip(local, device.max_work_item_sizes))
    return local if fits and prod(local) <= device.max_work_group_size else (1,) * len(global_size)


def bind(program: cl.Program, name: str, global_size: tuple[int, ...], *args,
         local_size: tuple[int, ...] | None = None, by_row: bool = False) -> Launch:
    """A fresh kernel object of `program`'s `name` with `args` set (a kernel object holds one argument set).
    by_row: the first dimension counts independent items, local size from row_groups (unless
    local_size is given)."""
    kernel, local_size = _bound(program, name, global_size, args, local_size, by_row)
    return Launch(kernel, tuple(global_size), local_size)


def _bound(program: cl.Program, name: str, global_size: tuple[int, ...], args: tuple, local_size, by_row: bool):
    """(a kernel object with `args` set, the local size: the one given, else row_groups' when by_row)."""
    kernel = cl.Kernel(program, name)
    kernel.set_args(*args)
    if by_row and local_size is None:
        local_size = row_groups(program, tuple(global_size))
    return kernel, local_size


@dataclass(frozen=True)
class RowLaunch:
    """A launch bound once whose global size follows a step's rows (the paged step, paged_plans.py).

    `rows_dim` is the dimension that spans rows: the launch covers rows [start, start + count) of the
    step through a global size of `count` there (times `rows_scale`) and a global offset of `start`,
    so one kernel object serves every step, whatever its rows. rows_dim None: a fixed global size
    (a kernel that reads its row count from the device)."""

    kernel: cl.Kernel
    global_size: tuple[int, ...]  # rows_dim's entry is ignored
    rows_dim: int | None = 0
    rows_scale: int = 1  # work-items per row along rows_dim (a GPU's lanes)
    local_size: tuple[int, ...] | None = None

    def enqueue(self, queue: cl.CommandQueue, start: int, count: int) -> None:
        if count <= 0:
            return
        size, offset = list(self.global_size), None
        if self.rows_dim is not None:
            size[self.rows_dim] = count * self.rows_scale
            if start:
                offset = [0] * len(size)
                offset[self.rows_dim] = start * self.rows_scale
        cl.enqueue_nd_range_kernel(queue, self.kernel, tuple(size), self.local_size, global_work_offset=offset)


@dataclass(frozen=True)
class ByRowCount:
    """Two RowLaunches that compute the same bits, `few` for a step of at most `up_to` rows, `many`
    for more: the faster kernel for each size, bound once, the choice made on the host at enqueue."""

    few: RowLaunch
    many: RowLaunch
    up_to: int

    def enqueue(self, queue: cl.CommandQueue, start: int, count: int) -> None:
        (self.few if count <= self.up_to else self.many).enqueue(queue, start, count)


def bind_rows(program: cl.Program, name: str, global_size: tuple[int, ...], *args, rows_dim: int | None = 0,
              rows_scale: int = 1, local_size: tuple[int, ...] | None = None, by_row: bool = False) -> RowLaunch:
    """bind, for a RowLaunch (by_row: the first dimension's items are independent and the kernel has no
    barriers, see row_groups)."""
    kernel, local_size = _bound(program, name, global_size, args, local_size, by_row)
    return RowLaunch(kernel, tuple(global_size), rows_dim, rows_scale, local_size)


def balanced_groups(items: int, units: int, max_local: int, per_unit: int = 1) -> tuple[int, int]:
    """(global size, local size) for `items` work-items in a multiple of `units` work-groups (at least
    per_unit a compute unit, each at most max_local items), the items rounded up (the kernel skips the
    extra ones). PoCL's own choice can leave a core idle: for 12288 items on 2 cores it makes 3 groups
    of 4096, one core running two."""
    step = max(1, units * per_unit)
    groups = step * -(-items // (step * max_local))
    local = -(-items // groups)
    return local * groups, local
