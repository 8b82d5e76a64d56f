"""Leases: descriptors of tier files and write-tier data files that a FUSE transport hands to
the kernel, so that reads, writes and mmap of an open file go straight to the file that holds
its bytes (kernel FUSE passthrough, ``FOPEN_PASSTHROUGH`` with a backing id, Linux 6.9+).

Two kinds, each made by the component that owns the file:

* :meth:`tierfs.cache.manager.Cache.lease_resident`: the tier file of a clean file whose every
  byte is resident, current and verified in one tier (read-only). While any lease of the file is
  held its chunks are *pinned*: no eviction, demotion, promotion, hole punch or removal of that
  tier file.
* :meth:`tierfs.writeback.manager.WriteBack.lease_data`: the data file of a dirty file in the
  write tier (``O_RDWR`` when writable). The daemon no longer sees the writes: the FUSE layer
  calls :meth:`~tierfs.writeback.manager.WriteBack.after_passthrough_write` at flush, fsync and
  release of a writable passthrough handle.

All concurrent leases of one file share one descriptor (:class:`LeaseTable`, reference
counted), closed at the last :meth:`Lease.release`: the kernel wants one backing id per inode
(numpy opens a file twice) and registers it from that descriptor. The kernel opens its own file
of the same path (``backing_file_open`` with the opener's flags and the daemon's credentials),
so the descriptor's access mode only names the file; it is read-only wherever writing is not
meant (defense in depth).

Everything here runs on the trio event loop; :meth:`Lease.release` is synchronous and cheap
(a close of a descriptor whose file is still linked; a close that would free a large unlinked
file is handed to the owner's ``close`` callable, which may defer it to a device thread).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import trio

__all__ = ["Lease", "LeaseTable"]


@dataclass(eq=False)
class _Shared:
    """One descriptor shared by every lease of ``key``. ``ready`` is set once the descriptor
    is open (or the open failed); until then ``fd`` is -1 and newcomers wait."""

    key: Hashable
    fd: int = -1
    refs: int = 0
    ready: trio.Event = field(default_factory=trio.Event)
    on_last: Callable[[], None] | None = None  # called once, after the descriptor is closed
    parked: bool = False  # held without a descriptor (LeaseTable.park); fd is -1 meanwhile


@dataclass(eq=False)
class Lease:
    """A claim on a descriptor the kernel may read (and, ``writable``, write) directly.

    Attributes:
        fd: the shared descriptor (valid until the last lease of ``key`` is released; do not
            close it yourself). Give it to ``FUSE_DEV_IOC_BACKING_OPEN``.
        tier: name of the tier holding the file (``"ram"``, ``"ssd"``).
        size: bytes of the file when the lease was taken (for a tier file: exactly its
            ``st_size``, the file's size; a data file grows under a writable lease).
        writable: writes through it are meant (a data file opened ``O_RDWR``).
        key: hashable, equal for leases sharing one descriptor: ``("tier", tier, file_key)``
            or ``("data", dirty_id, writable)``.
    """

    fd: int
    tier: str
    size: int
    writable: bool
    key: Hashable
    _table: LeaseTable = field(repr=False)
    _shared: _Shared = field(repr=False)
    _on_release: Callable[[], None] | None = field(default=None, repr=False)
    released: bool = False

    def release(self) -> None:
        """Give the lease back. Idempotent: a second call does nothing. The last release of
        a key closes the descriptor and unpins the file."""
        if self.released:
            return
        self.released = True
        try:
            self._table._release(self._shared)
        finally:
            if self._on_release is not None:
                on_release, self._on_release = self._on_release, None
                on_release()


class LeaseTable:
    """Shared, reference-counted descriptors by lease key.

    Args:
        close: closes a descriptor at the last release (default ``os.close``).
    """

    def __init__(self, close: Callable[[int], None] = os.close) -> None:
        self._entries: dict[Hashable, _Shared] = {}
        self._close = close
        self.opens = 0  # leases handed out (each share counts)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def refs(self, key: Hashable) -> int:
        """Leases of ``key`` held now (0: none)."""
        sh = self._entries.get(key)
        return sh.refs if sh is not None else 0

    async def share(self, key: Hashable, *, tier: str, size: int, writable: bool,
                    on_release: Callable[[], None] | None = None) -> Lease | None:
        """A new lease on the descriptor of ``key`` if one is open (waiting while another task
        opens it); None if there is none (the caller may :meth:`begin` one). ``on_release()``
        runs when this lease is released (after the shared descriptor's bookkeeping)."""
        while True:
            sh = self._entries.get(key)
            if sh is None or sh.parked:
                return None
            if sh.fd >= 0:
                return self._lease(sh, tier, size, writable, on_release)
            await sh.ready.wait()

    def share_now(self, key: Hashable, *, tier: str, size: int, writable: bool,
                  on_release: Callable[[], None] | None = None) -> Lease | None:
        """:meth:`share` without waiting: None also while another task opens ``key``."""
        sh = self._entries.get(key)
        if sh is None or sh.fd < 0:
            return None
        return self._lease(sh, tier, size, writable, on_release)

    def park(self, key: Hashable) -> bool:
        """Close the descriptor of ``key`` while its one lease left is a keeper's, which holds
        the file (and what its owner pins with it) but reads nothing through it: a kept lease
        then costs no descriptor (the kernel keeps its own reference to the file it
        registered). :meth:`share` and :meth:`share_now` find nothing until :meth:`unpark`
        gives it a descriptor again; the last release closes none. False (nothing done) if
        ``key`` is not open or other leases share it."""
        sh = self._entries.get(key)
        if sh is None or sh.fd < 0 or sh.refs != 1:
            return False
        fd, sh.fd = sh.fd, -1
        sh.parked = True
        self._close(fd)
        return True

    def is_parked(self, key: Hashable) -> bool:
        sh = self._entries.get(key)
        return sh is not None and sh.parked

    def unpark(self, key: Hashable, fd: int) -> None:
        """``fd`` (the same file, opened again) is the descriptor of parked ``key`` now.
        Raises KeyError if ``key`` is not parked."""
        sh = self._entries.get(key)
        if sh is None or not sh.parked:
            raise KeyError(key)
        sh.fd = fd
        sh.parked = False

    def begin(self, key: Hashable) -> None:
        """Claim ``key`` while its descriptor is opened (across awaits): :meth:`share` callers
        wait. Must be followed by :meth:`finish` or :meth:`abort`. Raises KeyError if ``key``
        is claimed or open already (call :meth:`share` first, with no await in between)."""
        if key in self._entries:
            raise KeyError(key)
        self._entries[key] = _Shared(key)

    def finish(self, key: Hashable, fd: int, *, tier: str, size: int, writable: bool,
               on_last: Callable[[], None] | None = None,
               on_release: Callable[[], None] | None = None) -> Lease:
        """The descriptor of ``key`` is open: the first lease on it. ``on_last()`` runs once
        the last lease is released (after the close)."""
        sh = self._entries[key]
        sh.fd = fd
        sh.on_last = on_last
        sh.ready.set()
        return self._lease(sh, tier, size, writable, on_release)

    def abort(self, key: Hashable) -> None:
        """Opening the descriptor of ``key`` failed: waiters look again (and find nothing)."""
        sh = self._entries.pop(key, None)
        if sh is not None:
            sh.ready.set()

    def _lease(self, sh: _Shared, tier: str, size: int, writable: bool,
               on_release: Callable[[], None] | None = None) -> Lease:
        sh.refs += 1
        self.opens += 1
        return Lease(sh.fd, tier, size, writable, sh.key, self, sh, on_release)

    def _release(self, sh: _Shared) -> None:
        sh.refs -= 1
        if sh.refs > 0:
            return
        if self._entries.get(sh.key) is sh:
            del self._entries[sh.key]
        fd, sh.fd = sh.fd, -1
        try:
            if fd >= 0:
                self._close(fd)
        finally:
            if sh.on_last is not None:
                on_last, sh.on_last = sh.on_last, None
                on_last()

    def close_all(self) -> None:
        """Unmount: close every descriptor (leases still held become void; their
        :meth:`Lease.release` is then a no-op)."""
        for sh in list(self._entries.values()):
            sh.refs = 1
            self._release(sh)
