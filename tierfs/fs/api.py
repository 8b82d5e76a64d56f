"""What the FUSE handlers take and give, in terms of no transport.

:class:`~tierfs.fs.handlers.Handlers` answers requests with these types and raises
:class:`FuseError` for an errno reply; a transport (:mod:`tierfs.transport`) turns them into its
own replies (pyfuse3 objects, or the kernel's structs of ``include/uapi/linux/fuse.h``). Field
names follow ``struct stat`` (and pyfuse3's ``EntryAttributes``), so a test reads them alike
whichever transport ran.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

# renameat2(2) flags, as the kernel passes them in FUSE_RENAME2 (include/uapi/linux/fs.h)
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
RENAME_WHITEOUT = 4
ENOATTR = errno.ENODATA  # getxattr(2) of a name the object lacks


class FuseError(Exception):
    """Answer the request with ``errno`` (positive). Raised by the handler layer only; inner
    layers raise typed tierfs errors or OSError and the boundary maps them."""

    def __init__(self, errno_: int) -> None:
        super().__init__(errno_)
        self.errno = errno_

    def __str__(self) -> str:
        return f"{errno.errorcode.get(self.errno, self.errno)}"


class RequestCtx(Protocol):
    """Who asked: the caller's ids as the kernel sent them with the request."""

    @property
    def uid(self) -> int: ...
    @property
    def gid(self) -> int: ...
    @property
    def pid(self) -> int: ...


class Ctx(NamedTuple):
    """A :class:`RequestCtx` made by a transport (pyfuse3 hands its own object, same fields).
    A tuple: one is made per request (~4x cheaper than a frozen dataclass)."""

    uid: int = 0
    gid: int = 0
    pid: int = 0
    umask: int = 0


@dataclass(slots=True)
class Attr:
    """An entry (lookup, create, mkdir, ...) or attribute (getattr) reply. Times in ns since
    the epoch; timeouts in seconds (how long the kernel may keep the name / the attributes)."""

    st_ino: int = 0
    generation: int = 0
    entry_timeout: float = 0.0
    attr_timeout: float = 0.0
    st_mode: int = 0
    st_nlink: int = 0
    st_uid: int = 0
    st_gid: int = 0
    st_rdev: int = 0
    st_size: int = 0
    st_blksize: int = 4096
    st_blocks: int = 0
    st_atime_ns: int = 0
    st_mtime_ns: int = 0
    st_ctime_ns: int = 0

    @classmethod
    def of(cls, inode: int, st: os.stat_result, *, nlink: int | None = None,
           entry_timeout: float = 0.0, attr_timeout: float = 0.0) -> Attr:
        return cls(inode, 0, entry_timeout, attr_timeout, st.st_mode,
                   st.st_nlink if nlink is None else nlink, st.st_uid, st.st_gid, st.st_rdev,
                   st.st_size, st.st_blksize, st.st_blocks, st.st_atime_ns, st.st_mtime_ns,
                   st.st_ctime_ns)


@dataclass(slots=True)
class OpenReply:
    """An open/create reply: the handle number and the page-cache policy for this open.
    ``keep_cache``: keep the page cache of an unchanged file; ``direct_io``: bypass it (control
    files only: it breaks shared mmap)."""

    fh: int
    keep_cache: bool = False
    direct_io: bool = False


@dataclass(slots=True)
class SetAttr:
    """What a setattr changes; None = left alone. Times in ns (a transport resolves "now")."""

    size: int | None = None
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None
    # After the changes above, drop set-user-ID, and set-group-ID if group-executable, of a
    # regular file: what the kernel leaves to the daemon for a chown, and for a truncate by a
    # caller without CAP_FSETID, once FUSE_HANDLE_KILLPRIV_V2 is negotiated
    kill_suidgid: bool = False


# readdir: emit(name, attrs, next_offset) -> False when the reply buffer is full (the entry was
# not taken; the kernel asks again from that offset)
DirEmit = Callable[[bytes, Attr, int], bool]
StatVfs = Any  # os.statvfs_result (f_bsize, f_frsize, f_blocks, ... f_namemax)
