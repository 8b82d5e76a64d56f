"""Scheduler order, coalescing, single-flight and slicing, on trio's mock clock (no sleeps)."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.sched.backing import BackingFile, Identity
from tierfs.sched.scheduler import Klass, TransactionScheduler

CS = 1 << 20  # 1 MiB chunks
RATE = 100 * CS  # the fake disk: 100 MiB/s, plus 10 ms per transfer (a seek)
SEEK = 0.010


def bfile(name: str, ino: int, size: int = 64 * CS) -> BackingFile:
    return BackingFile(Identity(f"/b/{name}", size, 1, ino, 1), fd=-1)


class FakeDisk:
    def __init__(self) -> None:
        self.log: list[tuple[str, int, int, float]] = []  # (name, first chunk, chunks, start)

    async def read(self, f: BackingFile, offset: int, length: int) -> bytes:
        self.log.append((f.path.rsplit("/", 1)[1], offset // CS, -(-length // CS), trio.current_time()))
        await trio.sleep(SEEK + length / RATE)
        return bytes(length)


async def start(nursery: trio.Nursery, disk: FakeDisk, **kw) -> TransactionScheduler:  # type: ignore[no-untyped-def]
    kw.setdefault("slice_size", 4 * CS)
    sched = TransactionScheduler(disk.read, chunk_size=CS, **kw)
    await nursery.start(sched.run)
    return sched


async def test_demand_before_deadline_before_speculative(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    disk = FakeDisk()
    a, b, c, busy = bfile("a", 1), bfile("b", 2), bfile("c", 3), bfile("busy", 4)
    async with trio.open_nursery() as n:
        sched = await start(n, disk, slice_size=CS)
        n.start_soon(sched.fetch, busy, 0)  # the disk is busy while the others queue up
        await trio.testing.wait_all_tasks_blocked()
        sched.submit(a, 10, Klass.SPECULATIVE)
        sched.submit(b, 20, Klass.DEADLINE, deadline=trio.current_time() + 100)
        n.start_soon(sched.fetch, c, 30, Klass.DEMAND)
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(1)
        n.cancel_scope.cancel()
    assert [name for name, *_ in disk.log] == ["busy", "c", "b", "a"]


async def test_deadline_work_in_edf_order(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    disk = FakeDisk()
    files = [bfile(f"f{i}", 10 - i) for i in range(4)]
    deadlines = [40.0, 10.0, 30.0, 20.0]
    async with trio.open_nursery() as n:
        sched = await start(n, disk, slice_size=CS, escalate_s=0.0)
        now = trio.current_time()
        for f, d in zip(files, deadlines, strict=True):
            sched.submit(f, 0, Klass.DEADLINE, deadline=now + d)
        await trio.sleep(1)
        n.cancel_scope.cancel()
    assert [name for name, *_ in disk.log] == ["f1", "f3", "f2", "f0"]


async def test_escalated_deadline_work_is_not_starved_by_demand(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    disk = FakeDisk()
    hot, wb = bfile("hot", 1, size=1000 * CS), bfile("wb", 2)
    async with trio.open_nursery() as n:
        sched = await start(n, disk, slice_size=CS, escalate_s=5.0)
        sched.submit(wb, 0, Klass.DEADLINE, deadline=trio.current_time() + 1.0)
        for i in range(20):  # a stream of demand reads
            n.start_soon(sched.fetch, hot, i, Klass.DEMAND)
        await trio.sleep(5)
        n.cancel_scope.cancel()
    order = [name for name, *_ in disk.log]
    assert order.index("wb") <= 2, order


async def test_elevator_sweeps_one_way(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    disk = FakeDisk()
    f = bfile("f", 1, size=1000 * CS)
    async with trio.open_nursery() as n:
        sched = await start(n, disk, slice_size=CS)
        n.start_soon(sched.fetch, f, 500)  # occupies the disk; head moves to 501
        await trio.testing.wait_all_tasks_blocked()
        for idx in (900, 100, 600, 50, 700):
            n.start_soon(sched.fetch, f, idx)
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(2)
        n.cancel_scope.cancel()
    assert [first for _, first, *_ in disk.log] == [500, 600, 700, 900, 50, 100]


async def test_demand_coalesces_queued_readahead_up_to_one_slice(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    disk = FakeDisk()
    f = bfile("f", 1)
    async with trio.open_nursery() as n:
        sched = await start(n, disk, slice_size=4 * CS)
        for i in range(1, 10):
            sched.submit(f, i, Klass.SPECULATIVE)
        await sched.fetch(f, 0)
        await trio.sleep(2)
        n.cancel_scope.cancel()
    assert [(first, cnt) for _, first, cnt, _ in disk.log] == [(0, 4), (4, 4), (8, 2)]
    assert sched.statistics().coalesced_chunks == 7


async def test_single_flight(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    disk = FakeDisk()
    f = bfile("f", 1)
    results: list[bytes] = []
    async with trio.open_nursery() as n:
        sched = await start(n, disk)

        async def reader() -> None:
            results.append(await sched.fetch(f, 3))

        for _ in range(8):
            n.start_soon(reader)
        await trio.sleep(1)
        n.cancel_scope.cancel()
    assert len(disk.log) == 1 and len(results) == 8


async def test_demand_for_queued_readahead_raises_its_class(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    disk = FakeDisk()
    busy, f = bfile("busy", 1, size=1000 * CS), bfile("f", 2)
    async with trio.open_nursery() as n:
        sched = await start(n, disk, slice_size=CS)
        n.start_soon(sched.fetch, busy, 0)
        await trio.testing.wait_all_tasks_blocked()
        sched.submit(f, 7, Klass.SPECULATIVE)
        for i in range(1, 4):
            sched.submit(busy, 100 + i, Klass.SPECULATIVE)
        n.start_soon(sched.fetch, f, 7)  # a reader now waits for it
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(2)
        n.cancel_scope.cancel()
    assert [name for name, *_ in disk.log][:2] == ["busy", "f"]


async def test_demand_waits_at_most_one_slice_behind_a_long_transfer(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    disk = FakeDisk()
    big, f = bfile("big", 1, size=256 * CS), bfile("f", 2)
    slice_s = SEEK + 4 * CS / RATE
    async with trio.open_nursery() as n:
        sched = await start(n, disk, slice_size=4 * CS)
        for i in range(256):  # a 256 MiB prefetch
            sched.submit(big, i, Klass.SPECULATIVE)
        await trio.sleep(0.5)  # the transfer is under way
        t0 = trio.current_time()
        await sched.fetch(f, 0)
        waited = trio.current_time() - t0
        n.cancel_scope.cancel()
    # at most the rest of the current slice, then its own transfer
    assert waited <= slice_s + SEEK + CS / RATE + 1e-6, waited


async def test_backing_error_reaches_every_waiter(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    from tierfs.errors import BackingIOError

    async def failing(f: BackingFile, offset: int, length: int) -> bytes:
        raise OSError(5, "Input/output error")

    f = bfile("f", 1)
    async with trio.open_nursery() as n:
        sched = TransactionScheduler(failing, chunk_size=CS, slice_size=CS)
        await n.start(sched.run)
        with pytest.raises(BackingIOError) as e:
            await sched.fetch(f, 0)
        assert e.value.errno == 5
        n.cancel_scope.cancel()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 15), st.sampled_from(list(Klass))),
                min_size=1, max_size=40))
def test_every_request_served_exactly_once_per_chunk(reqs) -> None:  # type: ignore[no-untyped-def]
    """Property: whatever is queued, every chunk is read once (single-flight), nothing is read
    that was not asked for, and no run crosses a slice."""

    async def main() -> None:
        disk = FakeDisk()
        files = [bfile(f"f{i}", i + 1, size=16 * CS) for i in range(4)]
        async with trio.open_nursery() as n:
            sched = await start(n, disk, slice_size=3 * CS)
            for fi, idx, klass in reqs:
                sched.submit(files[fi], idx, klass, deadline=trio.current_time() + 5 if klass is Klass.DEADLINE else math.inf)
            await trio.sleep(100)
            n.cancel_scope.cancel()
        read = [(name, first + k) for name, first, cnt, _ in disk.log for k in range(cnt)]
        assert sorted(read) == sorted({(f"f{fi}", idx) for fi, idx, _ in reqs})
        assert all(cnt <= 3 for _, _, cnt, _ in disk.log)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# -- the parallel profile: several runs in flight, arrival order, a share kept for demand ------

async def test_parallel_profile_runs_depth_at_once_in_class_order(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    disk = FakeDisk()
    spec, dl, dem = bfile("spec", 1), bfile("dl", 2), bfile("dem", 3)
    sched = TransactionScheduler(disk.read, chunk_size=CS, slice_size=CS, depth=4, elevator=False)
    for idx in (9, 3, 7, 1, 5):  # arrival order, not disk order
        sched.submit(spec, idx, Klass.SPECULATIVE)
    sched.submit(dl, 0, Klass.DEADLINE, deadline=trio.current_time() + 100)
    async with trio.open_nursery() as n:
        n.start_soon(sched.fetch, dem, 0, Klass.DEMAND)
        await trio.testing.wait_all_tasks_blocked()
        await n.start(sched.run)
        await trio.sleep(5)
        n.cancel_scope.cancel()
    first = [(name, idx) for name, idx, _, t in disk.log if t == disk.log[0][3]]
    # 4 in flight at once: demand, then deadline, then the oldest readahead; background work
    # holds at most 3 of the 4 slots
    assert first == [("dem", 0), ("dl", 0), ("spec", 9), ("spec", 3)]
    assert [idx for name, idx, *_ in disk.log if name == "spec"] == [9, 3, 7, 1, 5]
    assert sched.statistics().background_slots == 3 and not sched.statistics().elevator


async def test_parallel_profile_demand_never_waits_behind_readahead(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    disk = FakeDisk()
    f, g = bfile("f", 1, size=1000 * CS), bfile("g", 2)
    async with trio.open_nursery() as n:
        sched = await start(n, disk, slice_size=CS, depth=8, elevator=False)
        for i in range(100):  # a deep readahead queue
            sched.submit(f, i, Klass.SPECULATIVE)
        await trio.testing.wait_all_tasks_blocked()
        assert sched.statistics().in_flight == 6  # 8 - 8 // 4: two slots stay free
        t0 = trio.current_time()
        await sched.fetch(g, 0)
        assert trio.current_time() - t0 == pytest.approx(SEEK + CS / RATE)  # served at once
        n.cancel_scope.cancel()


async def test_hdd_profile_keeps_one_request_and_the_elevator(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    disk = FakeDisk()
    f = bfile("f", 1, size=1000 * CS)
    async with trio.open_nursery() as n:
        sched = await start(n, disk, slice_size=CS)  # the defaults are the hdd profile's
        for idx in (900, 100, 600):
            sched.submit(f, idx, Klass.SPECULATIVE)
        await trio.testing.wait_all_tasks_blocked()
        assert sched.statistics().in_flight == 1
        await trio.sleep(2)
        n.cancel_scope.cancel()
    assert [first for _, first, *_ in disk.log] == [100, 600, 900]
    assert sched.statistics().elevator and sched.statistics().background_slots == 1


async def test_cancelled_io_caller_never_outlives_nor_precedes_its_call(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """A caller cancelled while its backing-store call runs gets Cancelled only once the call
    has returned (it then closes what the call used); one cancelled while its call is still
    queued drops it: the call never runs after its caller has gone."""
    events: list[str] = []

    async def run_io(fn):  # type: ignore[no-untyped-def]
        await trio.sleep(1.0)  # the device thread
        return fn()

    async def caller(name: str, scope_box: list[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            scope_box.append(scope)
            await sched.io(lambda: events.append(f"{name} ran"), Klass.DEADLINE, nbytes=0)
        events.append(f"{name} unwound")

    disk = FakeDisk()
    async with trio.open_nursery() as n:
        sched = await start(n, disk, run_io=run_io)
        running: list[trio.CancelScope] = []
        queued: list[trio.CancelScope] = []
        n.start_soon(caller, "running", running)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(caller, "queued", queued)
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(0.5)  # the first call is half done, the second waits its turn
        running[0].cancel()
        queued[0].cancel()
        await trio.sleep(5)
        n.cancel_scope.cancel()
    assert events == ["queued unwound", "running ran", "running unwound"]


@pytest.mark.parametrize(("name", "wakes_after_chunks"), [("parallel", 1), ("hdd", 8)])
async def test_a_waiting_reader_wakes_when_its_chunk_is_there(autojump_clock, name: str,  # type: ignore[no-untyped-def]
                                                             wakes_after_chunks: int) -> None:
    """A large miss with readahead queued behind it: on the parallel profile the chunks are
    separate transfers running at once, and the reader of chunk 0 wakes after one chunk's
    time; the hdd profile reads them as one run (a reader waits for the run: one seek)."""
    from tierfs.sched import profile

    # the profile's own values (hdd: slices of 8 chunks here, 32 MiB at 4 MiB chunks)
    p = profile.resolve(name, "test", "/x", chunk_size=CS, depth=None,
                        slice_size=8 * CS if name == "hdd" else None)
    disk = FakeDisk()
    f = bfile("f", 1)
    sched = TransactionScheduler(disk.read, chunk_size=CS, slice_size=p.slice_size, depth=p.depth,
                                 elevator=p.elevator)
    for i in range(1, 8):
        sched.submit(f, i, Klass.SPECULATIVE)
    woke: list[float] = []

    async def reader() -> None:
        await sched.fetch(f, 0)
        woke.append(trio.current_time())

    async with trio.open_nursery() as n:
        n.start_soon(reader)  # queued before the dispatcher starts: both profiles see all 8
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        await n.start(sched.run)
        await trio.sleep(1)
        n.cancel_scope.cancel()
    assert woke[0] - t0 == pytest.approx(SEEK + wakes_after_chunks * CS / RATE)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "del", "pop", "pop_missing", "clear"]),
                          st.integers(0, 3), st.integers(0, 5)), max_size=60))
def test_class_queue_index_follows_every_change(ops: list[tuple[str, int, int]]) -> None:
    """The per-file index of a class queue always names exactly the queued chunks of each file,
    in arrival order, whatever sequence of assignments, deletions, pops and clears it saw."""
    from tierfs.sched.scheduler import ClassQueue

    q = ClassQueue()
    model: dict[tuple[str, int], object] = {}
    for op, f, i in ops:
        cid = (f"f{f}", i)
        if op == "set":
            q[cid] = model[cid] = object()  # type: ignore[assignment]
        elif op == "del" and cid in model:
            del q[cid], model[cid]
        elif op == "pop":
            assert q.pop(cid, None) is model.pop(cid, None)
        elif op == "pop_missing" and cid not in model:
            with pytest.raises(KeyError):
                q.pop(cid)
        elif op == "clear":
            q.clear()
            model.clear()
        assert dict(q) == model
        want: dict[str, list[tuple[str, int]]] = {}
        for c in model:
            want.setdefault(c[0], []).append(c)
        assert {k: list(v) for k, v in q.by_file.items()} == want
    for bypass in (lambda: q.update({("f0", 0): 1}), lambda: q.setdefault(("f0", 0), 1), q.popitem):
        with pytest.raises(TypeError):  # a change the index would not see is refused, not silent
            bypass()


async def test_closing_a_file_drops_only_its_unwaited_readahead(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """cancel_speculative(key) drops the queued speculative fetches of that file nobody waits
    for, and nothing of any other file or class (it finds them through the per-file index)."""
    disk = FakeDisk()
    a, b, busy = bfile("a", 1), bfile("b", 2), bfile("busy", 3)
    async with trio.open_nursery() as n:
        sched = await start(n, disk, slice_size=CS)
        n.start_soon(sched.fetch, busy, 0)
        await trio.testing.wait_all_tasks_blocked()
        for i in range(0, 20, 2):  # not adjacent: each its own run
            sched.submit(a, i, Klass.SPECULATIVE)
            sched.submit(b, i, Klass.SPECULATIVE)
        sched.submit(a, 40, Klass.DEADLINE, deadline=trio.current_time() + 100)
        n.start_soon(sched.fetch, a, 30, Klass.SPECULATIVE)  # waited for: kept
        await trio.testing.wait_all_tasks_blocked()
        assert sched.cancel_speculative(a.key) == 10
        assert sched.cancel_speculative(a.key) == 0
        await trio.sleep(10)
        n.cancel_scope.cancel()
    fetched = sorted((name, first) for name, first, *_ in disk.log)
    assert fetched == sorted([("busy", 0), ("a", 30), ("a", 40)] + [("b", i) for i in range(0, 20, 2)])


class StepCounter(trio.abc.Instrument):
    """Counts ``on_fetched`` calls within each task step: what one step of the loop did."""

    def __init__(self) -> None:
        self.in_step = 0
        self.most = 0

    def before_task_step(self, task) -> None:  # type: ignore[no-untyped-def]
        self.in_step = 0

    def fetched(self, req, data) -> None:  # type: ignore[no-untyped-def]
        self.in_step += 1
        self.most = max(self.most, self.in_step)


async def test_a_run_hands_on_one_chunk_per_loop_step(autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """The chunks of a coalesced run are copied out of its buffer one per step of the event
    loop, each chunk's reader woken before the next copy: a 32 MiB run copied in one step held
    a loaded loop for tens of milliseconds."""
    disk = FakeDisk()
    f = bfile("f", 1)
    counter = StepCounter()
    trio.lowlevel.add_instrument(counter)
    try:
        async with trio.open_nursery() as n:
            sched = await start(n, disk, slice_size=8 * CS)
            sched.on_fetched = counter.fetched
            for i in range(1, 8):
                sched.submit(f, i, Klass.SPECULATIVE)
            got = await sched.fetch(f, 0)
            await trio.sleep(1)
            n.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(counter)
    assert [(first, cnt) for _, first, cnt, _ in disk.log] == [(0, 8)]
    assert got == bytes(CS)
    assert counter.most == 1
