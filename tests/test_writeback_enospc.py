"""Full filesystems on either side of the write path: the daemon never dies of ENOSPC, writers
are told (ENOSPC at write, fsync or close) only when the backing store is full, and a full write
tier's filesystem means write-through, as docs/writes.md promises."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import needs_fuse, tierfs_cmd, tmpfs

pytestmark = [needs_fuse, pytest.mark.fuse]
MiB = 1 << 20


def fill(fs: Path) -> None:
    """Fill a filesystem from outside tierfs until it is full."""
    with open(fs / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * MiB)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC


def write_chunks(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        for i in range(0, len(data), MiB):
            f.write(data[i : i + MiB])


def test_full_write_tier_filesystem_writes_through(tiermount, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ssdfs", "32m") as fs:
        m = tiermount(ram="8MiB", extra=("--ssd", f"{fs}/tier:24MiB", "-o", "writeback_deadline=3600"))
        try:
            (m.mnt / "before").write_bytes(b"b" * 100_000)  # a journal and some dirty data first
            fill(fs)
            data = os.urandom(6 * MiB)
            write_chunks(m.mnt / "after-full", data)  # used to answer EIO, then kill the daemon
            (m.mnt / "small").write_bytes(b"s" * 1000)
            assert m.stats()["writeback"]["dirty_files"] >= 1  # the daemon is alive
            tierfs_cmd("flush", str(m.mnt))
            assert (tmp_path / "back" / "after-full").read_bytes() == data
            assert (tmp_path / "back" / "small").read_bytes() == b"s" * 1000
            assert (tmp_path / "back" / "before").read_bytes() == b"b" * 100_000
        finally:
            m.stop()  # before the tmpfs goes


def free(path: Path) -> int:
    sv = os.statvfs(path)
    return sv.f_bavail * sv.f_frsize


def _daemon_fds_into(pid: int, where: Path) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(where)) and ".tierfs-wb." in target:
            out.append(target)
    return out


def test_backing_store_full_writer_told_enospc(tiermount, tmp_path: Path) -> None:
    """The write tier has room, the backing store has not: the writer gets ENOSPC (it used to
    close without error a file that could never be written back)."""
    with tmpfs(tmp_path / "back", "24m") as back:
        m = tiermount(ram="8MiB", ssd="128MiB", backing=back)
        try:
            with pytest.raises(OSError) as e:
                write_chunks(m.mnt / "too-big", os.urandom(40 * MiB))
            assert e.value.errno == errno.ENOSPC
            os.unlink(m.mnt / "too-big")  # what was written of it stays, as on a local disk
            # its write-back, started at close, stops at its next slice and removes its
            # temporary file: wait for the space to come back (a condition, not a delay)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (
                    free(back) < 8 * MiB or [n for n in os.listdir(back) if n.startswith(".tierfs-wb.")]):
                time.sleep(0.05)
            ok = os.urandom(4 * MiB)
            write_chunks(m.mnt / "fits", ok)
            tierfs_cmd("flush", str(m.mnt))
            assert (back / "fits").read_bytes() == ok
            assert not [n for n in os.listdir(back) if n.startswith(".tierfs-wb.")]
            assert not _daemon_fds_into(m.pid, back)
        finally:
            m.stop()
            subprocess.run(["sync"], check=False)
