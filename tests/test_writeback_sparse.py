"""Sparse files through the write path: a truncate that extends a file (or a write far past its
end) costs no space in the write tier or on the backing store, is never refused for want of
room it does not need, and is written back sparse - only the data segments are copied."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.conftest import needs_fuse, tierfs_cmd, tmpfs

pytestmark = [needs_fuse, pytest.mark.fuse]
MiB = 1 << 20
HUGE = 999_999_999_999_999  # pjdfstest truncate/12.t, ftruncate/12.t


def test_huge_sparse_truncate_on_small_backing_store(tiermount, tmp_path: Path) -> None:
    """pjdfstest (f)truncate/12.t on a backing store with little room: the extension is a hole,
    so it needs no room anywhere (it used to answer ENOSPC: the size was counted as bytes to
    write back). A tmpfs holds a file that large: the truncate succeeds and is written back
    as a hole, at once."""
    with tmpfs(tmp_path / "back", "16m") as back:
        m = tiermount(ram="8MiB", backing=back)
        try:
            f = m.mnt / "f"
            f.write_bytes(b"head")
            os.truncate(f, HUGE)
            assert os.stat(f).st_size == HUGE
            with open(f, "r+b") as fh:  # ftruncate/12.t: the same through a descriptor
                os.ftruncate(fh.fileno(), HUGE + 1)
            tierfs_cmd("flush", str(m.mnt), timeout=60)  # a dense copy would never finish
            st = os.stat(back / "f")
            assert st.st_size == HUGE + 1
            assert st.st_blocks * 512 < MiB
            with open(back / "f", "rb") as fh:
                assert fh.read(4) == b"head"
            assert m.stats()["writeback"]["failures"] == 0
        finally:
            m.stop()


def test_sparse_file_written_back_sparse(tiermount, tmp_path: Path) -> None:
    """Data segments at both ends of a 1 TiB file (larger than the backing store's free space,
    smaller than ext4's largest file): accepted, written back with its hole, the data intact."""
    m = tiermount(ram="64MiB", ssd="64MiB")
    f = m.mnt / "sparse"
    a, b = os.urandom(MiB + 17), os.urandom(3 * MiB)
    far = (1 << 40) - len(b)
    with open(f, "wb") as fh:
        fh.write(a)
        fh.seek(far)
        fh.write(b)
    assert os.stat(f).st_size == 1 << 40
    tierfs_cmd("flush", str(m.mnt), timeout=60)
    back = tmp_path / "back" / "sparse"
    st = os.stat(back)
    assert st.st_size == 1 << 40
    assert st.st_blocks * 512 < 16 * MiB
    with open(back, "rb") as fh:
        assert fh.read(len(a)) == a
        assert os.pread(fh.fileno(), 4096, len(a) + 12345) == b"\0" * 4096
        assert os.pread(fh.fileno(), len(b), far) == b
    assert m.stats()["writeback"]["failures"] == 0


def test_truncate_past_backing_max_file_size(tiermount, tmp_path: Path) -> None:
    """On an ext4 backing store (largest file 16 TiB) a truncate to ~909 TiB answers EFBIG at
    once, as ext4 itself does, never ENOSPC; and never leaves a file that cannot be written
    back."""
    m = tiermount(ram="8MiB")
    f = m.mnt / "f"
    f.write_bytes(b"x")
    try:
        os.truncate(f, HUGE)
    except OSError as e:
        assert e.errno in (errno.EFBIG, errno.EINVAL), e
    else:  # the backing filesystem holds it after all: then it must be written back
        tierfs_cmd("flush", str(m.mnt), timeout=60)
        assert os.stat(tmp_path / "back" / "f").st_size == HUGE
    assert os.stat(f).st_size in (1, HUGE)
    tierfs_cmd("flush", str(m.mnt), timeout=60)
    assert m.stats()["writeback"]["failures"] == 0
    assert os.stat(tmp_path / "back" / "f").st_size == os.stat(f).st_size


def _sparse_backing_file(path: Path, size: int) -> tuple[bytes, bytes, int]:
    """A file of ``size`` bytes with data at its start and in its middle, holes elsewhere."""
    a, b = os.urandom(64 * 1024 + 5), os.urandom(3 * 4096)
    mid = size // 2
    with open(path, "wb") as fh:
        fh.write(a)
        fh.seek(mid)
        fh.write(b)
        fh.truncate(size)
    assert os.stat(path).st_blocks * 512 < MiB  # (a filesystem with holes: ext4, tmpfs)
    return a, b, mid


def test_a_copy_up_keeps_the_holes(tiermount, tmp_path: Path) -> None:
    """Opening a sparse file of the backing store for writing copies only its data segments
    into the write tier: a 1 GiB file with 80 KiB of data, through a 64 MiB RAM tier, is
    written at once instead of being written through, and goes back with its holes."""
    size = 1 << 30
    a, b, mid = _sparse_backing_file(tmp_path / "back" / "img", size)
    m = tiermount(ram="64MiB")
    with open(m.mnt / "img", "r+b") as fh:
        fh.seek(7 * MiB)
        fh.write(b"hello")
        fh.flush()
        wb = m.stats()["writeback"]
        assert wb["dirty_files"] == 1 and wb["through_files"] == 0, wb
        assert m.tier("ram")["dirty_bytes"] < 2 * MiB
    with open(m.mnt / "img", "rb") as fh:
        assert fh.read(len(a)) == a
        assert os.pread(fh.fileno(), 5, 7 * MiB) == b"hello"
        assert os.pread(fh.fileno(), len(b), mid) == b
        assert os.pread(fh.fileno(), 4096, 300 * MiB) == b"\0" * 4096
    tierfs_cmd("flush", str(m.mnt), timeout=60)
    back = tmp_path / "back" / "img"
    assert os.stat(back).st_size == size and os.stat(back).st_blocks * 512 < 4 * MiB
    with open(back, "rb") as fh:
        assert fh.read(len(a)) == a
        assert os.pread(fh.fileno(), 5, 7 * MiB) == b"hello"
        assert os.pread(fh.fileno(), len(b), mid) == b
    assert m.stats()["writeback"]["failures"] == 0


def test_an_unlinked_sparse_file_larger_than_the_write_tier_can_be_written(tiermount, tmp_path: Path) -> None:
    """A descriptor of a file unlinked after its open writes to an anonymous copy, which must fit
    in the write tier: a sparse file larger than the tier fits when its holes stay holes."""
    size = 256 * MiB
    a, b, mid = _sparse_backing_file(tmp_path / "back" / "f", size)
    m = tiermount(ram="32MiB")
    fd = os.open(m.mnt / "f", os.O_RDWR)
    try:
        os.unlink(m.mnt / "f")
        assert os.pwrite(fd, b"new", 1000) == 3
        assert os.pread(fd, 3, 1000) == b"new"
        assert os.pread(fd, len(b), mid) == b
        assert os.pread(fd, 10, 100 * MiB) == b"\0" * 10
        assert os.fstat(fd).st_size == size
    finally:
        os.close(fd)


def test_a_copy_up_copies_in_the_kernel_what_no_tier_holds(tiermount, tmp_path: Path) -> None:
    """The first write to an existing file copies it into the write tier: from the backing
    file in the kernel where no tier holds its bytes (none of it fills the RAM tier's cache
    on the way), through the cache where one does (the backing store is not read again)."""
    back = tmp_path / "back"
    back.mkdir(exist_ok=True)
    cold, warm = os.urandom(20 * MiB), os.urandom(12 * MiB)
    (back / "cold").write_bytes(cold)
    (back / "warm").write_bytes(warm)
    m = tiermount(ram="256MiB")
    tierfs_cmd("warmup", str(m.mnt / "warm"), timeout=60)
    cached_before = m.tier("ram")["used_bytes"] - m.tier("ram")["dirty_bytes"]
    assert cached_before >= len(warm)
    for name in ("cold", "warm"):
        with open(m.mnt / name, "r+b") as fh:
            fh.seek(5 * MiB)
            fh.write(b"hello")
    wb = m.stats()["writeback"]
    assert wb["copied_up_in_kernel"] == len(cold), wb
    assert m.tier("ram")["used_bytes"] - m.tier("ram")["dirty_bytes"] <= cached_before
    tierfs_cmd("flush", str(m.mnt), timeout=60)
    for name, data in (("cold", cold), ("warm", warm)):
        want = data[: 5 * MiB] + b"hello" + data[5 * MiB + 5 :]
        assert (m.mnt / name).read_bytes() == want
        assert (back / name).read_bytes() == want
    assert m.stats()["writeback"]["failures"] == 0
