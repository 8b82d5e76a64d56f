"""A tier: a directory with a byte capacity holding cached chunks.

Cached data of one backing file lives in one sparse tier file (named by the file's identity key)
at the same offsets as in the backing file, so a hit is one ``pread``; evicting a chunk punches a
hole. Capacity is counted in 4 KiB blocks, as the filesystem allocates them.

All methods here are blocking; :class:`~tierfs.cache.manager.Cache` decides whether they run
inline (tmpfs) or in the tier's device thread.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tierfs import io, private
from tierfs.errors import TierIOError

BLOCK = 4096
MAX_OPEN_FDS = 256  # per tier; more distinct cached files than this reopen on demand


@dataclass
class _OpenFile:
    """A cached tier-file descriptor. ``users``: calls using it now (in any thread); an evicted
    or removed entry is closed by its last user (``doomed``), never under a user's feet, where
    the number could already name another file."""

    fd: int
    users: int = 0
    doomed: bool = False


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
    # Passthrough (kernel reads the tier file directly; see tierfs.cache.lease). Such reads
    # never reach the daemon: they are not in hits, misses or bytes_served.
    passthrough_opens: int = 0  # leases handed out (each open passed through counts)
    passthrough_bytes: int = 0  # bytes made available by them (the file's size, per open)
    leased_files: int = 0  # files with a lease now (their chunks are pinned)
    leased_bytes: int = 0  # bytes of those files (pinned in this tier now)


class Tier:
    """One tier. ``capacity`` bytes are never exceeded: :meth:`reserve` refuses first.

    The tier directory is private (see :mod:`tierfs.private`): opened once, verified (owned by
    the daemon's user, mode 0700, not a symlink), and every file in it is created and opened
    relative to that descriptor with ``O_NOFOLLOW`` (``O_EXCL`` when new). A tier file that
    exists already (an SSD tier's data from an earlier mount) is used only if it is a regular
    file of the daemon's user with one link; anything else under its name is removed and the
    file created anew.

    Args:
        name: ``"ram"`` or ``"ssd"``.
        path: the tier's directory (created 0700 if missing); data lives in ``path/data``.
        capacity: bytes.
        inline: reads may run on the event loop (a tmpfs tier).
        dir_fd: ``path`` already opened and verified by the caller (the tier takes it over).

    Raises:
        PrivateStateError: ``path`` exists and is a symlink, another user's, or accessible to
            others.
    """

    def __init__(self, name: str, path: str, capacity: int, *, inline: bool,
                 dir_fd: int | None = None) -> None:
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
        self.passthrough_opens = 0
        self.passthrough_bytes = 0
        self.leased_files = 0
        self.leased_bytes = 0
        self.dir_fd = private.open_dir(path) if dir_fd is None else dir_fd
        self.data_fd = private.subdir(self.dir_fd, "data", os.path.join(path, "data"))
        self._buckets: dict[str, int] = {}  # data/<xx>/ directory fds (at most 256)
        self._fds: OrderedDict[str, _OpenFile] = OrderedDict()
        self._fd_lock = threading.Lock()  # fds are used from the event loop and device threads

    # -- accounting -------------------------------------------------------------------------
    def set_aside(self, nbytes: int) -> None:
        """Take ``nbytes`` out of the capacity for tierfs' own files in the tier directory (the
        journal's preallocated space in the write tier), so the directory as a whole stays
        within the configured size (design invariant 3)."""
        self.capacity = max(0, self.capacity - nbytes)
        self.effective_capacity = min(self.effective_capacity, self.capacity)

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
        """A path naming the tier file of ``key`` through the tier's verified descriptor (for
        ``stat``); valid while the tier is open."""
        return private.fd_path(self.data_fd, f"{key[:2]}/{key}")

    def _bucket(self, key: str) -> int:
        """The fd of ``data/<key[:2]>`` (created if missing). Called with ``_fd_lock`` held."""
        sub = key[:2]
        fd = self._buckets.get(sub)
        if fd is None:
            try:
                fd = private.subdir(self.data_fd, sub)
            except private.PrivateStateError as e:  # at I/O time, an OSError: callers fall back
                raise OSError(errno.EPERM, str(e)) from None
            self._buckets[sub] = fd
        return fd

    @contextmanager
    def _use(self, key: str, create: bool) -> Iterator[int]:
        """The descriptor of the tier file of ``key``, held open while the block runs (another
        thread may evict it from the cache meanwhile: it is closed after the block).
        ``create``: create it if missing. Raises OSError."""
        with self._fd_lock:
            ent = self._fds.get(key)
            if ent is not None:
                self._fds.move_to_end(key)
            else:
                ent = _OpenFile(private.open_file(self._bucket(key), key, os.O_RDWR, create=create))
                self._fds[key] = ent
                while len(self._fds) > MAX_OPEN_FDS:
                    _, old = self._fds.popitem(last=False)
                    self._drop(old)
            ent.users += 1
        try:
            yield ent.fd
        finally:
            with self._fd_lock:
                ent.users -= 1
                if ent.doomed and ent.users == 0:
                    os.close(ent.fd)

    @staticmethod
    def _drop(ent: _OpenFile) -> None:
        """Close a descriptor taken out of the cache, now or by its last user. ``_fd_lock``."""
        if ent.users:
            ent.doomed = True
        else:
            os.close(ent.fd)

    def write(self, key: str, offset: int, data: bytes | memoryview) -> None:
        """Store ``data`` at ``offset`` of the tier file of ``key``. Raises TierIOError."""
        try:
            with self._use(key, create=True) as fd:
                io.pwrite_all(fd, data, offset)
        except OSError as e:
            raise TierIOError(self.name, e) from e

    def copy_in(self, key: str, offset: int, src_fd: int, length: int, src_dev: int = 0) -> int:
        """Copy ``length`` bytes at ``offset`` of file ``src_fd`` to the same offset of the tier
        file of ``key`` in the kernel (:func:`tierfs.io.copy_range`: copy_file_range, else
        splice). Returns the bytes copied (short at the end of the source). Blocking. Raises
        TierIOError for any failure, of either file (the caller falls back to a plain read).
        ``src_dev``: the source's device: a method the kernel refuses is not tried again
        between that filesystem and this tier."""
        try:
            with self._use(key, create=True) as fd:
                return io.copy_range(src_fd, fd, length, offset, offset, route=(self.name, src_dev))
        except OSError as e:
            raise TierIOError(self.name, e) from e

    def read(self, key: str, offset: int, length: int) -> bytes:
        """Read cached bytes. Raises TierIOError (the caller falls back)."""
        try:
            with self._use(key, create=False) as fd:
                data = io.pread_exact(fd, length, offset)
        except OSError as e:
            raise TierIOError(self.name, e) from e
        if len(data) != length:
            raise TierIOError(self.name, OSError(5, f"short read of cached chunk {key}@{offset}"))
        return data

    def punch(self, key: str, offset: int, length: int) -> None:
        """Free a chunk's blocks. Best effort: a failure is counted, never raised."""
        try:
            with self._use(key, create=False) as fd:
                io.punch_hole(fd, offset, blocks(length))
        except OSError:
            self.errors += 1

    def truncate_file(self, key: str, size: int) -> None:
        """Set the size of the tier file of ``key`` (a file written in place through
        passthrough: :meth:`tierfs.cache.manager.Cache.truncate_leased`). Raises TierIOError."""
        try:
            with self._use(key, create=False) as fd:
                os.ftruncate(fd, size)
        except OSError as e:
            raise TierIOError(self.name, e) from e

    def open_readonly(self, key: str) -> int:
        """A new read-only descriptor of the tier file of ``key`` (for a passthrough lease),
        opened relative to the verified bucket directory with ``O_NOFOLLOW``: only a regular
        file of the daemon's user with one link (:func:`tierfs.private.open_file`). The caller
        closes it. Raises OSError (ENOENT: no such tier file)."""
        with self._fd_lock:
            bucket = self._bucket(key)
        return private.open_file(bucket, key, os.O_RDONLY, create=False)

    def remove_file(self, key: str) -> None:
        with self._fd_lock:
            ent = self._fds.pop(key, None)
            if ent is not None:
                self._drop(ent)
            try:
                os.unlink(key, dir_fd=self._bucket(key))
            except FileNotFoundError:
                pass
            except OSError:
                self.errors += 1

    def existing_keys(self) -> list[str]:
        out = []
        for sub in os.listdir(self.data_fd):
            try:
                fd = private.subdir(self.data_fd, sub)
            except (OSError, private.PrivateStateError):
                continue  # not a bucket directory of ours: its files are not counted
            try:
                out.extend(os.listdir(fd))
            finally:
                os.close(fd)
        return out

    def wipe(self) -> None:
        """Remove all cached data (a RAM tier at mount time). Dirty files (``dirty/``) and the
        journal are not cached data and stay."""
        self._close_files()
        private.remove(self.dir_fd, "data")
        os.close(self.data_fd)
        self.data_fd = private.subdir(self.dir_fd, "data", os.path.join(self.path, "data"))
        self.used = 0
        self.chunks = 0

    def _close_files(self) -> None:
        with self._fd_lock:
            for ent in self._fds.values():
                self._drop(ent)
            self._fds.clear()
            for fd in self._buckets.values():
                os.close(fd)
            self._buckets.clear()

    def close(self) -> None:
        """Close every descriptor (a call still using one closes it when done)."""
        self._close_files()
        for fd in (self.data_fd, self.dir_fd):
            if fd >= 0:
                os.close(fd)
        self.data_fd = self.dir_fd = -1

    def statistics(self) -> TierStats:
        return TierStats(
            name=self.name, path=self.path, capacity_bytes=self.capacity,
            effective_capacity_bytes=self.effective_capacity, used_bytes=self.used,
            dirty_bytes=self.dirty,
            chunks=self.chunks, hits=self.hits, misses=self.misses, bytes_served=self.bytes_served,
            promotions=self.promotions, demotions=self.demotions, evictions=self.evictions,
            errors=self.errors, full_events=self.full_events,
            passthrough_opens=self.passthrough_opens, passthrough_bytes=self.passthrough_bytes,
            leased_files=self.leased_files, leased_bytes=self.leased_bytes,
        )
