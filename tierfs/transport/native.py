"""The native transport: the kernel FUSE protocol spoken over ``/dev/fuse`` in the daemon's trio
loop, driving the same :class:`~tierfs.fs.handlers.Handlers` as the pyfuse3 transport.

Why a second transport: libfuse 3.14 (under pyfuse3) answers INIT itself with protocol 7.31 and
cannot negotiate what 7.40 offers, above all kernel *passthrough* (``FOPEN_PASSTHROUGH`` with a
backing id: reads, writes and mmap of an open file go straight to a tier file, never through
the daemon). It also lets a request be interrupted (``FUSE_INTERRUPT``: the request's cancel
scope is cancelled and it is answered EINTR).

Shape: :func:`mount_fuse` opens ``/dev/fuse`` and calls mount(2); :meth:`NativeSession.init`
answers INIT; :meth:`NativeSession.main` serves requests with a pool of worker tasks, one of
which reads at a time (non-blocking descriptor, ``trio.lowlevel.wait_readable``: one read is a
copy of at most 1 MiB, ~0.1 ms, so it stays on the loop) and then serves what it read while the
next reads. Wire format: :mod:`tierfs.transport.codec`.

Passthrough (:class:`Passthrough`): at open the handler layer is asked for a lease
(:meth:`Handlers.lease`); the lease's descriptor is registered with
``FUSE_DEV_IOC_BACKING_OPEN`` once per inode, shared by every concurrent open of it and closed
at the last release (a small clean file's tier copy may stay registered after it, while the
handler layer keeps it: :attr:`Handlers.kept_passthrough`). The kernel refuses to mix, on one
inode, opens in page-cache mode and opens in passthrough mode (``fs/fuse/iomode.c``: the open
fails with EIO), so the mode of each inode's open handles is tracked here.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import logging
import os
import select
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass, field
from typing import Any

import trio

from tierfs import loopwatch
from tierfs.errors import MountError
from tierfs.fs.api import Ctx, FuseError, OpenReply, SetAttr
from tierfs.fs.handlers import Handlers
from tierfs.transport import codec as c
from tierfs_hints import wire

log = logging.getLogger("tierfs.transport")

MAX_PAGES = 256  # 1 MiB requests (4 KiB pages): the chunk-sized reads and writes tierfs wants
MAX_WRITE = MAX_PAGES * 4096
# the kernel refuses a read buffer smaller than max_write + one page (FUSE_MIN_READ_BUFFER)
READ_BUFFER = MAX_WRITE + 4096
MAX_BACKGROUND = 64  # async requests (readahead, async reads) the kernel keeps in flight
CONGESTION = 48
# Write data held by requests in flight: past this the reader stops taking requests until some
# finish (the kernel queues them meanwhile). 256 MiB: 256 concurrent 1 MiB writes.
MAX_WRITE_BYTES_IN_FLIGHT = 256 << 20
BUSY_POLL_MISSES = 4  # polls in a row that found nothing before reads stop polling for a while
BUSY_POLL_SKIP = 64  # reads that then sleep at once before polling again
MAX_IDLE_WORKERS = 8  # request workers kept waiting for work; more end (a burst started them)
BURST = 16  # requests a worker serves back to back before it lets the loop's other tasks run
# Opcodes whose work may be cancelled by FUSE_INTERRUPT: those that wait in the daemon for data
# (a read waiting for the backing store's scheduler, a hint's wait on a control file, a
# write-back at fsync). Writes, namespace changes and releases run to completion (a half-done
# change is worse than a slow one). Lookups, attributes, xattrs and directory listings are not
# worth a cancel scope each (~5 us, 10-15 % of a lookup's round trip in a walk): their only
# wait is a metadata call, which a cancel cannot stop in its worker thread anyway.
INTERRUPTIBLE = frozenset({c.READ, c.FSYNC, c.IOCTL})
NO_REPLY = frozenset({c.FORGET, c.BATCH_FORGET})
_TASK_NAMES = {op: f"fuse.{name}" for op, name in c.OPCODE_NAMES.items()}  # (not an f-string per request)
_OPENS = {c.OPEN: 0, c.OPENDIR: 0, c.CREATE: c.ENTRY_HEAD.size + c.ATTR.size}  # where fh is in the reply
# Replies that count a lookup of the inode they name (nodeid first in the reply): one the kernel
# did not take (its caller was interrupted meanwhile) is given back, or the inode would be kept
# for ever (libfuse does the same: forget_node when fuse_reply_entry fails)
_ENTRIES = frozenset({c.LOOKUP, c.MKNOD, c.MKDIR, c.SYMLINK, c.LINK, c.CREATE})
CAP_SYS_ADMIN = 21
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOATIME = 1, 2, 4, 1024
MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def has_cap_sys_admin() -> bool:
    """Whether this process holds CAP_SYS_ADMIN (``FUSE_DEV_IOC_BACKING_OPEN`` needs it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def mount_fuse(mountpoint: str, *, fsname: str, subtype: str, allow_other: bool,
               read_only: bool = False) -> tuple[int, str]:
    """Open ``/dev/fuse`` and mount it on ``mountpoint`` with mount(2) (needs CAP_SYS_ADMIN).
    Options as the pyfuse3 transport's: ``default_permissions`` (the kernel checks modes),
    ``noatime``, ``nosuid``, ``nodev``; ``read_only``: ``MS_RDONLY``. Returns the descriptor (non-blocking, close-on-exec) and
    the mountpoint resolved (before mounting: once mounted, resolving it asks the daemon, which
    must then be serving). Raises MountError."""
    mountpoint = os.path.realpath(mountpoint)
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    st = os.stat(mountpoint)
    opts = (f"fd={fd},rootmode={st.st_mode & 0o170000:o},user_id={os.geteuid()},"
            f"group_id={os.getegid()},default_permissions,max_read={MAX_WRITE}")
    if allow_other:
        opts += ",allow_other"
    rc = _libc.mount(fsname.encode(), mountpoint.encode(), f"fuse.{subtype}".encode(),
                     MS_NOSUID | MS_NODEV | MS_NOATIME | (MS_RDONLY if read_only else 0), opts.encode())
    if rc != 0:
        e = ctypes.get_errno()
        os.close(fd)
        raise MountError(f"FUSE mount of {mountpoint} failed: {os.strerror(e)}")
    return fd, mountpoint


def unmount_detach(mountpoint: str) -> bool:
    return _libc.umount2(mountpoint.encode(), MNT_DETACH) == 0


class _Inline:
    """``await _Inline(coro, on_suspend)`` awaits ``coro`` and calls ``on_suspend()`` the first
    time it suspends (yields to trio), before it does; never if it completes without
    suspending. It forwards what trio sends or throws in, as ``await`` would."""

    __slots__ = ("coro", "on_suspend")

    def __init__(self, coro: Coroutine[Any, Any, Any], on_suspend: Callable[[], None]) -> None:
        self.coro = coro
        self.on_suspend = on_suspend

    def __await__(self) -> Generator[Any, Any, Any]:
        coro = self.coro
        try:
            out = coro.send(None)
        except StopIteration as e:
            return e.value
        self.on_suspend()
        while True:
            try:
                sent = yield out
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as e:  # noqa: BLE001 - thrown in by trio: the coroutine's to handle
                try:
                    out = coro.throw(e)
                except StopIteration as s:
                    return s.value
            else:
                try:
                    out = coro.send(sent)
                except StopIteration as s:
                    return s.value


def _fstype(real: str) -> str | None:
    """The type of what is mounted on top of ``real`` (a resolved path; /proc/self/mounts), or
    None."""
    found = None
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and fields[1].encode().decode("unicode_escape") == real:
                found = fields[2]
    return found


@dataclass
class _InodeIO:
    """The open handles of one inode, by the mode the kernel keeps them in."""

    cached: int = 0  # opens answered without passthrough (page-cache mode)
    pt: int = 0  # passthrough opens
    backing_id: int = 0
    ident: tuple[int, int] | None = None  # (st_dev, st_ino) of the registered file
    kind: str = ""  # "tier" (a clean file's tier copy: read-only) or "data" (a dirty file)
    pt_wrote: bool = False  # a passthrough writer had it: the next cached open drops the cache


@dataclass
class PassthroughStats:
    opens: int = 0
    bytes: int = 0  # bytes made available (a lease's size per open)
    conflicts: int = 0  # opens refused: the inode was open in passthrough mode on another file
    ioctl_failures: int = 0
    registrations: int = 0  # FUSE_DEV_IOC_BACKING_OPEN calls
    kept_reuses: int = 0  # opens answered with a backing id kept since the inode's last close
    by_tier: Counter[str] = field(default_factory=Counter)


class Passthrough:
    """Backing ids per inode (one per inode, shared by its concurrent opens) and the per-inode
    open mode. ``dev_fd``: the /dev/fuse descriptor."""

    def __init__(self, dev_fd: int, kept: Callable[[int], bool] = lambda inode: False) -> None:
        """``kept(inode)``: the handler layer still holds the inode's tier copy (a tier or
        backing file's registration then outlives the inode's last close, until
        :meth:`ended`)."""
        self.dev_fd = dev_fd
        self.kept = kept
        self.inodes: dict[int, _InodeIO] = {}
        self.by_fh: dict[int, tuple[int, str, bool]] = {}  # fh -> (inode, "pt"|"cached"|"direct", writer)
        self.stats = PassthroughStats()

    def io(self, inode: int) -> _InodeIO:
        io = self.inodes.get(inode)
        if io is None:
            io = self.inodes[inode] = _InodeIO()
        return io

    def register(self, inode: int, fd: int, kind: str) -> int | None:
        """The backing id for an open of ``inode`` whose bytes are in ``fd``: the inode's own if
        it has one for the same file, a new one if it has none; None on a conflict (another
        file registered) or a failed ioctl."""
        io = self.io(inode)
        st = os.fstat(fd)  # of an open descriptor: no I/O
        ident = (st.st_dev, st.st_ino)
        if io.pt:
            if io.ident != ident:
                return None
            return io.backing_id
        if io.backing_id:  # kept since the last close
            if io.ident == ident:
                self.stats.kept_reuses += 1
                return io.backing_id
            self._close_backing(io)
        self.stats.registrations += 1
        try:
            # mutate=True: the ioctl's return value (the backing id) comes back
            bid = fcntl.ioctl(self.dev_fd, c.DEV_IOC_BACKING_OPEN, c.backing_map(fd), True)
        except OSError as e:
            self.stats.ioctl_failures += 1
            log.warning("passthrough: FUSE_DEV_IOC_BACKING_OPEN failed (%s); serving through the daemon", e)
            return None
        io.backing_id, io.ident, io.kind = int(bid), ident, kind
        return io.backing_id

    def opened(self, fh: int, inode: int, mode: str, writer: bool) -> None:
        io = self.io(inode)
        if mode == "pt":
            io.pt += 1
        elif mode == "cached":
            io.cached += 1
        self.by_fh[fh] = (inode, mode, writer)

    def released(self, fh: int) -> None:
        got = self.by_fh.pop(fh, None)
        if got is None:
            return
        inode, mode, writer = got
        io = self.inodes.get(inode)
        if io is None:
            return
        if mode == "pt":
            io.pt -= 1
            io.pt_wrote |= writer
            # a written file's data file goes now; a tier copy's registration when the
            # handler layer lets the copy go (ended), which it may keep for the next open
            if io.pt == 0 and (io.kind == "data" or not self.kept(inode)):
                self._close_backing(io)
        elif mode == "cached":
            io.cached -= 1
        if io.pt == 0 and io.cached == 0 and not io.pt_wrote and not io.backing_id:
            del self.inodes[inode]

    def ended(self, inode: int) -> None:
        """The handler layer let go of ``inode``'s tier copy: its registration goes, unless an
        open still uses it."""
        io = self.inodes.get(inode)
        if io is None or io.pt or not io.backing_id or io.kind == "data":
            return
        self._close_backing(io)
        if io.cached == 0 and not io.pt_wrote:
            del self.inodes[inode]

    def _close_backing(self, io: _InodeIO) -> None:
        bid, io.backing_id, io.ident, io.kind = io.backing_id, 0, None, ""
        if bid:
            try:
                fcntl.ioctl(self.dev_fd, c.DEV_IOC_BACKING_CLOSE, bytearray(bid.to_bytes(4, "little")), True)
            except OSError as e:
                log.warning("passthrough: FUSE_DEV_IOC_BACKING_CLOSE of %d failed: %s", bid, e)

    def keep_cache(self, inode: int, wanted: bool) -> bool:
        """A cached open's KEEP_CACHE: never right after passthrough writes (the kernel's page
        cache of the inode may hold pages older than them)."""
        io = self.inodes.get(inode)
        if io is not None and io.pt_wrote:
            io.pt_wrote = False
            return False
        return wanted

    def close_all(self) -> None:
        for io in self.inodes.values():
            if io.backing_id:
                self._close_backing(io)
        self.inodes.clear()


@dataclass
class InitResult:
    kernel_minor: int
    offered: int
    granted: int
    passthrough: bool


class NativeSession:
    """One mounted native FUSE connection serving ``handlers``.

    Args:
        handlers: the filesystem. fd: from :func:`mount_fuse`. mountpoint: for unmount.
        want_passthrough: negotiate passthrough if the kernel offers it (the caller checked
            CAP_SYS_ADMIN). clean_passthrough: pass through clean files' tier copies too (else
            written files only).
    """

    name = "native"

    def __init__(self, handlers: Handlers, fd: int, mountpoint: str, *, want_passthrough: bool,
                 clean_passthrough: bool = True, read_only: bool = False, kernel_opens: bool = False,
                 busy_poll_s: float = 0.0) -> None:
        """``mountpoint``: as /proc/self/mounts names it (resolved before mounting: resolving
        it now would ask this very daemon for the mount's root). ``read_only``: the mount is
        ``MS_RDONLY`` (the kernel refuses changes; requests that would change anything are
        answered EROFS here too). ``kernel_opens`` (read-only mounts only): OPEN is answered
        ENOSYS, which makes the kernel open and close every file itself from then on, with no
        request (``fc->no_open``, fs/fuse/file.c, with the page cache kept across opens: its
        default for no-open); READs then carry no handle and are served by inode
        (:meth:`Handlers.read_inode`). ``busy_poll_s``: seconds to poll ``/dev/fuse`` for the
        next request before sleeping (:meth:`_busy_poll`; 0: never; ignored with one CPU)."""
        if kernel_opens and not read_only:
            raise ValueError("kernel_opens needs a read-only mount")
        self.h = handlers
        self.read_only = read_only
        self.kernel_opens = kernel_opens
        if kernel_opens:
            handlers.on_inval_inode = self._inval_inode
            handlers.ns.on_changed_in_place = handlers._changed_in_place
        self.clean_passthrough = clean_passthrough
        self.fd = fd
        self.mountpoint = mountpoint
        self.want_passthrough = want_passthrough
        self.init_result: InitResult | None = None
        self.pt: Passthrough | None = None
        self.why = ""
        self._buf = bytearray(READ_BUFFER)
        self._inflight: dict[int, tuple[int, trio.CancelScope]] = {}
        self._write_bytes = 0
        self._room = trio.Event()
        self._scope: trio.CancelScope | None = None
        self._reading = False  # a worker is reading /dev/fuse (the others park in _turn)
        self._turn = trio.lowlevel.ParkingLot()
        self._idle = 0  # workers waiting to read
        self._burst = 0  # requests served since the last read that had to wait
        self.workers = 0
        self.peak_workers = 0
        self.closed = False
        self.ended = False  # the kernel ended the connection (unmounted): nothing to unmount
        self._by_opcode: dict[int, int] = {}  # requests by opcode (named in requests)
        self.interrupts = 0
        self.interrupted = 0  # requests answered EINTR
        self.stale_replies = 0  # replies the kernel no longer wanted (ENOENT)
        self.malformed = 0
        # one CPU: the client the daemon would wait for could not run meanwhile
        self.busy_poll_s = busy_poll_s if len(os.sched_getaffinity(0)) > 1 else 0.0
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        self._poll_misses = 0  # polls in a row that found nothing
        self._poll_skip = 0  # reads left that sleep at once (polls had stopped paying)
        self._runq: Any = None  # trio's run queue (_runnable), once looked up
        self.busy_poll_hits = 0
        self.epoll_waits = 0  # reads that found nothing and slept in epoll
        self.busy_poll_misses = 0
        self.unexpected = 0  # handler exceptions answered EIO
        self.unknown = 0  # ENOSYS
        self.ioctls = 0  # answered ENOTTY (tierfs files have no ioctls)
        self.refused_read_only = 0  # changes answered EROFS (a read-only mount)
        self.reads_now = 0  # READs answered as read, with no task (Handlers.read_inode_now)
        self.getxattrs_now = 0  # GETXATTRs likewise (Handlers.getxattr_now)
        self.releases_now = 0  # RELEASEs likewise (Handlers.release_now)
        self.opens_now = 0  # OPENs likewise (Handlers.open_now)
        self.getattrs_now = 0  # GETATTRs likewise (Handlers.getattr_now)
        self.forgets_now = 0  # FORGETs done likewise (Handlers.forget_now)
        self.lookups_now = 0  # LOOKUPs answered likewise (Handlers.lookup_now)
        self.unlinks_now = 0  # UNLINKs answered likewise (Handlers.unlink_now)
        self.setattrs_now = 0  # SETATTRs answered likewise (Handlers.setattr_now)

    @property
    def passthrough(self) -> bool:
        return self.pt is not None

    @property
    def requests(self) -> Counter[str]:
        """Requests received, by opcode name."""
        return Counter({c.OPCODE_NAMES.get(op, str(op)): k for op, k in self._by_opcode.items()})

    # -- INIT ------------------------------------------------------------------------------
    async def init(self) -> InitResult:
        """Read the kernel's INIT and answer it. Raises MountError if the kernel's protocol is
        not 7.x or the connection ends first."""
        while True:
            raw = await self._read()
            if raw is None:
                raise MountError("the FUSE connection ended before INIT")
            try:
                req = c.decode(raw)
            except c.MalformedRequest as e:
                raise MountError(f"bad INIT from the kernel: {e}") from None
            if req.opcode == c.INIT:
                break
            self._send(c.error_reply(req.unique, errno.EIO))
        a = req.args
        if a["major"] != c.KERNEL_MAJOR:
            self._send(c.error_reply(req.unique, errno.EPROTO))
            raise MountError(f"kernel FUSE protocol {a['major']}.{a['minor']} is not 7.x")
        offered = a["flags"]
        want = (c.ASYNC_READ | c.ATOMIC_O_TRUNC | c.BIG_WRITES | c.AUTO_INVAL_DATA | c.DO_READDIRPLUS
                | c.ASYNC_DIO | c.PARALLEL_DIROPS | c.MAX_PAGES | c.INIT_EXT | c.HANDLE_KILLPRIV_V2)
        if self.want_passthrough:
            want |= c.PASSTHROUGH
        granted = want & offered
        pt = bool(granted & c.PASSTHROUGH)
        minor = min(a["minor"], c.KERNEL_MINOR)
        self._send(c.reply(req.unique, c.init_out(
            minor=minor, max_readahead=a["max_readahead"], flags=granted,
            max_background=MAX_BACKGROUND, congestion_threshold=CONGESTION, max_write=MAX_WRITE,
            max_pages=MAX_PAGES, max_stack_depth=1 if pt else 0)))
        if pt:
            tiers = getattr(self.h, "tier_passthrough", {})
            self.pt = Passthrough(self.fd, kept=tiers.__contains__)
            self.h.on_passthrough_end = self.pt.ended
            self.h.flush_at_close = True  # a passthrough writer is told ENOSPC at close
        self.init_result = InitResult(a["minor"], offered, granted, pt)
        return self.init_result

    # -- the loop --------------------------------------------------------------------------
    def _runnable(self) -> int:
        """Tasks of the loop ready to run now. ``trio.lowlevel.current_statistics()`` says it,
        but also counts the epoll registrations each time (~2.5 us, ~9 times per file of a
        ``tar -x``): the run queue's length is read directly where trio keeps it (0.24-0.35;
        tests/test_native_protocol.py checks the two agree), else through the public call."""
        runq = self._runq
        if runq is None:
            try:
                runq = self._runq = trio._core._run.GLOBAL_RUN_CONTEXT.runner.runq
                if not isinstance(runq, collections.deque):
                    raise TypeError(type(runq))
            except (AttributeError, TypeError):
                runq = self._runq = ()
        if isinstance(runq, collections.deque):
            return len(runq)
        return trio.lowlevel.current_statistics().tasks_runnable

    def _busy_poll(self) -> bool:
        """Poll ``/dev/fuse`` for up to :attr:`busy_poll_s` for the next request; True when
        one came (read it), False when the caller should sleep in epoll as before.

        A serial client (``rm -rf``, ``tar -x``, a ``stat`` walk) sends its next request a few
        microseconds after our reply: ``unlink`` sends its UNLINK right after the GETATTR that
        checked the directory's permissions, and ``tar`` its next call after ~15 us of its own.
        Sleeping for it costs an epoll registration, an ``epoll_wait`` and a trip through
        trio's scheduler on our side, and a wake-up (an IPI) on the client's: polling (as the
        kernel's ``net.core.busy_poll`` does for sockets) took ``rm -rf`` of 10,000 files from
        155-185 to 123-143 us per file, and ``tar -x`` of 3,000 files from 2.80 to 2.20 s
        (bench/profile_tarx.py), 94% of polls of 15 us finding a request.

        Not while a request's handler waits (for a thread: its result comes through epoll),
        not when a task of the loop is in its run queue (one scheduled later in the batch
        running now is not seen there: it may wait for the poll, at most ``busy_poll_s``),
        and not while it does not pay: after ``BUSY_POLL_MISSES`` polls in a row that found nothing
        (a client that computes between requests), the next ``BUSY_POLL_SKIP`` reads sleep at
        once; so a poll that finds nothing costs at most ~1/16 of its time per read then."""
        if self._poll_skip:
            self._poll_skip -= 1
            return False
        if self.workers > self._idle or self._runnable():
            # a handler is waiting (for a thread, the scheduler): its client waits for that
            # reply, not for our next request, and its wake-up comes through epoll, which a
            # poll would hold off for the whole poll (a thread-served request of a serial
            # client took 362-414 us instead of 184-186 with a 200 us poll)
            return False
        poll = self._poller.poll
        end = time.perf_counter() + self.busy_poll_s
        while True:
            if poll(0):
                self.busy_poll_hits += 1
                self._poll_misses = 0
                return True
            if time.perf_counter() >= end:
                self.busy_poll_misses += 1
                self._poll_misses += 1
                if self._poll_misses >= BUSY_POLL_MISSES:
                    self._poll_misses = 0
                    self._poll_skip = BUSY_POLL_SKIP
                return False

    async def _read(self) -> bytes | None:
        """One request, or None when the connection is gone (unmounted, aborted). Tried before
        waiting: under load the next request is usually queued, and a read that finds it
        costs one syscall where the wait costs an epoll registration and a trip through the
        scheduler."""
        while True:
            try:
                n = os.readv(self.fd, [self._buf])
            except BlockingIOError:
                if self.busy_poll_s and self._busy_poll():
                    continue
                self._burst = 0
                self.epoll_waits += 1
                await trio.lowlevel.wait_readable(self.fd)
                continue
            except OSError as e:
                if e.errno == errno.ENODEV:
                    self.ended = True
                    return None
                if e.errno in (errno.EINTR, errno.ENOENT):  # ENOENT: interrupted before we read it
                    continue
                raise
            if n == 0:  # end of file: not /dev/fuse's way, but a closed socket's (tests)
                self.ended = True
                return None
            return bytes(memoryview(self._buf)[:n])

    async def main(self) -> None:
        """Serve until the filesystem is unmounted (or :meth:`terminate`).

        Requests are served by a pool of worker tasks, as libfuse's multi-threaded loop and
        pyfuse3 do: one worker at a time reads ``/dev/fuse``, then serves what it read itself
        while the next idle worker reads; a new worker is started when none is left idle, so
        a request never waits behind a slow one (as many run at once as the kernel sends),
        and workers beyond ``MAX_IDLE_WORKERS`` idle ones end. A task per request cost ~10 us
        more per request (its spawn, its exit, one more scheduling round), about a fifth of
        the loop's own time in a small-file epoch (py-spy).

        The worker that read a request keeps the reading turn until its handler first
        suspends (:class:`_Inline`): most requests (a lookup, a getattr, an unlink) never do,
        and while a handler runs without suspending no other task of the loop could have
        read anyway. Handing the turn on before serving woke a parked worker for every
        request only for it to park again."""
        with trio.CancelScope() as self._scope:
            async with trio.open_nursery() as nursery:
                self._start_worker(nursery)

    def _start_worker(self, nursery: trio.Nursery) -> None:
        self.workers += 1
        self.peak_workers = max(self.peak_workers, self.workers)
        # idle from now, not from when it first runs: the worker that started it may read and
        # serve again before then, and must not start another one each time
        self._idle += 1
        nursery.start_soon(self._worker, nursery, name="fuse.worker")

    async def _worker(self, nursery: trio.Nursery) -> None:
        task = trio.lowlevel.current_task()
        holding = False  # this worker holds the reading turn (its last handler never suspended)

        def hand_off() -> None:  # its handler suspends: the next worker reads meanwhile
            nonlocal holding
            holding = False
            self._release_turn()
            if self._idle == 0:
                self._start_worker(nursery)  # someone must go on reading meanwhile

        try:
            while True:
                try:  # counted idle (by _start_worker, or at the end of the last round)
                    # (not held while it runs: it releases the turn itself if it raises)
                    held, holding = holding, False
                    raw = await self._next_request(held)
                    holding = True
                finally:
                    self._idle -= 1
                if raw is None:  # (the turn is released on the way out: no new worker)
                    nursery.cancel_scope.cancel()  # unmounted: nobody waits for the answers
                    return
                try:
                    job = self._dispatch(raw)
                except Exception as e:  # noqa: BLE001 - a bug answering at once: EIO, never the session
                    job = None
                    self._dispatch_failed(raw, e)
                if job is not None:
                    # the loop watch names it: by the task's name while the handler waits, by
                    # ``request`` when the step that ran it ends in this loop (it did not wait)
                    task.name = loopwatch.request[0] = _TASK_NAMES.get(job[0].opcode, "fuse.?")
                    await _Inline(self._serve(*job), hand_off)
                    task.name = "fuse.worker"
                self._burst += 1
                if self._burst >= BURST:
                    # requests kept coming without a wait and their handlers may not have
                    # yielded (a release, a forget): let the loop's other tasks run
                    self._burst = 0
                    await trio.lowlevel.checkpoint()
                if not holding and self._idle >= MAX_IDLE_WORKERS:
                    return
                self._idle += 1
        finally:
            if holding:
                self._release_turn()
            self.workers -= 1

    def _dispatch_failed(self, raw: bytes, e: Exception) -> None:
        """:meth:`_dispatch` raised (a bug in a request it answers itself, with no task): the
        request is answered EIO, as a handler's bug is, and the reader goes on."""
        self.unexpected += 1
        try:
            h = c.decode_header(raw)
        except c.MalformedRequest:
            return
        log.error("native transport: %s: unexpected %s: %s; answering EIO", c.OPCODE_NAMES.get(h.opcode, h.opcode),
                  type(e).__name__, e, exc_info=True)
        if h.opcode not in NO_REPLY:
            self._send(c.error_reply(h.unique, errno.EIO))

    def _release_turn(self) -> None:
        self._reading = False
        self._turn.unpark()

    async def _next_request(self, holding: bool) -> bytes | None:
        """The next request, read by one worker at a time (a descriptor has one waiter in
        trio): the worker holding the turn (``holding``), or the first to take it; the
        others park until it is handed on. Returns with the turn held; raises with it
        released."""
        if not holding:
            while self._reading:
                await self._turn.park()
            self._reading = True
        try:
            while self._write_bytes > MAX_WRITE_BYTES_IN_FLIGHT:
                self._room = trio.Event()
                await self._room.wait()
            return await self._read()
        except BaseException:
            self._release_turn()
            raise

    def terminate(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    def close(self, unmount: bool = True) -> None:
        """Release backing ids, unmount (lazily: like ``fusermount3 -u -z``) and close the
        descriptor. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.pt is not None:
            self.pt.close_all()
        try:
            # never a stat of the mountpoint here: the loop that would answer it is not running
            if unmount and not self.ended and _fstype(self.mountpoint) == "fuse.tierfs":
                unmount_detach(self.mountpoint)
        finally:
            os.close(self.fd)

    def _dispatch(self, raw: bytes) -> tuple[c.Request, _Handler, trio.CancelScope | None] | None:
        """Decode one request and do what must happen in the order the kernel sent them
        (interrupts, open-mode counts); returns what :meth:`_serve` runs, or None when
        nothing is left to run."""
        try:
            req = c.decode(raw)
        except c.MalformedRequest as e:
            self.malformed += 1
            log.warning("native transport: malformed request: %s", e)
            if e.unique and e.opcode not in NO_REPLY:
                self._send(c.error_reply(e.unique, errno.EINVAL))
            return None
        op = req.h.opcode
        n = self._by_opcode
        n[op] = n.get(op, 0) + 1
        if op == c.INTERRUPT:
            self._interrupt(req.args["unique"])
            return None
        if op == c.READ and self.kernel_opens and req.args["fh"] == 0:
            a = req.args
            data = self.h.read_inode_now(req.nodeid, a["offset"], a["size"])
            if data is not None:  # from the RAM tier, with no task (Handlers.read_inode_now)
                self.reads_now += 1
                self._send_parts(req.unique, [data])
                return None
        if self.kernel_opens and op in _KERNEL_ANSWERS:
            # ENOSYS once: the kernel answers every later one itself (fc->no_open, no_flush,
            # no_fsync), so a file's open and close cost the daemon nothing
            self._send(c.error_reply(req.unique, errno.ENOSYS))
            return None
        if self.read_only and op in _CHANGES:
            # MS_RDONLY: the VFS refuses these before they are sent; answered here too, so
            # that nothing but the kernel's own checks stands between a request and the store
            self.refused_read_only += 1
            self._send(c.error_reply(req.unique, errno.EROFS))
            return None
        if op == c.IOCTL and not (self.read_only and req.args["cmd"] == wire.CTL_IOC):
            # No file of tierfs has ioctls but the control file's on a read-only mount
            # (wire.CTL_IOC: its requests, which it cannot take as writes there). The kernel
            # sends every ioctl of a file to the daemon, and Python's built-in open() (with its
            # default buffering) asks isatty(),
            # a TCGETS ioctl: one request per file a Dataset opens that way (PIL's loaders do).
            # Answered here, as the kernel would answer ENOSYS, with no handler task.
            self.ioctls += 1
            self._send(c.error_reply(req.unique, errno.ENOTTY))
            return None
        if op == c.GETATTR:
            attrs = self.h.getattr_now(req.nodeid)
            if attrs is not None:  # from the open's fstat, with no task (Handlers.getattr_now)
                self.getattrs_now += 1
                self._send(c.reply(req.unique, c.attr_out(attrs)))
                return None
        if op == c.LOOKUP:
            got = self.h.lookup_now(req.nodeid, req.args["name"])
            if got is not None:  # answered with no task (Handlers.lookup_now)
                self.lookups_now += 1
                if isinstance(got, int):
                    self._send(c.error_reply(req.unique, got))
                elif not self._send(c.reply(req.unique, c.entry_out(got))):
                    # the kernel did not take it (its caller was killed): the lookup it counted
                    # is given back (at once: lookups are not answered so where an inode may
                    # hold an implicit read handle, which forget_now leaves to forget)
                    self.h.forget_now(got.st_ino, 1)
                return None
        if op == c.FORGET and self.h.forget_now(req.nodeid, req.args["nlookup"]):
            self.forgets_now += 1  # (no reply: FORGET has none)
            return None
        if op == c.GETXATTR:
            err = self.h.getxattr_now(req.nodeid, req.args["name"])
            if err is not None:  # answered with no task (Handlers.getxattr_now)
                self.getxattrs_now += 1
                self._send(c.error_reply(req.unique, err))
                return None
        if op == c.SETATTR:
            got = self.h.setattr_now(req.nodeid, _set_attr(req.args))
            if got is not None:  # a file being written: answered with no task (Handlers.setattr_now)
                self.setattrs_now += 1
                self._send(c.error_reply(req.unique, got) if isinstance(got, int)
                           else c.reply(req.unique, c.attr_out(got)))
                return None
        if op == c.UNLINK:
            got = self.h.unlink_now(req.nodeid, req.args["name"])
            if got is not None:  # a clean name, removed with no task (Handlers.unlink_now)
                self.unlinks_now += 1
                self._send(c.error_reply(req.unique, got) if got else c.reply(req.unique, b""))
                return None
        if op == c.OPEN and self.pt is not None and self.clean_passthrough and self._open_now(req):
            return None  # a kept tier copy, answered with no task (Handlers.open_now)
        handler = _HANDLERS.get(op)
        if handler is None:
            self.unknown += 1
            if op not in NO_REPLY:
                self._send(c.error_reply(req.unique, errno.ENOSYS))
            return None
        if op == c.WRITE:
            self._write_bytes += len(req.args["data"])
        elif op == c.RELEASE:
            if self.pt is not None:
                # Counted down now, in the order the kernel sent the requests, not when the
                # release's task runs: the kernel forgets an open's mode before it sends
                # RELEASE, and an OPEN read after it must not find the old open still counted
                # (a writer would be refused).
                self.pt.released(req.args["fh"])
            if self.h.release_now(req.args["fh"]):  # a reader's: nothing to wait for, no task
                self.releases_now += 1
                self._send(c.reply(req.unique, b""))
                return None
        # Only a request an interrupt may cancel gets a cancel scope and an entry the INTERRUPT
        # finds (an interrupt of any other one is ignored, as the protocol allows: it runs to
        # completion): the scope and the bookkeeping were ~a third of the loop's own cost per
        # request in a small-file epoch (cProfile), paid by every open and release. Registered
        # now, before the next request is read, so that an INTERRUPT read next always finds it.
        scope = None
        if op in INTERRUPTIBLE:
            scope = trio.CancelScope()
            self._inflight[req.unique] = (op, scope)
        return req, handler, scope

    def _open_now(self, req: c.Request) -> bool:
        """Answer a reader's OPEN of an inode no handle has open whose tier copy's
        registration is kept since its last close (:meth:`Handlers.open_now`); False: nothing
        done (the OPEN handler runs)."""
        pt = self.pt
        assert pt is not None
        inode = req.nodeid
        io = pt.inodes.get(inode)
        if io is None or not io.backing_id or io.pt or io.cached or io.kind != "tier":
            return False
        got = self.h.open_now(inode, req.args["flags"], self.ctx(req),
                              lambda fd: pt.register(inode, fd, "tier"))
        if got is None:
            return False
        r, lease, bid = got
        pt.opened(r.fh, inode, "pt", False)
        if not self._send(c.reply(req.unique, c.open_out(r.fh, c.FOPEN_PASSTHROUGH | c.FOPEN_NOFLUSH, bid))):
            # not taken (its opener was killed meanwhile): the kernel never releases it
            pt.released(r.fh)
            self.h.release_now(r.fh, count=False)
            return True
        self.opens_now += 1
        pt.stats.opens += 1
        pt.stats.bytes += lease.size
        pt.stats.by_tier[lease.tier] += 1
        return True

    def _interrupt(self, unique: int) -> None:
        self.interrupts += 1
        got = self._inflight.get(unique)
        if got is not None and got[0] in INTERRUPTIBLE:
            got[1].cancel()

    async def _serve(self, req: c.Request, handler: _Handler, scope: trio.CancelScope | None) -> None:
        op = req.opcode
        payload: bytes | list[bytes] | None = None
        err = 0
        try:
            if scope is None:
                payload = await handler(self, req)
            else:
                with scope:
                    payload = await handler(self, req)
                if scope.cancelled_caught:
                    err = errno.EINTR
                    self.interrupted += 1
        except FuseError as e:
            err = e.errno
        except Exception as e:  # noqa: BLE001 - one request fails, never the daemon
            self.unexpected += 1
            log.error("native transport: %s: unexpected %s: %s; %s", c.OPCODE_NAMES.get(op, op),
                      type(e).__name__, e, "ignored (no reply)" if op in NO_REPLY else "answering EIO",
                      exc_info=log.isEnabledFor(logging.DEBUG))
            err = errno.EIO
        finally:
            if scope is not None:
                self._inflight.pop(req.unique, None)
            if op == c.WRITE:
                self._write_bytes -= len(req.args["data"])
                if self._write_bytes <= MAX_WRITE_BYTES_IN_FLIGHT:
                    self._room.set()
        if op in NO_REPLY:
            return
        if err:
            self._send(c.error_reply(req.unique, err))
        elif isinstance(payload, list):
            if not self._send_parts(req.unique, payload) and isinstance(payload, _DirParts) and payload.taken:
                await self._forget_unseen([(ino, 1) for ino in payload.taken])
        elif not self._send(c.reply(req.unique, payload or b"")) and payload:
            if op in _ENTRIES:
                (ino,) = struct.unpack_from("<Q", payload, 0)
                if ino:
                    await self._forget_unseen([(ino, 1)])
            if op in _OPENS:
                await self._release_unseen(op, payload)

    async def _forget_unseen(self, items: list[tuple[int, int]]) -> None:
        """Lookups counted for a reply the kernel did not take: give them back."""
        with trio.CancelScope(shield=True):
            await self.h.forget(items)

    async def _release_unseen(self, op: int, payload: bytes) -> None:
        """An open whose reply the kernel did not take (its opener was killed meanwhile): the
        kernel will never release the handle, so release it here."""
        (fh,) = struct.unpack_from("<Q", payload, _OPENS[op])
        with trio.CancelScope(shield=True):
            if op == c.OPENDIR:
                await self.h.releasedir(fh)
            else:
                try:
                    await self.h.release(fh)
                finally:
                    if self.pt is not None:
                        self.pt.released(fh)

    async def _inval_inode(self, inode: int) -> None:
        """FUSE_NOTIFY_INVAL_INODE for ``inode`` (its cached pages and attributes), written from
        a thread while this loop serves on: the kernel locks the inode's pages to drop them,
        and a page may be locked for a READ this loop has yet to answer (a write from the loop
        would then wait forever; libfuse's notify docs warn of the same)."""
        try:
            await trio.to_thread.run_sync(os.write, self.fd, c.notify_inval_inode(inode, 0, 0),
                                          abandon_on_cancel=True)
        except OSError as e:  # ENOENT: the kernel holds no such inode any more; ENODEV: unmounted
            if e.errno not in (errno.ENOENT, errno.ENODEV, errno.EBADF):
                log.warning("native transport: invalidation refused by the kernel: %s", e)

    def _send(self, data: bytes) -> bool:
        return self._send_raw([data])

    def _send_parts(self, unique: int, parts: list[bytes]) -> bool:
        n = sum(len(p) for p in parts)
        return self._send_raw([c.out_header(unique, 0, n), *parts])

    def _send_raw(self, parts: list[bytes]) -> bool:
        """Write one reply; False if the kernel did not take it."""
        try:
            os.writev(self.fd, parts)
            return True
        except OSError as e:
            if e.errno == errno.ENOENT:  # interrupted and answered, or aborted: nobody waits
                self.stale_replies += 1
            elif e.errno in (errno.ENODEV, errno.EBADF):  # unmounted: the loop ends at its next read
                pass
            else:
                log.error("native transport: reply refused by the kernel: %s", e)
            return False

    # -- handlers ----------------------------------------------------------------------------
    @staticmethod
    def ctx(req: c.Request, umask: int = 0) -> Ctx:
        return Ctx(req.h.uid, req.h.gid, req.h.pid, umask)

    async def _open_reply(self, inode: int, flags: int, r: OpenReply, writer: bool) -> bytes:
        """The open_out for handle ``r``: passthrough when the handler layer leases the file
        and the inode's open mode allows it; else page cache (or direct I/O) as the handler said."""
        pt = self.pt
        # A read-only open needs no FLUSH at close (only writers are told of write-back errors
        # there): one synchronous round trip less per file read, which a small-file epoch pays
        # per image (the FLUSH is answered once passthrough writes are negotiated)
        nf = 0 if writer else c.FOPEN_NOFLUSH
        if r.direct_io:
            if pt is not None:
                pt.opened(r.fh, inode, "direct", writer)
            return c.open_out(r.fh, c.FOPEN_DIRECT_IO | nf)
        if pt is None:
            return c.open_out(r.fh, (c.FOPEN_KEEP_CACHE if r.keep_cache else 0) | nf)
        io = pt.inodes.get(inode)
        if io is None or io.cached == 0:
            lease = await self.h.lease(r.fh, clean=self.clean_passthrough,
                                       written=io is not None and io.pt > 0 and io.kind == "data")
            io = pt.inodes.get(inode)  # again: a cached open may have been answered meanwhile
            if lease is not None and io is not None and io.cached:
                self.h.drop_lease(r.fh)
                lease = None
            if lease is not None:
                key = lease.key
                kind = "data" if isinstance(key, tuple) and key[0] == "data" else "tier"
                bid = pt.register(inode, lease.fd, kind)
                if bid is not None:
                    pt.opened(r.fh, inode, "pt", writer)
                    pt.stats.opens += 1
                    pt.stats.bytes += lease.size
                    pt.stats.by_tier[lease.tier] += 1
                    return c.open_out(r.fh, c.FOPEN_PASSTHROUGH | nf, bid)
                self.h.drop_lease(r.fh)
            if io is not None and io.pt and io.kind == "data" and not writer:
                # A reader of a file whose open handles use its write-tier data file, which the
                # handler layer no longer leases (written back and let go meanwhile): the same
                # bytes, the newest written through this mount; share them.
                pt.opened(r.fh, inode, "pt", writer)
                pt.stats.opens += 1
                return c.open_out(r.fh, c.FOPEN_PASSTHROUGH | nf, io.backing_id)
            if io is not None and io.pt:
                # the inode is open in passthrough mode on another file: the kernel refuses a
                # cached open of it (EIO), and this one cannot share the backing file
                pt.stats.conflicts += 1
                raise FuseError(errno.ETXTBSY)
        pt.opened(r.fh, inode, "cached", writer)
        return c.open_out(r.fh, (c.FOPEN_KEEP_CACHE if pt.keep_cache(inode, r.keep_cache) else 0) | nf)

    async def op_open(self, req: c.Request) -> bytes:
        flags = req.args["flags"]
        r = await self.h.open(req.nodeid, flags, self.ctx(req),
                              kill_suidgid=bool(req.args["open_flags"] & c.OPEN_KILL_SUIDGID))
        return await self._reply_or_release(req.nodeid, flags, r, bool(flags & _WRITE_FLAGS))

    async def op_create(self, req: c.Request) -> bytes:
        a = req.args
        r, attrs = await self.h.create(req.nodeid, a["name"], a["mode"], a["flags"], self.ctx(req, a["umask"]))
        return c.entry_out(attrs) + await self._reply_or_release(attrs.st_ino, a["flags"], r, True)

    async def _reply_or_release(self, inode: int, flags: int, r: OpenReply, writer: bool) -> bytes:
        """:meth:`_open_reply`; if it fails the handle is released (the kernel never sees it).

        Only that release is shielded from a cancel, not the whole reply: an OPEN is never
        interrupted (:data:`INTERRUPTIBLE`), so a cancel here is the unmount's, and a
        shielded cancel scope costs ~11 us (``timeit``), 7% of an open of a resident file."""
        try:
            return await self._open_reply(inode, flags, r, writer)
        except BaseException:
            with trio.CancelScope(shield=True):  # the handle exists: no leak on a cancel either
                if r.fh in self.h.handles.handles:
                    await self.h.release(r.fh)
                if self.pt is not None:
                    self.pt.released(r.fh)
            raise

    async def op_release(self, req: c.Request) -> None:
        await self.h.release(req.args["fh"])  # the inode's open modes were counted down at read

    async def op_read(self, req: c.Request) -> bytes:
        a = req.args
        if self.kernel_opens and a["fh"] == 0:  # opened by the kernel (no handle is ever 0)
            return await self.h.read_inode(req.nodeid, a["offset"], a["size"], self.ctx(req))
        return await self.h.read(a["fh"], a["offset"], a["size"])

    async def op_write(self, req: c.Request) -> bytes:
        a = req.args
        kill = bool(a["write_flags"] & c.WRITE_KILL_SUIDGID)
        n = await self.h.write(a["fh"], a["offset"], bytes(a["data"]), self.ctx(req) if kill else None, kill)
        return c.write_out(n)

    async def op_readdir(self, req: c.Request) -> list[bytes]:
        a = req.args
        plus = req.opcode == c.READDIRPLUS
        buf = c.DirBuffer(a["size"], plus)
        await self.h.readdir(a["fh"], a["offset"], buf.add)
        if not plus and buf.taken:  # the handler counted a lookup per entry (READDIRPLUS)
            await self.h.forget([(ino, 1) for ino in buf.taken])
            return buf.parts
        return _DirParts(buf.parts, buf.taken)

    async def op_getxattr(self, req: c.Request) -> bytes:
        v = await self.h.getxattr(req.nodeid, req.args["name"], self.ctx(req))
        return _sized(v, req.args["size"])

    async def op_listxattr(self, req: c.Request) -> bytes:
        names = await self.h.listxattr(req.nodeid, self.ctx(req))
        return _sized(b"".join(n + b"\0" for n in names), req.args["size"])

    async def op_ioctl(self, req: c.Request) -> bytes:
        """A control request's piece on a read-only mount (wire.CTL_IOC; the only ioctl that
        reaches a handler: _dispatch answers the others)."""
        a = req.args
        out = await self.h.control_ioctl(req.nodeid, bytes(a["data"]), self.ctx(req))
        return c.ioctl_out(out[: a["out_size"]])

    async def op_setattr(self, req: c.Request) -> bytes:
        a = req.args
        v = a["valid"]
        attrs = await self.h.setattr(req.nodeid, _set_attr(a), a["fh"] if v & c.FATTR_FH else None,
                                     self.ctx(req))
        return c.attr_out(attrs)

    def statistics(self) -> dict[str, Any]:
        ir = self.init_result
        out: dict[str, Any] = {
            "name": "native", "passthrough": self.passthrough, "why": self.why,
            "protocol": f"{c.KERNEL_MAJOR}.{c.KERNEL_MINOR}",
            "kernel_protocol": f"{c.KERNEL_MAJOR}.{ir.kernel_minor}" if ir else None,
            "negotiated": " ".join(sorted(n for b, n in c.INIT_FLAG_NAMES.items() if ir and ir.granted & b)),
            "requests": sum(self.requests.values()),
            "interrupts": self.interrupts, "interrupted": self.interrupted,
            "stale_replies": self.stale_replies, "malformed": self.malformed,
            "unexpected_errors": self.unexpected, "unknown_opcodes": self.unknown,
            "busy_poll_us": round(self.busy_poll_s * 1e6), "busy_poll_hits": self.busy_poll_hits,
            "busy_poll_misses": self.busy_poll_misses, "epoll_waits": self.epoll_waits,
            "ioctls": self.ioctls, "read_only": self.read_only, "kernel_opens": self.kernel_opens,
            "refused_read_only": self.refused_read_only, "reads_answered_at_once": self.reads_now,
            "getxattrs_answered_at_once": self.getxattrs_now,
            "releases_answered_at_once": self.releases_now,
            "opens_answered_at_once": self.opens_now,
            "getattrs_answered_at_once": self.getattrs_now,
            "forgets_done_at_once": self.forgets_now,
            "lookups_answered_at_once": self.lookups_now,
            "unlinks_answered_at_once": self.unlinks_now,
            "setattrs_answered_at_once": self.setattrs_now,
            "workers": self.workers, "peak_workers": self.peak_workers,
            "requests_by_opcode": {k.lower(): v for k, v in self.requests.most_common()},
        }
        if self.pt is not None:
            s = self.pt.stats
            out.update(passthrough_opens=s.opens, passthrough_bytes=s.bytes,
                       # misses read by the kernel from the backing file (parallel profile)
                       passthrough_misses=bool(getattr(self.h, "backing_passthrough", False)),
                       passthrough_opens_by_tier=dict(s.by_tier),
                       passthrough_conflicts=s.conflicts,
                       # registered with the kernel for open files, and kept after their last close
                       backing_ids=sum(1 for io in self.pt.inodes.values() if io.backing_id and io.pt),
                       kept_backing_ids=sum(1 for io in self.pt.inodes.values() if io.backing_id and not io.pt),
                       backing_registrations=s.registrations, kept_backing_reuses=s.kept_reuses)
        return out


class _DirParts(list[bytes]):
    """A READDIRPLUS reply's entries, with the inodes whose lookups they counted."""

    def __init__(self, parts: list[bytes], taken: list[int]) -> None:
        super().__init__(parts)
        self.taken = taken


def _sized(value: bytes, size: int) -> bytes:
    """getxattr/listxattr: size 0 asks for the length; a buffer too small is ERANGE."""
    if size == 0:
        return c.xattr_size_out(len(value))
    if len(value) > size:
        raise FuseError(errno.ERANGE)
    return value


_Handler = Callable[[NativeSession, c.Request], Awaitable[Any]]


def _simple(fn: Callable[[NativeSession, c.Request], Awaitable[Any]],
            enc: Callable[[Any], bytes] | None = None) -> _Handler:
    async def run(s: NativeSession, req: c.Request) -> Any:
        out = await fn(s, req)
        return enc(out) if enc is not None else None
    return run


async def _nothing(s: NativeSession, req: c.Request) -> None:
    return None


async def _destroy(s: NativeSession, req: c.Request) -> None:
    s.terminate()


def _ident(x: Any) -> bytes:
    return bytes(x)


async def _lookup(s: NativeSession, r: c.Request) -> bytes:
    # (the commonest requests of a walk or a small-file epoch get no _simple wrapper: one
    # coroutine and one lambda less each)
    h = r.h
    return c.entry_out(await s.h.lookup(h.nodeid, r.args["name"], Ctx(h.uid, h.gid, h.pid, 0)))


async def _getattr(s: NativeSession, r: c.Request) -> bytes:
    h = r.h
    return c.attr_out(await s.h.getattr(h.nodeid, Ctx(h.uid, h.gid, h.pid, 0)))


async def _forget(s: NativeSession, r: c.Request) -> None:
    await s.h.forget([(r.h.nodeid, r.args["nlookup"])])


# Answered ENOSYS on a mount whose opens the kernel answers: it then stops sending them
_KERNEL_ANSWERS = frozenset({c.OPEN, c.FLUSH, c.FSYNC})


def _set_attr(a: dict[str, Any]) -> SetAttr:
    """The :class:`SetAttr` of a SETATTR's arguments (``FATTR_*_NOW`` resolved to now)."""
    v = a["valid"]
    now = time.time_ns()
    return SetAttr(
        size=a["size"] if v & c.FATTR_SIZE else None,
        mode=a["mode"] if v & c.FATTR_MODE else None,
        uid=a["uid"] if v & c.FATTR_UID else None,
        gid=a["gid"] if v & c.FATTR_GID else None,
        atime_ns=(now if v & c.FATTR_ATIME_NOW else a["atime_ns"]) if v & c.FATTR_ATIME else None,
        mtime_ns=(now if v & c.FATTR_MTIME_NOW else a["mtime_ns"]) if v & c.FATTR_MTIME else None,
        kill_suidgid=bool(v & c.FATTR_KILL_SUIDGID))


# Requests that change a file or directory: EROFS on a read-only mount
_CHANGES = frozenset({c.SETATTR, c.SYMLINK, c.MKNOD, c.MKDIR, c.UNLINK, c.RMDIR, c.RENAME, c.RENAME2,
                      c.LINK, c.CREATE, c.WRITE, c.SETXATTR, c.REMOVEXATTR, c.FALLOCATE, c.TMPFILE})

_HANDLERS: dict[int, _Handler] = {
    c.LOOKUP: _lookup,
    c.FORGET: _forget,
    c.BATCH_FORGET: _simple(lambda s, r: s.h.forget(r.args["items"])),
    c.GETATTR: _getattr,
    c.SETATTR: NativeSession.op_setattr,
    c.READLINK: _simple(lambda s, r: s.h.readlink(r.nodeid, s.ctx(r)), _ident),
    c.SYMLINK: _simple(lambda s, r: s.h.symlink(r.nodeid, r.args["name"], r.args["target"], s.ctx(r)), c.entry_out),
    c.MKNOD: _simple(lambda s, r: s.h.mknod(r.nodeid, r.args["name"], r.args["mode"], r.args["rdev"],
                                            s.ctx(r, r.args["umask"])), c.entry_out),
    c.MKDIR: _simple(lambda s, r: s.h.mkdir(r.nodeid, r.args["name"], r.args["mode"],
                                            s.ctx(r, r.args["umask"])), c.entry_out),
    c.UNLINK: _simple(lambda s, r: s.h.unlink(r.nodeid, r.args["name"], s.ctx(r))),
    c.RMDIR: _simple(lambda s, r: s.h.rmdir(r.nodeid, r.args["name"], s.ctx(r))),
    c.RENAME: _simple(lambda s, r: s.h.rename(r.nodeid, r.args["name"], r.args["newdir"], r.args["newname"], 0, s.ctx(r))),
    c.RENAME2: _simple(lambda s, r: s.h.rename(r.nodeid, r.args["name"], r.args["newdir"], r.args["newname"],
                                               r.args["flags"], s.ctx(r))),
    c.LINK: _simple(lambda s, r: s.h.link(r.args["oldnodeid"], r.nodeid, r.args["name"], s.ctx(r)), c.entry_out),
    c.OPEN: NativeSession.op_open,
    c.CREATE: NativeSession.op_create,
    c.READ: NativeSession.op_read,
    c.WRITE: NativeSession.op_write,
    c.STATFS: _simple(lambda s, r: s.h.statfs(s.ctx(r)), c.statfs_out),
    c.RELEASE: NativeSession.op_release,
    c.FLUSH: _simple(lambda s, r: s.h.flush(r.args["fh"])),
    c.FSYNC: _simple(lambda s, r: s.h.fsync(r.args["fh"], bool(r.args["fsync_flags"] & c.FSYNC_FDATASYNC))),
    c.SETXATTR: _simple(lambda s, r: s.h.setxattr(r.nodeid, r.args["name"], r.args["value"], s.ctx(r))),
    c.GETXATTR: NativeSession.op_getxattr,
    c.LISTXATTR: NativeSession.op_listxattr,
    c.REMOVEXATTR: _simple(lambda s, r: s.h.removexattr(r.nodeid, r.args["name"], s.ctx(r))),
    c.OPENDIR: _simple(lambda s, r: s.h.opendir(r.nodeid, s.ctx(r)), lambda fh: c.open_out(fh)),
    c.READDIR: NativeSession.op_readdir,
    c.READDIRPLUS: NativeSession.op_readdir,
    c.RELEASEDIR: _simple(lambda s, r: s.h.releasedir(r.args["fh"])),
    c.FSYNCDIR: _simple(lambda s, r: s.h.fsyncdir(r.args["fh"], bool(r.args["fsync_flags"] & c.FSYNC_FDATASYNC))),
    c.ACCESS: _nothing,  # default_permissions: the kernel checks modes
    c.IOCTL: NativeSession.op_ioctl,
    c.DESTROY: _destroy,
}
