"""A burst of writes (tar -x, cp -a) holds the write-back of the files it closes until it ends
(:mod:`tierfs.writeback.hold`): the rule alone, then a WriteBack driven in-process."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from tests.test_writeback_inprocess import Disks, backing_bytes, instance, write_file
from tierfs.writeback import hold

KiB = 1024


# -- the rule -----------------------------------------------------------------------------------
def test_a_burst_is_many_closes_in_a_short_time_and_ends_after_a_quiet_spell() -> None:
    m = hold.BurstMeter()
    for i in range(hold.BURST_FILES - 1):
        m.closed(i * 0.01)
    assert m.ends_at(0.2) == -math.inf  # one file short of a burst
    m.closed(0.16)
    assert m.ends_at(0.2) == 0.16 + hold.QUIET_S
    assert m.ends_at(0.16 + hold.QUIET_S) == -math.inf  # quiet long enough: over
    slow = hold.BurstMeter()  # as many files, spread over more than the window: no burst
    for i in range(hold.BURST_FILES):
        slow.closed(i * (hold.BURST_WINDOW_S / (hold.BURST_FILES - 1) + 0.001))
    assert slow.ends_at(slow._closes[-1]) == -math.inf


def _hold(**kw: object) -> float | None:
    args: dict[str, object] = dict(now=10.0, burst_end=10.3, closed_at=9.0, hold_s=30.0,
                                   urgent=False, dirty_bytes=0, tier_capacity=1 << 30)
    args.update(kw)
    return hold.hold_until(**args)  # type: ignore[arg-type]


def test_what_ends_a_hold() -> None:
    assert _hold() == 10.3  # in a burst: look again when it would end
    assert _hold(hold_s=0) is None  # holding off
    assert _hold(urgent=True) is None  # someone waits for the file
    assert _hold(burst_end=-math.inf) is None and _hold(burst_end=10.0) is None  # no burst
    assert _hold(closed_at=-20.0) is None  # held hold_s already
    assert _hold(closed_at=-19.9) == pytest.approx(10.1)  # never past closed_at + hold_s
    assert _hold(dirty_bytes=(1 << 30) // 4 + 1) is None  # the write tier fills up
    assert _hold(dirty_bytes=(1 << 30) // 4) == 10.3


@given(now=st.floats(0, 100), burst=st.floats(-1, 101), closed=st.floats(-100, 100),
       hold_s=st.floats(0, 60), urgent=st.booleans(), dirty=st.integers(0, 1 << 20))
def test_a_hold_is_short_and_bounded(now: float, burst: float, closed: float, hold_s: float,
                                     urgent: bool, dirty: int) -> None:
    """Whatever the state, a hold ends within LOOK_AGAIN_S of now (the worker looks again), never
    lasts past closed_at + hold_s, and never happens for a file someone waits for."""
    t = hold.hold_until(now=now, burst_end=burst, closed_at=closed, hold_s=hold_s, urgent=urgent,
                        dirty_bytes=dirty, tier_capacity=1 << 20)
    if t is not None:
        assert not urgent and hold_s > 0 and dirty <= (1 << 20) / 4
        assert now < t <= min(now + hold.LOOK_AGAIN_S, closed + hold_s, burst)


# -- in a WriteBack -------------------------------------------------------------------------------
async def test_a_burst_of_small_files_is_written_back_after_it_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 files written in quick succession: once they make a burst (the first BURST_FILES
    closes, written back at once), none is written back while it lasts (the worker holds), a
    flush of one is not held (nor are its neighbours), and all of them reach the backing store
    once the burst has been quiet for QUIET_S. (A quiet spell of 2 s here, so a preempted test
    machine cannot end the burst early.)"""
    monkeypatch.setattr(hold, "QUIET_S", 2.0)
    monkeypatch.setattr(hold, "BURST_WINDOW_S", 30.0)
    disks = Disks(tmp_path / "d")
    async with instance(disks, deadline_s=120, hold_s=30) as wb:
        for i in range(40):
            await write_file(wb, b"f%d" % i, b"%d" % i * 100)
        await trio.sleep(0.2)
        assert wb.holding
        early = wb.written_files
        assert early <= hold.BURST_FILES
        await trio.sleep(0.3)
        assert wb.written_files == early and len(os.listdir(disks.back)) == early
        late = next(b"f%d" % i for i in range(39, -1, -1) if backing_bytes(disks, f"f{i}") is None)
        # someone waits for one file: written back now, burst or not
        assert await wb.wait_durable([wb.get(late)], timeout=30) == [late.decode()]  # type: ignore[list-item]
        assert backing_bytes(disks, late.decode()) == late[1:] * 100
        assert wb.written_files == early + 1
        with trio.fail_after(30):
            while wb.written_files < 40:  # noqa: ASYNC110 - counters of the code under test
                await trio.sleep(0.05)
        assert not wb.holding and wb.hold_seconds > 1.0
        for i in range(40):
            assert backing_bytes(disks, f"f{i}") == b"%d" % i * 100


