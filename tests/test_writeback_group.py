"""Small files of one directory are written back in groups (:mod:`tierfs.writeback.group`):
two transactions (create and copy, then rename, with the files' commit locks), one directory
fsync, the same outcome per file as alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from tests.test_writeback_inprocess import (
    Disks,
    backing_bytes,
    close_together,
    count_transactions,
    counting_journal,
    instance,
    open_write,
    tmp_names,
)
from tierfs.writeback import backing_ops, group

KiB = 1024


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> list[list[backing_ops.GroupItem]]:
    """Every group's items, as the worker wrote them back."""
    seen: list[list[backing_ops.GroupItem]] = []
    real = backing_ops._group_create

    def spy(tree, parent, items, limit):  # type: ignore[no-untyped-def]
        seen.append(items)
        return real(tree, parent, items, limit)

    monkeypatch.setattr(group, "_group_create", spy)
    return seen


def _files(d: str, n: int, size: int = 3 * KiB) -> dict[bytes, bytes]:
    return {f"{d}/f{i:02d}".encode(): bytes([i % 251]) * (size + i) for i in range(n)}


async def test_small_files_closed_together_are_written_back_in_groups(
        tmp_path: Path, groups: list[list[backing_ops.GroupItem]]) -> None:
    """40 files in one directory and 5 in another, closed together: written back in groups of
    at most GROUP_FILES files of one directory, each file whole under its final name; the
    directory keeps the times it had (as tar -x restored them), no temporary file is left, the
    journal is empty."""
    disks = Disks(tmp_path / "d")
    (disks.back / "a").mkdir()
    (disks.back / "b").mkdir()
    files = {**_files("a", 40), **_files("b", 5)}
    async with instance(disks, deadline_s=3600, slice_size=1 << 20) as wb:
        os.utime(disks.back / "a", ns=(10**18, 10**18))
        await close_together(wb, files)
        os.utime(disks.back / "a", ns=(1_000_000_000, 2_000_000_000))  # as tar -x sets it last
        await wb.wait_durable(None, timeout=30)
        assert wb.journal.rows() == []
        assert wb.written_files == 45
    for path, data in files.items():
        assert backing_bytes(disks, path.decode()) == data
    assert tmp_names(disks) == [] and not [n for d in ("a", "b") for n in os.listdir(disks.back / d)
                                           if n.startswith(".tierfs-wb.")]
    assert os.stat(disks.back / "a").st_mtime_ns == 2_000_000_000
    sizes = [len(g) for g in groups]
    assert max(sizes) == group.GROUP_FILES and sum(sizes) >= 40
    for g in groups:
        assert len({os.path.dirname(it.final) for it in g}) == 1


async def test_a_group_takes_at_most_one_slice_and_skips_what_cannot_join(
        tmp_path: Path, groups: list[list[backing_ops.GroupItem]]) -> None:
    """Files larger than a slice, or together past one slice, are not grouped beyond it."""
    disks = Disks(tmp_path / "d")
    async with instance(disks, deadline_s=3600, slice_size=16 * KiB) as wb:
        files = {b"x%d" % i: b"x" * (6 * KiB) for i in range(6)}
        files[b"big"] = b"B" * (40 * KiB)  # several slices: alone
        await close_together(wb, files)
        await wb.wait_durable(None, timeout=30)
    for path, data in files.items():
        assert backing_bytes(disks, path.decode()) == data
    assert groups and all(sum(max(it.size, 1) for it in g) <= 16 * KiB for g in groups)
    assert all(it.final != b"big" for g in groups for it in g)


async def test_a_file_changed_during_its_group_stays_dirty_and_is_written_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, groups: list[list[backing_ops.GroupItem]]) -> None:
    """One file of a group is found changed when its rename comes (its copy is of an older
    generation): it is not renamed, its temporary file is removed, and it is written back
    again; the others are committed."""
    real = group._current
    stale = {b"f03"}

    def current(df, gen, path, seen):  # type: ignore[no-untyped-def]
        if path in stale:
            stale.discard(path)  # changed once, as if a write had landed
            return False
        return real(df, gen, path, seen)

    monkeypatch.setattr(group, "_current", current)
    disks = Disks(tmp_path / "d")
    files = {b"f%02d" % i: b"%d" % i * 100 for i in range(8)}
    async with instance(disks, deadline_s=3600) as wb:
        await close_together(wb, files)
        await wb.wait_durable(None, timeout=30)
        assert wb.journal.rows() == [] and wb.failures == 0
    for path, data in files.items():
        assert backing_bytes(disks, path.decode()) == data
    assert tmp_names(disks) == []
    first = next(it for g in groups for it in g if it.final == b"f03")
    assert first.outcome is None and not first.tmp_left  # not renamed; its temporary file removed


