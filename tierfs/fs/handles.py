"""Open file and directory handles."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import trio

from tierfs.access import Caller
from tierfs.cache.lease import Lease
from tierfs.cache.manager import AccessState
from tierfs.predict.readahead import ReadaheadState
from tierfs.sched.backing import BackingFile
from tierfs.writeback.manager import DirtyFile


@dataclass(eq=False)
class FileHandle:
    """An open regular file: reads come from ``dirty`` while the file has one, else from the
    backing ``file`` through the cache. ``writer``: opened for writing; ``append``: O_APPEND."""

    inode: int
    file: BackingFile | None = None
    dirty: DirtyFile | None = None
    writer: bool = False
    append: bool = False
    access: AccessState = field(default_factory=AccessState)
    readahead: ReadaheadState = field(default_factory=ReadaheadState)
    pid: int = 0  # the opener (readers are told apart for next-file prediction)
    uid: int = 0  # the opener's ids (set-user/group-ID dropped after its passthrough writes)
    gid: int = 0
    # a transport handed the file to the kernel (passthrough): reads (and writes) of this handle
    # do not reach the daemon while it is held (tierfs.cache.lease)
    lease: Lease | None = None


@dataclass(eq=False)
class ControlHandle:
    """An open control file: its content is a snapshot taken at open; a command file also
    collects a request (written) and holds the reply (read back)."""

    data: bytes
    name: bytes = b""
    request: bytearray = field(default_factory=bytearray)
    answered: trio.Event | None = None  # set when the reply to the last request is in ``data``
    # The opener's uid, gid, supplementary groups and pid, taken at open (FUSE gives a write
    # no request context): every request written to this handle acts with them.
    caller: Caller | None = None
    overflow: bool = False  # the request being collected went over its cap: dropped to its newline
    held: int = 0  # bytes of ``data`` (a reply) counted against the opener's budget (ControlPlane.hold)
    closed: bool = False  # released: a reply finished after that is not kept


@dataclass(eq=False)
class DirHandle:
    """An open directory. ``listing``: its :class:`~tierfs.fs.namespace.DirListing`, read a
    batch at a time and started again each time it is read from the start (first read,
    ``rewinddir``), so entries made after the open show, as on a local filesystem."""

    inode: int
    listing: Any = None


Handle = FileHandle | ControlHandle | DirHandle


class HandleTable:
    """Open handles by number (never 0: a READ with handle 0 is one of a file the kernel opened
    itself), and the file handles of each inode: an open that looks for the other handles of
    its inode scanned every open handle, quadratic in the files open (8,000 files held open
    took 1.8 ms per open, most of a first epoch's daemon time)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.handles: dict[int, Handle] = {}
        self._by_inode: dict[int, dict[int, FileHandle]] = {}

    def add(self, h: Handle) -> int:
        fh = next(self._ids)
        self.handles[fh] = h
        if isinstance(h, FileHandle):
            self._by_inode.setdefault(h.inode, {})[fh] = h
        return fh

    def get(self, fh: int) -> Handle:
        return self.handles[fh]

    def pop(self, fh: int) -> Handle | None:
        h = self.handles.pop(fh, None)
        if isinstance(h, FileHandle):
            of = self._by_inode.get(h.inode)
            if of is not None:
                of.pop(fh, None)
                if not of:
                    del self._by_inode[h.inode]
        return h

    def has_inode(self, inode: int) -> bool:
        """Whether any handle of ``inode`` is open."""
        return inode in self._by_inode

    def of_inode(self, inode: int) -> list[FileHandle]:
        """The open file handles of ``inode``, oldest first."""
        of = self._by_inode.get(inode)
        return list(of.values()) if of else []
