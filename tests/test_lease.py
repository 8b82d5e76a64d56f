"""Passthrough leases, in-process: the cache's pins on leased tier files and the write path's
handling of data files written behind the daemon (tierfs.cache.lease).

A lease's descriptor is what the kernel reads and writes under passthrough, so these tests play
the kernel: they ``pread``/``pwrite`` the lease's descriptor (or a second descriptor of the same
file, as the kernel's own backing file is) and call what the FUSE layer calls at flush, fsync
and release."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_cache import CS, bfile, make_cache, read_whole, settle, whole_file
from tests.test_writeback_inprocess import Disks, KiB, backing_bytes, instance
from tierfs.cache.lease import LeaseTable
from tierfs.writeback import worker as wbw
from tierfs.writeback.manager import DirtyState, WriteBack


def _closed(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError as e:
        return e.errno == errno.EBADF
    return False


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _tiers_of(cache, key: str) -> set[int]:  # type: ignore[no-untyped-def]
    return {cache.catalog.entries[(key, i)].tier for i in cache.catalog.chunks_of(key)}


# -- the lease table ------------------------------------------------------------------------------
async def test_lease_table_shares_one_descriptor_and_closes_at_last_release(tmp_path: Path) -> None:
    closed: list[int] = []
    last: list[str] = []
    table = LeaseTable(close=closed.append)
    assert await table.share("k", tier="ram", size=1, writable=False) is None
    table.begin("k")
    a = table.finish("k", 42, tier="ram", size=1, writable=False, on_last=lambda: last.append("k"))
    b = await table.share("k", tier="ram", size=1, writable=False)
    assert b is not None and a.fd == b.fd == 42 and a.key == b.key == "k"
    a.release()
    a.release()  # idempotent: must not take b's reference
    assert closed == [] and table.refs("k") == 1
    b.release()
    assert closed == [42] and last == ["k"] and "k" not in table


async def test_lease_table_waiters_see_a_failed_open(tmp_path: Path) -> None:
    table = LeaseTable()
    table.begin("k")
    got: list[object] = []

    async def waiter() -> None:
        got.append(await table.share("k", tier="ram", size=1, writable=False))

    async with trio.open_nursery() as n:
        n.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # waits while the descriptor is being opened
        table.abort("k")
    assert got == [None]


# -- the cache: leases of resident tier files -----------------------------------------------------
async def test_lease_pins_a_ram_file_against_eviction_and_demotion(tmp_path: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """A file leased in the RAM tier stays there, bytes and all, while other files churn the
    tier (LRU would evict and demote it first); after the last release it may go."""
    cache, sched, _ = make_cache(tmp_path, ram=4 * CS, ssd=16 * CS, policy="lru")
    a = bfile(1, 2 * CS - 100)
    others = [bfile(i, CS) for i in range(10, 16)]
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        await read_whole(cache, a)
        await settle(cache)
        assert _tiers_of(cache, a.key) == {0}
        lease = await cache.lease_resident(a)
        assert lease is not None and lease.tier == "ram" and lease.size == a.size
        assert not lease.writable and os.fstat(lease.fd).st_size == a.size
        assert fcntl.fcntl(lease.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        ram = cache.tiers[0]
        assert (ram.passthrough_opens, ram.passthrough_bytes, ram.leased_files, ram.leased_bytes) == (
            1, a.size, 1, a.size)
        for _ in range(2):
            for f in others:
                await read_whole(cache, f)
                await settle(cache)
                assert cache.check() == []
        assert _tiers_of(cache, a.key) == {0}, "a leased file was evicted or demoted"
        assert len(cache.catalog.chunks_of(a.key)) == 2
        assert os.pread(lease.fd, a.size + 10, 0) == whole_file(a)  # no hole punched under it
        assert cache.tiers[0].evictions > 0  # the churn did evict (others)
        lease.release()
        assert not cache.is_leased(a.key) and ram.leased_files == 0 and ram.leased_bytes == 0
        for f in others:
            await read_whole(cache, f)
            await settle(cache)
        assert 0 not in _tiers_of(cache, a.key)  # unpinned: LRU took it out of RAM
        assert cache.check() == []
        n.cancel_scope.cancel()
    cache.close()


async def test_lease_pins_against_promotion_evict_and_drop(tmp_path: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """An SSD-resident leased file is not promoted by hits, not dropped by ``tierfs evict``,
    and a change of the backing file (drop_file) waits for the last release."""
    cache, sched, _ = make_cache(tmp_path, ram=0, ssd=8 * CS, policy="lru")
    f = bfile(1, 2 * CS)
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        await read_whole(cache, f)
        await settle(cache)
        lease = await cache.lease_resident(f)
        assert lease is not None and lease.tier == "ssd"
        assert await cache.evict_chunks([(f.key, 0), (f.key, 1)]) == (0, 0)
        assert await cache.drop_file(f.key) == 0
        await settle(cache)
        assert len(cache.catalog.chunks_of(f.key)) == 2
        assert os.pread(lease.fd, f.size, 0) == whole_file(f)
        # a changed file takes no new lease on the old copy
        assert await cache.lease_resident(f) is None
        lease.release()
        await settle(cache)
        assert cache.catalog.chunks_of(f.key) == []  # dropped at the last release
        assert cache.check() == []
        n.cancel_scope.cancel()
    cache.close()

    cache, sched, _ = make_cache(tmp_path / "b", ram=8 * CS, ssd=8 * CS, policy="lru")
    cache.tiers[0].capacity = cache.tiers[0].effective_capacity = 0  # fill the SSD first
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        await read_whole(cache, f)
        await settle(cache)
        assert _tiers_of(cache, f.key) == {1}
        lease = await cache.lease_resident(f)
        assert lease is not None
        cache.tiers[0].capacity = cache.tiers[0].effective_capacity = 8 * CS
        for _ in range(4):  # hot: would be promoted to RAM
            await read_whole(cache, f)
            await settle(cache)
        assert _tiers_of(cache, f.key) == {1}, "a leased file was promoted"
        assert cache.tiers[0].promotions == 0
        lease.release()
        for _ in range(2):
            await read_whole(cache, f)
            await settle(cache)
        assert 0 in _tiers_of(cache, f.key)  # unpinned: now it is promoted
        n.cancel_scope.cancel()
    cache.close()


async def test_kept_lease_yields_to_eviction_drop_and_evict(tmp_path: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """A lease kept after a file's opens closed (Cache.keep_lease: the next open then costs no
    tier open nor kernel registration) pins the file like an open's lease while opens share
    it, and lets go as soon as the cache wants the file: eviction under churn, ``tierfs
    evict``, a changed backing file. An open lease beside it still pins."""
    cache, sched, _ = make_cache(tmp_path, ram=4 * CS, ssd=0, policy="lru")
    a, b, c = bfile(1, CS - 100), bfile(2, CS // 2), bfile(3, CS // 3)
    others = [bfile(i, CS) for i in range(10, 16)]
    revoked: list[str] = []

    def keeper(f, lease_box):  # type: ignore[no-untyped-def]
        def revoke() -> None:
            revoked.append(f.key)
            cache.unkeep(f.key)
            lease_box.pop().release()
        return revoke

    async def keep(f):  # type: ignore[no-untyped-def]
        await read_whole(cache, f)
        await settle(cache)
        opened = await cache.lease_resident(f)
        assert opened is not None
        box: list = []
        kept = cache.keep_lease(opened.key, keeper(f, box))
        assert kept is not None and kept.fd == opened.fd
        box.append(kept)
        return opened, box

    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        ram = cache.tiers[0]
        # eviction: kept alone, it yields; with an open lease beside it, it stays
        opened, box = await keep(a)
        opened.release()  # the open closed: only the kept lease holds it
        assert cache.is_leased(a.key) and ram.passthrough_opens == 1
        again = cache.reuse_kept(box[0].key, a)  # the next open: counted, same descriptor
        assert again is not None and again.fd == box[0].fd and ram.passthrough_opens == 2
        for f in others:
            await read_whole(cache, f)
            await settle(cache)
        assert _tiers_of(cache, a.key) == {0} and revoked == []  # an open lease pins it
        again.release()
        for f in others:
            await read_whole(cache, f)
            await settle(cache)
        assert revoked == [a.key] and not cache.is_leased(a.key) and box == []
        assert 0 not in _tiers_of(cache, a.key) and cache.check() == []
        # tierfs evict, and a backing file changed behind tierfs' back
        opened, box_b = await keep(b)
        opened.release()
        assert await cache.evict_chunks([(b.key, 0)]) == (1, b.size)
        assert revoked[-1] == b.key and cache.catalog.chunks_of(b.key) == []
        opened, box_c = await keep(c)
        opened.release()
        await cache.drop_file(c.key)
        assert revoked[-1] == c.key and cache.catalog.chunks_of(c.key) == [] and not cache.is_leased(c.key)
        assert cache.reuse_kept(("tier", "ram", c.key), c) is None
        assert ram.leased_files == 0 and cache.check() == []
        n.cancel_scope.cancel()
    cache.close()


async def test_kept_lease_of_a_ram_copy_is_parked_without_a_descriptor(tmp_path: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """A kept lease alone on a RAM-tier file closes its descriptor (Cache.park_kept) and still
    pins the file; the next open (reuse_kept) opens the same tier file again; a parked lease
    yields to eviction like any kept lease, and a lease with an open beside it, or in a tier
    that is not inline, is not parked."""
    cache, sched, _ = make_cache(tmp_path, ram=4 * CS, ssd=8 * CS, policy="lru")
    a = bfile(1, CS // 2)
    others = [bfile(i, CS) for i in range(10, 16)]
    revoked: list[str] = []
    box: list = []

    def revoke() -> None:
        revoked.append(a.key)
        cache.unkeep(a.key)
        box.pop().release()

    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        await read_whole(cache, a)
        await settle(cache)
        opened = await cache.lease_resident(a)
        assert opened is not None and opened.tier == "ram"
        fd, ino = opened.fd, os.fstat(opened.fd).st_ino
        box.append(cache.keep_lease(opened.key, revoke))
        assert not cache.park_kept(opened.key)  # an open shares it: not parked
        assert not cache.park_kept(("tier", "ssd", a.key))  # not inline: its reopen takes a thread
        opened.release()
        assert cache.park_kept(opened.key) and _closed(fd)  # the keeper alone: parked
        assert cache.is_leased(a.key) and cache.leases.is_parked(opened.key)
        again = cache.reuse_kept(opened.key, a)  # the next open: the same file, opened again
        assert again is not None and again.fd >= 0 and os.fstat(again.fd).st_ino == ino
        assert not cache.leases.is_parked(opened.key)
        shared = await cache.lease_resident(a)  # a second open shares the reopened descriptor
        assert shared is not None and shared.fd == again.fd
        shared.release()
        again.release()
        assert cache.park_kept(opened.key)
        again_fd_closed = _closed(again.fd)
        for f in others:  # eviction wants it: the parked lease yields
            await read_whole(cache, f)
            await settle(cache)
        assert again_fd_closed and revoked == [a.key] and not cache.is_leased(a.key) and box == []
        assert cache.reuse_kept(opened.key, a) is None and cache.check() == []
        n.cancel_scope.cancel()
    cache.close()


async def test_concurrent_leases_share_one_descriptor(tmp_path: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    cache, sched, _ = make_cache(tmp_path, ram=8 * CS, ssd=0)
    f = bfile(1, 3 * CS)
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        await read_whole(cache, f)
        await settle(cache)
        leases = []
        freq0 = cache.policy.freq.get((f.key, 0))

        async def take() -> None:
            leases.append(await cache.lease_resident(f))

        async with trio.open_nursery() as m:
            for _ in range(5):
                m.start_soon(take)
        assert all(lease is not None for lease in leases)
        fds = {lease.fd for lease in leases}  # type: ignore[union-attr]
        assert len(fds) == 1
        fd = fds.pop()
        assert cache.tiers[0].passthrough_opens == 5 and cache.tiers[0].leased_files == 1
        # each open stands for one pass over the file, for the eviction policy
        assert cache.policy.freq.get((f.key, 0)) == freq0 + 5
        for lease in leases[:-1]:
            lease.release()  # type: ignore[union-attr]
            lease.release()  # type: ignore[union-attr]
        assert not _closed(fd) and cache.is_leased(f.key)
        leases[-1].release()  # type: ignore[union-attr]
        assert _closed(fd) and not cache.is_leased(f.key)
        assert cache.check() == []
        n.cancel_scope.cancel()
    cache.close()


async def test_lease_refused_unless_whole_current_and_in_one_tier(tmp_path: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    cache, sched, _ = make_cache(tmp_path, ram=2 * CS, ssd=8 * CS, policy="lru")
    partial_ = bfile(1, 3 * CS)
    split = bfile(2, 3 * CS)
    empty = bfile(3, 0)
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        from tierfs.cache.manager import AccessState

        acc = AccessState()
        await cache.read(partial_, 0, CS, acc)
        cache.forget_access(acc)
        await settle(cache)
        assert await cache.lease_resident(partial_) is None  # partly resident
        await read_whole(cache, split)
        await settle(cache)
        assert len(_tiers_of(cache, split.key)) == 2, "setup: the file should be split"
        assert await cache.lease_resident(split) is None  # across tiers
        assert await cache.lease_resident(empty) is None
        assert cache.statistics().passthrough_refusals == 3
        n.cancel_scope.cancel()
    cache.close()

    # an SSD tier restored from its catalog: chunks are unverified until read once
    cache, sched, _ = make_cache(tmp_path / "p", ram=0, ssd=8 * CS, persistent=True)
    f = bfile(4, 2 * CS)
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        await read_whole(cache, f)
        await settle(cache)
        n.cancel_scope.cancel()
    cache.close()
    cache, sched, _ = make_cache(tmp_path / "p", ram=0, ssd=8 * CS, persistent=True)
    assert cache.load_persistent() == 2
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        assert await cache.lease_resident(f) is None  # not verified against its checksum yet
        assert await read_whole(cache, f) == whole_file(f)
        await settle(cache)
        lease = await cache.lease_resident(f)
        assert lease is not None
        assert os.pread(lease.fd, f.size, 0) == whole_file(f)
        lease.release()
        n.cancel_scope.cancel()
    cache.close()


async def test_tier_file_size_must_equal_the_file_size(tmp_path: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """The kernel reads the backing file up to its own size: a tier file longer than the file
    (debris past the end) must not be passed through."""
    cache, sched, _ = make_cache(tmp_path, ram=8 * CS, ssd=0)
    f = bfile(1, CS + 10)
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        await read_whole(cache, f)
        await settle(cache)
        cache.tiers[0].write(f.key, f.size, b"x")  # one stray byte past the end
        assert await cache.lease_resident(f) is None
        assert not cache.is_leased(f.key) and cache.tiers[0].leased_files == 0
        assert cache.check() == []
        n.cancel_scope.cancel()
    cache.close()


async def test_read_through_daemon_of_leased_file_with_failing_tier(tmp_path: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """A tier read that fails for a leased file is served from the backing store; the chunk is
    not punched under the kernel, and is dropped at the last release."""
    from tierfs.errors import TierIOError

    cache, sched, _ = make_cache(tmp_path, ram=8 * CS, ssd=0)
    f = bfile(1, 2 * CS)
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        await read_whole(cache, f)
        await settle(cache)
        lease = await cache.lease_resident(f)
        assert lease is not None
        tier = cache.tiers[0]
        real = tier.read

        def failing(key, offset, length):  # type: ignore[no-untyped-def]
            raise TierIOError("ram", OSError(5, "Input/output error"))

        tier.read = failing  # type: ignore[method-assign]
        assert await read_whole(cache, f) == whole_file(f)
        assert len(cache.catalog.chunks_of(f.key)) == 2
        assert os.pread(lease.fd, f.size, 0) == whole_file(f)
        tier.read = real  # type: ignore[method-assign]
        lease.release()
        await settle(cache)
        assert cache.catalog.chunks_of(f.key) == []
        assert cache.check() == []
        n.cancel_scope.cancel()
    cache.close()


# -- the write path: leases of data files -----------------------------------------------------------
async def _open_leased(wb: WriteBack, path: bytes, writable: bool = True):  # type: ignore[no-untyped-def]
    """create + open + lease, as the FUSE layer does for an ``open(O_CREAT|O_TRUNC)``
    passed through."""
    df = await wb.create(path, 0o100644, os.getuid(), os.getgid())
    wb.opened(df, writable)
    lease = await wb.lease_data(df, writable)
    assert lease is not None
    return df, lease


async def _close_leased(wb: WriteBack, df, lease, writable: bool = True) -> None:  # type: ignore[no-untyped-def]
    """flush + release of a passthrough handle, as the FUSE layer does."""
    if writable:
        await wb.after_passthrough_write(df)
    lease.release()
    await wb.closed(df, writable)


async def test_passthrough_writes_are_written_back_with_size_and_content(tmp_path: Path) -> None:
    disks = Disks(tmp_path)
    data = os.urandom(200 * KiB + 7)
    async with instance(disks) as wb:
        df, lease = await _open_leased(wb, b"ckpt.pt")
        assert lease.writable and lease.tier == "ssd"
        assert fcntl.fcntl(lease.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
        os.pwrite(lease.fd, data, 0)  # the kernel writes; the daemon hears nothing
        st = await wb.stat(df)  # getattr from another process: right at once
        assert st.st_size == len(data) and wb.size_of(df) == len(data)
        assert await wb.read(df, len(data) - 7, 100) == data[-7:]  # a daemon read sees it too
        await _close_leased(wb, df, lease)
        await wb.wait_durable(None, timeout=30)
        assert backing_bytes(disks, "ckpt.pt") == data
        assert wb.tier.dirty == 0 and wb.files == {}
        s = wb.statistics()
        assert (s.passthrough_opens, s.passthrough_writable_opens, s.leased_files) == (1, 1, 0)
        assert s.passthrough_changes >= 1


async def test_a_lease_opens_its_data_file_through_the_attribute_device(tmp_path: Path) -> None:
    """The data file's open and the tier's statvfs of a writable lease go through the write
    tier's attribute device (inline while cheap on a RAM tier), not the data device's threads:
    two thread hand-offs per file of a ``tar -x`` passed through (tar -x 31 -> 26 s)."""
    from tierfs.io import Device

    disks = Disks(tmp_path)
    attrs = Device("attrs", 4, inline_under=1.0)
    async with instance(disks, attr_device=attrs) as wb:
        before = wb.device.thread_calls
        df, lease = await _open_leased(wb, b"f")
        assert wb.device.thread_calls == before, "the lease's calls went to the tier's threads"
        assert attrs.inline_calls >= 2
        os.pwrite(lease.fd, b"abc", 0)
        await _close_leased(wb, df, lease)
        await wb.wait_durable(None, timeout=30)
        assert backing_bytes(disks, "f") == b"abc"


async def test_data_leases_share_a_descriptor_per_access_mode(tmp_path: Path) -> None:
    disks = Disks(tmp_path)
    async with instance(disks) as wb:
        df, a = await _open_leased(wb, b"f")
        wb.opened(df, True)
        b = await wb.lease_data(df, True)
        wb.opened(df, False)
        r = await wb.lease_data(df, False)
        assert b is not None and r is not None
        assert a.fd == b.fd and r.fd != a.fd
        assert fcntl.fcntl(r.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        assert (df.leases, df.lease_writers) == (3, 2)
        os.pwrite(a.fd, b"hello", 0)
        assert os.pread(r.fd, 5, 0) == b"hello"
        await _close_leased(wb, df, a)
        assert not _closed(b.fd)
        await _close_leased(wb, df, r, writable=False)
        assert _closed(r.fd)
        fd = b.fd
        await _close_leased(wb, df, b)
        assert _closed(fd) and (df.leases, df.lease_writers) == (0, 0)
        await wb.wait_durable(None, timeout=30)
        assert backing_bytes(disks, "f") == b"hello"


async def test_writeback_in_flight_when_a_passthrough_write_lands_does_not_mark_clean(
        tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A write-back copies the file (its writers closed); a write behind the daemon lands
    mid-copy (a shared mapping that outlived close, or any write the FUSE layer did not report
    yet). That copy must not mark the file clean: the file is copied again and the backing store
    ends with the last content, never the older one."""
    disks = Disks(tmp_path)
    v1 = b"1" * (64 * KiB)
    v2 = b"2" * (64 * KiB)
    real = wbw._copy_data
    landed: list[int] = []
    late_fd: list[int] = []

    def copy_hook(src, out, off, *args):  # type: ignore[no-untyped-def]
        if late_fd and not landed and off > 0:  # in the middle of the copy
            os.pwrite(late_fd[0], v2, 0)
            landed.append(off)
        return real(src, out, off, *args)

    monkeypatch.setattr(wbw, "_copy_data", copy_hook)
    async with instance(disks) as wb:
        df, lease = await _open_leased(wb, b"model.bin")
        os.pwrite(lease.fd, v1, 0)
        late_fd.append(os.dup(lease.fd))  # the kernel's own backing file, still mapped
        await _close_leased(wb, df, lease)
        try:
            await wb.wait_durable(None, timeout=30)
        finally:
            os.close(late_fd[0])
        assert landed, "setup: the write did not land during a copy"
        # the copy that raced the write was dropped; the one after it is what flush waited for
        assert backing_bytes(disks, "model.bin") == v2
        assert wb.files == {}


