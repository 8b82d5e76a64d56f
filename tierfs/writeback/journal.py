"""The write-back journal: one sqlite row per dirty file, in the write tier's directory.

A row is written when a dirty file is created and changed at every rename, unlink and
write-back step, *before* the operation is answered. With the file's bytes already in the tier
file (``pwrite`` returned), ``kill -9`` of the daemon at any moment leaves a journal that names
every dirty file and where it belongs; recovery at the next mount resumes write-back and removes
any temporary file a write-back had started on the backing store.

Commits use WAL with ``synchronous=NORMAL``: they survive the daemon's death (the WAL is in the
kernel's page cache) at ~30 us each, and :meth:`Journal.sync` (a full checkpoint, with fsync)
makes them survive power loss too; ``fsync(2)`` of a dirty file calls it.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from dataclasses import dataclass

SCHEMA = 1


@dataclass(frozen=True)
class JournalRow:
    id: int
    path: bytes | None  # where the file belongs (relative to the backing root); None: unlinked
    tmp: bytes | None  # a write-back's temporary file on the backing store, if one was started
    through: bool  # written through: the bytes live in ``tmp`` on the backing store
    in_place: bool = False  # hard-linked on the backing store: written back into the same inode


class Journal:
    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS dirty (id INTEGER PRIMARY KEY AUTOINCREMENT, path BLOB,"
            " tmp BLOB, through INTEGER DEFAULT 0)"
        )
        cols = [r[1] for r in self._db.execute("PRAGMA table_info(dirty)")]
        if "in_place" not in cols:
            self._db.execute("ALTER TABLE dirty ADD COLUMN in_place INTEGER DEFAULT 0")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT)")
        self._db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA),))

    def _exec(self, sql: str, args: tuple) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    def add(self, path: bytes | None) -> int:
        """A new dirty file at ``path``; returns its id (which names its data file)."""
        return int(self._exec("INSERT INTO dirty (path) VALUES (?)", (path,)).lastrowid or 0)

    def set_path(self, id: int, path: bytes | None) -> None:
        self._exec("UPDATE dirty SET path=? WHERE id=?", (path, id))

    def rename_prefix(self, old: bytes, new: bytes) -> None:
        """A directory moved: every row under ``old/`` moves under ``new/``."""
        with self._lock:
            rows = self._db.execute("SELECT id, path FROM dirty WHERE path IS NOT NULL").fetchall()
            self._db.execute("BEGIN")
            for id_, p in rows:
                if p.startswith(old + b"/"):
                    self._db.execute("UPDATE dirty SET path=? WHERE id=?", (new + p[len(old):], id_))
            self._db.execute("COMMIT")

    def set_tmp(self, id: int, tmp: bytes | None, through: bool = False) -> None:
        self._exec("UPDATE dirty SET tmp=?, through=? WHERE id=?", (tmp, int(through), id))

    def set_in_place(self, id: int) -> None:
        self._exec("UPDATE dirty SET in_place=1 WHERE id=?", (id,))

    def remove(self, id: int) -> None:
        self._exec("DELETE FROM dirty WHERE id=?", (id,))

    def rows(self) -> list[JournalRow]:
        cur = self._exec("SELECT id, path, tmp, through, in_place FROM dirty ORDER BY id", ())
        return [JournalRow(i, p, t, bool(th), bool(ip)) for i, p, t, th, ip in cur.fetchall()]

    def sync(self) -> None:
        """Make every commit so far durable (blocking: call from a device thread)."""
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(FULL)")
            fd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            self._db.close()
