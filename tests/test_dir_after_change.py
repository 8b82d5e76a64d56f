"""The GETATTR of a directory right after a name was created or removed in it through tierfs is
answered by the ``fstat`` that change took of it (a create, mkdir, mknod, symlink or unlink) (Namespace.saw_dir), in-process: only the
next one, only within ``LOOKED_UP_S``, and only when no other change of names, nor a change of
the directory's own attributes, came between. And an unlink keeps a clean file's content only
for an inode a handle has open (Namespace.preserve). (Through a real mount:
tests/test_mount_basic.py, ``-k directory_after``.)"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from pathlib import Path

import pytest
import trio

from tests.test_getattr_after_open import _handlers
from tests.test_writeback_inprocess import Disks, instance
from tierfs.fs import namespace as nsmod
from tierfs.fs.api import Ctx, FuseError, SetAttr
from tierfs.fs.inodes import ROOT, InodeTable

CTX = Ctx(0, 0, 1, 0o022)


def _same_times(a, st: os.stat_result) -> bool:  # type: ignore[no-untyped-def]
    return (a.st_mtime_ns, a.st_ctime_ns, a.st_nlink, a.st_size) == (
        st.st_mtime_ns, st.st_ctime_ns, st.st_nlink, st.st_size)


async def test_a_directory_changed_through_tierfs_answers_its_next_getattr_from_the_change(tmp_path: Path) -> None:
    disks = Disks(tmp_path / "d")
    (disks.back / "d").mkdir()
    for n in "abc":
        (disks.back / "d" / n).write_bytes(b"x")
    async with instance(disks, deadline_s=3600) as wb:
        inodes = InodeTable(wb.tree)
        ops = _handlers(wb, inodes)
        ns = ops.ns
        d = await ops.lookup(ROOT, b"d")

        # an unlink, then the directory's GETATTR: the unlink's fstat, equal to an lstat now
        await ops.unlink(d.st_ino, b"a")
        a = await ops.getattr(d.st_ino)
        assert ns.dir_stats == 1
        assert _same_times(a, os.lstat(disks.back / "d"))
        await ops.getattr(d.st_ino)  # used up: an lstat
        assert ns.dir_stats == 1

        # a create likewise (the new name is only in the write tier: the directory was touched)
        fi, _ = await ops.create(d.st_ino, b"new", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
        await ops.release(fi.fh)
        a = await ops.getattr(d.st_ino)
        assert ns.dir_stats == 2
        assert _same_times(a, os.lstat(disks.back / "d"))

        # a mkdir (the directory's link count grows) and a symlink likewise
        await ops.mkdir(d.st_ino, b"sub", 0o755, CTX)
        a = await ops.getattr(d.st_ino)
        assert ns.dir_stats == 3
        assert _same_times(a, os.lstat(disks.back / "d")) and a.st_nlink == 3
        await ops.symlink(d.st_ino, b"ln", b"target", CTX)
        a = await ops.getattr(d.st_ino)
        assert ns.dir_stats == 4
        assert _same_times(a, os.lstat(disks.back / "d"))

        # another change of names between them: an lstat
        await ops.unlink(d.st_ino, b"b")
        (disks.back / "other").mkdir()
        o = await ops.lookup(ROOT, b"other")
        await ops.rmdir(ROOT, b"other")
        await ops.getattr(d.st_ino)
        assert ns.dir_stats == 4
        del o

        # a change of the directory's own attributes between them: an lstat, which sees it
        await ops.unlink(d.st_ino, b"c")
        await ops.setattr(d.st_ino, SetAttr(mode=0o700))
        a = await ops.getattr(d.st_ino)
        assert ns.dir_stats == 4
        assert a.st_mode & 0o777 == 0o700

        # too late: an lstat
        fi, _ = await ops.create(d.st_ino, b"late", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
        await ops.release(fi.fh)
        await trio.sleep(0.25)  # past LOOKED_UP_S
        await ops.getattr(d.st_ino)
        assert ns.dir_stats == 4


async def test_a_change_in_flight_keeps_nothing_for_the_directory(tmp_path: Path) -> None:
    disks = Disks(tmp_path / "d")
    (disks.back / "d").mkdir()
    (disks.back / "d" / "a").write_bytes(b"x")
    async with instance(disks, deadline_s=3600) as wb:
        inodes = InodeTable(wb.tree)
        ops = _handlers(wb, inodes)
        ns = ops.ns
        d = await ops.lookup(ROOT, b"d")
        ns.begin_ns_change()  # another create, unlink or rename, still running
        await ops.unlink(d.st_ino, b"a")
        await ops.getattr(d.st_ino)
        assert ns.dir_stats == 0
        ns.end_ns_change()


async def test_an_unlink_keeps_a_clean_file_only_for_a_handle_that_has_it_open(tmp_path: Path) -> None:
    disks = Disks(tmp_path / "d")
    (disks.back / "looked").write_bytes(b"looked up only")
    (disks.back / "held").write_bytes(b"held open")
    async with instance(disks, deadline_s=3600) as wb:
        inodes = InodeTable(wb.tree)
        ops = _handlers(wb, inodes)
        looked = await ops.lookup(ROOT, b"looked")
        held = await ops.lookup(ROOT, b"held")
        fi = await ops.open(held.st_ino, os.O_RDONLY, CTX)
        opens = wb.tree.opens

        # looked up, not open: nothing is opened to keep it; a late open (one that raced the
        # unlink) gets ENOENT, as if the unlink came first
        await ops.unlink(ROOT, b"looked")
        assert wb.tree.opens == opens
        with pytest.raises(FuseError) as e:
            await ops.open(looked.st_ino, os.O_RDONLY, CTX)
        assert e.value.errno == errno.ENOENT

        # open: kept, and a second open of the inode (/proc/PID/fd/N) reads the old content
        await ops.unlink(ROOT, b"held")
        assert not (disks.back / "held").exists()
        fi2 = await ops.open(held.st_ino, os.O_RDONLY, CTX)
        h = ops.handles.get(fi2.fh)
        assert os.pread(h.file.fd, 100, 0) == b"held open"  # (what its READs read: no cache here)
        assert (await ops.getattr(held.st_ino)).st_nlink == 0
        await ops.release(fi2.fh)
        await ops.release(fi.fh)


async def test_a_late_open_of_an_unlinked_hard_link_is_told_to_look_the_name_up_again(tmp_path: Path) -> None:
    """A file with another name: the open that raced the unlink of one gets ESTALE, on which
    the kernel looks the name it opened up again (it may be the other one)."""
    disks = Disks(tmp_path / "d")
    (disks.back / "a").write_bytes(b"linked")
    os.link(disks.back / "a", disks.back / "b")
    async with instance(disks, deadline_s=3600) as wb:
        ops = _handlers(wb, InodeTable(wb.tree))
        a = await ops.lookup(ROOT, b"a")
        await ops.unlink(ROOT, b"a")
        with pytest.raises(FuseError) as e:
            await ops.open(a.st_ino, os.O_RDONLY, CTX)
        assert e.value.errno == errno.ESTALE
        b = await ops.lookup(ROOT, b"b")  # the kernel's second lookup
        fi = await ops.open(b.st_ino, os.O_RDONLY, CTX)
        assert os.pread(ops.handles.get(fi.fh).file.fd, 10, 0) == b"linked"
        await ops.release(fi.fh)


async def test_an_open_in_flight_at_the_unlink_keeps_the_file_for_a_reopen(tmp_path: Path) -> None:
    """An OPEN of a clean file is in flight (its backing file open, its handle not yet made)
    when the name is unlinked, so the unlink sees no handle and keeps nothing: a reopen of
    that open file's inode (``/proc/PID/fd/N``) still reads it, through that handle's file."""
    disks = Disks(tmp_path / "d")
    (disks.back / "f").write_bytes(b"content")
    async with instance(disks, deadline_s=3600) as wb:
        ops = _handlers(wb, InodeTable(wb.tree))
        f = await ops.lookup(ROOT, b"f")
        real_bf = ops.ns.backing_file
        opened, go = trio.Event(), trio.Event()

        async def slow_backing_file(*a, **k):  # type: ignore[no-untyped-def]
            bf = await real_bf(*a, **k)
            if not opened.is_set():
                opened.set()
                await go.wait()  # the UNLINK runs here
            return bf

        ops.ns.backing_file = slow_backing_file  # type: ignore[method-assign]
        fis = []
        async with trio.open_nursery() as n:
            async def first_open() -> None:
                fis.append(await ops.open(f.st_ino, os.O_RDONLY, CTX))
            n.start_soon(first_open)
            await opened.wait()
            await ops.unlink(ROOT, b"f")
            go.set()
        ops.ns.backing_file = real_bf  # type: ignore[method-assign]
        again = await ops.open(f.st_ino, os.O_RDONLY, CTX)
        assert os.pread(ops.handles.get(again.fh).file.fd, 100, 0) == b"content"
        await ops.release(again.fh)
        await ops.release(fis[0].fh)


@contextlib.asynccontextmanager
async def _open_dir_0777(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A running instance whose backing store has directory ``d`` (mode 0777), looked up:
    yields (write-back, handlers, d's attributes)."""
    disks = Disks(tmp_path / "d")
    (disks.back / "d").mkdir()
    os.chmod(disks.back / "d", 0o777)
    async with instance(disks, deadline_s=3600) as wb:
        ops = _handlers(wb, InodeTable(wb.tree))
        yield wb, ops, await ops.lookup(ROOT, b"d")