async def test_flush_while_a_writable_lease_is_open_waits_for_what_was_written(tmp_path: Path) -> None:
    """``tierfs flush`` (wait_durable) of a file open for writing through passthrough writes it
    back as it is now, including writes the FUSE layer has not reported yet; the file stays
    dirty while its writer holds it."""
    disks = Disks(tmp_path)
    async with instance(disks) as wb:
        df, lease = await _open_leased(wb, b"log")
        os.pwrite(lease.fd, b"a" * 1000, 0)
        await wb.after_passthrough_write(df)
        await wb.wait_durable(None, timeout=30)
        assert backing_bytes(disks, "log") == b"a" * 1000
        os.pwrite(lease.fd, b"b" * 500, 1000)  # not reported yet
        await wb.wait_durable(None, timeout=30)
        assert backing_bytes(disks, "log") == b"a" * 1000 + b"b" * 500
        assert df.state is not DirtyState.CLEAN and df in wb.files.values()
        await _close_leased(wb, df, lease)
        await wb.wait_durable(None, timeout=30)
        assert backing_bytes(disks, "log") == b"a" * 1000 + b"b" * 500


async def test_writable_lease_refused_when_the_write_tier_is_nearly_full(tmp_path: Path) -> None:
    disks = Disks(tmp_path)
    async with instance(disks, tier_bytes=1024 * KiB) as wb:
        big = await wb.create(b"big", 0o100644, os.getuid(), os.getgid())
        wb.opened(big, True)
        await wb.write(big, 0, b"x" * (960 * KiB))  # 1/8 of the tier is 128 KiB: less is left
        df = await wb.create(b"f", 0o100644, os.getuid(), os.getgid())
        wb.opened(df, True)
        assert await wb.lease_data(df, True) is None
        r = await wb.lease_data(df, False)  # reading it in place costs no room
        assert r is not None
        r.release()
        assert wb.statistics().passthrough_refusals == 1
        await wb.closed(df, True)
        await wb.closed(big, True)


