"""The KV hand-off arena: one shared-memory region in /dev/shm, carved into slots.

prefill_gpu creates it at start-up (its pages reserved with posix_fallocate, so a
too small /dev/shm is a clear error now and never a SIGBUS later, then pre-faulted:
a fresh segment costs ~5x more per hand-off), registers it as pinned memory with
CUDA when CUDA is present, and allocates one slot per request; decode_fpga maps
it by name, read-only, and maps it again when prefill_gpu restarts.

A slot is a `HEADER_SIZE`-byte header (header.py) then the KV in the wire layout
(layout.py). Each slot handed out gets the arena's next generation, stamped in its
header; freeing a slot zeroes its header before the space can be handed out again.

A segment is named after its creator's pid and that process's start time, so a
new prefill_gpu removes the segments of dead ones (`remove_stale_segments`).
This module is only the memory; shm.py is the hand-off transport that uses it.
"""
from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from services.kv.header import HEADER_SIZE, HeaderMismatch, SlotHeader

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
ALIGN = 4096
NAME_PREFIX = "hybridserve-kv-"


class ArenaFull(RuntimeError):
    """No slot could be allocated within the bounded wait: back-pressure, not a crash."""


class ArenaNoRoom(OSError):
    """The shared-memory file system cannot hold the arena: a deployment fault, said at start."""


@dataclass(frozen=True)
class Slot:
    offset: int  # of the header, from the start of the arena
    size: int  # header + data, rounded up to ALIGN
    generation: int = 0  # the arena's count of slots handed out when this one was

    @property
    def data_offset(self) -> int:
        return self.offset + HEADER_SIZE


def check_room(directory: Path, size: int) -> None:
    """ArenaNoRoom if `directory`'s file system reports less than `size` bytes free."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise ArenaNoRoom(errno.ENOSPC, _no_room(directory, size, free))


def reserve(fd: int, size: int, directory: Path) -> None:
    """Back every byte of the file with memory now (posix_fallocate), or ArenaNoRoom: a sparse
    tmpfs file would instead SIGBUS the first process that touches a page it cannot get."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        st = os.statvfs(directory)
        raise ArenaNoRoom(errno.ENOSPC, _no_room(directory, size, st.f_bavail * st.f_frsize)) from None


def _no_room(directory: Path, size: int, free: int) -> str:
    return (f"the KV arena needs {size / 2**20:.1f} MiB but {directory} has {free / 2**20:.1f} MiB free: "
            f"give it more (docker run --shm-size, compose shm_size) or lower HYBRIDSERVE_PREFILL_ARENA_BYTES")


class _Mapping:
    def __init__(self, path: Path, size: int, create: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        if create:
            check_room(path.parent, size)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
                reserve(fd, size, path.parent)
            st = os.fstat(fd)
            size = st.st_size
            self.identity = (st.st_dev, st.st_ino)  # which file: a new arena under the same name is another
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            if create:
                path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.size = size
        self.array = np.frombuffer(self.mm, dtype=np.uint8)


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22); None if it is gone.
    With the pid it names one process: a pid the kernel reused belongs to another start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return ""  # unreadable: alive, start time unknown
    return stat.rsplit(")", 1)[1].split()[19]  # fields after "pid (comm)" start at field 3


