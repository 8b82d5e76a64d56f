"""An unlinked file that is still open answers ``getattr`` (``fstat``) from what its handle
reads, also when it was opened while dirty and its write-back finished before the unlink
(pjdfstest unlink/14.t: ENOENT 6-7 times in 100)."""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import needs_fuse, tierfs_cmd
from tests.test_writeback_inprocess import Disks, instance, write_file
from tierfs.fs.handlers import Handlers
from tierfs.fs.handles import FileHandle
from tierfs.fs.inodes import ROOT, InodeTable
from tierfs.io import Device


async def test_getattr_after_unlink_when_write_back_finished_first(tmp_path: Path) -> None:
    """Driven in-process, in the order that failed: the file is opened read-only while dirty
    (the handle reads its data file), and its write-back completes after the unlink began but
    before the unlink decided (it then finds the file clean and removes the backing file)."""
    disks = Disks(tmp_path / "d")
    async with instance(disks, deadline_s=3600) as wb:
        await write_file(wb, b"f", b"hello")  # created, written, closed: dirty
        df = wb.get(b"f")
        assert df is not None
        inodes = InodeTable(wb.tree)
        ops = Handlers(tree=wb.tree, inodes=inodes, cache=SimpleNamespace(), writeback=wb,  # type: ignore[arg-type]
                         readahead=SimpleNamespace(), control=SimpleNamespace(by_inode={}),  # type: ignore[arg-type]
                         meta=Device("meta", 2),
                         attr_timeout=1.0)
        entry = inodes.remember_dirty(b"f", df)  # looked up ...
        ops.handles.add(FileHandle(inode=entry.inode, dirty=df))  # ... and opened read-only
        wb.opened(df, False)
        real_unlink = wb.unlink

        async def unlink_after_write_back(d):  # type: ignore[no-untyped-def]
            await wb.wait_durable([d], timeout=30)  # the write-back finishes first
            assert d.state.value == "clean" and wb.statistics().dirty_files == 0
            return await real_unlink(d)

        wb.unlink = unlink_after_write_back  # type: ignore[method-assign]
        await ops.unlink(ROOT, b"f", None)
        assert not (disks.back / "f").exists()
        attrs = await ops.getattr(entry.inode)  # used to raise ENOENT
        assert attrs.st_size == 5
        assert attrs.st_nlink == 0
        await wb.closed(df, False)


@needs_fuse
@pytest.mark.fuse
def test_fstat_after_unlink_of_file_opened_dirty_then_written_back(tiermount, tmp_path: Path) -> None:
    """The same through a mount, with the write-back done before the unlink is asked."""
    m = tiermount(ram="16MiB", extra=("-o", "writeback_deadline=3600"))
    f = m.mnt / "f"
    f.write_bytes(b"hello")  # created, written, closed: dirty (written back only when asked)
    fd = os.open(f, os.O_RDONLY)  # opened while dirty: the handle reads the data file
    try:
        assert m.stats()["writeback"]["dirty_files"] == 1
        tierfs_cmd("flush", str(m.mnt))
        assert m.stats()["writeback"]["dirty_files"] == 0
        assert (tmp_path / "back" / "f").read_bytes() == b"hello"
        os.unlink(f)
        st = os.fstat(fd)
        assert st.st_size == 5
        assert st.st_nlink == 0
        assert os.pread(fd, 10, 0) == b"hello"
    finally:
        os.close(fd)
    assert not (tmp_path / "back" / "f").exists()


@needs_fuse
@pytest.mark.fuse
def test_a_handle_of_a_renamed_over_file_reads_what_it_opened(tiermount, tmp_path: Path) -> None:
    """A handle whose inode was renamed over reads the backing file it holds open, also when
    another open of that inode had meanwhile found a different backing file under the name
    (that read got ESTALE: the handle looked for the name's current backing file, and a
    detached inode has none). The second open goes by ``/proc/self/fd`` (no lookup), after the
    backing file was replaced behind tierfs' back, so it reaches the old inode; through the
    daemon (no passthrough), which serves the reads."""
    m = tiermount(ram="16MiB", extra=("-o", "passthrough=off"))
    back = tmp_path / "back"
    (back / "ckpt").write_bytes(b"A" * 5000)
    fd1 = os.open(m.mnt / "ckpt", os.O_RDONLY)
    try:
        (back / "ckpt.new").write_bytes(b"B" * 7000)
        os.replace(back / "ckpt.new", back / "ckpt")  # behind tierfs' back: a new backing inode
        reopen = f"/proc/self/fd/{fd1}"
        # the same inode (its first open after the change answers ESTALE, and the kernel,
        # which cannot look a /proc/self/fd link up again, retries it), opening the new file
        fd2 = os.open(reopen, os.O_RDONLY)
        os.close(fd2)
        (m.mnt / "next").write_bytes(b"C" * 100)
        os.replace(m.mnt / "next", m.mnt / "ckpt")  # the inode is renamed over: detached
        assert os.pread(fd1, 10_000, 0) == b"A" * 5000  # used to raise ESTALE
    finally:
        os.close(fd1)
    assert (m.mnt / "ckpt").read_bytes() == b"C" * 100