async def test_leased_file_overruns_instead_of_switching_to_write_through(tmp_path: Path) -> None:
    """The kernel holds a leased data file: a file the tier cannot hold stays there (counted as
    an overrun) and is written back once closed, never switched under the kernel."""
    disks = Disks(tmp_path)
    data = os.urandom(768 * KiB)
    async with instance(disks, tier_bytes=512 * KiB) as wb:
        df, lease = await _open_leased(wb, b"ckpt")
        os.pwrite(lease.fd, data, 0)
        await wb.after_passthrough_write(df)  # fsync/flush
        assert not df.through and df.state is not DirtyState.THROUGH
        assert wb.statistics().passthrough_overrun_bytes > 0
        await wb.write(df, len(data), b"tail")  # a daemon write to it: no switch either
        assert not df.through
        assert os.pread(lease.fd, 4, len(data)) == b"tail"
        await _close_leased(wb, df, lease)
        await wb.wait_durable(None, timeout=30)
        assert backing_bytes(disks, "ckpt") == data + b"tail"
        assert wb.tier.dirty == 0


async def test_rename_and_unlink_of_a_leased_dirty_file(tmp_path: Path) -> None:
    disks = Disks(tmp_path)
    async with instance(disks) as wb:
        df, lease = await _open_leased(wb, b"tmp.123")
        os.pwrite(lease.fd, b"state", 0)
        assert await wb.rename(df, b"final") is True  # os.replace while still open
        os.pwrite(lease.fd, b"STATE!", 0)
        await _close_leased(wb, df, lease)
        await wb.wait_durable(None, timeout=30)
        assert backing_bytes(disks, "final") == b"STATE!"
        assert backing_bytes(disks, "tmp.123") is None

        df, lease = await _open_leased(wb, b"scratch")
        os.pwrite(lease.fd, b"x" * 4096, 0)
        data_path = df.data_path
        assert await wb.unlink(df) is True
        os.pwrite(lease.fd, b"y" * 4096, 0)  # still writable through the open handle
        assert os.pread(lease.fd, 4096, 0) == b"y" * 4096
        fd = lease.fd
        await _close_leased(wb, df, lease)
        assert _closed(fd)
        # removed in the tier's device thread (a disk tier: never on the loop)
        for _ in range(1000):
            if not _exists(data_path):
                break
            await trio.sleep(0.01)
        assert not _exists(data_path)
        assert backing_bytes(disks, "scratch") is None and wb.files == {}


