"""The write-back journal: one sqlite row per dirty file, in the write tier's directory.

A row is written when a dirty file is created and changed at every rename, unlink and
write-back transition, *before* the effect (the file operation, the temporary file, the rename)
happens. With the file's bytes already in the tier file (``pwrite`` returned), ``kill -9`` of the
daemon at any moment leaves a journal that names every dirty file, where it belongs, which
temporary file on the backing store it may have started, and whether that temporary file is
complete (:class:`JState`); :mod:`tierfs.writeback.recovery` resumes from it at the next mount.

Commits use WAL with ``synchronous=NORMAL``: they survive the daemon's death (the WAL is in the
kernel's page cache) at ~10-25 us each. :meth:`Journal.sync` makes them survive power loss too by
``fsync``-ing the WAL file (``fsync(2)`` of a dirty file calls it): with ``synchronous=NORMAL``
sqlite syncs the WAL before each checkpoint and the database after it, so a synced WAL holds
every commit not yet in a synced database. It takes no lock: journal writes never wait for it.

A row that recovery cannot honour (its bytes are gone) is moved to the ``quarantine`` table,
never deleted, so ``tierfs stats`` and ``tierfs doctor`` can name it.

Errors: every method raises ``OSError`` - ``ENOSPC`` when sqlite finds the disk full
(``sqlite3.OperationalError: database or disk is full``), ``EIO`` for other sqlite failures -
so callers handle the journal like any other file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import errno
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tierfs.errors import ForeignJournal

SCHEMA = 2
ID_RESERVE = 4096  # ids reserved in sqlite_sequence at once (Journal.add)
_INSERT_ROW = "INSERT INTO dirty (id, path) VALUES (?, ?)"  # a new row (Journal.add, Journal.readd)
# Blocks allocated ahead for the journal (see Journal._reserve). The WAL grows to its
# auto-checkpoint size (1000 pages of 4 KiB) and is then reused in place from its start, so
# 4 MiB covers it; the database itself holds one small row per dirty file (1 MiB: thousands).
WAL_RESERVE_BYTES = 4 << 20
DB_RESERVE_BYTES = 1 << 20
FALLOC_FL_KEEP_SIZE = 0x01
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


class JState(enum.Enum):
    """What a row's temporary file (``tmp``) is, as recorded before the step that makes it so."""

    DIRTY = "dirty"  # the data file in the write tier holds the bytes; ``tmp`` is a partial write-back
    TO_THROUGH = "to-through"  # still the data file; ``tmp`` is a partial copy for write-through
    THROUGH = "through"  # ``tmp`` (complete) holds the bytes; None: the final file itself does
    COMMIT = "commit"  # ``tmp`` (complete) is being renamed to ``path``


@dataclass(frozen=True)
class JournalRow:
    id: int
    path: bytes | None  # where the file belongs (relative to the backing root); None: unlinked
    tmp: bytes | None  # a temporary file on the backing store, if one was started
    state: JState = JState.DIRTY
    in_place: bool = False  # hard-linked on the backing store: written back into the same inode
    prev: bytes | None = None  # a THROUGH file's temporary file before a move to ``tmp`` (rename)

    @property
    def through(self) -> bool:
        return self.state in (JState.THROUGH, JState.COMMIT)


@dataclass(frozen=True)
class QuarantinedRow:
    id: int
    path: bytes | None
    tmp: bytes | None
    state: str
    reason: str
    at: float  # seconds since the epoch
    data: str | None  # the kept data file, if any (under the write tier's ``quarantine/``)


def _os_error(e: sqlite3.Error) -> OSError:
    msg = str(e)
    if "full" in msg:  # "database or disk is full"
        return OSError(errno.ENOSPC, f"write-back journal: {msg}")
    return OSError(errno.EIO, f"write-back journal: {msg}")


