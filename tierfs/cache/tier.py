"""A tier: a directory with a byte capacity holding cached chunks.

Cached data of one backing file lives in one sparse tier file (named by the file's identity key)
at the same offsets as in the backing file, so a hit is one ``pread``; evicting a chunk punches a
hole. Capacity is counted in 4 KiB blocks, as the filesystem allocates them.

All methods here are blocking; :class:`~tierfs.cache.manager.Cache` decides whether they run
inline (tmpfs) or in the tier's device thread.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass

from tierfs import io
from tierfs.errors import TierIOError

BLOCK = 4096
MAX_OPEN_FDS = 256  # per tier; more distinct cached files than this reopen on demand


def blocks(length: int) -> int:
    """Bytes a chunk of ``length`` occupies in a tier (rounded up to 4 KiB blocks)."""
    return -(-length // BLOCK) * BLOCK


@dataclass(frozen=True)
class TierStats:
    name: str
    path: str
    capacity_bytes: int
    effective_capacity_bytes: int  # lower than capacity while the tier's filesystem is full
    used_bytes: int
    dirty_bytes: int
    chunks: int
    hits: int
    misses: int
    bytes_served: int
    promotions: int
    demotions: int
    evictions: int
    errors: int
    full_events: int


class Tier:
    """One tier. ``capacity`` bytes are never exceeded: :meth:`reserve` refuses first.

    Args:
        name: ``"ram"`` or ``"ssd"``.
        path: the tier's directory (created if missing); data lives in ``path/data``.
        capacity: bytes.
        inline: reads may run on the event loop (a tmpfs tier).
    """

    def __init__(self, name: str, path: str, capacity: int, *, inline: bool) -> None:
        self.name = name
        self.path = path
        self.capacity = capacity
        self.effective_capacity = capacity  # lowered when the filesystem fills from outside
        self.inline = inline
        self.used = 0
        self.dirty = 0  # bytes of dirty files (write tier), not evictable
        self.keep_free = 0  # bytes cached chunks leave free for writes (checkpoint hints)
        self.chunks = 0
        self.hits = 0
        self.misses = 0
        self.bytes_served = 0
        self.promotions = 0
        self.demotions = 0
        self.evictions = 0
        self.errors = 0
        self.full_events = 0
        self.data_dir = os.path.join(path, "data")
        os.makedirs(self.data_dir, exist_ok=True)
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._fd_lock = threading.Lock()  # fds are used from the event loop and device threads

    # -- accounting -------------------------------------------------------------------------
    def room(self) -> int:
        """Free bytes (for writes: dirty data may use the room kept free)."""
        return self.effective_capacity - self.used - self.dirty

    def cache_room(self) -> int:
        """Free bytes cached chunks may use: :meth:`room` less ``keep_free``."""
        return self.room() - self.keep_free

    def reserve(self, length: int, keep_free: int = 0) -> bool:
        """Account ``length`` bytes if they fit with ``keep_free`` bytes left; False otherwise
        (never over capacity)."""
        need = blocks(length)
        if self.used + self.dirty + need + keep_free > self.effective_capacity:
            return False
        self.used += need
        self.chunks += 1
        return True

    def release(self, length: int) -> None:
        self.used -= blocks(length)
        self.chunks -= 1

    # -- files -----------------------------------------------------------------------------
    def file_path(self, key: str) -> str:
        return os.path.join(self.data_dir, key[:2], key)

    def _fd(self, key: str, create: bool) -> int:
        with self._fd_lock:
            fd = self._fds.get(key)
            if fd is not None:
                self._fds.move_to_end(key)
                return fd
            path = self.file_path(key)
            if create:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            else:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            self._fds[key] = fd
            while len(self._fds) > MAX_OPEN_FDS:
                _, old = self._fds.popitem(last=False)
                os.close(old)
            return fd

    def write(self, key: str, offset: int, data: bytes | memoryview) -> None:
        """Store ``data`` at ``offset`` of the tier file of ``key``. Raises TierIOError."""
        try:
            io.pwrite_all(self._fd(key, create=True), data, offset)
        except OSError as e:
            raise TierIOError(self.name, e) from e

    def read(self, key: str, offset: int, length: int) -> bytes:
        """Read cached bytes. Raises TierIOError (the caller falls back)."""
        try:
            data = io.pread_exact(self._fd(key, create=False), length, offset)
        except OSError as e:
            raise TierIOError(self.name, e) from e
        if len(data) != length:
            raise TierIOError(self.name, OSError(5, f"short read of cached chunk {key}@{offset}"))
        return data

    def punch(self, key: str, offset: int, length: int) -> None:
        """Free a chunk's blocks. Best effort: a failure is counted, never raised."""
        try:
            io.punch_hole(self._fd(key, create=False), offset, blocks(length))
        except OSError:
            self.errors += 1

    def remove_file(self, key: str) -> None:
        with self._fd_lock:
            fd = self._fds.pop(key, None)
            if fd is not None:
                os.close(fd)
        try:
            os.unlink(self.file_path(key))
        except FileNotFoundError:
            pass
        except OSError:
            self.errors += 1

    def existing_keys(self) -> list[str]:
        out = []
        for sub in os.listdir(self.data_dir):
            d = os.path.join(self.data_dir, sub)
            if os.path.isdir(d):
                out.extend(os.listdir(d))
        return out

    def wipe(self) -> None:
        """Remove all cached data (a RAM tier at mount time). Dirty files (``dirty/``) and the
        journal are not cached data and stay."""
        self.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        os.makedirs(self.data_dir, exist_ok=True)
        self.used = 0
        self.chunks = 0

    def close(self) -> None:
        with self._fd_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def statistics(self) -> TierStats:
        return TierStats(
            name=self.name, path=self.path, capacity_bytes=self.capacity,
            effective_capacity_bytes=self.effective_capacity, used_bytes=self.used,
            dirty_bytes=self.dirty,
            chunks=self.chunks, hits=self.hits, misses=self.misses, bytes_served=self.bytes_served,
            promotions=self.promotions, demotions=self.demotions, evictions=self.evictions,
            errors=self.errors, full_events=self.full_events,
        )
