"""Hole punches and file removals of the cache tiers run in the tiers' threads, not on the
event loop (a multi-GB tier file's unlink, or a punch on a busy SSD, takes tens to hundreds of
ms), without letting a chunk written meanwhile be punched or unlinked."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

import trio
import trio.testing

from tests.test_cache import CS, bfile, content, make_cache, read_whole, settle
from tierfs.cache.tier import Tier

SLOW_TIER_OPS = ("punch", "remove_file")


class RecordingTier(Tier):
    """Records which thread each punch and file removal ran on; ``hold`` (when set) makes a
    removal wait until it is released, to open the window between the decision and the unlink."""

    calls: list[tuple[str, bool]]
    hold: threading.Event | None = None
    entered: threading.Event | None = None

    def punch(self, key: str, offset: int, length: int) -> None:
        self.calls.append(("punch", threading.current_thread() is threading.main_thread()))
        super().punch(key, offset, length)

    def remove_file(self, key: str) -> None:
        self.calls.append(("remove_file", threading.current_thread() is threading.main_thread()))
        if self.hold is not None and self.entered is not None:
            self.entered.set()
            self.hold.wait(10)
        super().remove_file(key)


def _ssd_only(tmp: Path):  # type: ignore[no-untyped-def]
    cache, sched, backing = make_cache(tmp, ram=0, ssd=16 * CS)
    ssd = cache.tiers[1]
    ssd.__class__ = RecordingTier
    ssd.calls = []  # type: ignore[attr-defined]
    return cache, sched, ssd


async def test_ssd_punch_and_unlink_run_in_threads(tmp_path: Path) -> None:
    cache, sched, ssd = _ssd_only(tmp_path)
    f = bfile(1, 3 * CS)
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        await read_whole(cache, f)
        await settle(cache)
        assert cache.catalog.chunks_of(f.key) == [0, 1, 2]
        await cache.drop_file(f.key)
        await settle(cache)
        n.cancel_scope.cancel()
    cache.close()
    kinds = {k for k, _ in ssd.calls}
    assert kinds == set(SLOW_TIER_OPS), ssd.calls
    on_loop = [k for k, main in ssd.calls if main]
    assert on_loop == [], f"on the event loop: {on_loop}"


async def test_chunk_placed_while_its_file_is_being_removed_survives(tmp_path: Path) -> None:
    cache, sched, ssd = _ssd_only(tmp_path)
    ssd.hold, ssd.entered = threading.Event(), threading.Event()  # type: ignore[attr-defined]
    f = bfile(2, 2 * CS)
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        await read_whole(cache, f)
        await settle(cache)
        n.start_soon(cache.drop_file, f.key)
        await trio.to_thread.run_sync(ssd.entered.wait, 10)  # type: ignore[attr-defined]
        # the removal is decided and under way in the tier's thread: read the file again,
        # which places its chunks in the same tier file
        assert await read_whole(cache, f) == content(f.path, 0, CS) + content(f.path, CS, CS)
        await trio.testing.wait_all_tasks_blocked()
        ssd.hold.set()  # type: ignore[attr-defined]
        await settle(cache)
        assert cache.catalog.chunks_of(f.key) == [0, 1]
        for idx in (0, 1):  # the tier really holds what the catalog says
            assert ssd.read(f.key, idx * CS, CS) == content(f.path, idx * CS, CS)
        assert cache.check() == []
        n.cancel_scope.cancel()
    cache.close()


async def test_quiet_waits_for_a_busy_chunk(tmp_path: Path) -> None:
    """A placement waiting for a punch of its chunk: ``_quiet`` returns once the punch is done
    (it used to test a trio.Event for truth, which raises: the daemon died in test_c25)."""
    cache, _, _ = make_cache(tmp_path, ram=8 * CS, ssd=16 * CS)
    cid = ("k", 0)
    busy = cache._tier_busy[(0, cid)] = trio.Event()
    done = []

    async def place() -> None:
        await cache._quiet(0, cid)
        done.append(True)

    async with trio.open_nursery() as n:
        n.start_soon(place)
        await trio.testing.wait_all_tasks_blocked()
        assert not done
        del cache._tier_busy[(0, cid)]
        busy.set()
    assert done == [True]


class AllocationCheckingTier(Tier):
    """At each punch, before it frees anything, records the blocks really allocated under the
    tier's data directory next to the bytes the tier accounts (``used`` + ``dirty``)."""

    seen: list[tuple[int, int]]

    def punch(self, key: str, offset: int, length: int) -> None:
        allocated = sum(os.lstat(os.path.join(d, name)).st_blocks * 512
                        for d, _, names in os.walk(os.path.join(self.path, "data")) for name in names)
        self.seen.append((allocated, self.used + self.dirty))
        super().punch(key, offset, length)


async def test_evicted_chunk_is_accounted_until_its_blocks_are_freed() -> None:
    """An evicted chunk's bytes go back to the tier only after its punch: released first, a
    chunk placed while the punch ran in the tier's thread found room whose blocks were still
    allocated, and the tier directory outgrew its limit (CI: 50.1 MiB in a 48 MiB + 2 MiB
    allowance, test_c29). The tier lives on tmpfs, whose allocation is exactly the pages
    written (a disk filesystem may allocate ahead of a file's end, XFS for one)."""
    shm = Path(tempfile.mkdtemp(prefix="tierfs-test-", dir="/dev/shm"))
    try:
        await _accounted_until_freed(shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


async def _accounted_until_freed(tmp: Path) -> None:
    cache, sched, _ = make_cache(tmp, ram=0, ssd=4 * CS, policy="lru")
    ssd = cache.tiers[1]
    ssd.__class__ = AllocationCheckingTier
    ssd.seen = []  # type: ignore[attr-defined]
    files = [bfile(10 + i, 4 * CS) for i in range(3)]
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        for f in files:  # each file evicts the one before it
            await read_whole(cache, f)
            await settle(cache)
        n.cancel_scope.cancel()
    cache.close()
    seen = ssd.seen  # type: ignore[attr-defined]
    assert len(seen) >= 4, "no eviction happened: the test tests nothing"
    over = [(a, acc) for a, acc in seen if a > acc]
    assert over == [], f"allocated > accounted at a punch: {over}"
    assert cache.check() == []