class Journal:
    """Args: path: the sqlite file (created if missing). reserve_limit: bytes the space
    allocated ahead (WAL + database) may take at most; a small write tier (an 8 MiB RAM tier)
    gets a proportionally smaller reserve. Raises OSError if it cannot be opened."""

    def __init__(self, path: str, reserve_limit: int | None = None) -> None:
        self.path = path
        full = WAL_RESERVE_BYTES + DB_RESERVE_BYTES
        scale = 1.0 if reserve_limit is None else min(1.0, max(0, reserve_limit) / full)
        self._reserve_sizes = tuple(int(n * scale) // 4096 * 4096 for n in (WAL_RESERVE_BYTES, DB_RESERVE_BYTES))
        self._lock = threading.Lock()
        self._wal_fd = -1
        # descriptors of the database and its WAL opened to reserve their room, held until
        # close: closing any descriptor of the database file would drop every POSIX lock this
        # process holds on it, sqlite's included, and another process's connection then
        # counted itself the last one, checkpointed and deleted the WAL at its close, so that
        # the commits after it were lost to a kill -9 (10 of 20 rows, seen). (For the same
        # reason a process must not open a second Journal on the same file and close it.)
        self._reserve_fds: list[int] = []
        try:
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
            if "state" not in cols:
                # schema 1: ``through=1`` was written *before* the copy into ``tmp``, so such a
                # row only says "maybe complete": TO_THROUGH, and recovery keeps the data file
                # if it is still there (it was removed only after a complete copy).
                self._db.execute("ALTER TABLE dirty ADD COLUMN state TEXT DEFAULT 'dirty'")
                self._db.execute("UPDATE dirty SET state='to-through' WHERE through=1")
            if "prev" not in cols:
                self._db.execute("ALTER TABLE dirty ADD COLUMN prev BLOB")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS quarantine (id INTEGER PRIMARY KEY, path BLOB, tmp BLOB,"
                " state TEXT, reason TEXT, at REAL, data TEXT)"
            )
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT)")
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (str(SCHEMA),))
            # the ids handed out so far: AUTOINCREMENT's counter (never lowered by a delete),
            # and any row above it (a quarantined one, a row from an older schema)
            used = [r[0] for r in self._db.execute(
                "SELECT seq FROM sqlite_sequence WHERE name='dirty'"
                " UNION ALL SELECT MAX(id) FROM dirty UNION ALL SELECT MAX(id) FROM quarantine")]
            self._last_id = max((int(u) for u in used if u is not None), default=0)
            # sqlite_sequence's row holds ids reserved ahead (see add): none above it is used yet
            self._reserved_to = self._last_id
        except sqlite3.Error as e:
            raise _os_error(e) from None

        self.reserved = self._reserve()
        # bytes of the write tier's filesystem the journal holds ahead (taken out of the tier)
        self.reserved_bytes = sum(self._reserve_sizes) if self.reserved else 0

    def _reserve(self) -> bool:
        """Allocate the blocks the WAL and the database will grow into, beyond their ends
        (``fallocate(FALLOC_FL_KEEP_SIZE)``: the files look unchanged to sqlite): when the
        write tier's filesystem fills up, journal writes still have room, so the switch to
        write-through that a full tier calls for can be recorded. Best effort (blocking):
        False if the filesystem cannot (no room now, or no fallocate)."""
        ok = True
        for suffix, n in zip(("-wal", ""), self._reserve_sizes, strict=True):
            if n <= 0:
                continue
            try:
                fd = os.open(self.path + suffix, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                ok = False
                continue
            self._reserve_fds.append(fd)  # never closed before the connection (see __init__)
            if _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, n) != 0:
                ok = False
        return ok

    def _exec(self, sql: str, args: tuple) -> sqlite3.Cursor:
        with self._lock:
            try:
                return self._db.execute(sql, args)
            except sqlite3.Error as e:
                raise _os_error(e) from None

    def claim(self, backing: bytes, mountpoint: bytes | None = None) -> None:
        """Record that this journal's files belong to the backing directory ``backing`` (a
        real path, bytes: any name the filesystem allows), before recovery writes any of them
        back, and the ``mountpoint`` they are written through (for :func:`summary`: which
        mount writes back a write tier no daemon holds). Raises ForeignJournal if it holds dirty files of another backing directory: the
        write tier is named after the mountpoint, and another directory mounted there after a
        crash (or an unmount that left files to write back) would have had them written into
        it. A journal that names no
        directory yet (new, or older than this record) is claimed as it is. OSError if it
        cannot be written."""
        with self._lock:
            try:
                row = self._db.execute("SELECT v FROM meta WHERE k='backing'").fetchone()
                if row is not None and row[0] != backing:
                    (n,) = self._db.execute("SELECT COUNT(*) FROM dirty WHERE path IS NOT NULL").fetchone()
                    if n:
                        was = os.fsdecode(row[0])
                        raise ForeignJournal(
                            f"this mountpoint's write tier holds {n} file(s) not yet written back to "
                            f"{was}, which was mounted here, not {os.fsdecode(backing)}: mount {was} "
                            "here again to write them back (docs/troubleshooting.md, \"Files of "
                            "another backing directory\")",
                            was, n)
                self._db.execute("INSERT OR REPLACE INTO meta VALUES ('backing', ?)", (backing,))
                if mountpoint is not None:
                    self._db.execute("INSERT OR REPLACE INTO meta VALUES ('mountpoint', ?)", (mountpoint,))
            except sqlite3.Error as e:
                raise _os_error(e) from None

    def new_id(self) -> int:
        """An id for a new dirty file (it names its data file), never handed out before by
        this journal: chosen in memory, so that a create writes one row, once its data file
        exists (:meth:`add`), not a row and then its path (two commits: ~20 us each)."""
        with self._lock:
            self._last_id += 1
            return self._last_id

    def add(self, id: int, path: bytes | None) -> None:
        """A new dirty file ``id`` (from :meth:`new_id`) at ``path``.

        AUTOINCREMENT keeps the highest id used in ``sqlite_sequence`` and rewrites that row in
        every insert that goes above it: a second page in the commit, 4 ``pwrite`` calls instead
        of 2 and ~40% of the insert's time (19 -> 11 us, sqlite on tmpfs, this machine). So the
        row is moved ahead by ID_RESERVE ids at once, in the commit of the insert that reaches
        it, and the inserts below it write one page. A later mount starts above the reserved
        ids (they are counted as used): ids still never repeat, and older versions of tierfs
        read the same row."""
        if id <= self._reserved_to:
            self._exec(_INSERT_ROW, (id, path))
            return
        ahead = id + ID_RESERVE

        def insert(db: sqlite3.Connection) -> None:
            db.execute(_INSERT_ROW, (id, path))
            db.execute("UPDATE sqlite_sequence SET seq=? WHERE name='dirty'", (ahead,))

        self._transaction(insert)
        self._reserved_to = ahead

    def readd(self, id: int, path: bytes) -> None:
        """A file written back and clean, whose row was removed, dirty again with the same data
        file (``id`` names it): :meth:`tierfs.writeback.manager.WriteBack.redirty`."""
        self._exec(_INSERT_ROW, (id, path))

    def set_path(self, id: int, path: bytes | None) -> None:
        self._exec("UPDATE dirty SET path=? WHERE id=?", (path, id))

    def rename_prefix(self, old: bytes, new: bytes) -> None:
        """A directory moved: every row (path and temporary file) under ``old/`` moves under
        ``new/``, in one transaction."""
        def moved(p: bytes | None) -> bytes | None:
            return new + p[len(old):] if p is not None and p.startswith(old + b"/") else p

        def move(db: sqlite3.Connection) -> None:
            for id_, p, t, pv in db.execute("SELECT id, path, tmp, prev FROM dirty").fetchall():
                if (moved(p), moved(t), moved(pv)) != (p, t, pv):
                    db.execute("UPDATE dirty SET path=?, tmp=?, prev=? WHERE id=?",
                               (moved(p), moved(t), moved(pv), id_))

        self._transaction(move)

    def _transaction(self, fn: Callable[[sqlite3.Connection], object]) -> None:
        """``fn(db)`` in one transaction (one commit), rolled back if it raises."""
        with self._lock:
            try:
                self._db.execute("BEGIN")
                try:
                    fn(self._db)
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as e:
                raise _os_error(e) from None

    def set_tmp(self, id: int, tmp: bytes | None, state: JState = JState.DIRTY,
                prev: bytes | None = None) -> None:
        """Record the row's temporary file and what it is (before the step that makes it so)."""
        self._exec("UPDATE dirty SET tmp=?, state=?, through=?, prev=? WHERE id=?",
                   (tmp, state.value, int(state in (JState.THROUGH, JState.COMMIT)), prev, id))

    def set_tmps(self, items: list[tuple[int, bytes | None]], state: JState = JState.DIRTY) -> None:
        """:meth:`set_tmp` of several rows, ``(id, tmp)`` each, in one transaction (a group
        of small files written back together: one commit, not one per file)."""
        through = int(state in (JState.THROUGH, JState.COMMIT))
        self._transaction(lambda db: db.executemany(
            "UPDATE dirty SET tmp=?, state=?, through=?, prev=NULL WHERE id=?",
            [(tmp, state.value, through, id_) for id_, tmp in items]))

    def set_in_place(self, id: int) -> None:
        self._exec("UPDATE dirty SET in_place=1 WHERE id=?", (id,))

    def remove(self, id: int) -> None:
        self._exec("DELETE FROM dirty WHERE id=?", (id,))

    def rows(self) -> list[JournalRow]:
        cur = self._exec("SELECT id, path, tmp, state, in_place, prev FROM dirty ORDER BY id", ())
        out = []
        for i, p, t, s, ip, pv in cur.fetchall():
            try:
                st = JState(s)
            except ValueError:
                st = JState.TO_THROUGH  # unknown: the safest reading (keep the data file)
            out.append(JournalRow(i, p, t, st, bool(ip), pv))
        return out

    def quarantine(self, row: JournalRow, reason: str, data: str | None = None) -> None:
        """Move ``row`` to the quarantine table (one transaction)."""
        with self._lock:
            try:
                self._db.execute("BEGIN")
                try:
                    self._db.execute("INSERT OR REPLACE INTO quarantine VALUES (?, ?, ?, ?, ?, ?, ?)",
                                     (row.id, row.path, row.tmp, row.state.value, reason, time.time(), data))
                    self._db.execute("DELETE FROM dirty WHERE id=?", (row.id,))
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as e:
                raise _os_error(e) from None

    def quarantined(self) -> list[QuarantinedRow]:
        cur = self._exec("SELECT id, path, tmp, state, reason, at, data FROM quarantine ORDER BY id", ())
        return [QuarantinedRow(*r) for r in cur.fetchall()]

    def sync(self) -> None:
        """Make every commit so far durable: fsync the WAL (blocking: call from a device thread;
        takes no lock, so journal writes go on meanwhile). Raises OSError."""
        if self._wal_fd < 0:
            fd = os.open(self.path + "-wal", os.O_RDONLY | os.O_CLOEXEC)
            dfd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)  # the WAL's directory entry, once
            finally:
                os.close(dfd)
            self._wal_fd = fd
        os.fsync(self._wal_fd)

    def close(self) -> None:
        with self._lock:
            if self._wal_fd >= 0:
                os.close(self._wal_fd)
                self._wal_fd = -1
            self._db.close()
            for fd in self._reserve_fds:  # after the connection: its locks are gone with it
                os.close(fd)
            self._reserve_fds.clear()