async def test_a_planted_temporary_name_in_a_group_is_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, groups: list[list[backing_ops.GroupItem]]) -> None:
    """A name someone planted where a group member's temporary file goes (EEXIST) is never
    opened: that member gets another name, the planted file stays as it was."""
    disks = Disks(tmp_path / "d")
    files = {b"f%02d" % i: b"%d" % i * 100 for i in range(6)}
    async with instance(disks, deadline_s=3600) as wb:
        real = wb.new_tmp_name
        planted = []

        def name(df, path=None):  # type: ignore[no-untyped-def]
            n = real(df, path)
            if df.path == b"f02" and not planted:
                (disks.back / n.decode()).write_bytes(b"planted")
                planted.append(n)
            return n

        monkeypatch.setattr(wb, "new_tmp_name", name)
        await close_together(wb, files)
        with trio.fail_after(30):
            await wb.wait_durable(None, timeout=30)
    for path, data in files.items():
        assert backing_bytes(disks, path.decode()) == data
    assert (disks.back / planted[0].decode()).read_bytes() == b"planted"
    assert len(groups[0]) > 1


async def test_writes_the_kernel_made_behind_the_daemon_are_in_the_group_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, groups: list[list[backing_ops.GroupItem]]) -> None:
    """Files written through passthrough (the kernel writes their data files; the daemon sees
    no write): a write that landed before the group is taken in first; one that lands during
    the group's copy makes that file's copy stale - not renamed, and written back again with
    it. Nothing older than what was written is ever marked clean."""
    from tierfs.writeback import manager as wbm

    files = {b"f%02d" % i: b"%d" % i * 100 for i in range(6)}
    real_copy = backing_ops._copy_small
    behind: dict[int, bytes] = {}  # data file fd -> bytes the kernel appends during the copy

    def copy(tmp_fd, src_fd, size, limit):  # type: ignore[no-untyped-def]
        n = real_copy(tmp_fd, src_fd, size, limit)
        extra = behind.pop(src_fd, None)
        if extra is not None:
            os.pwrite(src_fd, extra, os.fstat(src_fd).st_size)  # lands just after the copy
        return n

    monkeypatch.setattr(backing_ops, "_copy_small", copy)
    disks = Disks(tmp_path / "d")
    async with instance(disks, deadline_s=3600) as wb:
        dfs = await open_write(wb, files)
        for df in dfs[1:3]:  # as WriteBack.lease_data records a writable lease
            df.pt_written = True
            df.pt_seen = wbm._fingerprint(os.fstat(df.fd))
        os.pwrite(dfs[1].fd, b"+before", len(files[b"f01"]))  # behind the daemon, before
        behind[dfs[2].fd] = b"+during"
        for df in dfs:
            await wb.closed(df, True)
        await wb.wait_durable(None, timeout=30)
        for _ in range(3):  # (the stale copy of f02 is written again at once)
            await wb.wait_durable(None, timeout=30)
        assert wb.journal.rows() == []
    want = dict(files)
    want[b"f01"] += b"+before"
    want[b"f02"] += b"+during"
    for path, data in want.items():
        assert backing_bytes(disks, path.decode()) == data, path
    stale = next(it for g in groups for it in g if it.final == b"f02")
    assert stale.outcome is None  # the first copy of f02 was not renamed
    assert tmp_names(disks) == []


