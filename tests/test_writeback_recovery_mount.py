"""Crash recovery through a real mount: a journal row recovery cannot honour is quarantined
(kept, logged, shown by ``tierfs stats`` and ``tierfs doctor``) and never stops the mount."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.conftest import needs_fuse, tierfs_cmd

pytestmark = [needs_fuse, pytest.mark.fuse]


def test_stale_journal_row_never_bricks_the_mount(tiermount, tmp_path: Path) -> None:
    m = tiermount(ram="16MiB", ssd="64MiB", extra=("-o", "writeback_deadline=3600"))
    (m.mnt / "good").write_bytes(b"g" * 10000)  # dirty, closed, not yet written back
    m.kill9()
    # a written-through row whose temporary file is gone (a kill between its commit and the
    # journal's removal, as seen in the field); written as the daemon at hand writes rows
    assert m.ssd is not None
    con = sqlite3.connect(m.ssd / "journal.sqlite")
    cols = [r[1] for r in con.execute("PRAGMA table_info(dirty)")]
    cur = con.execute("INSERT INTO dirty (path, tmp, through) VALUES (?, ?, 1)",
                      (b"stale", b".tierfs-wb.77.3"))
    if "state" in cols:
        con.execute("UPDATE dirty SET state='through' WHERE id=?", (cur.lastrowid,))
    con.commit()
    con.close()
    m.start()  # used to fail: "daemon failed" (BackingIOError out of recovery), at every mount
    tierfs_cmd("flush", str(m.mnt))
    assert (tmp_path / "back" / "good").read_bytes() == b"g" * 10000
    wb = m.stats()["writeback"]
    assert wb["quarantined"] == 1 and wb["quarantined_paths"] == ["stale"]
    doctor = tierfs_cmd("doctor", str(m.mnt), check=False, timeout=60)
    assert "quarantined" in doctor.stdout and "stale" in doctor.stdout


def test_files_left_to_write_back_never_go_to_another_backing_directory(tiermount, tmp_path: Path) -> None:
    """The write tier is named after the mountpoint. Files a crash left in it belong to the
    backing directory mounted there then: another directory mounted on the same mountpoint is
    refused (it used to get them written into it), and the first one gets them back."""
    m = tiermount(ram="16MiB", ssd="64MiB", extra=("-o", "writeback_deadline=3600"))
    (m.mnt / "private").write_bytes(b"p" * 1000)  # dirty, closed, not yet written back
    m.kill9()
    other = tmp_path / "other"
    other.mkdir()
    r = tierfs_cmd("mount", str(other), str(m.mnt), *m.args, check=False, timeout=60)
    assert r.returncode != 0 and "not yet written back to" in r.stderr, r.stderr
    assert not (other / "private").exists()
    m.start()  # the directory they belong to
    tierfs_cmd("flush", str(m.mnt))
    assert (tmp_path / "back" / "private").read_bytes() == b"p" * 1000
    m.stop()
    m2 = tiermount(ram="16MiB", ssd="64MiB", backing=other)  # nothing left: mounted as usual
    m2.stop()
