"""The implicit read handles of files the kernel opened itself (a read-only mount with
``kernel_opens``: READs carry no handle): one per inode, shared by concurrent READs, opened
again once older than ``attr_timeout``, let go when the kernel forgets the inode or beyond
a cap (half of RLIMIT_NOFILE at most), and never released under a READ in flight. In-process, with the open, read
and release of a handle faked (their own tests are elsewhere); trio's mock clock."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from tierfs.fs import handlers as handlers_mod
from tierfs.fs.api import Ctx, FuseError, OpenReply
from tierfs.fs.handlers import Handlers
from tierfs.fs.handles import FileHandle, HandleTable


class _Fake:
    def __init__(self, ops: Handlers) -> None:
        self.ops = ops
        self.opened: list[int] = []
        self.released: list[int] = []
        self.reading: dict[int, int] = {}
        self.gate: trio.Event | None = None
        self.stale_once: set[int] = set()
        self.invalidated: list[int] = []

    async def open(self, inode: int, flags: int, ctx: Ctx, kill_suidgid: bool = False) -> OpenReply:
        assert flags == os.O_RDONLY
        await trio.sleep(0.001)  # an open waits (a metadata thread): READs may race it
        if inode in self.stale_once:
            self.stale_once.discard(inode)
            raise FuseError(116)  # ESTALE: changed since the kernel was told
        fh = self.ops.handles.add(FileHandle(inode))
        self.opened.append(fh)
        return OpenReply(fh)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        assert fh not in self.released, "a READ on a released handle"
        self.reading[fh] = self.reading.get(fh, 0) + 1
        if self.gate is not None:
            await self.gate.wait()
        assert fh not in self.released, "released under a READ in flight"
        self.reading[fh] -= 1
        return b"%d" % self.ops.handles.get(fh).inode  # type: ignore[union-attr]

    async def release(self, fh: int) -> None:
        assert self.reading.get(fh, 0) == 0, "released under a READ in flight"
        self.released.append(fh)
        self.ops.handles.pop(fh)


def _ops(attr_timeout: float = 60.0) -> tuple[Handlers, _Fake]:
    ops = Handlers.__new__(Handlers)  # only what read_inode and forget touch
    ops.handles = HandleTable()
    ops.inode_readers = handlers_mod.collections.OrderedDict()
    ops.inode_reader_opens = 0
    ops.inode_readers_max = handlers_mod.INODE_READERS_MAX
    ops._inode_opening = {}
    ops.inode_invalidations = 0
    ops.current = True  # type: ignore[attr-defined]

    async def still_current(inode: int, r) -> bool:  # type: ignore[no-untyped-def]
        return ops.current  # type: ignore[attr-defined,no-any-return]

    ops._still_current = still_current  # type: ignore[method-assign]
    ops.attr_timeout = attr_timeout
    ops.control = SimpleNamespace(by_inode={})  # type: ignore[assignment]
    ops.requests = handlers_mod.collections.Counter()
    ops.inodes = SimpleNamespace(by_inode={}, forget=lambda inode, n: None)  # type: ignore[assignment]
    fake = _Fake(ops)
    ops._pending_invals = []

    async def invalidated(inode: int) -> None:
        fake.invalidated.append(inode)

    ops.on_inval_inode = invalidated
    ops.open = fake.open  # type: ignore[method-assign]
    ops.read = fake.read  # type: ignore[method-assign]
    ops.release = fake.release  # type: ignore[method-assign]
    return ops, fake


CTX = Ctx(0, 0, 1, 0)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> trio.testing.MockClock:
    c = trio.testing.MockClock(autojump_threshold=0)
    monkeypatch.setattr(handlers_mod.time, "monotonic", trio.current_time)
    return c


async def test_one_reader_per_inode_shared_by_concurrent_reads_and_reopened_after_attr_timeout(
        clock: trio.testing.MockClock) -> None:
    ops, fake = _ops(attr_timeout=60.0)
    async with trio.open_nursery() as n:
        for _ in range(5):  # five READs of one file at once: one open
            n.start_soon(ops.read_inode, 7, 0, 10, CTX)
    assert len(fake.opened) == 1 and not fake.released and list(ops.inode_readers) == [7]
    assert await ops.read_inode(7, 0, 10, CTX) == b"7"
    assert len(fake.opened) == 1
    await trio.sleep(61)  # older than attr_timeout, the backing file unchanged: kept
    assert await ops.read_inode(7, 0, 10, CTX) == b"7"
    assert len(fake.opened) == 1 and not fake.invalidated
    ops.current = False  # type: ignore[attr-defined]  # changed in place behind tierfs' back
    await trio.sleep(61)
    assert await ops.read_inode(7, 0, 10, CTX) == b"7"
    assert len(fake.opened) == 2 and fake.released == fake.opened[:1]
    # (the kernel's pages go at the GETATTR or LOOKUP that sees the change, never from a READ:
    # its own pages stay locked until it is answered, and the invalidation would wait for them)
    assert ops.inode_reader_opens == 2 and fake.invalidated == []


async def test_an_open_that_finds_the_file_changed_is_retried_once(clock: trio.testing.MockClock) -> None:
    ops, fake = _ops()
    fake.stale_once.add(3)
    assert await ops.read_inode(3, 0, 10, CTX) == b"3"
    assert len(fake.opened) == 1


async def test_readers_are_let_go_beyond_the_cap_least_recently_read_first(
        clock: trio.testing.MockClock) -> None:
    ops, fake = _ops()
    ops.inode_readers_max = 3
    for inode in (11, 12, 13):
        await ops.read_inode(inode, 0, 1, CTX)
    await ops.read_inode(11, 0, 1, CTX)  # 11 is now the most recent
    await ops.read_inode(14, 0, 1, CTX)  # 12 goes
    assert list(ops.inode_readers) == [13, 11, 14]
    assert len(fake.released) == 1 and len(ops.handles.handles) == 3
    assert ops.handles.of_inode(12) == []


async def test_forget_lets_a_reader_go_but_never_under_a_read_in_flight(clock: trio.testing.MockClock) -> None:
    ops, fake = _ops()
    await ops.read_inode(5, 0, 1, CTX)
    fake.gate = trio.Event()
    async with trio.open_nursery() as n:
        n.start_soon(ops.read_inode, 5, 0, 1, CTX)
        await trio.sleep(0.01)  # the READ waits inside read()
        await ops.forget([(5, 1)])  # the kernel forgets the inode (its lookups reach 0)
        assert 5 not in ops.inode_readers and not fake.released  # not yet: a READ is in flight
        fake.gate.set()
    assert len(fake.released) == 1 and not ops.handles.handles
    await ops.forget([(5, 1)])  # again: nothing left to let go
    assert len(fake.released) == 1


def test_handle_table_knows_the_handles_of_each_inode() -> None:
    t = HandleTable()
    a, b, c = t.add(FileHandle(1)), t.add(FileHandle(1)), t.add(FileHandle(2))
    assert [h.inode for h in t.of_inode(1)] == [1, 1] and len(t.of_inode(2)) == 1
    t.pop(a)
    assert t.of_inode(1) == [t.get(b)]
    t.pop(b)
    t.pop(c)
    assert t.of_inode(1) == [] and t.of_inode(2) == [] and not t._by_inode
    assert a != 0 and b != 0 and c != 0  # 0 is never a handle (a kernel-opened file's READ)


async def test_idle_readers_are_let_go_every_attr_timeout(clock: trio.testing.MockClock) -> None:
    ops, fake = _ops(attr_timeout=10.0)
    async with trio.open_nursery() as n:
        n.start_soon(ops.sweep_inode_readers)  # sweeps at t=10, 20, ...
        await trio.sleep(1)
        await ops.read_inode(21, 0, 1, CTX)
        await ops.read_inode(22, 0, 1, CTX)
        await trio.sleep(10)  # t=11: the sweep at t=10 found none idle for 10 s
        assert list(ops.inode_readers) == [21, 22]
        await trio.sleep(4)
        await ops.read_inode(22, 0, 1, CTX)  # t=15
        await trio.sleep(6)  # t=21: the sweep at t=20 let 21 go (idle since t=1), kept 22
        assert list(ops.inode_readers) == [22]
        assert len(fake.released) == 1
        n.cancel_scope.cancel()