async def test_create_is_not_written_back_before_it_answers(tmp_path: Path) -> None:
    """A file being created is opened for writing before the create's last await: the
    write-back, running meanwhile (here: everything else runs while the directory's times are
    set), must not take it, write it back empty and close its data file (the create then
    answered EBADF: 3 of 10,000 files of a tar -x into the mount)."""
    disks = Disks(tmp_path / "d")
    async with instance(disks, deadline_s=0.0) as wb:
        class Meta(Device):
            async def run(self, fn, *args):  # type: ignore[no-untyped-def,override]
                if fn == wb.tree.touch:
                    # the write-back gets its turn, and a whole write-back of the new file
                    # happens here (a flush asked meanwhile makes it due)
                    await wb.wait_durable([wb.get(b"new")], timeout=30)  # type: ignore[list-item]
                return fn(*args)

        ops = Handlers(tree=wb.tree, inodes=InodeTable(wb.tree), cache=SimpleNamespace(), writeback=wb,  # type: ignore[arg-type]
                       readahead=SimpleNamespace(), control=SimpleNamespace(by_inode={}),  # type: ignore[arg-type]
                       meta=Meta("meta", 2), attr_timeout=1.0)
        ctx = SimpleNamespace(uid=os.getuid(), gid=os.getgid(), pid=1, umask=0)
        reply, attrs = await ops.create(ROOT, b"new", 0o644, os.O_WRONLY | os.O_CREAT, ctx)
        assert attrs.st_size == 0
        assert await ops.write(reply.fh, 0, b"data") == 4
        await ops.release(reply.fh)
        await wb.wait_durable([wb.get(b"new")], timeout=30)  # type: ignore[list-item]
    assert (disks.back / "new").read_bytes() == b"data"


