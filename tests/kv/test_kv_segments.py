"""The arena's segment in /dev/shm: room checked and reserved up front, dead owners' segments removed.

Real segments and real processes: a child that makes an arena and is SIGKILLed leaves
its segment behind, as a killed prefill_gpu does; the next start removes it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.kv.arena import NAME_PREFIX, SHM_DIR, Arena, ArenaNoRoom, ArenaReader, remove_stale_segments, reserve
from tests.services_harness import ROOT

MAKE_ARENA_AND_WAIT = ("import sys, time; from services.kv.arena import Arena; a = Arena(1 << 20); "
                       "print(a.name, flush=True); time.sleep(600)")


def _child_with_arena() -> tuple[subprocess.Popen, str]:
    child = subprocess.Popen([sys.executable, "-c", MAKE_ARENA_AND_WAIT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    return child, child.stdout.readline().strip()


def test_the_segment_of_a_killed_owner_is_removed_and_a_live_ones_kept():
    dead, dead_name = _child_with_arena()
    live, live_name = _child_with_arena()
    mine = Arena(1 << 20)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        assert (SHM_DIR / dead_name).exists()  # a killed process cannot clean up after itself
        removed = remove_stale_segments()
        assert dead_name in removed and not (SHM_DIR / dead_name).exists()
        assert (SHM_DIR / live_name).exists() and mine.path.exists()
        assert live_name not in removed and mine.name not in removed
    finally:
        for p in (dead, live):
            p.kill()
            p.wait()
        mine.close()
        remove_stale_segments()  # the live child is dead now too
    assert not (SHM_DIR / live_name).exists()


def test_a_reused_pid_does_not_keep_a_dead_owners_segment(tmp_path):
    """The name holds the creator's start time: a live process under the same pid is another one."""
    me = os.getpid()
    reused = tmp_path / f"{NAME_PREFIX}{me}-1-deadbeef"  # this pid, but started at tick 1: not us
    ours = Arena(1 << 16, directory=tmp_path)
    foreign = tmp_path / "hybridserve-kv-notapid"  # not named by the arena: left alone
    try:
        reused.write_bytes(b"x")
        foreign.write_bytes(b"x")
        assert remove_stale_segments(tmp_path) == [reused.name]
        assert ours.path.exists() and foreign.exists()
    finally:
        ours.close()


def test_a_reader_sees_its_segment_go():
    arena = Arena(1 << 20)
    reader = ArenaReader(arena.name)
    assert reader.is_current()
    arena.close()
    assert not reader.is_current()


def test_an_arena_larger_than_the_free_shared_memory_is_a_clear_error():
    free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
    before = set(SHM_DIR.glob(NAME_PREFIX + "*"))
    with pytest.raises(ArenaNoRoom, match="MiB free.*HYBRIDSERVE_PREFILL_ARENA_BYTES"):
        Arena(free + (64 << 20))
    assert set(SHM_DIR.glob(NAME_PREFIX + "*")) == before  # nothing left behind


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs, where mounting one is allowed (root); skipped elsewhere."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_reserving_more_than_a_full_tmpfs_holds_fails_up_front(tiny_tmpfs: Path):
    """Past the statvfs check (another file took the room meanwhile), posix_fallocate still refuses
    at once; a sparse file would have passed and SIGBUSed whoever touched the missing pages."""
    (tiny_tmpfs / "other").write_bytes(b"\0" * (768 << 10))
    fd = os.open(tiny_tmpfs / "arena", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 512 << 10)
        with pytest.raises(ArenaNoRoom, match="needs 0.5 MiB but .* has 0.2 MiB free"):
            reserve(fd, 512 << 10, tiny_tmpfs)
    finally:
        os.close(fd)
    with pytest.raises(ArenaNoRoom, match="MiB free"):
        Arena(2 << 20, directory=tiny_tmpfs)
    arena = Arena(128 << 10, directory=tiny_tmpfs)  # what fits is fine
    arena.close()
