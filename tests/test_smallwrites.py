"""The small-file write path without a mount: what each created file costs the daemon (calls
and journal commits), and that the shortcuts taken keep every answer and every promise."""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import pytest

from tests.conftest import needs_fuse, tierfs_cmd
from tests.test_writeback_inprocess import (
    Disks,
    backing_bytes,
    copy_up,
    count_transactions,
    counting_journal,
    instance,
    write_file,
)
from tierfs.io import Device
from tierfs.writeback.manager import CAPS_XATTR

# a valid VFS_CAP_REVISION_2 value: cap_net_bind_service permitted, nothing inheritable
CAPS_VALUE = struct.pack("<IIIII", 0x02000000, 1 << 10, 0, 0, 0)


class CountingDevice(Device):
    """A Device that counts the calls it runs."""

    calls = 0

    async def run(self, fn, *args):  # type: ignore[no-untyped-def]
        self.calls += 1
        return await super().run(fn, *args)


async def test_a_new_files_capability_is_answered_without_a_call(tmp_path: Path) -> None:
    """The kernel asks for ``security.capability`` before writes and attribute changes: for a
    data file tierfs made (new, or a copy-up: it copies ``user.*`` xattrs only) the answer
    (none) costs no call; once one is set, or for a file recovered after a crash, it is read
    from the file."""
    disks = Disks(tmp_path / "d")
    (disks.back / "old").write_bytes(b"old")
    async with instance(disks, deadline_s=3600) as wb:
        counting = CountingDevice("attrs", 4)
        wb.attr_device = counting
        df = await wb.create(b"new", 0o100644, os.getuid(), os.getgid())
        wb.opened(df, True)
        up = await copy_up(wb, disks, "old")
        made = counting.calls  # (their data files were made through the device)
        for f in (df, up):
            with pytest.raises(OSError) as e:
                await wb.getxattr(f, CAPS_XATTR)
            assert e.value.errno == errno.ENODATA
        assert counting.calls == made
        await wb.setxattr(df, b"user.k", b"v")  # other attributes: as before
        assert await wb.getxattr(df, b"user.k") == b"v"
        await wb.write(df, 0, b"data")  # (a write drops file capabilities: before setting one)
        if os.getuid() == 0:  # setting file capabilities needs CAP_SETFCAP
            await wb.setxattr(df, CAPS_XATTR, CAPS_VALUE)
            assert await wb.getxattr(df, CAPS_XATTR) == CAPS_VALUE
        # still open at the "crash" here
    async with instance(disks, deadline_s=3600) as wb:
        counting = CountingDevice("attrs", 4)
        wb.attr_device = counting
        kept = wb.get(b"new")
        assert kept is not None
        if os.getuid() == 0:
            assert await wb.getxattr(kept, CAPS_XATTR) == CAPS_VALUE
        else:
            with pytest.raises(OSError):
                await wb.getxattr(kept, CAPS_XATTR)
        assert counting.calls == 1
        await wb.wait_durable(None, timeout=30)
    assert backing_bytes(disks, "new") == b"data"
    assert os.getxattr(disks.back / "new", b"user.k") == b"v"


async def test_journal_commits_per_small_file(tmp_path: Path) -> None:
    """A file created, written, closed and written back costs 3 journal commits: its row (with
    its path, once its data file exists: the row and then its path were two), its temporary
    file's name (before the file exists), and the row's removal once clean (the temporary name
    was forgotten in a commit of its own before the removal)."""
    writes: list[str] = []
    disks = Disks(tmp_path / "d")
    async with instance(disks, journal_cls=counting_journal(writes)) as wb:
        del writes[:]
        for i in range(10):  # one at a time (files due together are written back in groups)
            await write_file(wb, b"f%d" % i, b"small %d" % i)
            await wb.wait_durable(None, timeout=30)
    assert backing_bytes(disks, "f9") == b"small 9"
    assert len(writes) == 3 * 10, writes[:12]


async def test_a_small_files_write_back_is_three_backing_transactions(tmp_path: Path) -> None:
    """A file of one slice or less is written back in 3 backing-store transactions (each a
    thread hand-off): its temporary file made, filled and finished in one call, renamed into
    place; sizing, copying and finishing were three. Content, mode and times arrive."""
    disks = Disks(tmp_path / "d")
    async with instance(disks, slice_size=64 * 1024) as wb:
        calls = count_transactions(wb)
        sizes = [0, 1, 4096, 5000, 64 * 1024]
        for i, n in enumerate(sizes):  # one at a time (not a group: tests/test_writeback_group.py)
            await write_file(wb, b"f%d" % i, os.urandom(n) if n else b"")
            await wb.wait_durable(None, timeout=30)
    assert calls[0] == 3 * len(sizes)
    for i, n in enumerate(sizes):
        data = backing_bytes(disks, f"f{i}")
        assert data is not None and len(data) == n


@needs_fuse
@pytest.mark.fuse
def test_attribute_calls_on_a_ram_write_tier_stay_on_the_loop(tiermount) -> None:  # type: ignore[no-untyped-def]
    """What ``tar -x`` does to each file (create, write, owner, mode, times) costs no thread
    hand-off on a RAM write tier (tmpfs): the attribute calls on data files run inline; the
    files come out right."""
    m = tiermount()
    for i in range(20):
        p = m.mnt / f"f{i}"
        p.write_bytes(b"x" * i)
        os.chown(p, os.getuid(), os.getgid())
        os.chmod(p, 0o640)
        os.utime(p, ns=(10**18, 10**18 + i))
    dev = m.stats()["devices"]["ram-dirty-attrs"]
    assert dev["inline_calls"] >= 20 * 3
    tierfs_cmd("flush", str(m.mnt))
    for i in range(20):
        st = os.stat(m.backing / f"f{i}")
        assert (st.st_mode & 0o7777, st.st_mtime_ns, st.st_size) == (0o640, 10**18 + i, i)