async def test_last_descriptors_of_unlinked_files_are_closed_off_the_loop_in_batches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last close of an unlinked file frees its blocks (tens of ms for a large one), so it
    runs in a thread; the closes queued meanwhile go in one thread hop (one hop per file was 11%
    of the loop's busy time in ``rm -rf``); an unlinked empty file, or a linked one, has nothing
    to free and is closed at once."""
    import trio
    import trio.testing

    import tierfs.fs.namespace as namespace_mod

    disks = Disks(tmp_path / "d")
    batches: list[list[int]] = []
    real_close_all = namespace_mod._close_all

    def recording_close_all(fds: list[int]) -> None:
        batches.append(list(fds))
        real_close_all(fds)

    monkeypatch.setattr(namespace_mod, "_close_all", recording_close_all)

    def opened(name: str, data: bytes, unlink: bool) -> int:
        p = tmp_path / name
        p.write_bytes(data)
        fd = os.open(p, os.O_RDONLY)
        if unlink:
            p.unlink()
        return fd

    def is_open(fd: int) -> bool:
        try:
            os.fstat(fd)
        except OSError:
            return False
        return True

    async with instance(disks, deadline_s=3600) as wb:
        ops = Handlers(tree=wb.tree, inodes=InodeTable(wb.tree), cache=SimpleNamespace(),  # type: ignore[arg-type]
                       writeback=wb, readahead=SimpleNamespace(),  # type: ignore[arg-type]
                       control=SimpleNamespace(by_inode={}), meta=Device("meta", 2),  # type: ignore[arg-type]
                       attr_timeout=1.0)
        async with trio.open_nursery() as n:
            ops.ns.nursery = n
            empty = opened("empty", b"", unlink=True)
            linked = opened("linked", b"x" * 65536, unlink=False)
            ops.ns._close_backing(empty)
            ops.ns._close_backing(linked)
            assert not is_open(empty) and not is_open(linked), "closed at once"
            full = [opened(f"full{i}", b"y" * 65536, unlink=True) for i in range(5)]
            for fd in full:
                ops.ns._close_backing(fd)
            assert all(is_open(fd) for fd in full), "closed on the event loop"
            while ops.ns._closing:  # noqa: ASYNC110 - a flag of the code under test
                await trio.sleep(0.01)
        assert not any(is_open(fd) for fd in full)
        assert batches == [full], batches


@needs_fuse
@pytest.mark.fuse
def test_a_descriptor_of_an_unlinked_file_writes_as_on_a_local_filesystem(tiermount, tmp_path: Path) -> None:
    """A clean file opened for writing and unlinked before its first write: the write, a
    truncate and every descriptor of the file work as on a local filesystem (the first write
    used to fail ENOENT: the copy-up needed the name). The copy is anonymous: nothing is
    written back, nothing of it stays after the last close or after kill -9."""
    back = tmp_path / "back"
    (back / "f").write_bytes(b"hello-world\n")
    (back / "g").write_bytes(b"hello-again\n")
    m = tiermount(ram="16MiB")
    fd = os.open(m.mnt / "f", os.O_RDWR)
    ro = os.open(m.mnt / "f", os.O_RDONLY)
    try:
        os.unlink(m.mnt / "f")
        assert os.pwrite(fd, b"XY", 0) == 2
        assert os.pread(fd, 100, 0) == b"XYllo-world\n"
        assert os.pread(ro, 100, 0) == b"XYllo-world\n"
        with open(f"/proc/self/fd/{fd}", "rb") as again:  # a reopen of the unlinked file
            assert again.read() == b"XYllo-world\n"
        os.ftruncate(fd, 4)
        os.fchmod(fd, 0o600)
        os.utime(fd, ns=(1_000_000_000, 2_000_000_000))
        st = os.fstat(fd)
        assert (st.st_size, st.st_nlink, st.st_mode & 0o777, st.st_mtime_ns) == (4, 0, 0o600, 2_000_000_000)
        assert os.pread(ro, 100, 0) == b"XYll"
        assert m.stats()["writeback"]["dirty_files"] == 0  # nothing to write back
        os.close(fd)
        fd = -1
        # the writer is gone: the reader still reads the change, from the disk's copy too
        os.posix_fadvise(ro, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(ro, 100, 0) == b"XYll"
        with open(f"/proc/self/fd/{ro}", "rb") as again:
            assert again.read() == b"XYll"
    finally:
        if fd >= 0:
            os.close(fd)
        os.close(ro)
    assert sorted(os.listdir(back)) == ["g"] and sorted(os.listdir(m.mnt)) == ["g"]

    # an attribute change alone makes the copy too; then killed while the copy is open:
    # recovery finds a row that names no file
    fd = os.open(m.mnt / "g", os.O_RDWR)
    os.unlink(m.mnt / "g")
    os.fchmod(fd, 0o640)
    assert os.fstat(fd).st_mode & 0o777 == 0o640 and os.pread(fd, 100, 0) == b"hello-again\n"
    assert os.pwrite(fd, b"ZZ", 0) == 2
    m.kill9()
    with contextlib.suppress(OSError):  # (ENOTCONN: the mount is dead)
        os.close(fd)
    m.start()
    assert os.listdir(back) == [] and os.listdir(m.mnt) == []
    assert m.stats()["writeback"]["dirty_files"] == 0
    time.sleep(0.2)
    assert os.listdir(back) == []


@needs_fuse
@pytest.mark.fuse
def test_a_descriptor_of_an_unlinked_file_with_other_names_does_not_write_a_copy(tiermount, tmp_path: Path) -> None:
    """A file with other names: a copy would split it from them (a write through the
    descriptor would not show under the other name), so the write is refused as before."""
    back = tmp_path / "back"
    (back / "f").write_bytes(b"hello-world\n")
    os.link(back / "f", back / "h")
    m = tiermount(ram="16MiB")
    fd = os.open(m.mnt / "f", os.O_RDWR)
    try:
        os.unlink(m.mnt / "f")
        with pytest.raises(OSError):
            os.pwrite(fd, b"XY", 0)
    finally:
        os.close(fd)
    assert (m.mnt / "h").read_bytes() == b"hello-world\n"


@needs_fuse
@pytest.mark.fuse
def test_a_descriptor_of_a_hard_linked_file_renamed_over_does_not_write_a_copy(tiermount, tmp_path: Path) -> None:
    """Renamed over (not unlinked), the file keeps its other name on the backing store: a copy
    would take the write away from it, so the write is refused."""
    back = tmp_path / "back"
    (back / "a").write_bytes(b"AAAA-original\n")
    os.link(back / "a", back / "a2")
    (back / "b").write_bytes(b"B\n")
    m = tiermount(ram="16MiB")
    fd = os.open(m.mnt / "a", os.O_RDWR)
    try:
        os.rename(m.mnt / "b", m.mnt / "a")
        with pytest.raises(OSError):
            os.pwrite(fd, b"ZZZZ", 0)
    finally:
        os.close(fd)
    assert (m.mnt / "a2").read_bytes() == (back / "a2").read_bytes() == b"AAAA-original\n"
    assert (m.mnt / "a").read_bytes() == b"B\n"


@needs_fuse
@pytest.mark.fuse
def test_a_copy_of_an_unlinked_file_the_write_tier_cannot_hold_leaves_nothing(tiermount, tmp_path: Path) -> None:
    """An anonymous copy cannot go to the backing store instead (it has no name there): a
    write tier too small for it answers ENOSPC, and every retry leaves nothing behind (no
    data file, no journal row, no dirty bytes), as before the first write."""
    back = tmp_path / "back"
    content = os.urandom(1 << 20) * 40  # 40 MiB, in a 16 MiB write tier
    (back / "big").write_bytes(content)
    m = tiermount(ram="16MiB")
    fd = os.open(m.mnt / "big", os.O_RDWR)
    try:
        os.unlink(m.mnt / "big")
        for _ in range(3):
            with pytest.raises(OSError) as ei:
                os.pwrite(fd, b"X", 0)
            assert ei.value.errno == errno.ENOSPC
        assert os.pread(fd, 4096, 0) == content[:4096]  # unchanged, still readable
        tier = m.tier("ram")
        assert tier["dirty_bytes"] == 0  # nothing of the cut copies is left
        assert [p.name for p in (Path(tier["path"]) / "dirty").iterdir()] == []
    finally:
        os.close(fd)
    assert m.stats()["writeback"]["dirty_files"] == 0