@pytest.mark.parametrize("at", ["after-close", "while-open"])
async def test_leased_and_written_file_survives_kill_and_recovery(tmp_path: Path, at: str) -> None:
    """``kill -9`` after the close (before write-back) or while the passthrough handle is still
    open: recovery writes back what the data file holds, as for a daemon-written file."""
    disks = Disks(tmp_path / "d")
    data = os.urandom(100 * KiB)
    async with instance(disks) as wb:
        df, lease = await _open_leased(wb, b"ckpt")
        os.pwrite(lease.fd, data, 0)
        if at == "after-close":
            await _close_leased(wb, df, lease)
            # no checkpoint since the close: the worker has not started the write-back
            assert df.state is DirtyState.DIRTY
        snap = disks.snapshot(tmp_path / "snap")  # what kill -9 now leaves
        lease.release()
    assert backing_bytes(snap, "ckpt") is None
    async with instance(snap) as wb2:
        await wb2.wait_durable(None, timeout=30)
        assert backing_bytes(snap, "ckpt") == data


async def test_fsync_of_a_passthrough_written_file_with_fsync_backing(tmp_path: Path) -> None:
    """``--fsync=backing`` (or a RAM write tier): the FUSE layer's fsync of a passthrough
    handle (after_passthrough_write, then fsync) returns once what the kernel wrote is on the
    backing store, the handle still open."""
    disks = Disks(tmp_path)
    data = os.urandom(50 * KiB)
    async with instance(disks) as wb:
        wb.fsync_backing = True
        df, lease = await _open_leased(wb, b"ckpt")
        os.pwrite(lease.fd, data, 0)
        await wb.after_passthrough_write(df)
        await wb.fsync(df)
        assert backing_bytes(disks, "ckpt") == data
        os.pwrite(lease.fd, b"more", len(data))
        await wb.after_passthrough_write(df)
        await wb.fsync(df)
        assert backing_bytes(disks, "ckpt") == data + b"more"
        await _close_leased(wb, df, lease)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["read", "lease", "release", "evict", "drop"]),
                              st.integers(0, 5)), min_size=1, max_size=50),
       policy=st.sampled_from(["nothrash", "lru"]), ram=st.integers(0, 5), ssd=st.integers(0, 5))