@dataclass(frozen=True)
class JournalSummary:
    """What a journal holds, read without changing it (:func:`summary`)."""

    dirty: int  # files not yet written back (rows naming a path)
    quarantined: int  # rows recovery could not honour (their data, if any, kept)
    backing: bytes | None  # the backing directory they belong to (None: not recorded)
    mountpoint: bytes | None  # the mountpoint they were written through (None: not recorded)
    paths: tuple[bytes, ...]  # the first ``listed`` paths of the dirty files, relative


def summary(path: str, listed: int = 3) -> JournalSummary:
    """Read the journal at ``path`` read-only (``tierfs doctor``: a write tier no daemon holds).
    Raises OSError (EIO: not a journal, or damaged; ENOENT)."""
    if not os.path.exists(path):
        raise OSError(errno.ENOENT, "no journal", path)
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            meta = dict(db.execute("SELECT k, v FROM meta"))
            (dirty,) = db.execute("SELECT COUNT(*) FROM dirty WHERE path IS NOT NULL").fetchone()
            (quarantined,) = db.execute("SELECT COUNT(*) FROM quarantine").fetchone()
            paths = tuple(bytes(r[0]) for r in db.execute(
                "SELECT path FROM dirty WHERE path IS NOT NULL ORDER BY id LIMIT ?", (listed,)))
        finally:
            db.close()
    except sqlite3.Error as e:
        raise _os_error(e) from None

    def blob(v: object) -> bytes | None:
        return v if isinstance(v, bytes) else v.encode() if isinstance(v, str) else None

    return JournalSummary(int(dirty), int(quarantined), blob(meta.get("backing")),
                          blob(meta.get("mountpoint")), paths)
