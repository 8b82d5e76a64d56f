"""Residency catalog: which tier holds which chunk, and the persistent record of the SSD tier.

The SSD tier's catalog is a sqlite database in the tier directory, so a new mount with the same
directory starts warm. Each chunk carries its xxh3-64 checksum; the first read of a chunk after
a mount verifies it, so a torn or corrupted tier file is detected and fetched again, never served.
Writes are batched (:meth:`SsdCatalog.flush`, every few seconds and at unmount); a crash loses at
most the last batch of *records*, and :meth:`SsdCatalog.reconcile` then punches the orphaned
bytes so capacity accounting stays true.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from dataclasses import dataclass

from tierfs.cache.policy import ChunkId

SCHEMA_VERSION = 1


def _to_sql(checksum: int) -> int:
    """sqlite integers are signed 64-bit; xxh3-64 digests are unsigned."""
    return checksum - (1 << 64) if checksum >= (1 << 63) else checksum


def _from_sql(value: int) -> int:
    return value + (1 << 64) if value < 0 else value


@dataclass
class ChunkEntry:
    """A resident chunk. ``tier`` indexes the cache's tier list (0 = fastest)."""

    tier: int
    length: int
    checksum: int = 0  # xxh3_64 of the chunk; 0 for tiers that do not persist
    verified: bool = True  # False until the first read after a mount checked the checksum
    pins: int = 0  # readers in a device thread; a pinned chunk is never evicted or moved


class Catalog:
    """In-memory map of resident chunks, with a per-file index for dropping a whole file."""

    def __init__(self) -> None:
        self.entries: dict[ChunkId, ChunkEntry] = {}
        self.by_file: dict[str, set[int]] = {}

    def get(self, cid: ChunkId) -> ChunkEntry | None:
        return self.entries.get(cid)

    def add(self, cid: ChunkId, entry: ChunkEntry) -> None:
        self.entries[cid] = entry
        self.by_file.setdefault(cid[0], set()).add(cid[1])

    def remove(self, cid: ChunkId) -> ChunkEntry | None:
        entry = self.entries.pop(cid, None)
        if entry is not None:
            idxs = self.by_file.get(cid[0])
            if idxs is not None:
                idxs.discard(cid[1])
                if not idxs:
                    del self.by_file[cid[0]]
        return entry

    def chunks_of(self, key: str) -> list[int]:
        return sorted(self.by_file.get(key, ()))

    def file_has_tier(self, key: str, tier: int) -> bool:
        return any(self.entries[(key, i)].tier == tier for i in self.by_file.get(key, ()))


class SsdCatalog:
    """The persistent record of an SSD tier (sqlite, WAL). Thread-safe; call from a device thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT)")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS chunk (file_key TEXT, idx INTEGER, length INTEGER,"
            " checksum INTEGER, freq INTEGER, PRIMARY KEY (file_key, idx))"
        )
        row = self._db.execute("SELECT v FROM meta WHERE k='schema'").fetchone()
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        self._pending_add: dict[ChunkId, tuple[int, int]] = {}
        self._pending_del: set[ChunkId] = set()
        self._pending_freq: dict[ChunkId, int] = {}
        # A batch whose write failed (set by write() in its thread, taken by take_pending() on
        # the loop; flushes are sequential, so the two never overlap)
        self._failed: tuple[dict, set, dict] | None = None

    def load(self) -> list[tuple[str, int, int, int, int]]:
        """All recorded chunks as (file_key, idx, length, checksum, freq)."""
        with self._lock:
            rows = self._db.execute("SELECT file_key, idx, length, checksum, freq FROM chunk")
            return [(k, i, n, _from_sql(c), f) for k, i, n, c, f in rows]

    # The event loop records changes in memory; flush() writes them in one transaction.
    def record_add(self, cid: ChunkId, length: int, checksum: int) -> None:
        self._pending_del.discard(cid)
        self._pending_add[cid] = (length, checksum)

    def record_remove(self, cid: ChunkId) -> None:
        self._pending_add.pop(cid, None)
        self._pending_del.add(cid)

    def record_freq(self, cid: ChunkId, freq: int) -> None:
        self._pending_freq[cid] = freq

    def take_pending(self) -> tuple[dict, set, dict]:
        """Swap out the pending batch (on the event loop), to be written by :meth:`write`."""
        adds, dels, freqs = self._pending_add, self._pending_del, self._pending_freq
        self._pending_add, self._pending_del, self._pending_freq = {}, set(), {}
        failed, self._failed = self._failed, None
        if failed is not None:  # the failed batch first; records made since override it
            old_adds, old_dels, old_freqs = failed
            for cid in dels:
                old_adds.pop(cid, None)
            for cid in adds:
                old_dels.discard(cid)
            adds, dels, freqs = old_adds | adds, old_dels | dels, old_freqs | freqs
        return adds, dels, freqs

    def write(self, batch: tuple[dict, set, dict]) -> None:
        """Write a batch from :meth:`take_pending` in one transaction. Raises sqlite3.Error
        (a full or failing disk); the transaction is then rolled back and the batch is kept
        for the next :meth:`take_pending`, so no record is lost to a failed write."""
        adds, dels, freqs = batch
        if not (adds or dels or freqs):
            return
        with self._lock:
            try:
                self._write(adds, dels, freqs)
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                self._failed = batch
                raise

    def _write(self, adds: dict, dels: set, freqs: dict) -> None:
        self._db.execute("BEGIN")
        self._db.executemany("DELETE FROM chunk WHERE file_key=? AND idx=?", list(dels))
        self._db.executemany(
            "INSERT OR REPLACE INTO chunk VALUES (?, ?, ?, ?, ?)",
            [(k, i, ln, _to_sql(ck), freqs.get((k, i), 1)) for (k, i), (ln, ck) in adds.items()],
        )
        self._db.executemany(
            "UPDATE chunk SET freq=? WHERE file_key=? AND idx=?",
            [(f, k, i) for (k, i), f in freqs.items() if (k, i) not in adds],
        )
        self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()


def tier_file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return -1