async def test_no_hold_without_a_burst_or_when_held_long_enough(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file closed alone (a checkpoint) is written back at once: nothing is held. In a burst
    longer than hold_s, its files are written back hold_s after their close all the same, and
    writeback_deadline=0 (write back at once) holds nothing at all."""
    monkeypatch.setattr(hold, "QUIET_S", 60.0)
    monkeypatch.setattr(hold, "BURST_WINDOW_S", 60.0)
    disks = Disks(tmp_path / "d")
    async with instance(disks, deadline_s=120, hold_s=30) as wb:
        await write_file(wb, b"ckpt", b"c" * (64 * KiB))
        with trio.fail_after(30):
            while wb.written_files < 1:  # noqa: ASYNC110 - counters of the code under test
                await trio.sleep(0.01)
        assert wb.hold_seconds == 0.0
    disks = Disks(tmp_path / "e")
    async with instance(disks, deadline_s=120, hold_s=0.5) as wb:
        for i in range(20):  # a burst (the quiet spell is 60 s), but held 0.5 s at most
            await write_file(wb, b"f%d" % i, b"x")
        with trio.fail_after(30):
            while wb.written_files < 20:  # noqa: ASYNC110 - counters of the code under test
                await trio.sleep(0.05)
        assert wb.hold_seconds > 0.0
    disks = Disks(tmp_path / "f")
    async with instance(disks, deadline_s=0, hold_s=30) as wb:
        for i in range(20):
            await write_file(wb, b"f%d" % i, b"x")
        with trio.fail_after(30):
            while wb.written_files < 20:  # noqa: ASYNC110 - counters of the code under test
                await trio.sleep(0.01)
        assert wb.hold_seconds == 0.0


async def test_a_write_tier_filling_up_ends_the_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dirty data past a quarter of the write tier is written back during the burst: the
    burst's later files keep fitting in the tier."""
    monkeypatch.setattr(hold, "QUIET_S", 60.0)
    monkeypatch.setattr(hold, "BURST_WINDOW_S", 60.0)
    disks = Disks(tmp_path / "d")
    async with instance(disks, deadline_s=120, hold_s=60, tier_bytes=1 << 20) as wb:
        for i in range(20):  # 20 x 16 KiB, under a quarter of 1 MiB: held
            await write_file(wb, b"a%d" % i, b"a" * (16 * KiB))
        await trio.sleep(0.2)
        assert wb.holding
        early = wb.written_files
        for i in range(20):  # 640 KiB in all: past a quarter, written back in the burst
            await write_file(wb, b"b%d" % i, b"b" * (16 * KiB))
        with trio.fail_after(30):
            while wb.tier.dirty > wb.tier.effective_capacity // 4:  # noqa: ASYNC110 - counters of the code under test
                await trio.sleep(0.05)
        assert wb.written_files > early