def segment_name(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{NAME_PREFIX}{pid}-{_start_time(pid) or 0}-{secrets.token_hex(4)}"


def _owner_alive(name: str) -> bool:
    """Whether the process that created segment `name` still runs (True when the name says nothing)."""
    parts = name[len(NAME_PREFIX):].split("-")
    if not parts[0].isdigit():
        return True  # not named by this module: not ours to judge
    start = _start_time(int(parts[0]))
    if start is None:
        return False
    # name formats: <pid>-<start>-<hex> (now) or <pid>-<hex> (before start times were in the name)
    return len(parts) < 3 or not start or start == parts[1]


def remove_stale_segments(directory: Path = SHM_DIR) -> list[str]:
    """Remove the arenas whose creating process is dead (killed before it could remove its own).
    A reader that still maps one keeps its memory until it lets go; the names removed."""
    removed = []
    for path in sorted(directory.glob(NAME_PREFIX + "*")):
        if not _owner_alive(path.name):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


class Arena:
    """The creating side: owns the segment and every slot's lifetime."""

    def __init__(self, size: int, name: str | None = None, pin_cuda: bool = False, directory: Path = SHM_DIR):
        self.name = name or segment_name()
        self.path = Path(directory) / self.name
        self._map = _Mapping(self.path, size, create=True)
        self.size = size
        self._map.array[::mmap.PAGESIZE] = 0  # pre-fault every page now, not during a hand-off
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, size), sorted by offset
        self._used: dict[int, Slot] = {}  # by offset
        self._generations = itertools.count(1)  # never 0: a zero generation is a freed slot
        self._cond = threading.Condition()
        self.pinned = pin_cuda and self._pin()

    def _pin(self) -> bool:
        import ctypes

        import torch

        ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._map.mm))
        return torch.cuda.cudart().cudaHostRegister(ptr, self.size, 0) == 0

    @property
    def buffer(self) -> memoryview:
        return memoryview(self._map.mm)

    def data_view(self, slot: Slot, nbytes: int) -> np.ndarray:
        """The slot's first `nbytes` of KV, writable; never a byte of the next slot."""
        if self._used.get(slot.offset) != slot:
            raise ValueError(f"slot at {slot.offset} is not allocated: its bytes are not ours to write")
        if not 0 <= nbytes <= slot.size - HEADER_SIZE:
            raise ValueError(f"{nbytes} bytes do not fit a {slot.size}-byte slot after its header")
        return self._map.array[slot.data_offset: slot.data_offset + nbytes]

    # ---- slots --------------------------------------------------------------
    @staticmethod
    def slot_size(nbytes: int) -> int:
        """The bytes a slot for `nbytes` of KV takes of the arena: its header, rounded up to ALIGN."""
        return -(-(nbytes + HEADER_SIZE) // ALIGN) * ALIGN

    def allocate(self, nbytes: int, timeout: float) -> Slot:
        """A slot for `nbytes` of KV, waiting up to `timeout` s for space; else ArenaFull."""
        need = self.slot_size(nbytes)
        if need > self.size:
            raise ArenaFull(f"a slot of {need} bytes can never fit the {self.size}-byte arena")
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                slot = self.try_allocate(nbytes)
                if slot is not None:
                    return slot
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ArenaFull(f"no {need}-byte slot free within {timeout:.1f}s "
                                    f"({self.used_bytes} of {self.size} bytes in {len(self._used)} slots in use)")
                self._cond.wait(left)

    def try_allocate(self, nbytes: int) -> Slot | None:
        """A slot for `nbytes` of KV if one is free now (first fit), else None: never waits. What an
        admission that queues its own waiters (services/prefill_gpu/handoff_admission.py) asks."""
        need = self.slot_size(nbytes)
        with self._cond:
            for i, (off, size) in enumerate(self._free):
                if size >= need:
                    self._free[i:i + 1] = [(off + need, size - need)] if size > need else []
                    slot = Slot(off, need, next(self._generations) & 0xFFFFFFFF or 1)
                    self._used[off] = slot
                    return slot
        return None

    def free(self, slot: Slot) -> None:
        with self._cond:
            if self._used.get(slot.offset) != slot:
                # already freed (freeing is idempotent so every exit path may call it), or the space
                # is another request's now: a late second free must never take it from that one
                return
            del self._used[slot.offset]
            # zero the header (magic, nonce, generation) before the space can be handed out again: a
            # reader still copying sees it change and fails, rather than read the next request's KV
            self._map.mm[slot.offset: slot.offset + HEADER_SIZE] = bytes(HEADER_SIZE)
            self._free.append((slot.offset, slot.size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, size in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((off, size))
            self._free = merged
            self._cond.notify_all()

    def write_header(self, slot: Slot, header: SlotHeader) -> SlotHeader:
        """Write `header`, stamped with the slot's generation, in front of the slot; the header written."""
        if self._used.get(slot.offset) != slot:
            raise ValueError(f"slot at {slot.offset} is not allocated: its header is not ours to write")
        stamped = replace(header, generation=slot.generation)
        self._map.mm[slot.offset: slot.offset + HEADER_SIZE] = stamped.pack()
        return stamped

    @property
    def used_bytes(self) -> int:
        return sum(s.size for s in self._used.values())

    @property
    def slots_in_use(self) -> int:
        return len(self._used)

    def close(self) -> None:
        """Unmap and remove the segment (the owner's last act)."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


class ArenaReader:
    """The mapping side (decode_fpga): maps the segment by name; `is_current` says whether that
    segment is still the one under the name (prefill_gpu removes it when it stops, or its
    successor does when it was killed)."""

    def __init__(self, name: str, directory: Path = SHM_DIR):
        if "/" in name or not name:
            raise ValueError(f"bad arena name {name!r}")
        path = Path(directory) / name
        if not path.exists():
            raise FileNotFoundError(f"KV arena {name!r} does not exist in {directory}: is prefill_gpu on this host?")
        self.name, self.path = name, path
        self._map = _Mapping(path, 0, create=False)
        self.size = self._map.size

    def is_current(self) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self._map.identity

    def read_header(self, offset: int) -> SlotHeader:
        if not 0 <= offset <= self.size - HEADER_SIZE:
            raise HeaderMismatch(f"slot offset {offset} is outside the {self.size}-byte arena")
        return SlotHeader.unpack(bytes(self._map.mm[offset: offset + HEADER_SIZE]))

    def view(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or offset + nbytes > self.size:
            raise HeaderMismatch(f"byte range [{offset}, {offset + nbytes}) is outside the {self.size}-byte arena")
        return memoryview(self._map.mm)[offset: offset + nbytes]
