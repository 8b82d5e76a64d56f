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
