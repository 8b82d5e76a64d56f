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



def test_another_process_opening_the_journal_never_costs_a_commit(tmp_path: Path) -> None:
    """A program opening the journal of a running daemon (a user's ``sqlite3`` shell; ``tierfs
    doctor`` reads it) sees its rows, and closing its connection leaves the daemon's WAL alone:
    every row the daemon commits afterwards survives the daemon's kill -9. The daemon's
    reserve of room once closed a descriptor of the database file after sqlite had locked it,
    which dropped sqlite's locks: the other connection then counted itself the last one,
    checkpointed and deleted the WAL at its close, and the daemon's later commits were lost
    (10 of 20 rows)."""
    import sqlite3
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "j.sqlite"
    code = textwrap.dedent(f"""
        import os, sys
        from tierfs.writeback.journal import Journal
        j = Journal({str(path)!r})
        for i in range(10):
            j.add(j.new_id(), b"a%d" % i)
        print("ready", flush=True)
        sys.stdin.readline()
        for i in range(10):
            j.add(j.new_id(), b"b%d" % i)
        print("done", flush=True)
        sys.stdin.readline()
        os.kill(os.getpid(), 9)
    """)
    daemon = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert daemon.stdout is not None and daemon.stdin is not None
        assert daemon.stdout.readline() == "ready\n"
        other = sqlite3.connect(path)  # read-write, as a user's shell opens it
        assert other.execute("SELECT count(*) FROM dirty").fetchone()[0] == 10
        other.close()
        assert (tmp_path / "j.sqlite-wal").exists()
        daemon.stdin.write("\n")
        daemon.stdin.flush()
        assert daemon.stdout.readline() == "done\n"
        daemon.stdin.write("\n")
        daemon.stdin.flush()
        assert daemon.wait(timeout=60) == -9
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    j = Journal(str(path))
    assert sorted(row.path for row in j.rows()) == sorted([b"a%d" % i for i in range(10)] + [b"b%d" % i for i in range(10)])
    j.close()


def test_an_insert_below_the_reserved_ids_commits_one_page(tmp_path: Path) -> None:
    """A new row's commit writes the table's page alone (one WAL frame), not also the row of
    ``sqlite_sequence`` that AUTOINCREMENT rewrites whenever an id goes above it: that row is
    moved ahead ID_RESERVE ids at once. The ids reserved count as used after a reopen, and
    the row is where an older tierfs reads its counter."""
    import sqlite3

    from tierfs.writeback import journal

    path = str(tmp_path / "j.sqlite")
    j = Journal(path)
    first = j.new_id()
    j.add(first, b"f0")  # reaches the reserve: moves it ahead, in the same commit
    wal = Path(path + "-wal")
    page = j._db.execute("PRAGMA page_size").fetchone()[0]
    grown = wal.stat().st_size
    n = 50
    for i in range(n):
        j.add(j.new_id(), b"f%d" % (i + 1))
    frames = (wal.stat().st_size - grown) // (page + 24)  # a WAL frame: a 24-byte header and a page
    assert frames == n, f"{frames} WAL frames for {n} inserts"
    j.close()
    db = sqlite3.connect(path)
    try:
        [(seq,)] = db.execute("SELECT seq FROM sqlite_sequence WHERE name='dirty'").fetchall()
    finally:
        db.close()
    assert seq == first + journal.ID_RESERVE
    j = Journal(path)
    assert j.new_id() > seq  # the reserved ids are never handed out by a later mount
    assert len(j.rows()) == n + 1
    j.close()
