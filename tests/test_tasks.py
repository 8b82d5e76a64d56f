"""A background step that raises costs that step, never the daemon: the cache's placement
tasks, the scheduler's hand-off of fetched chunks and hint predictions run through
``tierfs.tasks``. Each test fails on code that lets the exception reach the mount's nursery
(the nursery would re-raise it and the ``async with`` would end in an exception)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from tierfs import tasks
from tierfs.cache.manager import Cache

from .test_cache import CS, bfile, content, make_cache, read_whole, settle


def expected(key: str, size: int) -> bytes:
    """The fake backing file's bytes (FakeBacking makes them chunk by chunk)."""
    return b"".join(content(key, off, min(CS, size - off)) for off in range(0, size, CS))


async def test_spawned_task_failure_is_counted_and_the_nursery_lives_on() -> None:
    before = tasks.failures["t.fail"]
    ran = trio.Event()

    async def boom() -> None:
        raise ValueError("a bug in one background step")

    async def fine() -> None:
        ran.set()

    async with trio.open_nursery() as n:
        tasks.spawn(n, "t.fail", boom)
        await trio.testing.wait_all_tasks_blocked()
        tasks.spawn(n, "t.ok", fine)
        await ran.wait()
    assert tasks.failures["t.fail"] == before + 1


async def test_cancellation_still_ends_a_guarded_task() -> None:
    started = trio.Event()

    async def forever() -> None:
        started.set()
        await trio.sleep_forever()

    with trio.move_on_after(5) as scope:
        async with trio.open_nursery() as n:
            tasks.spawn(n, "t.forever", forever)
            await started.wait()
            n.cancel_scope.cancel()
    assert not scope.cancelled_caught  # ended by its own cancel, not by the 5 s guard


async def test_placement_failure_costs_the_tier_copy_not_the_reader(
        tmp_path: Path, autojump_clock, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    cache, sched, _ = make_cache(tmp_path, ram=8 * CS, ssd=0)

    async def broken_place(self: Cache, *args: object) -> None:
        raise RuntimeError("placement bug")

    monkeypatch.setattr(Cache, "_place_staged", broken_place)
    before = sum(v for k, v in tasks.failures.items() if k.startswith("cache."))
    files = [bfile(i, 2 * CS) for i in range(3)]
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        for f in files:  # every read still gets its bytes, from staging or the backing store
            assert await read_whole(cache, f) == expected(f.path, 2 * CS)
        await settle(cache)
        n.cancel_scope.cancel()
    cache.close()
    assert sum(v for k, v in tasks.failures.items() if k.startswith("cache.")) > before


async def test_on_fetched_failure_still_wakes_the_reader(tmp_path: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    cache, sched, _ = make_cache(tmp_path, ram=8 * CS, ssd=0)

    def broken(req: object, data: bytes) -> None:
        raise RuntimeError("staging bug")

    sched.on_fetched = broken
    before = tasks.failures["scheduler.on_fetched"]
    f = bfile(7, 3 * CS)
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        with trio.fail_after(60):
            assert await read_whole(cache, f) == expected(f.path, 3 * CS)
        n.cancel_scope.cancel()
    cache.close()
    assert tasks.failures["scheduler.on_fetched"] > before
