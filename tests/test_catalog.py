"""The SSD catalog's batched writes: a failed write rolls back and its batch is retried."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tierfs.cache.catalog import SsdCatalog


class FailingDb:
    """The catalog's connection, failing the first ``executemany`` of an INSERT (as a full
    disk or an I/O error would, half-way through a transaction)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.fail = True

    @property
    def in_transaction(self) -> bool:
        return self.db.in_transaction

    def execute(self, *a):  # noqa: ANN002,ANN201 - a stand-in
        return self.db.execute(*a)

    def executemany(self, sql: str, rows):  # noqa: ANN001,ANN201
        if self.fail and sql.startswith("INSERT"):
            self.fail = False
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.executemany(sql, rows)

    def close(self) -> None:
        self.db.close()


def test_failed_write_rolls_back_and_keeps_its_batch(tmp_path: Path) -> None:
    cat = SsdCatalog(str(tmp_path / "catalog.sqlite"))
    real = cat._db
    cat.record_add(("old", 0), 100, 1)
    cat.write(cat.take_pending())
    cat._db = FailingDb(real)  # type: ignore[assignment]
    cat.record_add(("a", 0), 4096, 7)
    cat.record_add(("b", 1), 4096, (1 << 64) - 1)
    cat.record_remove(("old", 0))
    with pytest.raises(sqlite3.OperationalError):
        cat.write(cat.take_pending())
    assert not real.in_transaction  # rolled back: the next BEGIN works
    # records made after the failure win over the failed batch's
    cat.record_remove(("b", 1))
    cat.record_add(("c", 2), 10, 3)
    cat.write(cat.take_pending())
    rows = sorted((k, i, n, c) for k, i, n, c, _ in cat.load())
    assert rows == [("a", 0, 4096, 7), ("c", 2, 10, 3)]
    cat.close()


def test_failed_write_then_close_writes_the_batch(tmp_path: Path) -> None:
    path = str(tmp_path / "catalog.sqlite")
    cat = SsdCatalog(path)
    real = cat._db
    cat._db = FailingDb(real)  # type: ignore[assignment]
    cat.record_add(("a", 0), 4096, 7)
    with pytest.raises(sqlite3.OperationalError):
        cat.write(cat.take_pending())
    cat.write(cat.take_pending())  # what Cache.close does at unmount
    cat.close()
    again = SsdCatalog(path)
    assert [(k, i) for k, i, *_ in again.load()] == [("a", 0)]
    again.close()
