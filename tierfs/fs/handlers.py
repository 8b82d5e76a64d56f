"""The FUSE handlers: decode arguments, call collaborators, map errors. Nothing else.

This is the FUSE boundary: the only place where tierfs errors and OSErrors become errnos
(:class:`~tierfs.fs.api.FuseError`). A transport (:mod:`tierfs.transport`: pyfuse3, or the
native ``/dev/fuse`` protocol) calls these handlers and turns their neutral replies
(:mod:`tierfs.fs.api`) into its own; the handlers do not know which transport calls them.

Collaborators: :class:`~tierfs.fs.namespace.Namespace` (names, attributes, unlink/rename,
copy-up: the overlay of dirty files over the backing tree), :class:`~tierfs.fs.control.
ControlPlane` (``.tierfs/``), the cache (reads of clean files) and the write-back (dirty files).

Page cache: ``keep_cache`` is set on open unless the backing file's identity changed since the
last open, so the page cache survives across opens of unchanged files; ``direct_io`` is never
set on data files (it breaks shared mmap: numpy, lmdb, safetensors; design brief).
"""

from __future__ import annotations

import collections
import errno
import logging
import math
import os
import stat
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from functools import partial

import trio

from tierfs import logevents, tasks
from tierfs.backing_tree import BackingTree
from tierfs.cache.lease import Lease, LeaseTable
from tierfs.cache.manager import Cache
from tierfs.errors import TierfsError
from tierfs.fs.api import (
    ENOATTR,
    Attr,
    Ctx,
    DirEmit,
    FuseError,
    OpenReply,
    RequestCtx,
    SetAttr,
    StatVfs,
)
from tierfs.fs.control import ControlPlane
from tierfs.fs.handles import ControlHandle, DirHandle, FileHandle, HandleTable
from tierfs.fs.inodes import CONTROL_DIR, ROOT, InodeEntry, InodeTable
from tierfs.fs.namespace import CONTROL_NAME, Namespace
from tierfs.io import Device
from tierfs.predict.readahead import Readahead
from tierfs.sched.backing import BackingFile
from tierfs.writeback.manager import CAPS_XATTR, DirtyFile, WriteBack

log = logging.getLogger("tierfs.fs")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR
# kept passthrough leases of small files (Handlers.kept_passthrough): each pins a struct file
# in the kernel (~1 KiB with its registration), so at most ~64 MiB of kernel memory
KEPT_PASSTHROUGH_MAX = 65536
FORGET_STEP = 1000  # inodes forgotten between two checkpoints of one FORGET batch
# implicit read handles of files the kernel opened itself (Handlers.read_inode): each holds a
# FileHandle and its readahead state (~1 KiB) and the file's open backing file (a descriptor);
# the least recently read goes first beyond this many, or beyond half of RLIMIT_NOFILE (a
# read-only mount has no dirty files and no passthrough registrations, the descriptors' other
# users); the kernel's own FORGETs usually come first
INODE_READERS_MAX = 16384


