"""The GETATTR right after an open is answered by the fstat that open took of the backing file
(Namespace.lstat), in-process: only when no request that may change a file ran, or was in
flight, while the open's fstat was taken. (Through a real mount: tests/test_native_mount.py,
``-k fstat``.) And, with the same in-process handlers, which file a copy-up copies."""

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
