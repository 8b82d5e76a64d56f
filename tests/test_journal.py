"""The write-back journal (tierfs.writeback.journal), in-process: ids and the backing claim."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierfs.errors import ForeignJournal
from tierfs.writeback.journal import Journal


def test_ids_are_never_handed_out_twice_across_removals_quarantine_and_reopens(tmp_path: Path) -> None:
    """A data file is named by its id: an id used once (removed, quarantined, or above the
    counter) is never chosen again, also after the journal is reopened."""
    path = str(tmp_path / "j.sqlite")
    j = Journal(path)
    a, b = j.new_id(), j.new_id()
    j.add(a, b"a")
    j.add(b, b"b")
    j.remove(b)  # the highest id gone: still taken
    [row] = j.rows()
    j.quarantine(row, "test")  # a quarantined id: taken
    j.close()
    j = Journal(path)
    assert j.new_id() > b
    j.close()


def test_a_journal_with_files_of_another_backing_directory_refuses_the_claim(tmp_path: Path) -> None:
    j = Journal(str(tmp_path / "j.sqlite"))
    first = b"/data/\xff-first"  # any name the filesystem allows, not only UTF-8
    j.claim(first)
    j.claim(first)
    i = j.new_id()
    j.add(i, b"f")
    with pytest.raises(ForeignJournal) as e:
        j.claim(b"/data/second")
    assert e.value.files == 1 and e.value.recorded == "/data/\udcff-first"
    j.claim(first)  # its own directory: claimed
    j.remove(i)
    j.claim(b"/data/second")  # nothing left to write back: any directory
    j.add(j.new_id(), b"g")
    with pytest.raises(ForeignJournal):
        j.claim(first)
    j.close()


def test_the_daemon_holds_its_journal_alone_and_a_killed_daemon_leaves_every_row(tmp_path: Path) -> None:
    """The journal is locked for the daemon's life (``locking_mode=EXCLUSIVE``: no lock round
    per commit, the WAL index in its memory, no -shm file): another connection is refused
    while it is open, and the rows a daemon killed with the journal open committed are all
    there for the next one (the WAL replayed)."""
    import sqlite3
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "j.sqlite"
    j = Journal(str(path))
    j.add(j.new_id(), b"kept")
    assert not (tmp_path / "j.sqlite-shm").exists()
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        sqlite3.connect(path, timeout=0).execute("SELECT count(*) FROM dirty").fetchone()
    j.close()
    # a daemon killed with rows committed and the journal open (no close: no checkpoint)
    code = textwrap.dedent(f"""
        import os
        from tierfs.writeback.journal import Journal
        j = Journal({str(path)!r})
        for i in range(50):
            j.add(j.new_id(), b"f%d" % i)
        os.kill(os.getpid(), 9)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert r.returncode == -9, r.stderr
    assert (tmp_path / "j.sqlite-wal").stat().st_size > 0
    j = Journal(str(path))
    assert sorted(row.path for row in j.rows()) == sorted([b"kept"] + [b"f%d" % i for i in range(50)])
    j.close()
