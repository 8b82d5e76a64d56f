"""Write-back of a file at a path longer than PATH_MAX (pjdfstest link/03.t: its write-back
failed with ENAMETOOLONG and was retried forever, so ``link`` answered EIO), and a failed
write-back's log line names the file (it named the scheduler's task position)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tests.conftest import needs_fuse, tierfs_cmd
from tests.test_writeback_inprocess import Disks, instance, write_file
from tierfs.errors import BackingIOError

NAME = "d" * 200
DEPTH = 25  # 25 * 201 bytes: beyond PATH_MAX (4096), wherever the backing directory lives


def _descend(top: Path, mkdir: bool) -> None:
    """chdir into ``top`` and then, one relative name at a time, DEPTH levels down."""
    os.chdir(top)
    for _ in range(DEPTH):
        if mkdir:
            os.mkdir(NAME)
        os.chdir(NAME)


@needs_fuse
@pytest.mark.fuse
def test_write_back_of_file_beyond_path_max(tiermount, tmp_path: Path) -> None:
    m = tiermount(ram="16MiB", extra=("-o", "writeback_deadline=3600"))
    here = os.getcwd()
    data = os.urandom(100_000)
    try:
        _descend(m.mnt, mkdir=True)
        assert len(os.getcwd()) > 4096
        with open("f", "wb") as f:
            f.write(data)
        os.link("f", "g")  # pjdfstest link/03.t: the link waits for the write-back
    finally:
        os.chdir(here)
    tierfs_cmd("flush", str(m.mnt), timeout=60)
    st = m.stats()["writeback"]
    assert st["failures"] == 0
    assert st["dirty_files"] == 0
    try:
        _descend(tmp_path / "back", mkdir=False)
        with open("f", "rb") as f:
            assert f.read() == data
        assert os.stat("f").st_nlink == 2
        assert not [n for n in os.listdir(".") if n.startswith(".tierfs-wb.")]
    finally:
        os.chdir(here)


async def test_failed_write_back_log_names_the_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    disks = Disks(tmp_path / "d")
    name = b"no-such-dir/f\nforged line"
    with caplog.at_level(logging.WARNING, logger="tierfs.writeback"):
        async with instance(disks, deadline_s=3600) as wb:
            await write_file(wb, name, b"x" * 100)
            with pytest.raises(BackingIOError):
                await wb.wait_durable(None, timeout=30)
    lines = [r.getMessage() for r in caplog.records if "write-back of" in r.getMessage()]
    assert lines, caplog.text
    for line in lines:
        assert "\n" not in line
        assert "((0," not in line, line  # the scheduler's task position, not a name
        assert line.startswith("write-back of no-such-dir/f\\nforged line failed"), line
        assert "backing store: no-such-dir/" in line, line  # the failed call names its file too
