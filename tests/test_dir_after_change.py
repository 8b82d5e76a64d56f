"""The GETATTR of a directory right after a name was created or removed in it through tierfs is
answered by the ``fstat`` that change took of it (a create, mkdir, mknod, symlink or unlink) (Namespace.saw_dir), in-process: only the
next one, only within ``LOOKED_UP_S``, and only when no other change of names, nor a change of
the directory's own attributes, came between. And an unlink keeps a clean file's content only
for an inode a handle has open (Namespace.preserve). (Through a real mount:
tests/test_mount_basic.py, ``-k directory_after``.)"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import trio

from tests.test_getattr_after_open import _handlers
from tests.test_writeback_inprocess import Disks, instance
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

        # looked up, not open: nothing is opened to keep it; a late open gets ESTALE (the
        # kernel then looks the name up again and answers ENOENT)
        await ops.unlink(ROOT, b"looked")
        assert wb.tree.opens == opens
        with pytest.raises(FuseError) as e:
            await ops.open(looked.st_ino, os.O_RDONLY, CTX)
        assert e.value.errno == errno.ESTALE

        # open: kept, and a second open of the inode (/proc/PID/fd/N) reads the old content
        await ops.unlink(ROOT, b"held")
        assert not (disks.back / "held").exists()
        fi2 = await ops.open(held.st_ino, os.O_RDONLY, CTX)
        h = ops.handles.get(fi2.fh)
        assert os.pread(h.file.fd, 100, 0) == b"held open"  # (what its READs read: no cache here)
        assert (await ops.getattr(held.st_ino)).st_nlink == 0
        await ops.release(fi2.fh)
        await ops.release(fi.fh)
