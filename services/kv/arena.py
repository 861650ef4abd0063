"""The KV hand-off arena: one shared-memory region in /dev/shm, carved into slots.

prefill_gpu creates it at start-up (pre-faulted: a fresh segment costs ~5x more
per hand-off), registers it as pinned memory with CUDA when CUDA is present, and
allocates one slot per request; decode_fpga maps it once, by name, read-only.

A slot is a `HEADER_SIZE`-byte header (header.py) then the KV in the wire layout
(layout.py). This module is only the memory; shm.py is the hand-off transport
that uses it.
"""
from __future__ import annotations

import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.kv.header import HEADER_SIZE, HeaderMismatch, SlotHeader

SHM_DIR = Path("/dev/shm")
ALIGN = 4096


class ArenaFull(RuntimeError):
    """No slot could be allocated within the bounded wait: back-pressure, not a crash."""


@dataclass(frozen=True)
class Slot:
    offset: int  # of the header, from the start of the arena
    size: int  # header + data, rounded up to ALIGN

    @property
    def data_offset(self) -> int:
        return self.offset + HEADER_SIZE


class _Mapping:
    def __init__(self, path: Path, size: int, create: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self.array = np.frombuffer(self.mm, dtype=np.uint8)


class Arena:
    """The creating side: owns the segment and every slot's lifetime."""

    def __init__(self, size: int, name: str | None = None, pin_cuda: bool = False):
        self.name = name or f"hybridserve-kv-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = SHM_DIR / self.name
        self._map = _Mapping(self.path, size, create=True)
        self.size = size
        self._map.array[::mmap.PAGESIZE] = 0  # pre-fault every page now, not during a hand-off
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, size), sorted by offset
        self._used: dict[int, int] = {}
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
        return self._map.array[slot.data_offset: slot.data_offset + nbytes]

    # ---- slots --------------------------------------------------------------
    def allocate(self, nbytes: int, timeout: float) -> Slot:
        """A slot for `nbytes` of KV, waiting up to `timeout` s for space; else ArenaFull."""
        need = -(-(nbytes + HEADER_SIZE) // ALIGN) * ALIGN
        if need > self.size:
            raise ArenaFull(f"a slot of {need} bytes can never fit the {self.size}-byte arena")
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i, (off, size) in enumerate(self._free):
                    if size >= need:
                        self._free[i:i + 1] = [(off + need, size - need)] if size > need else []
                        self._used[off] = need
                        return Slot(off, need)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ArenaFull(f"no {need}-byte slot free within {timeout:.1f}s "
                                    f"({self.used_bytes} of {self.size} bytes in {len(self._used)} slots in use)")
                self._cond.wait(left)

    def free(self, slot: Slot) -> None:
        with self._cond:
            if self._used.pop(slot.offset, None) is None:
                return  # already freed: freeing is idempotent so every exit path may call it
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

    def write_header(self, slot: Slot, header: SlotHeader) -> None:
        self._map.mm[slot.offset: slot.offset + HEADER_SIZE] = header.pack()

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

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
    """The mapping side (decode_fpga): maps the segment once, by name."""

    def __init__(self, name: str):
        if "/" in name or not name:
            raise ValueError(f"bad arena name {name!r}")
        path = SHM_DIR / name
        if not path.exists():
            raise FileNotFoundError(f"KV arena {name!r} does not exist in {SHM_DIR}: is prefill_gpu on this host?")
        self.name = name
        self._map = _Mapping(path, 0, create=False)
        self.size = self._map.size

    def read_header(self, offset: int) -> SlotHeader:
        if not 0 <= offset <= self.size - HEADER_SIZE:
            raise HeaderMismatch(f"slot offset {offset} is outside the {self.size}-byte arena")
        return SlotHeader.unpack(bytes(self._map.mm[offset: offset + HEADER_SIZE]))

    def view(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or offset + nbytes > self.size:
            raise HeaderMismatch(f"byte range [{offset}, {offset + nbytes}) is outside the {self.size}-byte arena")
        return memoryview(self._map.mm)[offset: offset + nbytes]