async def test_a_group_member_unlinked_or_renamed_during_its_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a group's files are copied (no lock held), one is unlinked and one renamed: the
    unlinked one never appears on the backing store and its journal row goes once its
    temporary file is removed; the renamed one is written back under its new name; the rest
    are committed; no temporary file is left."""
    disks = Disks(tmp_path / "d")
    files = {b"f%02d" % i: b"%d" % i * 100 for i in range(6)}
    real = backing_ops._group_create
    async with instance(disks, deadline_s=3600) as wb:
        async def meanwhile() -> None:
            assert await wb.unlink(wb.get(b"f02"))  # type: ignore[arg-type]
            assert await wb.rename(wb.get(b"f03"), b"g03")  # type: ignore[arg-type]

        def create(tree, parent, items, limit):  # type: ignore[no-untyped-def]
            r = real(tree, parent, items, limit)
            if any(it.final == b"f02" for it in items):
                trio.from_thread.run(meanwhile)
            return r

        monkeypatch.setattr(group, "_group_create", create)
        await close_together(wb, files)
        await wb.wait_durable(None, timeout=30)
        assert wb.journal.rows() == []
    want = {k.decode(): v for k, v in files.items() if k not in (b"f02", b"f03")}
    want["g03"] = files[b"f03"]
    assert {n: (disks.back / n).read_bytes() for n in os.listdir(disks.back)} == want


async def test_what_a_group_costs(tmp_path: Path) -> None:
    """16 small files closed together: two backing-store transactions (create and copy all,
    then rename all and fsync the directory once) and one journal commit for all their
    temporary names, where one at a time took 3 transactions and 2 such commits per file
    (tests/test_smallwrites.py)."""
    writes: list[str] = []
    disks = Disks(tmp_path / "d")
    files = {b"f%02d" % i: b"%d" % i * 100 for i in range(group.GROUP_FILES)}
    async with instance(disks, deadline_s=3600, slice_size=1 << 20,
                        journal_cls=counting_journal(writes)) as wb:
        calls = count_transactions(wb)
        await close_together(wb, files)
        del writes[:]
        await wb.wait_durable(None, timeout=30)
    for path, data in files.items():
        assert backing_bytes(disks, path.decode()) == data
    assert calls[0] == 2
    assert writes.count("set_tmps") == 1 and "set_tmp" not in writes
    assert writes.count("remove") == group.GROUP_FILES


def test_a_write_back_copy_reads_without_renewing_the_atime_and_falls_back_when_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy of a data file (:func:`backing_ops._copy_data`) reads it through a descriptor
    of its own opened ``O_NOATIME``: an atime older than the ctime (relatime renews those), as
    a ``utime`` leaves it, stays. Where that open is refused, the copy reads through the data
    file's own descriptor and is whole all the same."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(os.urandom(70_000))
    os.utime(src, ns=(1_000_000_000_000_000_000, 1_100_000_000_000_000_000))
    control = tmp_path / "control"
    control.write_bytes(b"c")
    os.utime(control, ns=(1_000_000_000_000_000_000, 1_100_000_000_000_000_000))
    control.read_bytes()
    if os.stat(control).st_atime_ns == 1_000_000_000_000_000_000:
        pytest.skip("this filesystem renews no atime on a read (noatime): nothing to tell apart")
    sfd = os.open(src, os.O_RDWR)
    dfd = os.open(dst, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        reader = backing_ops.unrenewing_reader(sfd)
        assert reader != sfd and os.fstat(reader).st_ino == os.fstat(sfd).st_ino
        os.close(reader)
        os.ftruncate(dfd, 70_000)
        assert backing_ops._copy_data(sfd, dfd, 0, 70_000, 1 << 20, False) == (70_000, 70_000)
        assert os.fstat(sfd).st_atime_ns == 1_000_000_000_000_000_000
        assert dst.read_bytes() == src.read_bytes()  # (this read renews it)

        def refused(*a: object, **k: object) -> int:
            raise PermissionError(1, "O_NOATIME refused")

        monkeypatch.setattr(backing_ops.os, "open", refused)
        assert backing_ops.unrenewing_reader(sfd) == sfd
        os.ftruncate(dfd, 0)
        os.ftruncate(dfd, 70_000)
        assert backing_ops._copy_data(sfd, dfd, 0, 70_000, 1 << 20, False) == (70_000, 70_000)
        monkeypatch.undo()
        assert dst.read_bytes() == src.read_bytes()
    finally:
        os.close(sfd)
        os.close(dfd)