class _Named:
    """A ``with`` block named ``what`` for its log lines: :class:`_FuseErrors` and
    :class:`_LoggedErrors` (classes, not generators: a ``@contextmanager`` cost ~3 us per use,
    and one runs for every open, two for every release)."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None


class _FuseErrors(_Named):
    """:func:`fuse_errors`."""

    __slots__ = ()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        if e is None or isinstance(e, FuseError) or not isinstance(e, Exception):
            return  # (trio.Cancelled and other BaseExceptions go on as they are)
        if isinstance(e, TierfsError):
            log.debug("%s: %s", self.what, e)
            raise FuseError(e.errno) from None
        if isinstance(e, OSError):
            raise FuseError(e.errno or errno.EIO) from None
        if isinstance(e, KeyError):
            raise FuseError(errno.ENOENT) from None
        # A bug must cost one request, never the daemon (and every user of the mount).
        log.error("%s: unexpected error; answering EIO", self.what, exc_info=(et, e, tb))  # type: ignore[arg-type]
        raise FuseError(errno.EIO) from None


def fuse_errors(what: str) -> _FuseErrors:
    """``with``: map typed tierfs errors and OSErrors to FuseError (the FUSE boundary): a
    TierfsError to its errno, an OSError to its errno (EIO if none), a KeyError (an unknown
    inode or handle) to ENOENT, any other Exception (a bug) to EIO, logged."""
    return _FuseErrors(what)


def _nofile() -> int:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 30 if soft == resource.RLIM_INFINITY else soft


def _in_group(ctx: RequestCtx, gid: int) -> bool:
    """Whether caller ``ctx`` is root or in group ``gid``: its own gid, else its supplementary
    groups as /proc tells them (the kernel sends only the fsgid; False when it cannot be read:
    the caller is gone, and a set-group-ID bit is dropped rather than kept wrongly)."""
    if ctx.uid == 0 or ctx.gid == gid:
        return True
    try:
        with open(f"/proc/{ctx.pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    return str(gid).encode() in line.split()[1:]
    except OSError:
        pass
    return False


# set-user-ID and set-group-ID: a write by a caller without CAP_FSETID may drop them
_SUIDGID = stat.S_ISUID | stat.S_ISGID


# Requests that change no file's attributes: the fstat of an open stands for its file's
# attributes across these only (Namespace.lstat). An open counts only when it neither writes nor
# truncates (Handlers.open). An fsync changes nothing a backing fstat could show: a dirty file's
# attributes come from its data file, and a write-back that replaces the backing file changes
# its inode, which lstat checks.
# (RELEASE, RELEASEDIR and FORGET do not go through _op: a passthrough writer's writes are
# taken in at its release while it still counts as passing through, see _open_backing.)
# requests that may create, remove or rename a name (Namespace.begin_ns_change)
_NAME_CHANGES = frozenset({"create", "mkdir", "mknod", "symlink", "link", "unlink", "rmdir", "rename"})
_CHANGES_NOTHING = frozenset({"getattr", "lookup", "open", "read", "readdir", "readlink", "getxattr",
                              "listxattr", "statfs", "opendir", "flush", "fsync", "fsyncdir"})


class _Op:
    """``with handlers._op(what)``: one request, timed into ``Handlers.request_seconds``, its
    errors mapped as :func:`fuse_errors` maps them (a class, not a generator: this runs for
    every request)."""

    __slots__ = ("names", "ns", "seconds", "t0", "what")

    def __init__(self, what: str, seconds: collections.defaultdict[str, float], ns: Namespace | None,
                 names: bool = False) -> None:
        self.what = what
        self.seconds = seconds
        self.ns = ns  # the namespace told of a request that may change a file (end_change at exit)
        self.names = names  # ... and that it may create, remove or rename a name (end_ns_change)
        self.t0 = 0.0

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        self.seconds[self.what] += time.perf_counter() - self.t0
        if self.ns is not None:
            self.ns.end_change()
            if self.names:
                self.ns.end_ns_change()
        if e is None or isinstance(e, (FuseError, trio.Cancelled)) or not isinstance(e, Exception):
            return
        with fuse_errors(self.what):
            raise e


class _OwnAttrsChange:
    """:meth:`Handlers._own_attrs_change` (a class: it runs for every SETATTR)."""

    __slots__ = ("ns",)

    def __init__(self, ns: Namespace | None) -> None:
        self.ns = ns

    def __enter__(self) -> None:
        if self.ns is not None:
            self.ns.begin_attrs_change()

    def __exit__(self, *exc: object) -> None:
        if self.ns is not None:
            self.ns.end_attrs_change()


class _LoggedErrors(_Named):
    """:func:`logged_errors`."""

    __slots__ = ()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: object) -> bool:
        if e is None or not isinstance(e, Exception):
            return False  # (trio.Cancelled goes on)
        log.error("%s: unexpected error (ignored: the kernel takes no reply)", self.what,
                  exc_info=(et, e, tb))  # type: ignore[arg-type]
        return True


def logged_errors(what: str) -> _LoggedErrors:
    """``with``, for the handlers that cannot answer an error (release, releasedir, forget):
    log and swallow it (the kernel takes no reply; an exception must not reach the
    transport's loop)."""
    return _LoggedErrors(what)


@dataclass(eq=False)
class _InodeReader:
    """The implicit read-only handle of a file the kernel opened itself (a read-only mount
    with ``kernel_opens``): its READs carry no handle."""

    fh: int
    opened: float  # time.monotonic() of its open, or of its last identity check
    used: float = 0.0  # time.monotonic() of its last READ (idle ones are let go)
    reading: int = 0  # READs in flight on it (a release waits for them)
    dropped: bool = False  # let go: released when the last READ in flight ends


@dataclass(eq=False)
class _TierPassthrough:
    """An inode whose open handles the kernel passes through to one tier file (a clean
    file's tier copy, leased from the cache): every further open of it, reader or writer,
    must pass through to that same file while any remains open (the kernel wants one backing
    file per inode; a writer then writes the tier file *in place*, taken in at its release).
    ``handles``: handles holding a lease of it; ``fd``: the lease's descriptor (attributes)."""

    lkey: Hashable
    file_key: str
    fd: int
    handles: int = 0
    kind: str = "tier"  # or "backing": the backing file itself (a miss on a parallel store)
    # (size, mtime_ns, ctime_ns) of the tier file when leased, or when last taken in: a
    # writer that changed nothing (sqlite and np.memmap open O_RDWR to read) costs no copy
    seen: tuple[int, int, int] = (-1, -1, -1)
    # timestamps finer than the writes: False when the tier file changed within 0.1 s of the
    # lease (coarse timestamps, kernels before 6.13, could hide a write in that tick)
    trust_times: bool = True
    # a lease kept after the last open closes (Handlers.kept_passthrough), so that the next
    # open of the file costs no tier open, pin or kernel registration
    keeper: Lease | None = None
    holds_fd: bool = False  # kept with its descriptor open (not parked: Handlers._keep_descriptor)
    # kind "backing": the file to copy into a tier once its last reader closes (the copy then
    # comes from the page cache the readers filled instead of competing with them for the store
    # and the CPU: 8 readers of a 2 GiB file on an emulated parallel store, ...)
    fill: BackingFile | None = None

    def look(self) -> tuple[int, int, int]:
        st = os.fstat(self.fd)  # an open descriptor: no I/O
        return (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class Handlers:
    """Args:
        tree: the backing tree; every backing-store access goes through it (never a path
        string). inodes: the inode table. cache: reads of clean files. writeback: dirty files.
        readahead: per-handle prediction. control: ``.tierfs`` files. meta: device for
        backing-store metadata calls (stat, readdir, open, rename, ...), separate from the
        scheduler's data I/O. attr_timeout: seconds.
    """

    def __init__(
        self, *, tree: BackingTree, inodes: InodeTable, cache: Cache, writeback: WriteBack, readahead: Readahead,
        control: ControlPlane, meta: Device, attr_timeout: float,
        nursery: trio.Nursery | None = None,
        on_open_read: Callable[[int, bytes], None] | None = None,
        on_read_end: Callable[[int, bytes], None] | None = None,
    ) -> None:
        """``on_open_read(pid, path)``: a process opened a file for reading;
        ``on_read_end(pid, path)``: its readahead reached the file's last chunk (both for
        next-file prediction; they must not block)."""
        self.tree = tree
        self.inodes = inodes
        self.handles = HandleTable()
        self.cache = cache
        self.wb = writeback
        self.readahead = readahead
        self.control = control
        self.meta = meta
        self.attr_timeout = attr_timeout
        self.ns = Namespace(tree=tree, inodes=inodes, cache=cache, writeback=writeback, meta=meta,
                            handles=self.handles, attr_timeout=attr_timeout)
        self.nursery = nursery
        self.on_open_read = on_open_read
        self.on_read_end = on_read_end
        # set by a transport that passes writes through to the kernel (native + passthrough):
        # close(2) must then reach the daemon, which alone can tell the writer ENOSPC
        self.flush_at_close = False
        # inodes whose opens pass through to a tier copy or their backing file (_TierPassthrough)
        self.tier_passthrough: dict[int, _TierPassthrough] = {}
        # Misses passed through to the backing file (set by the mount: ``passthrough_misses`` on
        # a parallel store with a transport that passes through): the kernel reads the store
        # itself, at its speed, while the cache fills a tier in the background
        self.backing_passthrough = False
        self.backing_leases = LeaseTable(close=lambda fd: None)  # the fds are the open BackingFiles'
        # Clean tier copies of small files whose opens all closed, kept leased (and registered
        # with the kernel by the transport) for the next open, least recently closed first
        self.kept_passthrough: collections.OrderedDict[int, _TierPassthrough] = collections.OrderedDict()
        # each holds a file reference in the kernel (its registration); one in the RAM tier
        # holds no descriptor here (Cache.park_kept), one in another tier holds one: those are
        # limited to an eighth of the descriptor limit (524288 under systemd: 65536)
        self.kept_max = KEPT_PASSTHROUGH_MAX
        self.kept_fds_max = _nofile() // 8
        self.kept_fds = 0  # kept ones holding a descriptor
        # those of them in the RAM tier, least recently closed first: a copy in another tier
        # takes the descriptor of one of them (which parks) when none is left
        self._kept_ram_fds: collections.OrderedDict[int, _TierPassthrough] = collections.OrderedDict()
        self.kept_reuses = 0
        # set by a transport that registers tier files with the kernel: a tier copy's opens
        # all closed and it is not kept (or no longer): its registration can go
        self.on_passthrough_end: Callable[[int], None] | None = None
        self.reads = 0  # FUSE read requests of data files
        # read-only mounts whose opens the kernel answers: inode -> its implicit read handle,
        # least recently read first (read_inode)
        self.inode_readers: collections.OrderedDict[int, _InodeReader] = collections.OrderedDict()
        self.inode_reader_opens = 0
        self.inode_readers_max = min(INODE_READERS_MAX, _nofile() // 2)
        self._inode_opening: dict[int, trio.Event] = {}  # inode -> set when its open ends
        # the transport's: drop the kernel's cached pages and attributes of an inode (a file
        # changed in place behind tierfs' back on a mount whose opens the kernel answers)
        self.on_inval_inode: Callable[[int], Awaitable[None]] | None = None
        self.inode_invalidations = 0
        self._pending_invals: list[int] = []  # inodes whose pages go before the next reply
        self.read_bytes = 0
        self.max_read = 0
        self.writes = 0
        self.write_bytes = 0
        # inode -> (size, mtime_ns) at a chmod that set set-user/group-ID while passthrough
        # writers held it open (setattr, _after_passthrough)
        self._suid_watch: dict[int, tuple[int, int]] = {}
        self.stale_opens = 0  # opens answered ESTALE: the file changed behind tierfs' back
        self.readdir_held_max = 0  # most entries one open directory's listing held at once
        # requests answered, by handler name (stats "fuse.requests": how many round trips a
        # workload costs, e.g. whether the kernel's entry cache spared a LOOKUP)
        self.requests: collections.Counter[str] = collections.Counter()
        # seconds spent in each kind of handler (awaits included: a handler that waits for
        # the backing store counts its wait); with ``requests``, the handlers' share of a
        # request's cost (docs/benchmarks.md, "Where a small-file read's time goes")
        self.request_seconds: collections.defaultdict[str, float] = collections.defaultdict(float)

    def _op(self, what: str, changes: bool | None = None) -> _Op:
        """Count and time one ``what`` request; map its errors (:func:`fuse_errors`).
        ``changes``: whether it may change a file's attributes (default: unless ``what`` is in
        :data:`_CHANGES_NOTHING`); such a request is announced to the namespace for its
        duration (:meth:`Namespace.begin_change`)."""
        self.requests[what] += 1
        if changes is None:
            changes = what not in _CHANGES_NOTHING
        if changes:
            self.ns.begin_change()
            if what in _NAME_CHANGES:
                self.ns.begin_ns_change()
                return _Op(what, self.request_seconds, self.ns, True)
            return _Op(what, self.request_seconds, self.ns)
        return _Op(what, self.request_seconds, None)

    @property
    def nursery(self) -> trio.Nursery | None:
        """Where background work of requests runs (control answers, drops of stale chunks)."""
        return self.ns.nursery

    @nursery.setter
    def nursery(self, nursery: trio.Nursery | None) -> None:
        self.ns.nursery = nursery

    @property
    def open_files(self) -> dict[str, BackingFile]:
        return self.ns.open_files

    def _own_attrs_change(self, inode: int) -> _OwnAttrsChange:
        """``with``: around a change of ``inode``'s own attributes: unless it is a regular
        file, counted as a change of a directory's attributes (:meth:`Namespace.begin_attrs_change`:
        the SETATTRs of the files ``tar -x`` makes leave their directory's alone)."""
        entry = self.inodes.by_inode.get(inode)
        return _OwnAttrsChange(None if entry is not None and entry.regular else self.ns)

    def _is_control(self, inode: int) -> bool:
        return inode == CONTROL_DIR or inode in self.control.by_inode

    # -- namespace: reading ------------------------------------------------------------------
    async def lookup(self, parent_inode: int, name: bytes, ctx: RequestCtx | None = None) -> Attr:
        with self._op("lookup"):
            if parent_inode == CONTROL_DIR:
                return self.control.lookup(name, self.attr_timeout, None if ctx is None else ctx.uid)
            if parent_inode == ROOT and name == CONTROL_NAME:
                return self.control.attrs(CONTROL_DIR, self.attr_timeout)
            a = await self.ns.lookup(parent_inode, name)
            if self._pending_invals:
                await self._send_invals()
            return a

    def lookup_now(self, parent_inode: int, name: bytes) -> Attr | int | None:
        """:meth:`lookup` with no await: the attributes, an errno (ENOENT), or None (then call
        :meth:`lookup`); see :meth:`Namespace.lookup_now`. The transport answers it as it reads
        the request, with no task: every file ``tar -x`` or ``cp -a`` makes is looked up first
        (a missing name: 49-57 us of the daemon's time through the handler, the ENOENT raised
        through its layers), as is every name a walk or a first epoch opens."""
        if self._pending_invals or parent_inode == CONTROL_DIR or (parent_inode == ROOT and name == CONTROL_NAME):
            return None
        got = self.ns.lookup_now(parent_inode, name)
        if got is not None:
            self.requests["lookup"] += 1
        return got

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        self.requests["forget"] += 1
        for k, (inode, n) in enumerate(inode_list, 1):
            with logged_errors("forget"):  # one bad inode must not leak the others' lookups
                self.inodes.forget(inode, n)
                if inode in self.inode_readers and inode not in self.inodes.by_inode:
                    await self._drop_inode_reader(inode)
            if k % FORGET_STEP == 0:
                # the kernel batches thousands of forgets after a big listing: give the loop
                # to other requests between steps (a step costs a few ms)
                await trio.lowlevel.checkpoint()

    def forget_now(self, inode: int, n: int) -> bool:
        """:meth:`forget` of one inode with no await, or False (then call :meth:`forget`):
        an inode without an implicit read handle, whose forgetting is bookkeeping alone. The
        transport does it as it reads the request, with no task: ``rm -rf`` sends one per
        file it removes (7 us each through the handler path)."""
        if inode in self.inode_readers:
            return False
        self.requests["forget"] += 1
        with logged_errors("forget"):
            self.inodes.forget(inode, n)
        return True

    async def getattr(self, inode: int, ctx: RequestCtx | None = None) -> Attr:
        with self._op("getattr"):
            if self._is_control(inode):
                return self.control.attrs(inode, self.attr_timeout, None if ctx is None else ctx.uid)
            a = await self.ns.entry_attrs(self.inodes.get(inode))
            if self._pending_invals:
                await self._send_invals()
            return a

    def getattr_now(self, inode: int) -> Attr | None:
        """:meth:`getattr` with no await, or None (then call :meth:`getattr`): the attributes
        of a clean file that a reader's open fstat-ed moments ago
        (:meth:`~tierfs.fs.namespace.Namespace.opened_stat`), the GETATTR of the fstat that
        follows a program's open, or of a directory whose names a request changed moments ago
        (:meth:`~tierfs.fs.namespace.Namespace.seen_dir_stat`), the GETATTR of the permission
        check before the next change in it. The transport answers it as it reads the request,
        with no task: a small-file epoch sends one per file, and ``rm -rf``, ``tar -x`` and
        ``cp -a`` one per file they remove or make."""
        entry = self.inodes.by_inode.get(inode)
        if entry is None or entry.dirty is not None or self._pending_invals or self._is_control(inode):
            return None
        st = self.ns.opened_stat(entry) if entry.regular else self.ns.seen_dir_stat(entry)
        if st is None:
            return None
        self.requests["getattr"] += 1
        return self.ns.clean_attrs(entry, st)

    async def readlink(self, inode: int, ctx: RequestCtx | None = None) -> bytes:
        with self._op("readlink"):
            entry = self.inodes.get(inode)
            return await self.meta.run(self.tree.readlink, self.inodes.rel(entry))  # type: ignore[no-any-return]

    async def statfs(self, ctx: RequestCtx | None = None) -> StatVfs:
        with self._op("statfs"):
            return await self.meta.run(self.tree.statvfs)

    # -- xattrs ----------------------------------------------------------------------------
    async def getxattr(self, inode: int, name: bytes, ctx: RequestCtx | None = None) -> bytes:
        with self._op("getxattr"):
            if self._is_control(inode):
                raise FuseError(ENOATTR)
            entry = self.inodes.get(inode)
            if entry.dirty is not None:
                return await self.wb.getxattr(entry.dirty, name)
            return await self.meta.run(self.tree.getxattr, self.inodes.rel(entry), name)  # type: ignore[no-any-return]

    def getxattr_now(self, inode: int, name: bytes) -> int | None:
        """:meth:`getxattr` with no await, or None (then call :meth:`getxattr`): the errno
        (ENOATTR) of a GETXATTR of ``security.capability`` of a dirty file known to have none.
        The kernel asks it before each write and change of owner of a file (every attribute
        reply clears the inode's S_NOSEC: fs/fuse/inode.c), twice per file of a ``tar -x``;
        the transport answers it as it reads the request, with no task."""
        if name != CAPS_XATTR:
            return None
        entry = self.inodes.by_inode.get(inode)
        if entry is None or entry.dirty is None or not entry.dirty.no_caps:
            return None
        self.requests["getxattr"] += 1
        return ENOATTR

    async def listxattr(self, inode: int, ctx: RequestCtx | None = None) -> list[bytes]:
        with self._op("listxattr"):
            if self._is_control(inode):
                return []
            entry = self.inodes.get(inode)
            if entry.dirty is not None:
                names = await self.wb.xattr(entry.dirty, os.listxattr)
            else:
                names = await self.meta.run(self.tree.listxattr, self.inodes.rel(entry))
            return [n.encode("utf-8", "surrogateescape") for n in names]  # type: ignore[union-attr]

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: RequestCtx | None = None) -> None:
        with self._op("setxattr"), self._own_attrs_change(inode):
            if self._is_control(inode):
                raise FuseError(errno.EPERM)
            entry = self.inodes.get(inode)
            if entry.dirty is not None:
                await self.wb.setxattr(entry.dirty, name, value)
                return
            await self.meta.run(self.tree.setxattr, self.inodes.rel(entry), name, value)

    async def removexattr(self, inode: int, name: bytes, ctx: RequestCtx | None = None) -> None:
        with self._op("removexattr"), self._own_attrs_change(inode):
            if self._is_control(inode):
                raise FuseError(errno.EPERM)
            entry = self.inodes.get(inode)
            if entry.dirty is not None:
                entry.dirty.touch()
                await self.wb.xattr(entry.dirty, lambda fd: os.removexattr(fd, name))
                return
            await self.meta.run(self.tree.removexattr, self.inodes.rel(entry), name)

    # -- directories -----------------------------------------------------------------------
    async def opendir(self, inode: int, ctx: RequestCtx | None = None) -> int:
        with self._op("opendir"):
            if inode != CONTROL_DIR:
                self.inodes.rel(self.inodes.get(inode))  # ENOENT for a removed directory
            return self.handles.add(DirHandle(inode))

    async def readdir(self, fh: int, start_id: int, emit: DirEmit) -> None:
        """Entries from offset ``start_id`` on, each with its attributes; every entry the
        kernel takes (``emit`` returns True) adds one lookup to its inode (READDIRPLUS)."""
        with self._op("readdir"):
            h = self.handles.get(fh)
            assert isinstance(h, DirHandle)
            if h.inode == CONTROL_DIR:
                self.control.readdir(start_id, emit, self.attr_timeout)
                return
            parent = self.inodes.get(h.inode)
            if h.listing is None:
                h.listing = self.ns.listing(parent)
            lst = h.listing
            # read a batch at a time (namespace.DirListing); started again when read from
            # the start (first read, rewinddir), not at open: entries made after the open
            # show, as on a local filesystem
            await lst.seek(start_id)
            i = start_id
            try:
                while (item := lst.get(i) or await lst.entry(i)) is not None:
                    i += 1
                    name, obj = item
                    if type(obj) is os.stat_result:  # a backing entry: no await
                        got: tuple[InodeEntry, Attr] | None = self.ns.listed_backing(parent, name, obj)
                    else:
                        got = await self.ns.listed_attrs(parent, name, obj)
                    if got is None:
                        continue
                    entry, attrs = got
                    entry.lookups -= 1  # counted only if the kernel takes the entry
                    if not emit(name, attrs, i):
                        self.inodes.forget(entry.inode, 0)
                        return
                    entry.lookups += 1
            finally:
                self.readdir_held_max = max(self.readdir_held_max, lst.held)

    async def releasedir(self, fh: int) -> None:
        self.requests["releasedir"] += 1
        with logged_errors("releasedir"):
            h = self.handles.pop(fh)
            if isinstance(h, DirHandle) and h.listing is not None:
                h.listing.close()

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        with self._op("fsyncdir"):
            h = self.handles.get(fh)
            if isinstance(h, DirHandle) and h.inode != CONTROL_DIR:
                await self.meta.in_thread(self.tree.fsync_dir, self.inodes.rel(self.inodes.get(h.inode)))  # an fsync: never inline

    # -- namespace: changing -------------------------------------------------------------------
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: RequestCtx) -> Attr:
        with self._op("mkdir"):
            return await self.ns.mkdir(parent_inode, name, mode, ctx)

    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: RequestCtx) -> Attr:
        with self._op("mknod"):
            return await self.ns.mknod(parent_inode, name, mode, rdev, ctx)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: RequestCtx | None = None) -> None:
        with self._op("rmdir"):
            await self.ns.rmdir(parent_inode, name)

    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: RequestCtx) -> Attr:
        with self._op("symlink"):
            return await self.ns.symlink(parent_inode, name, target, ctx)

    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: RequestCtx | None = None) -> Attr:
        with self._op("link"):
            return await self.ns.link(inode, new_parent_inode, new_name)

    async def unlink(self, parent_inode: int, name: bytes, ctx: RequestCtx | None = None) -> None:
        with self._op("unlink"):
            await self.ns.unlink(parent_inode, name)

    def unlink_now(self, parent_inode: int, name: bytes) -> int | None:
        """:meth:`unlink` with no await: 0 (done), an errno, or None (nothing done; then call
        :meth:`unlink`). A clean name nothing keeps (:meth:`Namespace.unlink_now_path`). The
        transport answers it as it reads the request, with no task: ``rm -rf`` sends one per
        file."""
        if self._pending_invals:
            return None
        path = self.ns.unlink_now_path(parent_inode, name)
        if path is None:
            return None
        try:
            with self._op("unlink"):
                self.ns.unlink_now(path)
        except FuseError as e:
            return e.errno
        return 0

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx: RequestCtx | None = None) -> None:
        with self._op("rename"):
            await self.ns.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    async def setattr(self, inode: int, attr: SetAttr, fh: int | None = None, ctx: RequestCtx | None = None) -> Attr:
        with self._op("setattr"), self._own_attrs_change(inode):
            if self._is_control(inode):
                raise FuseError(errno.EPERM)
            a = await self.ns.setattr(inode, attr)
            if attr.size is not None and inode in self.tier_passthrough:
                await self._truncate_tier_copy(inode, attr.size)
                a = self.ns.in_place_attrs(a)
            if attr.kill_suidgid:
                a = await self._kill_suidgid(inode, a, ctx)
            elif attr.mode is not None and a.st_mode & _SUIDGID and self._passthrough_writers(inode):
                # Writes the kernel passes through never reach the daemon, and with
                # FUSE_HANDLE_KILLPRIV_V2 the kernel leaves dropping the bits to it: a writer
                # without CAP_FSETID that writes after this has them dropped at its flush or
                # close (an exec through the mount meanwhile fails: ETXTBSY, open for writing).
                self._suid_watch[inode] = (a.st_size, a.st_mtime_ns)
            return a

    def setattr_now(self, inode: int, attr: SetAttr) -> Attr | int | None:
        """:meth:`setattr` with no await: the attributes after, an errno, or None (nothing
        done; then call :meth:`setattr`). A change of mode, owner or times of a file being
        written in the write tier (:meth:`Namespace.setattr_now`): the ``fchown``, ``fchmod``
        and ``futimens`` that ``tar -x`` and ``cp -a`` make on each file they create. Never a
        truncate, a change that drops or sets set-user/group-ID bits (the handler's rule for
        dropping them, its watches of passthrough writers), a control file, or while
        invalidations wait to be sent."""
        if attr.mode is not None and attr.mode & _SUIDGID:  # (a size: Namespace.setattr_now)
            return None
        entry = self.inodes.by_inode.get(inode)
        if entry is None or entry.dirty is None or self._pending_invals or self._is_control(inode):
            return None
        ns = self.ns
        ns.begin_change()
        try:
            with self._own_attrs_change(inode):  # (as the handler: a file's leave its directory's alone)
                a = ns.setattr_now(entry, attr)
        except OSError as e:
            self.requests["setattr"] += 1
            return e.errno or errno.EIO
        finally:
            ns.end_change()
        if a is None:
            return None
        self.requests["setattr"] += 1
        return a

    async def _watch_setid(self, h: FileHandle, entry: InodeEntry) -> None:
        """After a writable lease of user handle ``h``: a user's writes through the kernel never
        reach the daemon, so the set-ID bits of a set-ID file go at the writer's flush or close
        if it wrote (:meth:`_after_passthrough`). A set-ID file gets a lease here when beside
        passthrough readers (refused, the open would fail ETXTBSY), or when a chmod made it so
        while the lease was being granted. Best effort: an error leaves it unwatched."""
        try:
            if h.dirty is not None and h.dirty.fd >= 0:
                mode = os.fstat(h.dirty.fd).st_mode  # no I/O: what an ordinary create pays
            else:
                mode = (await self.ns.entry_attrs(entry)).st_mode
            if stat.S_ISREG(mode) and mode & _SUIDGID:
                a = await self.ns.entry_attrs(entry)
                self._suid_watch.setdefault(h.inode, (a.st_size, a.st_mtime_ns))
        except (OSError, KeyError, FuseError, TierfsError) as e:
            log.debug("set-ID watch of inode %d: %s", h.inode, e)

    def _passthrough_writers(self, inode: int) -> bool:
        """Whether a handle of ``inode`` writes through a passthrough lease (a scan of the
        open handles: only for a chmod that sets set-user/group-ID)."""
        return any(h.lease is not None and h.lease.writable for h in self.handles.of_inode(inode))

    async def _kill_suidgid(self, inode: int, a: Attr | None = None, ctx: RequestCtx | None = None) -> Attr:
        """Drop set-user-ID, and set-group-ID if the file is group-executable (a set-group-ID
        without it marks mandatory locking), of regular file ``inode`` whose attributes are
        ``a`` (looked up if None): the kernel's own rule for a write, a truncate or a chown
        (``setattr_should_drop_suidgid``), which it leaves to the daemon once
        ``FUSE_HANDLE_KILLPRIV_V2`` is negotiated. The daemon's own writes and truncates do
        not drop them: it runs with CAP_FSETID. Returns the attributes after.

        A set-group-ID without group execute is dropped too when caller ``ctx`` is neither
        root nor in the file's group (as the kernel's VFS does since Linux 6.2, stricter than
        FUSE's own description of the flag)."""
        if a is None:
            a = await self.ns.entry_attrs(self.inodes.get(inode))
        m = a.st_mode
        if not stat.S_ISREG(m):
            return a
        drop = m & stat.S_ISUID
        if m & stat.S_ISGID and (m & stat.S_IXGRP or (ctx is not None and not _in_group(ctx, a.st_gid))):
            drop |= stat.S_ISGID
        if not drop:
            return a
        try:
            return await self.ns.setattr(inode, SetAttr(mode=stat.S_IMODE(m) & ~drop))
        except (OSError, KeyError, FuseError, TierfsError) as e:
            # (an unlinked file with no dirty copy has no name to chmod; the caller's write
            # or truncate is done and must not fail for this)
            log.warning("could not drop the set-ID bits of inode %d: %s", inode, e)
            return a

    async def _truncate_tier_copy(self, inode: int, size: int) -> None:
        """A truncate of an inode whose opens pass through to its tier copy reaches that
        copy too: they read it (the daemon's own copy is truncated as well, by the caller)."""
        tp = self.tier_passthrough.get(inode)
        if tp is None or tp.kind == "backing":  # (the backing file itself: Namespace truncated it)
            return
        if tp.handles <= 0:  # kept, and no open reads it: let it go (the file is dirty now)
            self._drop_kept(inode, tp)
            return
        tp.trust_times = False  # taken in at the next writer's release whatever the times say
        self.ns.written_in_place[inode] = (tp.fd, tp.seen)
        await self.cache.truncate_leased(tp.lkey, size)

    # -- files -----------------------------------------------------------------------------
    async def open(self, inode: int, flags: int, ctx: RequestCtx, kill_suidgid: bool = False) -> OpenReply:
        """Open ``inode`` with open(2) ``flags``. ``kill_suidgid``: an ``O_TRUNC`` open by a
        caller without CAP_FSETID, which drops set-user-ID and set-group-ID (:meth:`_kill_suidgid`)."""
        writer = bool(flags & _WRITE_FLAGS)
        # a writer's writes may pass through to a backing file with no request; a truncate
        # may be done in place (backing_in_place)
        with self._op("open", changes=writer or bool(flags & os.O_TRUNC)):
            if inode in self.control.by_inode:
                return self.control.open(inode, ctx, self.handles)
            entry = self.inodes.get(inode)
            if entry.path is None:
                return self._open_unlinked(entry, writer or bool(flags & os.O_TRUNC))
            h = FileHandle(inode, writer=writer, append=bool(flags & os.O_APPEND), pid=ctx.pid,
                           uid=ctx.uid, gid=ctx.gid)
            if not writer and self.on_open_read is not None:
                with logged_errors("open: predictions"):  # (learned in this step: a bug there must not fail the open)
                    self.on_open_read(ctx.pid, entry.path)
            if flags & os.O_TRUNC and inode in self.ns.backing_in_place and entry.dirty is None:
                await self.ns.truncate_backing(entry, 0)  # its opens pass through to it
            elif flags & os.O_TRUNC:
                made = await self.ns.make_dirty(entry, truncate=True)
                if made.size:
                    await self.wb.truncate(made, 0)
                await self._truncate_tier_copy(inode, 0)
            if flags & os.O_TRUNC and kill_suidgid:
                await self._kill_suidgid(inode, None, ctx)
            # Opened for writing but not truncated: the file becomes dirty at its first write,
            # not here. sqlite opens every database O_RDWR, fio's verify pass and np.memmap r+
            # too: an eager copy-up copied and wrote back whole files nobody changed.
            df = entry.dirty if entry.dirty is not None and entry.dirty.state.value != "clean" else None
            if df is None:
                df = await self._join_written_back(entry, writer)
            if df is not None:
                h.dirty = df
                self.wb.opened(df, writer)
                return OpenReply(self.handles.add(h), keep_cache=True)
            return await self._open_backing(entry, h)

    def open_now(self, inode: int, flags: int, ctx: RequestCtx,
                 register: Callable[[int], int | None]) -> tuple[OpenReply, Lease, int] | None:
        """:meth:`open` and then :meth:`lease` with no await, or None (nothing done: call
        them): a reader's open of a clean file that no handle has open and whose tier copy is
        kept leased since its last close (:meth:`_reuse_kept`), while backing-store metadata
        calls run inline. That is the open of every file of a small-file epoch after the first;
        a transport answers it as it reads the request, with no task. The backing file is
        opened and compared as :meth:`open` compares it, so a change made behind tierfs' back
        is seen at this open too (then None: :meth:`open` tells the kernel). An error of the
        backing open returns None too: :meth:`open` answers it.

        ``register(fd)``: the transport's registration of the lease's descriptor with the
        kernel, its backing id or None; None (or an unexpected error) undoes the open, before
        the open is counted or told to the predictors, and returns None. Returns (reply, lease,
        backing id); if the kernel then refuses the reply, release the handle with
        :meth:`release_now` (``count=False``)."""
        if flags & (_WRITE_FLAGS | os.O_TRUNC):
            return None
        entry = self.inodes.by_inode.get(inode)
        tp = self.tier_passthrough.get(inode)
        if (entry is None or entry.path is None or entry.dirty is not None or tp is None or tp.handles > 0
                or tp.kind != "tier" or tp.keeper is None or self.handles.has_inode(inode)
                or self._is_control(inode)):
            return None
        t0 = time.perf_counter()
        try:
            bf = self.ns.backing_file_now(self.inodes.rel(entry))
        except OSError:
            return None  # open() says why (and finds a file another handle holds)
        if bf is None:
            return None
        i = bf.identity
        if ((entry.told is not None and entry.told != (i.dev, i.ino, i.size, i.mtime_ns, i.ctime_ns))
                or entry.last_key not in (None, bf.key)):
            self.ns.release_backing(bf)
            return None  # changed behind tierfs' back: open() tells the kernel
        h = FileHandle(inode, writer=False, append=bool(flags & os.O_APPEND), pid=ctx.pid,
                       uid=ctx.uid, gid=ctx.gid)
        h.file = bf
        fh = self.handles.add(h)
        lease: Lease | None = None
        bid = None
        try:
            lease = self._reuse_kept(h, entry, tp)  # (None: the kept copy let go)
            if lease is not None:
                bid = register(lease.fd)
        except Exception:  # noqa: BLE001 - a bug: undone here, the handler tries (and answers)
            log.exception("open of %s: unexpected error answering it at once", logevents.user_text(entry.path))
        if bid is None or lease is None:  # open() leases and registers as for a first open
            self.handles.pop(fh)
            self._let_go(h)  # (the lease, kept again; the backing file)
            return None
        entry.reval_sent = False
        entry.last_key = bf.key
        path = entry.path
        with logged_errors("open: predictions"):  # (a bug there must not fail the open)
            if self.on_open_read is not None:
                self.on_open_read(ctx.pid, path)
            if self.on_read_end is not None:  # (as lease() does for a reader passed through)
                self.on_read_end(h.pid, path)
        self.requests["open"] += 1
        self.request_seconds["open"] += time.perf_counter() - t0
        return OpenReply(fh, keep_cache=True), lease, bid

    async def _join_written_back(self, entry: InodeEntry, writer: bool) -> DirtyFile | None:
        """The dirty file a new open of ``entry`` must share: one written back (clean) while
        handles still read its data file, which the kernel may pass them through to (one
        backing file per inode), as long as that data file still holds the backing file's
        bytes (nothing changed behind tierfs' back). A writer makes it dirty again, in that
        same data file (:meth:`tierfs.writeback.manager.WriteBack.redirty`). None: open the
        backing file as usual."""
        path = entry.path
        if path is None:
            return None
        held = self.ns.clean_but_open(entry, path)
        if held is None:
            return None
        if writer:
            # ``held`` made dirty again if it can; else (the backing file changed behind tierfs'
            # back) a copy-up of the backing file, which readers of ``held`` do not see
            return await self.ns.make_dirty(entry, truncate=False)
        st = await self.meta.run(self.tree.lstat, path)
        return held if held.clean_as == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) else None

    async def _open_backing(self, entry: InodeEntry, h: FileHandle) -> OpenReply:
        """Open of a clean file: its backing file; the page cache is kept unless the backing
        file changed since the last open (then its cached chunks are dropped too)."""
        # its fstat answers the GETATTR right after (Namespace.lstat) unless a writer may
        # change the file with no request: one open already passing through, in place. This
        # holds because a writer passes through only by joining an inode already passing
        # through, in the same step as its open ends (nothing in _open_reply -> lease ->
        # _lease -> _share_tier_copy awaits before it joins): a reader's open that began after
        # that writer's (a change: Handlers.open) sees handles > 0 here. An await added on that
        # path would need this check again after the fstat.
        tp = self.tier_passthrough.get(entry.inode)
        held = None
        try:
            bf = await self.ns.backing_file(self.inodes.rel(entry),
                                            reader=not h.writer and (tp is None or tp.handles <= 0))
        except FileNotFoundError:
            # an unlink of the name is under way (its backing unlink done, its inode not yet
            # detached: its metadata call ran in a thread): a reopen of a file another handle
            # has open (/proc/PID/fd/N) reads what that handle opened, as after the unlink
            # (that very object: no identity to compare with what the name named)
            held = None if h.writer else self._held_file(entry.inode)
            if held is None:
                raise
            held.acquire()
            held.opens += 1
            bf = held
        i = bf.identity
        if held is None and entry.told is not None and entry.told != (i.dev, i.ino, i.size, i.mtime_ns, i.ctime_ns):
            if not entry.reval_sent:
                # Changed behind tierfs' back since the kernel was told its attributes (it
                # caches names and attributes for attr_timeout): ESTALE makes the VFS walk the
                # path again with LOOKUP_REVAL, a fresh LOOKUP, and retry the open, so the
                # reader sees the new size (fs/namespace.py, "Kernel caching").
                entry.reval_sent = True
                self.ns.release_backing(bf)
                self.stale_opens += 1
                raise FuseError(errno.ESTALE)
        entry.reval_sent = False
        h.file = bf
        key = bf.key
        changed = entry.last_key is not None and entry.last_key != key
        if changed:
            old = entry.last_key
            # throttled: the owner of a backing directory can change a file and open it
            # again in a loop, and one line each grew the log (in /run) without bound
            logevents.event(log, logging.INFO, "backing-changed",
                            "backing file changed: %s; dropping its cached chunks", logevents.user_text(bf.path))
            if self.nursery is not None and old is not None:
                tasks.spawn(self.nursery, "cache.drop_file", self.cache.drop_file, old)
        entry.last_key = key
        return OpenReply(self.handles.add(h), keep_cache=not changed)

    def _held_file(self, inode: int) -> BackingFile | None:
        """The backing file an open handle of ``inode`` reads, if one does."""
        return next((o.file for o in self.handles.of_inode(inode) if o.file is not None and o.file.fd >= 0), None)

    def _open_unlinked(self, entry: InodeEntry, writer: bool) -> OpenReply:
        """Open of an inode whose name was unlinked or replaced after the kernel looked it up:
        the old content, kept by :meth:`Namespace.preserve` (reading only)."""
        if writer:
            raise FuseError(errno.ESTALE)
        h = FileHandle(entry.inode)
        if entry.dirty is not None and entry.dirty.fd >= 0:
            h.dirty = entry.dirty
            self.wb.opened(entry.dirty, False)
        else:
            held = entry.orphan
            if held is None:  # an open that was in flight at the unlink has it (/proc/PID/fd/N)
                held = self._held_file(entry.inode)
            if held is None:
                # Unlinked while no handle had it open (Namespace.preserve): an open that raced
                # the unlink. ENOENT, as if the unlink came first; ESTALE if the file has other
                # names, on which the kernel looks the name it opened up again (once: ESTALE
                # for a file of one name reached the caller when the name was made and
                # unlinked again meanwhile)
                raise FuseError(errno.ESTALE if entry.linked_elsewhere else errno.ENOENT)
            h.file = held
            held.acquire()
            held.opens += 1
        return OpenReply(self.handles.add(h), keep_cache=True)

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: RequestCtx) -> tuple[OpenReply, Attr]:
        with self._op("create"):
            entry, df = await self.ns.create(parent_inode, name, mode, flags, ctx)  # opened for writing
            h = FileHandle(entry.inode, dirty=df, writer=True, append=bool(flags & os.O_APPEND),
                           pid=ctx.pid, uid=ctx.uid, gid=ctx.gid)
            fi = OpenReply(self.handles.add(h), keep_cache=True)
            return fi, await self.ns.dirty_attrs(entry, df)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        with self._op("read"):
            h = self.handles.get(fh)
            if isinstance(h, ControlHandle):
                return await self.control.read(h, off, size)
            assert isinstance(h, FileHandle)
            self.reads += 1
            self.read_bytes += size
            self.max_read = max(self.max_read, size)
            entry = self.inodes.by_inode.get(h.inode)
            df = entry.dirty if entry is not None and entry.dirty is not None else h.dirty
            if df is not None and (df.state.value != "clean" or df is h.dirty):
                return await self.wb.read(df, off, size)
            f = await self._read_file(h, entry)
            if off >= f.size:
                return b""
            self._read_triggers(h, entry, f, off, size)
            return await self.cache.read(f, off, size, h.access)

    async def read_inode(self, inode: int, off: int, size: int, ctx: RequestCtx) -> bytes:
        """A READ of ``size`` bytes at ``off`` (bytes) of a file the kernel opened itself (a
        read-only mount with ``kernel_opens``: no OPEN reached the daemon, so the READ names
        the inode and no handle). Served through the inode's implicit read-only handle, opened
        at its first READ as an OPEN would be (permissions were checked by the kernel at the
        open(2): ``default_permissions``) and kept, with its readahead state, until the kernel
        forgets the inode, until nothing read it for ``attr_timeout``
        (:meth:`sweep_inode_readers`) or until more than :attr:`inode_readers_max` are kept (the
        least recently read goes); one older than ``attr_timeout`` is checked against the
        backing file first (:meth:`_inode_reader`: a change made behind tierfs' back is seen
        within ``attr_timeout``). A control file's READ gets its last rendering, the same for
        every caller (:meth:`ControlPlane.read_rendered`). Raises FuseError."""
        if self._is_control(inode):
            with self._op("read"):
                return self.control.read_rendered(inode, ctx.uid, off, size)
        r = await self._inode_reader(inode, ctx)
        r.reading += 1
        r.used = time.monotonic()
        try:
            return await self.read(r.fh, off, size)
        finally:
            r.reading -= 1
            if r.dropped and r.reading == 0:
                await self.release(r.fh)

    def read_inode_now(self, inode: int, off: int, size: int) -> bytes | None:
        """:meth:`read_inode` with no await, or None (then call :meth:`read_inode`): a READ
        of a clean file whose implicit read handle is current and whose bytes one chunk of the
        RAM tier holds. The transport answers it as it reads the request, with no task: in a
        small-file epoch from the RAM tier, that task, its scheduling and the handler layers
        around the ``pread`` were most of the daemon's own time per file (perf)."""
        r = self.inode_readers.get(inode)
        if r is None or time.monotonic() - r.opened > self.attr_timeout:
            return None
        h = self.handles.handles.get(r.fh)
        entry = self.inodes.by_inode.get(inode)
        if not isinstance(h, FileHandle) or h.dirty is not None or entry is None or entry.dirty is not None:
            return None
        f = h.file
        if f is None or entry.path is None or entry.last_key not in (None, f.key) or off >= f.size:
            return None
        t0 = time.perf_counter()
        data = self.cache.read_resident_now(f, off, size, h.access)
        if data is None:
            return None
        self.inode_readers.move_to_end(inode)
        r.used = time.monotonic()
        self.requests["read"] += 1
        self.reads += 1
        self.read_bytes += size
        self.max_read = max(self.max_read, size)
        self._read_triggers(h, entry, f, off, size)
        self.request_seconds["read"] += time.perf_counter() - t0
        return data

    async def _inode_reader(self, inode: int, ctx: RequestCtx) -> _InodeReader:
        """The implicit read handle of ``inode``, opened if it has none (single-flight: the
        kernel's readahead sends a file's first READs together; each opened one). One older
        than ``attr_timeout`` is checked against the backing file first
        (:meth:`_still_current`) and opened again only if the file changed in place."""
        while (opening := self._inode_opening.get(inode)) is not None:
            await opening.wait()
        r = self.inode_readers.get(inode)
        if r is not None and time.monotonic() - r.opened <= self.attr_timeout:
            self.inode_readers.move_to_end(inode)
            return r
        self._inode_opening[inode] = done = trio.Event()
        try:
            if r is not None:
                if await self._still_current(inode, r):
                    r.opened = time.monotonic()
                    self.inode_readers.move_to_end(inode)
                    return r
                # (its cached pages are dropped by the LOOKUP or GETATTR that tells the kernel
                # the new attributes, never from here: this READ's own pages are locked until
                # it is answered, and an invalidation waits for them: a deadlock, seen)
                await self._drop_inode_reader(inode)
            return await self._open_inode_reader(inode, ctx)
        finally:
            del self._inode_opening[inode]
            done.set()

    async def _backing_now(self, inode: int, r: _InodeReader) -> str:
        """What the name of ``inode`` names now, against the backing file implicit read handle
        ``r`` holds: ``"same"`` (the same object, unchanged), ``"changed"`` (the same device
        and inode number, another size, mtime or ctime: changed in place), ``"other"`` (another
        object, or nothing) or ``"none"`` (``r`` holds no backing file: a dirty file's handle)."""
        h = self.handles.handles.get(r.fh)
        entry = self.inodes.by_inode.get(inode)
        if not isinstance(h, FileHandle) or h.file is None or entry is None or entry.path is None:
            return "none"
        try:
            st = await self.meta.run(self.tree.lstat, self.inodes.rel(entry))
        except OSError:
            return "other"
        i = h.file.identity
        if (st.st_dev, st.st_ino) != (i.dev, i.ino):
            return "other"
        same = (st.st_size, st.st_mtime_ns, st.st_ctime_ns) == (i.size, i.mtime_ns, i.ctime_ns)
        return "same" if same else "changed"

    async def _still_current(self, inode: int, r: _InodeReader) -> bool:
        """Whether implicit read handle ``r`` still serves what the kernel's inode is: False
        only when the backing file it holds changed in place (then it is opened again, for the
        new content). A name that now names another object, or nothing, keeps it: the kernel's
        inode is the object it opened (a reader of a file replaced by a rename reads the old
        file to its end, as on a local filesystem; the new one gets an inode of its own at its
        lookup)."""
        return await self._backing_now(inode, r) != "changed"

    def _changed_in_place(self, entry: InodeEntry) -> None:
        """The namespace told the kernel new attributes of ``entry``'s backing object, changed
        in place behind tierfs' back (a LOOKUP or GETATTR after attr_timeout: at a path walk,
        a stat, a read(2)). With opens answered by the kernel, nothing else would drop its cached
        pages when the size and mtime did not change: they go now, and the inode's implicit
        read handle is checked at its next READ."""
        r = self.inode_readers.get(entry.inode)
        if r is not None:
            r.opened = -math.inf
        self._pending_invals.append(entry.inode)

    async def _send_invals(self) -> None:
        """Have the kernel drop its cached pages of the inodes :meth:`_changed_in_place`
        named, before the reply that told it their new attributes goes (else the read(2)
        that asked could still read old pages: a whole-file read was seen half old, half new).
        With opens answered by the kernel, nothing else drops them when a file changed in place
        behind tierfs' back without a new size or mtime (``rsync --inplace -a``, ``cp -p``
        restore the mtime; the kernel drops pages only on a size or mtime change,
        auto_inval_data). The transport writes each from a thread while this loop serves on
        (the kernel waits for locked pages, which READs in flight hold). Only from LOOKUP and
        GETATTR: the kernel locks no page of the file while it waits for those (a READ's
        pages stay locked until its reply, so a READ must never wait for this)."""
        while self._pending_invals:
            inode = self._pending_invals.pop()
            if self.on_inval_inode is not None:
                self.inode_invalidations += 1
                await self.on_inval_inode(inode)

    async def sweep_inode_readers(self) -> None:
        """Let go, every ``attr_timeout`` (at least 1 s), of the implicit read handles nothing
        read for ``attr_timeout``: each holds its backing file open (a file deleted in the
        backing directory kept its space; the kernel forgets inodes only under memory
        pressure, so idle handles used to pile up to the cap). Only those whose name still
        names the object they hold: one opened again later gets that same object. A handle
        whose file was replaced or deleted behind tierfs' back stays until the kernel forgets
        the inode (or the cap lets it go): a program may hold that file open, pausing, and must
        read the old file to its end, not the new one (or fail). Runs for the mount's life."""
        while True:
            await trio.sleep(max(self.attr_timeout, 1.0))
            now = time.monotonic()
            for inode, r in list(self.inode_readers.items()):  # least recently read first
                if now - r.used <= self.attr_timeout:
                    break
                if r.reading == 0 and self.inode_readers.get(inode) is r \
                        and await self._backing_now(inode, r) != "other" \
                        and r.reading == 0 and self.inode_readers.get(inode) is r:
                    await self._drop_inode_reader(inode)

    async def _open_inode_reader(self, inode: int, ctx: RequestCtx) -> _InodeReader:
        try:
            opened = await self.open(inode, os.O_RDONLY, ctx)
        except FuseError as e:
            if e.errno != errno.ESTALE:
                raise
            # changed behind tierfs' back since the kernel was told its attributes: an OPEN's
            # ESTALE makes the kernel look the name up again, which a READ cannot; this open
            # (told once: InodeEntry.reval_sent) serves the new content, the kernel gets the
            # new size at its next GETATTR (attr_timeout) and drops its pages then
            # (auto_inval_data)
            opened = await self.open(inode, os.O_RDONLY, ctx)
        h = self.handles.handles.get(opened.fh)
        entry = self.inodes.by_inode.get(inode)
        if isinstance(h, FileHandle) and h.file is not None and entry is not None and entry.dev_ino[0] >= 0 \
                and (h.file.identity.dev, h.file.identity.ino) != entry.dev_ino:
            # the name names another object now (replaced or swapped behind tierfs' back) and
            # this inode's own is no longer held: never serve the other one's bytes (a reader
            # that paused got the new file's rest after its old file's start); a stale handle,
            # as NFS answers
            await self.release(opened.fh)
            raise FuseError(errno.ESTALE)
        self.inode_reader_opens += 1
        # room first: a release awaits, and the new reader must not be let go meanwhile (other
        # READs may add theirs and make it the oldest) before its READ counts as in flight
        while self.inode_readers and len(self.inode_readers) >= self.inode_readers_max:
            await self._drop_inode_reader(next(iter(self.inode_readers)))
        now = time.monotonic()
        r = self.inode_readers[inode] = _InodeReader(opened.fh, now, now)
        return r

    async def _drop_inode_reader(self, inode: int) -> None:
        """Let go of ``inode``'s implicit read handle (released now, or by the last READ in
        flight on it)."""
        r = self.inode_readers.pop(inode, None)
        if r is None or r.dropped:
            return
        r.dropped = True
        if r.reading == 0:
            await self.release(r.fh)

    async def _read_file(self, h: FileHandle, entry: InodeEntry | None) -> BackingFile:
        """The backing file a clean read comes from: the handle's, or (opened while dirty, or
        written back since) the backing file the name has now. An inode whose name is gone
        (unlinked, or renamed over) has no backing file to move to: its handles keep reading
        the one they hold open, as on a local filesystem. (They got ESTALE when another open
        had meanwhile found a different backing file under the name, in the moment a rename
        over it waits for a write-back's commit.)"""
        f = h.file
        if f is not None and (entry is None or entry.path is None):
            return f
        if f is None or (entry is not None and entry.last_key not in (None, f.key)):
            if entry is None or entry.path is None:
                raise FuseError(errno.ESTALE)
            if f is not None:
                self.ns.release_backing(f)
            f = h.file = await self.ns.backing_file(self.inodes.rel(entry))
            entry.last_key = f.key
        return f

    def _read_triggers(self, h: FileHandle, entry: InodeEntry | None, f: BackingFile, off: int,
                       size: int) -> None:
        """What a read tells the predictors: readahead (queued first: the scheduler then
        coalesces the demand fetch with the following chunks into one long transfer) and the
        end of a file (next-file prediction)."""
        ahead = self.readahead.on_read(h.readahead, off, min(size, f.size - off), f.size)
        h.access.random = h.readahead.window == 0
        if ahead:
            self.cache.prefetch(f, ahead)
        if self.on_read_end is not None and entry is not None and entry.path is not None and (
                (ahead and ahead[-1] == (f.size - 1) // self.cache.chunk_size)
                or (off == 0 and f.size <= self.cache.chunk_size)):  # a one-chunk file: at once
            self.on_read_end(h.pid, entry.path)

    async def control_ioctl(self, inode: int, data: bytes, ctx: RequestCtx) -> bytes:
        """One piece of a control request sent as an ioctl of the command file (a read-only
        mount: :data:`tierfs_hints.wire.CTL_IOC`); the ioctl's out buffer. Raises FuseError
        (ENOTTY: not the command file; the rest as :meth:`ControlPlane.ioctl`)."""
        with self._op("ioctl", changes=False):  # (a piece may wait for its reply: MAX_WAIT_S)
            return await self.control.ioctl(inode, data, ctx, self.nursery)

    async def write(self, fh: int, off: int, buf: bytes, ctx: RequestCtx | None = None,
                    kill_suidgid: bool = False) -> int:
        """Write ``buf`` at byte ``off`` of handle ``fh``; the bytes written. ``kill_suidgid``:
        writer ``ctx`` lacks CAP_FSETID, so set-user-ID and set-group-ID go (:meth:`_kill_suidgid`)."""
        with self._op("write"):
            h = self.handles.get(fh)
            if isinstance(h, ControlHandle):
                return await self.control.write(h, buf, self.nursery)
            assert isinstance(h, FileHandle)
            if not h.writer:
                raise FuseError(errno.EBADF)
            df = await self._writable(h)
            if h.append:
                off = df.size
            self.writes += 1
            self.write_bytes += len(buf)
            n: int = await self.wb.write(df, off, buf)
            if kill_suidgid and df.fd >= 0 and os.fstat(df.fd).st_mode & _SUIDGID:
                # (the kernel sets the flag on every write of a caller without CAP_FSETID,
                # whatever the file's mode: an fstat first, the whole check only for set-ID files)
                await self._kill_suidgid(h.inode, None, ctx)
            return n

    async def _writable(self, h: FileHandle) -> DirtyFile:
        """The dirty file a write through ``h`` goes to; the first write through a handle makes
        the file dirty (a copy-up)."""
        df = h.dirty
        if df is None or df.state.value == "clean":
            df = await self.ns.make_dirty(self.inodes.get(h.inode), truncate=False)
            if h.dirty is not None:
                await self.wb.closed(h.dirty, True)
            h.dirty = df
            self.wb.opened(df, True)
        return df

    async def flush(self, fh: int) -> None:
        """close(2). Without passthrough writes (:attr:`flush_at_close` false) there is nothing
        to do (a dirty file's work is at release): ENOSYS, which the kernel takes as success
        and remembers, sending no FLUSH again for the mount's life (``fc->no_flush``; one
        round trip less per close). With them, a handle that wrote through the kernel has its
        writes taken in here, so the writer's close answers ENOSPC when the backing store
        cannot take what the file grew by (docs/writes.md), as a daemon-served write does.
        Raises FuseError (ENOSYS; ENOSPC)."""
        if not self.flush_at_close:
            self.requests["flush"] += 1
            raise FuseError(errno.ENOSYS)
        with self._op("flush"):
            h = self.handles.get(fh)
            if isinstance(h, FileHandle):
                await self._after_passthrough(h)

    async def fsync(self, fh: int, datasync: bool) -> None:
        with self._op("fsync"):
            h = self.handles.get(fh)
            if isinstance(h, FileHandle):
                await self._after_passthrough(h)
            df = h.dirty if isinstance(h, FileHandle) else None
            if isinstance(h, FileHandle) and h.lease is not None and h.lease.key[0] == "backing" and h.file is not None:  # type: ignore[index]
                await self.meta.in_thread(os.fsync, h.file.fd)  # written in the backing file in place
                return
            if isinstance(h, FileHandle) and df is None and h.lease is not None and h.lease.writable:
                entry = self.inodes.by_inode.get(h.inode)
                df = entry.dirty if entry is not None else None  # written in place, taken in above
            if df is not None and df.state.value != "clean":
                await self.wb.fsync(df)

    # -- passthrough ----------------------------------------------------------------------
    async def lease(self, fh: int, *, clean: bool = True, written: bool = False) -> Lease | None:
        """For a transport that can hand an open file to the kernel (passthrough): a lease on
        the file holding every byte of handle ``fh``, or None (the daemon serves the handle).

        A handle of a dirty file: its write-tier data file (writable for a writer). A reader
        of a clean file: the tier file holding all of it, resident and current. A writer of a
        clean file: None (its first write makes the dirty copy, in the daemon). The lease is
        kept on the handle and given back at :meth:`release` (or :meth:`drop_lease`).
        ``clean``: False leases dirty files only. ``written``: the file's other open handles
        read its write-tier data file (the transport registered it): a reader then leases that
        data file even once the file is written back and clean, while the file still holds it
        (the same bytes; the kernel wants every open of an inode on one backing file)."""
        with fuse_errors("lease"):
            h = self.handles.get(fh)
            if not isinstance(h, FileHandle) or h.lease is not None:
                return None
            lease = await self._lease(h, fh, clean, written)
            entry = self.inodes.by_inode.get(h.inode)
            if lease is not None and lease.writable and h.uid != 0 and entry is not None:
                await self._watch_setid(h, entry)
            if lease is not None and not h.writer and self.on_read_end is not None and entry is not None \
                    and entry.path is not None:
                # its reads go to the kernel, never to the daemon, so the end of the file is
                # never seen: predict the next file now (shards read in name order whose files
                # were all resident passed through and broke the chain of predictions)
                self.on_read_end(h.pid, entry.path)
            return lease

    async def _lease(self, h: FileHandle, fh: int, clean: bool, written: bool) -> Lease | None:
        """The body of :meth:`lease` (``h``: the handle of ``fh``)."""
        entry = self.inodes.by_inode.get(h.inode)
        tp = self.tier_passthrough.get(h.inode)
        if tp is not None and tp.handles <= 0:  # kept after its last close
            kept = self._reuse_kept(h, entry, tp)
            if kept is not None:
                return kept
            tp = None
        if tp is not None:
            return self._share_tier_copy(fh, h, tp)
        df = entry.dirty if entry is not None and entry.dirty is not None else h.dirty
        if df is not None and df.state.value != "clean":
            if h.dirty is not df:
                return None  # opened before the file became dirty: the daemon serves it
            if h.writer and h.uid != 0 and not written and df.fd >= 0 and os.fstat(df.fd).st_mode & _SUIDGID:
                # a set-user/group-ID file opened for writing by a user: its writes come to
                # the daemon, which drops the bits (_kill_suidgid); a write the kernel passes
                # through never reaches it. (Not while readers pass through to the data file:
                # refused, the open would fail ETXTBSY; watched instead, in lease().)
                return None
            lease = await self.wb.lease_data(df, h.writer)
        elif written and df is not None and not h.writer and df.fd >= 0:
            lease = await self.wb.lease_data(df, False)
        elif not clean or h.writer or h.file is None or (entry is not None and entry.last_key not in (None, h.file.key)):
            return None
        else:
            tp = _TierPassthrough(None, h.file.key, -1)
            lease = await self.cache.lease_resident(h.file, on_release=partial(self._tier_lease_released, h.inode, tp))
            if lease is None and self.backing_passthrough:
                lease = self._lease_backing(h, tp)
            if lease is not None:
                tp.lkey, tp.fd, tp.handles = lease.key, lease.fd, 1
                tp.seen = tp.look()
                tp.trust_times = time.time_ns() - tp.seen[2] > 100_000_000
                if h.inode in self.tier_passthrough:  # another open won the race: it shares
                    lease.release()
                    return self._share_tier_copy(fh, h, self.tier_passthrough[h.inode])
                self.tier_passthrough[h.inode] = tp
                if tp.kind == "backing":  # its truncates go to the backing file (Namespace)
                    self.ns.backing_in_place.add(h.inode)
                elif h.file.size <= self.cache.chunk_size and self.kept_max:
                    tp.keeper = self.cache.keep_lease(tp.lkey, partial(self._drop_kept, h.inode, tp))
        if fh not in self.handles.handles:  # released while we waited
            if lease is not None:
                lease.release()
            return None
        h.lease = lease
        return lease

    def _lease_backing(self, h: FileHandle, tp: _TierPassthrough) -> Lease | None:
        """A lease on the open backing file of reader ``h`` (a miss on a parallel store): the
        kernel reads the store directly; every chunk of the file is queued for a tier
        (speculative: after demand and hinted fetches) once the last of its readers closes,
        since those reads never reach the daemon. The descriptor is the shared BackingFile's, open while ``h`` is."""
        f = h.file
        if f is None or f.fd < 0 or f.stale or f.size == 0 or f.size > self.cache.capacity():
            # (a file the tiers cannot hold whole is not filled: the daemon serves it, and
            # fetches only what is read; a random reader of a store-sized file would else
            # queue the whole file at every open)
            return None
        lkey = ("backing", f.key)
        on_release = partial(self._tier_lease_released, h.inode, tp)
        lease = self.backing_leases.share_now(lkey, tier="backing", size=f.size, writable=False,
                                              on_release=on_release)
        if lease is None:
            self.backing_leases.begin(lkey)
            lease = self.backing_leases.finish(lkey, f.fd, tier="backing", size=f.size,
                                               writable=False, on_release=on_release)
        tp.kind = "backing"
        tp.fill = f
        f.kernel_reads = True
        return lease

    def _share_tier_copy(self, fh: int, h: FileHandle, tp: _TierPassthrough) -> Lease | None:
        """A lease on the tier copy the inode's other opens pass through to (see
        :class:`_TierPassthrough`). A writer writes it in place: the cache drops it at the
        last release, attributes come from it, and its release takes it in as the file's
        dirty copy (:meth:`_take_in_place`)."""
        on_release = partial(self._tier_lease_released, h.inode, tp)
        if tp.kind == "backing":
            lease = self.backing_leases.share_now(tp.lkey, tier="backing", size=0, writable=h.writer,
                                                  on_release=on_release)
            if lease is None:
                return None
            tp.handles += 1
            h.lease = lease
            return lease
        lease = self.cache.share_lease(tp.lkey, writable=h.writer, on_release=on_release)
        if lease is None:
            return None
        tp.handles += 1
        if h.writer:
            self._release_keeper(tp)  # written in place: dropped from the cache at the last close
            self.ns.written_in_place[h.inode] = (tp.fd, tp.seen)
            self.wb.in_place_opens += 1
        h.lease = lease
        return lease

    def _tier_lease_released(self, inode: int, tp: _TierPassthrough) -> None:
        tp.handles -= 1
        if tp.handles <= 0 and tp.fill is not None:
            f, tp.fill = tp.fill, None
            if f.fd >= 0 and not f.stale:
                self.cache.fill(f)
        if tp.handles <= 0 and self.tier_passthrough.get(inode) is tp:
            if tp.keeper is not None and inode not in self.ns.written_in_place:
                if not self._keep_descriptor(inode, tp):
                    self._end_passthrough(inode, tp)  # it would hold one descriptor too many
                    return
                self.kept_passthrough[inode] = tp
                self.kept_passthrough.move_to_end(inode)
                if len(self.kept_passthrough) > self.kept_max:
                    old, otp = next(iter(self.kept_passthrough.items()))
                    self._drop_kept(old, otp)
                return
            self._end_passthrough(inode, tp)

    def _keep_descriptor(self, inode: int, tp: _TierPassthrough) -> bool:
        """Where the kept copy ``tp`` (its last open just closed) keeps its descriptor: open,
        while fewer than :attr:`kept_fds_max` kept copies hold one; else parked
        (:meth:`Cache.park_kept`: a RAM tier copy, reopened at its next open); else (another
        tier's copy, whose reopen would take a thread) the slot of a RAM copy holding one,
        which parks. False: not kept (no slot)."""
        if self.kept_fds < self.kept_fds_max:
            self._hold_descriptor(inode, tp)
            return True
        # An open descriptor spares the next open a reopen of the tier file and its fstat (~12
        # us of ~60 in an open answered at once; the close at the release too): RAM copies
        # parked always made an epoch over 2,400 resident files cost the daemon 156-171 us
        # per file, against 126-132 holding descriptors (bench/profile_epoch.py --drop).
        if self.cache.park_kept(tp.lkey):
            tp.fd = -1  # (until the next open gives it one again)
            return True
        while self._kept_ram_fds:
            oinode, otp = self._kept_ram_fds.popitem(last=False)
            if otp.holds_fd and self.cache.park_kept(otp.lkey):
                otp.holds_fd, otp.fd = False, -1
                self.kept_fds -= 1
                self._hold_descriptor(inode, tp)
                return True
        return False

    def _hold_descriptor(self, inode: int, tp: _TierPassthrough) -> None:
        tp.holds_fd = True
        self.kept_fds += 1
        if self.cache.parks(tp.lkey):  # (one that could do without it, for another tier's)
            self._kept_ram_fds[inode] = tp

    def _end_passthrough(self, inode: int, tp: _TierPassthrough) -> None:
        """No open of ``inode`` passes through to ``tp`` any more, and it is not kept."""
        self._unkept(inode, tp)
        self._release_keeper(tp)
        if self.tier_passthrough.get(inode) is tp:
            del self.tier_passthrough[inode]
            self.ns.written_in_place.pop(inode, None)
            self.ns.backing_in_place.discard(inode)
            if self.on_passthrough_end is not None:
                self.on_passthrough_end(inode)

    def _unkept(self, inode: int, tp: _TierPassthrough) -> None:
        """``tp`` leaves :attr:`kept_passthrough` (reused by an open, or let go)."""
        if self.kept_passthrough.pop(inode, None) is not None and tp.holds_fd:
            tp.holds_fd = False
            self.kept_fds -= 1
            self._kept_ram_fds.pop(inode, None)

    def _release_keeper(self, tp: _TierPassthrough) -> None:
        keeper, tp.keeper = tp.keeper, None
        if keeper is not None:
            self.cache.unkeep(tp.file_key)
            keeper.release()

    def _drop_kept(self, inode: int, tp: _TierPassthrough) -> None:
        """Let go of the kept lease of ``tp`` (the cache wants its chunks, the file changed,
        or more are kept than ``kept_max``); with no open left, its
        passthrough ends."""
        if tp.handles <= 0:
            self._end_passthrough(inode, tp)
        else:
            self._release_keeper(tp)

    def _reuse_kept(self, h: FileHandle, entry: InodeEntry | None, tp: _TierPassthrough) -> Lease | None:
        """The lease for reader ``h`` on the tier copy kept since the file's last close, if
        it is still the current copy of what ``h`` opened; else the kept one is let go
        (None: the caller leases as for a first open)."""
        f = h.file
        dirty = entry.dirty if entry is not None else None
        lease = None
        if (not h.writer and f is not None and h.dirty is None and tp.kind == "tier"
                and (dirty is None or dirty.state.value == "clean") and tp.file_key == f.key
                and (entry is None or entry.last_key in (None, f.key))):
            lease = self.cache.reuse_kept(tp.lkey, f, on_release=partial(self._tier_lease_released, h.inode, tp))
        if lease is None:
            self._drop_kept(h.inode, tp)
            return None
        self._unkept(h.inode, tp)
        self.kept_reuses += 1
        tp.handles = 1
        tp.fd = lease.fd  # (a parked lease has a descriptor again)
        h.lease = lease
        return lease

    def drop_lease(self, fh: int) -> None:
        """The transport could not use the lease of ``fh``: give it back (the daemon serves)."""
        h = self.handles.handles.get(fh)
        if isinstance(h, FileHandle) and h.lease is not None:
            lease, h.lease = h.lease, None
            lease.release()

    async def _after_passthrough(self, h: FileHandle) -> None:
        """Take in what the kernel wrote through a writable lease (size, mtime, generation)."""
        if h.lease is None or not h.lease.writable:
            return
        if isinstance(h.lease.key, tuple) and h.lease.key[0] == "tier":
            await self._take_in_place(h)
        elif isinstance(h.lease.key, tuple) and h.lease.key[0] == "backing":
            # written in the backing file itself: what the cache holds of the old version is
            # not the file any more (its identity changed), and the kernel keeps its own size
            await self.cache.drop_file(str(h.lease.key[1]))
            entry = self.inodes.by_inode.get(h.inode)
            if entry is not None:
                entry.told = None
        elif h.dirty is not None:
            await self.wb.after_passthrough_write(h.dirty)
        seen = self._suid_watch.get(h.inode)
        entry = self.inodes.by_inode.get(h.inode)
        if seen is not None and h.uid != 0 and entry is not None and entry.path is not None:
            a = await self.ns.entry_attrs(entry)
            if (a.st_size, a.st_mtime_ns) != seen and self._suid_watch.pop(h.inode, None) is not None:
                await self._kill_suidgid(h.inode, a, Ctx(h.uid, h.gid, h.pid))  # written since

    async def _take_in_place(self, h: FileHandle) -> None:
        """A writer's passthrough writes went into the tier copy (in place): the file's dirty
        copy is made to hold that tier file's bytes, journalled and due for write-back as any
        file closed after writes (at fsync: durable in the write tier)."""
        assert h.lease is not None
        tp = self.tier_passthrough.get(h.inode)
        if tp is None:
            return
        now = tp.look()
        if now == tp.seen and tp.trust_times:
            return  # opened for writing, nothing written
        self.cache.mark_modified(tp.file_key)  # its chunks are not the backing file's any more
        entry = self.inodes.by_inode.get(h.inode)
        if entry is None or entry.path is None:
            return  # unlinked: nothing will be written back
        await self.ns.take_in_place(entry, tp.fd)
        tp.seen, tp.trust_times = now, True
        self.ns.written_in_place[h.inode] = (tp.fd, tp.seen)

    async def release(self, fh: int) -> None:
        self.requests["release"] += 1
        with logged_errors("release"):  # the kernel ignores release's answer
            h = self.handles.pop(fh)
            if isinstance(h, ControlHandle):
                self.control.release(h)
            if isinstance(h, FileHandle):
                if h.lease is not None:
                    with logged_errors("release: taking in passthrough writes"):
                        await self._after_passthrough(h)
                self._let_go(h)  # the lease before closed(): write-back may start at once
                if h.dirty is not None:
                    await self.wb.closed(h.dirty, h.writer)

    async def release_left(self) -> int:
        """Release every handle still open once the mount is gone (its FUSE session ended).
        The kernel drops the RELEASEs still queued when its connection closes (at the last
        close of a lazily unmounted mount's files, fs/fuse/dev.c ``fuse_abort_conn``): a
        writer's file then stayed counted as open for ever, and was reported "not written
        back" at exit although it was. Returns how many were released."""
        left = list(self.handles.handles.items())
        for fh, h in left:
            if isinstance(h, DirHandle):
                await self.releasedir(fh)
            else:
                await self.release(fh)
        return len(left)

    def release_now(self, fh: int, *, count: bool = True) -> bool:
        """The release of handle ``fh`` done now, with no await, when it needs none: a file
        handle with no dirty copy and no writable lease (every open of a clean file for
        reading). False (nothing done): call :meth:`release`. A transport answers it as it
        reads it, with no task: a small-file epoch releases every file it reads. ``count``:
        False for a handle the kernel never saw (an open undone before its reply)."""
        h = self.handles.handles.get(fh)
        if not isinstance(h, FileHandle) or h.dirty is not None or (h.lease is not None and h.lease.writable):
            return False
        if count:
            self.requests["release"] += 1
        with logged_errors("release"):
            self.handles.pop(fh)
            self._let_go(h)
        return True

    def _let_go(self, h: FileHandle) -> None:
        """What the release of file handle ``h`` gives back without waiting: its lease, its
        readahead and cache access state, its backing file."""
        if h.lease is not None:
            lease, h.lease = h.lease, None
            lease.release()
        if h.inode in self._suid_watch and not self._passthrough_writers(h.inode):
            del self._suid_watch[h.inode]
        self.readahead.forget(h.readahead)
        self.cache.forget_access(h.access)
        if h.file is not None:
            self.ns.release_backing(h.file)