async def test_a_chmod_of_the_directory_while_a_create_stats_it_is_not_hidden(tmp_path: Path) -> None:
    """The create's fstat of the directory was taken before a whole chmod of it ran (the
    create's metadata call finished late): the GETATTR after both sees the chmod."""
    async with _open_dir_0777(tmp_path) as (wb, ops, d):
        real = wb.tree.touch
        taken, go = threading.Event(), threading.Event()

        def late_touch(rel):  # type: ignore[no-untyped-def]
            st = real(rel)
            taken.set()
            go.wait(5)
            return st

        wb.tree.touch = late_touch  # type: ignore[method-assign]
        ops.ns.meta.run = ops.ns.meta.in_thread  # type: ignore[method-assign]  # (a thread: it can wait)
        async with trio.open_nursery() as n:
            async def create() -> None:
                fi, _ = await ops.create(d.st_ino, b"f", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
                await ops.release(fi.fh)
            n.start_soon(create)
            await trio.to_thread.run_sync(taken.wait)
            await ops.setattr(d.st_ino, SetAttr(mode=0o755))
            go.set()
        assert (await ops.getattr(d.st_ino)).st_mode & 0o7777 == 0o755


async def test_the_reply_to_a_chmod_of_the_directory_is_never_a_create_s_fstat_from_before_it(tmp_path: Path) -> None:
    """A chmod of the directory waits before its own call while a whole create runs in the
    directory: the chmod's reply (cached by the kernel for attr_timeout) is the mode it set."""
    async with _open_dir_0777(tmp_path) as (wb, ops, d):
        real_run = ops.ns.meta.run
        created = trio.Event()

        async def run(fn, *args):  # type: ignore[no-untyped-def]
            if fn is nsmod._setattr_backing:
                await created.wait()
            return await real_run(fn, *args)

        ops.ns.meta.run = run  # type: ignore[method-assign]
        replies = []
        async with trio.open_nursery() as n:
            async def chmod() -> None:
                replies.append(await ops.setattr(d.st_ino, SetAttr(mode=0o755)))
            n.start_soon(chmod)
            await trio.sleep(0.01)
            fi, _ = await ops.create(d.st_ino, b"f", 0o644, os.O_WRONLY | os.O_CREAT, CTX)
            await ops.release(fi.fh)
            created.set()
        assert replies[0].st_mode & 0o7777 == 0o755
