"""The handler layer in-process, over a real write-back instance and backing directory.

The GETATTR right after an open is answered by the fstat that open took of the backing file
(Namespace.lstat): only when no request that may change a file ran, or was in flight, while the
open's fstat was taken. (Through a real mount: tests/test_native_mount.py, ``-k fstat``.) Also:
which file a copy-up copies, the handles released when the mount is gone, and an open that a
bug in next-file prediction must not fail."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from tests.test_writeback_inprocess import Disks, instance
from tierfs.fs.handlers import Handlers
from tierfs.fs.inodes import InodeTable
from tierfs.io import Device


def _handlers(wb, inodes: InodeTable) -> Handlers:  # type: ignore[no-untyped-def]
    cache = SimpleNamespace(filling=set(), scheduler=SimpleNamespace(cancel_speculative=lambda key: None))
    return Handlers(tree=wb.tree, inodes=inodes, cache=cache, writeback=wb,  # type: ignore[arg-type]
                    readahead=SimpleNamespace(), control=SimpleNamespace(by_inode={}),  # type: ignore[arg-type]
                    meta=Device("meta", 2), attr_timeout=60.0)


async def test_an_open_keeps_its_fstat_for_the_next_getattr_unless_a_change_raced_it(tmp_path: Path) -> None:
    disks = Disks(tmp_path / "d")
    (disks.back / "f").write_bytes(b"12345")
    async with instance(disks, deadline_s=3600) as wb:
        inodes = InodeTable(wb.tree)
        ops = _handlers(wb, inodes)
        ns = ops.ns
        entry = inodes.remember(b"f", os.lstat(disks.back / "f"))

        # no change around it: the open's fstat answers, once
        bf = await ns.backing_file(b"f", reader=True)
        ns.release_backing(bf)
        assert (await ops.getattr(entry.inode)).st_size == 5
        assert ns.opened_stats == 1
        await ops.getattr(entry.inode)  # used up: an lstat now
        assert ns.opened_stats == 1

        # a change that starts and ends while the open's fstat is taken (the open waited for a
        # metadata thread meanwhile): nothing kept, the GETATTR sees the change
        real_run = ns.meta.run

        async def raced(fn, *args):  # type: ignore[no-untyped-def]
            out = await real_run(fn, *args)  # the fstat: the old size ...
            ns.begin_change()
            (disks.back / "f").write_bytes(b"1234567")  # ... a change through tierfs
            ns.end_change()
            return out

        ns.meta.run = raced  # type: ignore[method-assign]
        bf = await ns.backing_file(b"f", reader=True)
        ns.meta.run = real_run  # type: ignore[method-assign]
        assert bf.size == 5
        ns.release_backing(bf)
        assert (await ops.getattr(entry.inode)).st_size == 7
        assert ns.opened_stats == 1

        # a change still in flight when the open's fstat returns: nothing kept either
        ns.begin_change()
        bf = await ns.backing_file(b"f", reader=True)
        ns.release_backing(bf)
        assert not ns._opened
        ns.end_change()

        # an open that may write keeps nothing
        bf = await ns.backing_file(b"f", reader=False)
        ns.release_backing(bf)
        assert not ns._opened


async def test_a_copy_up_copies_the_file_it_opened_with_that_files_own_attributes(tmp_path: Path) -> None:
    """A copy-up (the first write to a clean file) lstat-s the name, then opens it. A file
    renamed over the name in between, behind tierfs' back, is copied whole with its own mode
    and size: it was copied to the old file's size, under the old file's mode and owner."""
    disks = Disks(tmp_path / "d")
    (disks.back / "f").write_bytes(b"old")
    os.chmod(disks.back / "f", 0o600)
    (disks.back / "new").write_bytes(b"the new file, longer")
    os.chmod(disks.back / "new", 0o640)
    async with instance(disks, deadline_s=3600) as wb:
        inodes = InodeTable(wb.tree)
        ops = _handlers(wb, inodes)
        ops.ns.cache = SimpleNamespace(  # type: ignore[assignment]
            filling=set(), scheduler=SimpleNamespace(cancel_speculative=lambda key: None),
            holds_any=lambda f, off, n: False, chunk_size=64 * 1024, forget_access=lambda access: None)
        ns = ops.ns
        entry = inodes.remember(b"f", os.lstat(disks.back / "f"))
        real_run = ns.meta.run

        async def swapped(fn, *args):  # type: ignore[no-untyped-def]
            out = await real_run(fn, *args)
            if fn == wb.tree.lstat:  # the copy-up's lstat: the old file; then the swap
                os.rename(disks.back / "new", disks.back / "f")
            return out

        ns.meta.run = swapped  # type: ignore[method-assign]
        df = await ns.make_dirty(entry, truncate=False)
        ns.meta.run = real_run  # type: ignore[method-assign]
        assert os.pread(df.fd, 100, 0) == b"the new file, longer"
        assert os.fstat(df.fd).st_mode & 0o7777 == 0o640 and df.size == 20


async def test_handles_left_open_when_the_mount_is_gone_are_released(tmp_path: Path) -> None:
    """When the FUSE session ends, the kernel may have dropped RELEASEs still queued (the last
    close of a lazily unmounted mount's files): the daemon then releases every handle it still
    holds, so a writer's file is written back and counted clean, not left "open" for ever."""
    from tierfs.fs.handles import DirHandle, FileHandle

    disks = Disks(tmp_path / "d")
    async with instance(disks, deadline_s=3600) as wb:
        inodes = InodeTable(wb.tree)
        ops = _handlers(wb, inodes)
        ops.readahead = SimpleNamespace(forget=lambda state: None)  # type: ignore[assignment]
        ops.ns.cache = ops.cache = SimpleNamespace(forget_access=lambda access: None)  # type: ignore[assignment]
        df = await wb.create(b"w", 0o100644, os.getuid(), os.getgid())
        wb.opened(df, True)
        await wb.write(df, 0, b"written")
        entry = inodes.remember_dirty(b"w", df)
        h = FileHandle(entry.inode, writer=True)
        h.dirty = df
        ops.handles.add(h)
        ops.handles.add(DirHandle(1))
        assert df.writers == 1
        assert await ops.release_left() == 2
        assert df.writers == 0 and not ops.handles.handles
        await wb.wait_durable(None, timeout=30)
        assert wb.statistics().dirty_files == 0
        assert (disks.back / "w").read_bytes() == b"written"

        # one written back while open (fsync on a RAM tier: fsync=backing), then released at
        # exit: counted clean too (wait_durable does not wait for what is durable already)
        df = await wb.create(b"s", 0o100644, os.getuid(), os.getgid())
        wb.opened(df, True)
        await wb.write(df, 0, b"synced")
        h = FileHandle(inodes.remember_dirty(b"s", df).inode, writer=True)
        h.dirty = df
        ops.handles.add(h)
        await wb.wait_durable([df], timeout=30)
        assert await ops.release_left() == 1
        await wb.wait_durable(None, timeout=30)  # (write_back_before_exit's wait)
        assert wb.statistics().dirty_files == 0
    assert (disks.back / "s").read_bytes() == b"synced"


async def test_a_bug_in_next_file_prediction_never_fails_an_open(tmp_path: Path) -> None:
    """The predictor learns an open in the open's own step when it can (no task): a bug there
    is logged, and the open succeeds, as when only the background task failed."""
    disks = Disks(tmp_path / "d")
    (disks.back / "f").write_bytes(b"x")
    async with instance(disks, deadline_s=3600) as wb:
        inodes = InodeTable(wb.tree)
        ops = _handlers(wb, inodes)

        def predictor_bug(pid: int, rel: bytes) -> None:
            raise RuntimeError("a bug in the predictor")

        ops.on_open_read = predictor_bug
        entry = inodes.remember(b"f", os.lstat(disks.back / "f"))
        r = await ops.open(entry.inode, os.O_RDONLY, SimpleNamespace(uid=0, gid=0, pid=7, umask=0))  # type: ignore[arg-type]
        ops.ns.release_backing(ops.handles.pop(r.fh).file)  # type: ignore[union-attr]