def test_leased_tier_files_hold_their_bytes_whatever_the_cache_does(  # type: ignore[no-untyped-def]
        tmp_path_factory, ops, policy, ram, ssd) -> None:
    """Property: under any mix of reads (placement, eviction, demotion, promotion), leases,
    releases, ``tierfs evict`` and backing changes, every held lease reads exactly the file's
    bytes through its descriptor (what the kernel would read), and the cache's invariants
    (capacity, accounting, pins) hold after every step."""
    tmp = tmp_path_factory.mktemp("lease")

    async def main() -> None:
        cache, sched, _ = make_cache(tmp, ram=ram * CS, ssd=ssd * CS, policy=policy)
        files = [bfile(i, (i % 3 + 1) * CS - 100 * i) for i in range(6)]
        held: list[tuple[object, object]] = []
        async with trio.open_nursery() as n:
            cache.attach(n)
            await n.start(sched.run)
            for op, fi in ops:
                f = files[fi]
                if op == "read":
                    assert await read_whole(cache, f) == whole_file(f)
                elif op == "lease":  # the open that follows a read, as a reader does
                    assert await read_whole(cache, f) == whole_file(f)
                    await settle(cache)
                    lease = await cache.lease_resident(f)
                    if lease is not None:
                        held.append((f, lease))
                elif op == "release" and held:
                    held.pop(fi % len(held))[1].release()  # type: ignore[attr-defined]
                elif op == "evict":
                    await cache.evict_chunks([(f.key, i) for i in range(3)])
                elif op == "drop":
                    await cache.drop_file(f.key)
                await settle(cache)
                assert cache.check() == []
                for t in cache.tiers:
                    assert t.used <= t.capacity
                for hf, lease in held:
                    assert os.pread(lease.fd, hf.size + 1, 0) == whole_file(hf)  # type: ignore[attr-defined]
            for _, lease in held:
                lease.release()  # type: ignore[attr-defined]
            await settle(cache)
            assert cache.check() == [] and all(t.leased_files == 0 for t in cache.tiers)
            n.cancel_scope.cancel()
        cache.close()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_same_size_write_within_one_timestamp_tick_is_written_back(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Coarse timestamps (kernels before 6.13, filesystems without multigrain ctime): a
    passthrough write that keeps the size and lands in the same tick as the daemon's last look
    leaves size, mtime and ctime as they were. The release must still make a new generation:
    the file was written back once while open (a flush), and calling that copy current lost
    the last write."""
    from tierfs.writeback import manager as wbm

    monkeypatch.setattr(wbm, "_fingerprint", lambda st: (st.st_size, 0, 0))  # one tick for everything
    disks = Disks(tmp_path)
    async with instance(disks) as wb:
        df, lease = await _open_leased(wb, b"state")
        os.pwrite(lease.fd, b"v1" * 1000, 0)
        await wb.after_passthrough_write(df)
        await wb.wait_durable(None, timeout=30)  # tierfs flush while open
        assert backing_bytes(disks, "state") == b"v1" * 1000
        os.pwrite(lease.fd, b"v2" * 1000, 0)  # same size, same "times"
        await _close_leased(wb, df, lease)
        await wb.wait_durable(None, timeout=30)
        assert backing_bytes(disks, "state") == b"v2" * 1000
