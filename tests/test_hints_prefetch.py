"""The hint prefetcher against the real cache, policy, plan and scheduler, in-process on trio's
mock clock, with small files in a temporary directory: what it fetches when the tiers are
smaller than the plan (found with bench/bench_hints_e2e.py, where the hinted run read ~1.5x the
bytes of the unhinted one)."""

from __future__ import annotations

import contextlib
import math
import os
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.testing

from tierfs.cache.manager import AccessState, Cache
from tierfs.cache.plan import HintPlan
from tierfs.cache.policy import Policy
from tierfs.cache.tier import Tier
from tierfs.io import Device, pread_exact
from tierfs.predict.hints import HintService
from tierfs.sched.backing import BackingFile, Identity
from tierfs.sched.scheduler import TransactionScheduler

CS = 64 * 1024


class Rig:
    """RAM tier of ``ram_chunks``; backing files of ``chunks`` chunks each under ``tmp``; every
    backing read is counted per (file, chunk)."""

    def __init__(self, tmp: Path, names: list[str], chunks: int, ram_chunks: int, budget_chunks: int = 64) -> None:
        self.root = tmp / "backing"
        self.root.mkdir()
        self.reads: Counter[tuple[str, int]] = Counter()
        self.files: dict[str, BackingFile] = {}
        for name in names:
            p = self.root / name
            p.write_bytes(os.urandom(chunks * CS))
            fd = os.open(p, os.O_RDONLY)
            self.files[name] = BackingFile(Identity.of(str(p), os.fstat(fd)), fd)
            self.files[name].acquire()
        self.by_key = {f.key: n for n, f in self.files.items()}
        inline = Device("test", 1, inline_under=math.inf)
        self.plan = HintPlan()
        tiers = [Tier("ram", str(tmp / "ram"), ram_chunks * CS, inline=True)]

        async def read_backing(f: BackingFile, offset: int, length: int) -> bytes:
            await trio.sleep(0.01 * math.ceil(length / CS))
            for c in range(offset // CS, (offset + length - 1) // CS + 1):
                self.reads[(self.by_key[f.key], c)] += 1
            return pread_exact(f.fd, length, offset)

        self.sched = TransactionScheduler(read_backing, chunk_size=CS, slice_size=4 * CS, depth=1)
        self.cache = Cache(tiers, [inline], Policy("nothrash", window=1 << 16, plan=self.plan), self.sched,
                           chunk_size=CS, staging_bytes=2 * CS)
        self.hints = HintService(cache=self.cache, scheduler=self.sched, backing_root=os.fsencode(self.root),
                                 meta=inline, chunk_size=CS, write_tier=0, budget=budget_chunks * CS)

    def close(self) -> None:
        for f in self.files.values():
            f.release()
        self.hints.close()
        self.cache.close()


@contextlib.asynccontextmanager
async def running(rig: Rig) -> AsyncIterator[None]:
    """The rig's cache, scheduler and hint service running for the block; closed after it."""
    try:
        async with trio.open_nursery() as n:
            rig.cache.attach(n)
            await n.start(rig.sched.run)
            await n.start(rig.hints.run)
            yield
            n.cancel_scope.cancel()
    finally:
        rig.close()


async def _settle(rig: Rig, seconds: float = 1.0) -> None:
    await trio.sleep(seconds)  # mock clock: several prefetch rounds and fetches
    await trio.testing.wait_all_tasks_blocked()


async def test_prefetch_queues_only_what_the_tier_can_take(tmp_path: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """An empty RAM tier of 4 chunks and an epoch order of 16: the prefetcher fetches the first
    4 chunks, not a whole budget of chunks no tier will admit on arrival."""
    names = [f"f{i}" for i in range(8)]
    rig = Rig(tmp_path, names, chunks=2, ram_chunks=4)
    async with running(rig):
        await rig.hints.handle({"op": "epoch", "paths": names, "source": "t"})
        await _settle(rig)
        fetched = sum(rig.reads.values())
        assert fetched == 4, rig.reads
        assert rig.cache.prefetch_wasted == 0


async def test_chunk_being_read_is_not_evicted_for_prefetch(tmp_path: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """A reader consumes a chunk at its first read; the prefetcher, waiting for room, must not
    evict that chunk while the reader is still in it (it was then fetched a second time for the
    rest of the reader's pass). Each chunk of one pass over the plan is fetched once."""
    names = [f"f{i}" for i in range(6)]
    rig = Rig(tmp_path, names, chunks=2, ram_chunks=3)
    async with running(rig):
        await rig.hints.handle({"op": "epoch", "paths": names, "source": "t"})
        await _settle(rig)
        for name in names:
            f = rig.files[name]
            access = AccessState()
            for off in range(0, 2 * CS, CS // 4):  # the kernel reads a chunk in pieces
                assert await rig.cache.read(f, off, CS // 4, access) == pread_exact(f.fd, CS // 4, off)
                await _settle(rig, 0.2)  # training computes; the prefetcher gets its turn
            rig.cache.forget_access(access)  # the handle is closed
        twice = {k: v for k, v in rig.reads.items() if v > 1}
        assert not twice, f"fetched more than once: {twice}"
        assert sum(rig.reads.values()) == 2 * len(names)
        assert rig.cache.check() == []


async def test_a_large_plans_counts_are_made_by_the_loop_in_slices(tmp_path: Path, autojump_clock,  # type: ignore[no-untyped-def]
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """stats.json of a plan over STATS_INLINE_CHUNKS occurrences: the resident and remaining
    bytes are the service loop's last count (paced, not one step of the FUSE request that reads
    stats.json), equal to the inline count once made, and say how old they are."""
    from tierfs.predict import hints as hints_mod

    names = [f"f{i}" for i in range(8)]
    rig = Rig(tmp_path, names, chunks=2, ram_chunks=4)
    async with running(rig):
        await rig.hints.handle({"op": "epoch", "paths": names * 3, "source": "t"})
        await _settle(rig)
        inline = rig.hints.statistics()
        assert inline["counts_age_s"] == 0.0 and inline["resident_bytes"] == 4 * CS
        assert inline["to_fetch_bytes"] == 12 * CS
        monkeypatch.setattr(hints_mod, "STATS_INLINE_CHUNKS", 10)  # 48 occurrences: "large"
        first = rig.hints.statistics()
        assert first["counts_age_s"] is None and first["resident_bytes"] == 0  # not counted yet
        await _settle(rig, 0.5)
        later = rig.hints.statistics()
        assert later["counts_age_s"] is not None and later["counts_age_s"] <= hints_mod.SUMMARY_MAX_AGE_S
        assert (later["resident_bytes"], later["to_fetch_bytes"]) == (inline["resident_bytes"], inline["to_fetch_bytes"])
