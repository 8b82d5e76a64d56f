"""Dirty files and their write-back.

A file written through the mount lives whole in a *data file* of the write tier
(``<tier>/dirty/<id>``) from its first write until it is written back; its attributes (mode,
owner, times, xattrs) are the data file's own. ``close`` returns once the bytes are in the tier.
When the last writer closes, the file is queued for write-back with a deadline
(``writeback_deadline`` after close); the worker (:mod:`tierfs.writeback.worker`) copies it
in slices, as DEADLINE work of the transaction scheduler (so it yields to demand reads and
escalates near its deadline), to a temporary file in the target's directory on the backing
store, fsyncs it, copies the attributes, and renames it into place. The backing store therefore
never shows a partial file under a final name (design invariant 4).

A file that does not fit in the write tier (after clean chunks are evicted from it) is
*written through* (:mod:`tierfs.writeback.through`): its bytes so far are copied to a temporary
file on the backing store, and later writes go there (as DEMAND work); close then only fsyncs
and renames.

Each dirty file moves through :class:`~tierfs.writeback.state.DirtyState` by
:meth:`DirtyFile.advance`; every move with a crash story is recorded in the
:class:`~tierfs.writeback.journal.Journal` before its effect, so
:func:`tierfs.writeback.recovery.recover` can resume after ``kill -9``.

Passthrough (:meth:`WriteBack.lease_data`): a FUSE transport may hand a data file to the
kernel, which then reads and writes it without the daemon. Such writes are taken in by
:meth:`WriteBack.after_passthrough_write` (size, generation, room in the tier), which the FUSE
layer calls at flush, fsync and release of a writable passthrough handle; a write-back of a
file passthrough writers may have changed checks the data file's size and times before it
commits, so a copy that raced such a write never marks the file clean. While any lease of a
data file is held, the file never switches to write-through (the kernel holds the data file):
if the tier cannot hold it, it overruns the tier's capacity (counted, logged) and is written
back as soon as its writers close.

Every backing-store access goes through a :class:`~tierfs.backing_tree.BackingTree`
(:mod:`tierfs.writeback.backing_ops`): temporary
files are created ``O_CREAT | O_EXCL | O_NOFOLLOW`` under an unpredictable name, in-place and
write-through opens never follow a symlink, commits are ``renameat`` beneath the root.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import resource
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import cast

import trio

from tierfs import logevents, private
from tierfs.backing_tree import BackingTree
from tierfs.cache.lease import Lease, LeaseTable
from tierfs.cache.tier import Tier, blocks
from tierfs.errors import BackingIOError, DirtyLimit, NotDurableYet
from tierfs.io import Device, copy_range, pread_exact, pwrite_all
from tierfs.sched.scheduler import Klass, TransactionScheduler
from tierfs.units import format_size
from tierfs.writeback import hold
from tierfs.writeback.backing_ops import (  # noqa: F401 - re-exported (tests patch by identity)
    DirTimes,
    _allocated,
    _commit,
    _copy_data,
    _copy_range,
    _copy_range_durable,
    _copy_xattrs,
    _create_tmp,
    _finish_attrs_only,
    _finish_in_place,
    _finish_tmp,
    _fsync_lstat,
    _parent,
    _probe_size,
    _remove_tmp,
    lock_backing,
)
from tierfs.writeback.journal import Journal, JState
from tierfs.writeback.ready import READY_FIELDS, DirtyTable, ReadyIndex
from tierfs.writeback.state import DirtyState, check_move

log = logging.getLogger("tierfs.writeback")
TMP_PREFIX = b".tierfs-wb."  # temporary names on the backing store; hidden from readdir
BIG_UNLINK_BYTES = 64 << 20  # data files from this size are removed in a device thread (see _remove_data)
RETRY_S = 5.0  # a failed write-back (e.g. backing store full) is retried after this
BACKING_FREE_TTL_S = 1.0  # how long a read of the backing store's free space is trusted
USER_DIRTY_SHARE = 0.25  # of the daemon's descriptor limit, per user other than root (user_dirty_bound)
COPY_UP_PIECE = 4 << 20  # bytes a copy-up reads and writes at a time (the default chunk size)
CAPS_XATTR = b"security.capability"  # what the kernel reads before each write (DirtyFile.no_caps)
TMP_TRIES = 8  # fresh names drawn when a temporary name is taken (a planted file or symlink)
# Sizes up to this need no check against the backing filesystem's largest file (every
# filesystem tierfs is meant for holds 4 GiB; FAT32's limit is 4 GiB - 1, close enough: its
# write-back then fails and is reported).
PROBE_FROM = 1 << 32
# A writable passthrough lease needs this share of the write tier free of dirty data (clean
# chunks can be evicted), and as much free space in the tier's filesystem: the kernel writes
# without asking the daemon, which can then neither switch the file to write-through nor stop
# at the tier's capacity (see WriteBack.lease_data).
WRITE_LEASE_ROOM_DIVISOR = 8
DATA_NAME_TRIES = 8  # ids tried for a new data file whose name is taken (crash debris)

__all__ = ["TMP_PREFIX", "DirtyFile", "DirtyState", "WriteBack", "WriteBackStats", "is_tmp_name"]


def is_tmp_name(name: bytes) -> bool:
    return name.startswith(TMP_PREFIX)


@dataclass(eq=False)
class DirtyFile:
    id: int
    path: bytes | None  # relative to the backing root; None once unlinked
    data_path: str
    fd: int = -1  # the data file (or, written through, the temporary file on the backing store)
    size: int = 0
    inode: int = 0
    writers: int = 0
    handles: int = 0
    gen: int = 0  # bumped by every change of content or attributes
    durable_gen: int = -1
    state: DirtyState = DirtyState.DIRTY
    since: float = field(default_factory=time.monotonic)
    deadline: float = math.inf
    due: float = math.inf  # writeback_deadline after the last writer closed (a flush moves ``deadline``, not this)
    through: bool = False  # the bytes live on the backing store (``tmp``, or the final file once committed)
    in_place: bool = False  # hard-linked on the backing store: written back into its inode
    # (st_dev, st_ino) of that backing inode, when known (None after recovery): the in-place
    # write-back opens the path again and must find the same file there
    backing_id: tuple[int, int] | None = None
    dir_times: tuple[tuple[int, int], int] | None = None  # dir times around a write-through's start
    tmp: bytes | None = None
    # the journal row outlives the file (unlinked while its write-back was copying into
    # ``tmp``): the write-back removes it once it has removed ``tmp`` (see WriteBack._discard)
    drop_row: bool = False
    accounted: int = 0  # bytes charged to the write tier
    error: str | None = None
    retry_at: float = 0.0
    # (a tuple: changed only by assignment, which the write-back index hears of)
    waiters: tuple[tuple[int, trio.Event], ...] = ()
    # copies into the data file under way (a copy-up, a take-in): never written back meanwhile,
    # even for a waiter (a flush waits for every dirty file): a partial copy written over the
    # good backing file, with no journal row to recover it, lost the rest of the file
    filling: int = 0
    commit_lock: trio.Lock = field(default_factory=trio.Lock)
    pins: int = 0  # operations using ``fd`` across an await; it is closed only at zero
    keep: int = 0  # kernel inodes that may still open it after an unlink (see Operations._preserve)
    close_pending: bool = False  # released (clean or discarded) while pinned
    # The fd gate: operations that use or change ``fd``, ``size`` or attributes count in
    # ``inflight``; the switch to write-through and a written-through file's commit hold it
    # exclusively (``excl`` set: newcomers wait on it; the holder waits for ``drained``).
    inflight: int = 0
    excl: trio.Event | None = None
    drained: trio.Event | None = None
    retired_fds: list[int] = field(default_factory=list)  # replaced while pinned: closed at zero pins
    wb_done: trio.Event | None = None  # set when the write-back in flight ends
    owner: int = 0  # the uid charged for it in WriteBack's per-user dirty-file bound
    # Passthrough (WriteBack.lease_data): leases of the data file held now (any / writable);
    # ``pt_written``: a writable lease was ever granted, so the data file may hold writes the
    # daemon did not see; ``pt_seen``: (size, mtime_ns, ctime_ns) of the data file when they
    # were last taken in (WriteBack._absorb)
    # The data file has no security.capability: tierfs created it (a copy-up copies user.*
    # xattrs only) and none was set since (False when unknown: a recovered file). The kernel asks for that
    # attribute before writes and attribute changes (to drop file capabilities); the answer
    # then costs no call.
    no_caps: bool = False
    leases: int = 0
    lease_writers: int = 0
    pt_written: bool = False
    pt_seen: tuple[int, int, int] | None = None
    # (st_dev, st_ino, st_size, st_mtime_ns) of the backing file it was written back as, once
    # clean: while it stays open its data file holds those very bytes (WriteBack.redirty)
    clean_as: tuple[int, int, int, int] | None = None
    # The write-back index (tierfs.writeback.ready): the ReadyIndex of the table holding this
    # file, its place in that table's order, the version of its entry, and whether it has one
    _ready_ix: ReadyIndex | None = field(default=None, init=False, repr=False)
    _ready_order: int = field(default=0, init=False, repr=False)
    _ready_ver: int = field(default=0, init=False, repr=False)
    _ready_in: bool = field(default=False, init=False, repr=False)

    def advance(self, new: DirtyState) -> None:
        """Move to ``new``; raises IllegalTransition for a move the state diagram lacks."""
        check_move(self.state, new)
        self.state = new

    @property
    def waited_for(self) -> bool:
        """Someone waits for it to reach the backing store (a flush, an fsync that waits for the
        backing store, ``wait_durable``, a write-tier overrun: each moves its deadline forward)."""
        return bool(self.waiters) or self.deadline < self.due

    def touch(self) -> None:
        self.gen += 1
        if self.state is DirtyState.CLEAN:
            self.advance(DirtyState.THROUGH if self.through else DirtyState.DIRTY)


class _ReadyField:
    """A :class:`DirtyFile` field the write-back choice reads (:data:`READY_FIELDS`): every
    assignment of it, wherever it is made, reaches the file's :class:`ReadyIndex`.

    A data descriptor with ``__set__`` and no ``__get__``: a read finds the value in the
    instance's ``__dict__`` at the speed of a plain attribute, and only these eleven fields pay for
    the hook. A ``__setattr__`` on the class, as before, ran in Python for every assignment of
    every field, its ~45 in ``__init__`` included: ~147 calls per file of a ``tar -x``, 7% of
    the daemon's time there (cProfile). The same object assigned again changes nothing the
    index reads: no update (a ``tar -x`` made ~21 index updates per file, many of them such).
    (On the class, ``DirtyFile.state`` and the other ten are these descriptors, not the
    defaults; nothing reads the defaults there, and a field is never deleted.)"""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __set__(self, df: DirtyFile, value: object) -> None:
        d = df.__dict__
        name = self.name
        if name in d and d[name] is value:
            return
        d[name] = value
        ix = d.get("_ready_ix")
        if ix is not None:
            ix.update(df)


# After the dataclass is made, so that its ``__init__`` keeps the fields' defaults and assigns
# them through the descriptors
for _field in READY_FIELDS:
    setattr(DirtyFile, _field, _ReadyField(_field))
del _field


class _Gate:
    """:meth:`WriteBack._gate`: a class, not an ``asynccontextmanager`` generator, which cost
    ~15 us per use (cProfile, scaled): every attribute change, xattr call and daemon-served
    write of a dirty file passes it (a ``tar -x`` three times per file)."""

    __slots__ = ("df", "wb")

    def __init__(self, wb: WriteBack, df: DirtyFile) -> None:
        self.wb = wb
        self.df = df

    async def __aenter__(self) -> None:
        await self.wb._enter(self.df)

    async def __aexit__(self, *exc: object) -> None:
        self.wb._leave(self.df)


def _apply_attrs(fd: int, mode: int | None, uid: int | None, gid: int | None,
                 times: tuple[int, int] | None) -> None:
    """Set what a SETATTR changes on data file ``fd``; None = left alone. Blocking (an
    attribute call: inline or a device thread). Owner first: a chown clears set-user/group-ID,
    a mode given with it is kept (as a local filesystem does for one setattr carrying both)."""
    if uid is not None or gid is not None:
        os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
    if mode is not None:
        os.fchmod(fd, mode & 0o7777)
    if times is not None:
        os.utime(fd, ns=times)


# The states in which an attribute change is made with no await (WriteBack.set_attrs_now): the
# bytes are in the write tier's data file, which the change reaches, and a write-back in flight
# sees the new generation; the others switch or commit the fd (their gate) or hold no changes
_SET_NOW_STATES = frozenset({DirtyState.DIRTY, DirtyState.WRITING})


def _copy_piece(src: int, offset: int, length: int, route: object, dst: int) -> int:
    """Copy ``[offset, offset+length)`` of ``src`` to the same offsets of ``dst`` in the
    kernel; the bytes copied. Blocking (a device thread)."""
    if length > 1 << 20:
        # the kernel copy reads the source one readahead window (128 KiB) after the other:
        # announced, the whole piece is queued at the device at once (as Cache._transfer does)
        os.posix_fadvise(src, offset, length, os.POSIX_FADV_WILLNEED)
    return copy_range(src, dst, length, offset, offset, route=route)


@dataclass(frozen=True)
class KernelSource:
    """The backing file a copy-up may copy from in the kernel (:meth:`WriteBack.copy_up`).

    ``fd``: its open descriptor (held open by the caller across the copy). ``cached(offset,
    n)``: whether the cache holds any of those bytes (a tier, memory, a fetch in flight):
    those pieces are read through the cache instead, never from the backing store again.
    ``piece``: bytes per transfer (the cache's chunk size: a piece is one chunk). ``route``:
    the pair of filesystems, for :func:`tierfs.io.copy_range`."""

    fd: int
    cached: Callable[[int, int], bool]
    piece: int = COPY_UP_PIECE
    route: object = None


def _pins_df(fn):  # type: ignore[no-untyped-def]
    """Decorator: the DirtyFile argument stays pinned (its fd open) while ``fn`` runs. Without
    it a write-back finishing meanwhile closed the fd under a setxattr (EBADF), or a discard
    closed it under a write-back copy (a reused fd number could be read instead)."""

    @functools.wraps(fn)
    async def wrapper(self, df, *args, **kwargs):  # type: ignore[no-untyped-def]
        df.pins += 1
        try:
            return await fn(self, df, *args, **kwargs)
        finally:
            _unpin(self, df)

    return wrapper


def _unpin(wb: WriteBack, df: DirtyFile) -> None:
    """Undo one ``df.pins += 1`` (see :func:`_pins_df`)."""
    df.pins -= 1
    if df.pins == 0:
        _close_retired(df)
        if df.close_pending:
            _close_released(df, wb._remove_data)


def _drain(receive: trio.MemoryReceiveChannel[str | int]) -> list[str | int]:
    out = []
    while True:
        try:
            out.append(receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return out


def _close_retired(df: DirtyFile) -> None:
    while df.retired_fds:
        os.close(df.retired_fds.pop())


def _close_released(df: DirtyFile, remove: Callable[[str, int], None]) -> None:
    """Close and remove the data of a released dirty file (called once nobody uses it);
    ``remove(data_path, size)`` removes the data file (:meth:`WriteBack._remove_data`)."""
    df.close_pending = False
    _close_retired(df)
    if df.fd >= 0:
        os.close(df.fd)
        df.fd = -1
    if df.through and df.tmp is not None and df.path is None:
        return  # an unlinked write-through file: its temporary file is removed by _discard
    if not df.through:
        remove(df.data_path, df.size)


def _remove_item(item: str | int) -> None:
    """A removal queued for the device thread: a data file's path (unlinked) or a lease's
    descriptor whose close frees an unlinked file (closed)."""
    if isinstance(item, int):
        os.close(item)
    else:
        _unlink_quiet(item)


class _Timed:
    """Wraps a blocking call to measure how long it held the device."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        self.seconds = 0.0

    def __call__(self) -> object:
        t0 = time.monotonic()
        try:
            return self.fn()
        finally:
            self.seconds = time.monotonic() - t0


class _Abort(Exception):
    """The file changed or vanished during its write-back: start again later."""


@dataclass(frozen=True)
class WriteBackStats:
    dirty_files: int
    dirty_bytes: int
    oldest_dirty_age_s: float
    writing: int
    written_files: int
    written_bytes: int
    writeback_seconds: float
    throughput_bytes_per_s: float
    eta_s: float | None  # None: unknown yet (nothing written back to measure the rate)
    through_files: int
    failures: int
    next_deadline_s: float | None
    write_tier: str
    late_files: int = 0  # closed files still dirty past their writeback_deadline
    quarantined: int = 0  # journal rows recovery could not honour (kept, see `tierfs doctor`)
    quarantined_paths: tuple[str, ...] = ()  # their paths (the first QUARANTINE_LISTED)
    journal_errors: int = 0  # journal writes that failed (disk full): the file stayed as it was
    copied_up_in_kernel: int = 0  # bytes copy-ups copied from the backing store in the kernel
    # Passthrough of data files (WriteBack.lease_data). Writes through such leases never reach
    # the daemon: they are not in fuse.write_requests.
    passthrough_opens: int = 0  # data-file leases handed out (read-only and writable)
    passthrough_writable_opens: int = 0  # of which writable
    passthrough_refusals: int = 0  # lease_data answered None (the daemon serves the open)
    passthrough_changes: int = 0  # times a data file was found changed behind the daemon
    passthrough_overrun_bytes: int = 0  # bytes passthrough writers put over the tier's capacity
    # opens for writing passed through to a clean file's tier copy that its readers read (the
    # kernel wants one backing file per inode), and the times such writes were taken in as the
    # file's dirty copy (a copy in the kernel at the writer's fsync or close)
    in_place_opens: int = 0
    in_place_takes: int = 0
    # clean files still open made dirty again in their own data file (its readers read it)
    redirtied: int = 0
    leased_files: int = 0  # dirty files with a lease now
    # a burst of writes holds write-back until it ends (tierfs.writeback.hold)
    holding: bool = False  # now
    hold_seconds: float = 0.0  # in all


QUARANTINE_LISTED = 20  # paths listed in the statistics (the journal keeps every row)


# -- blocking helpers (device threads) ---------------------------------------------------------
def _create_data_file(dir_fd: int, name: str, mode: int, uid: int, gid: int,
                      times: tuple[int, int] | None) -> int:
    # ``name`` in the private dirty/ directory ``dir_fd`` (WriteBack.dirty_fd); O_EXCL|O_NOFOLLOW:
    # never a name someone planted (ids are unique; recovery removes debris). Its mode is set
    # below in any case: no fchmod to 0600 first, as private.create_path does (a syscall per
    # created file, with the walk of a /proc path: ~10 us of a CREATE's daemon time)
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, private.FILE_MODE,
                 dir_fd=dir_fd)
    try:
        os.fchown(fd, uid, gid)  # owner first: a chown clears setuid/setgid set before it
        os.fchmod(fd, mode & 0o7777)
        if times is not None:
            os.utime(fd, ns=times)
    except BaseException:  # (no descriptor left open, no file left behind)
        os.close(fd)
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    return fd


def _copy_whole(src: int, dst: int, size: int) -> None:
    """Make file ``dst`` hold exactly the first ``size`` bytes of ``src`` (in the kernel where
    it can: :func:`tierfs.io.copy_range`). Blocking."""
    off = 0
    while off < size:
        n = copy_range(src, dst, size - off, off, off, route=("in-place", 0))
        if n <= 0:
            break
        off += n
    os.ftruncate(dst, off)


def _name(df: DirtyFile) -> bytes:
    """The file a dirty file's backing-store call concerns, for error messages and the log."""
    return df.path if df.path is not None else b"(unlinked file)"


def _one_line(text: str) -> str:
    """An error's text for one log line: as it is when printable (a BackingIOError's path is
    escaped already, not twice), else escaped."""
    return text if text.isprintable() else logevents.user_text(text)


def _unlink_quiet(path: bytes | str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fingerprint(st: os.stat_result) -> tuple[int, int, int]:
    """What a write behind the daemon changes in a data file: size, mtime and ctime. The
    ctime moves at every ``write`` (multigrain timestamps, Linux 6.13+, give it a fresh value
    once it was looked at), and no user can set it."""
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class WriteBack:
    """Args:
        backing_root: the backing directory. tree: its :class:`BackingTree` (one is opened
        here if None). tier: the write tier; tier_index: its index in the cache. device: the
        write tier's device. scheduler: for every backing transfer. make_room: evicts clean
        chunks from the write tier: ``await make_room(tier_index, n)``. deadline_s: seconds
        from close to the write-back deadline. attr_device: for attribute and xattr calls on
        data files and their creation (default: ``device``, threads). hold_s: the longest a burst
        of writes holds a closed file's write-back, in seconds (0: never held;
        :mod:`tierfs.writeback.hold`). on_clean: called with the file and the backing
        ``stat`` of its final path once it is written back.

    Raises:
        MountError: another tierfs daemon holds the backing directory (:func:`lock_backing`).
    """

    def __init__(self, *, backing_root: bytes, tier: Tier, tier_index: int, device: Device,
                 scheduler: TransactionScheduler, journal: Journal, data_device: Device | None = None,
                 make_room: Callable[[int, int], object], deadline_s: float,
                 slice_size: int, fsync_backing: bool = False, tree: BackingTree | None = None,
                 attr_device: Device | None = None, hold_s: float = 0.0,
                 on_clean: Callable[[DirtyFile, os.stat_result | None], None] | None = None) -> None:
        self.root = backing_root
        self._own_tree = tree is None
        self.tree = tree if tree is not None else BackingTree(backing_root)
        self._lock_fd = lock_backing(self.tree)
        self._removals: trio.MemorySendChannel[str | int] | None = None  # set while run() runs
        self.tier = tier
        self.tier_index = tier_index
        self.device = device
        # Data reads and writes of dirty files: inline while measured cheap (a page-cache copy;
        # 1.0 vs 0.6 GB/s for 1 MiB writes measured), threads once dirty throttling makes one slow.
        self.data_device = data_device or device
        # Attribute and xattr calls on a dirty file's descriptor (fchmod, fchown, futimens,
        # fgetxattr: microseconds, no data) and the creation of its data file go the same way:
        # in threads they cost a hand-off each, and tar -x makes ~7 per file (the kernel asks
        # security.capability before every write; tar sets owner, mode and times): 2.4 ms per
        # file in 1,000 files of tar -x with every one in a thread (load ~4); inline they made
        # 1.7 ms. But one inline fgetxattr on a data file held the event loop 102 ms in a full
        # test run (the write tier on the VM's disk, busy with write-back fsyncs), over the
        # loop's bound: on a disk they stay in threads until that is understood; a RAM write
        # tier (tmpfs: no I/O under these calls) passes an inline-while-cheap device (mount.py).
        self.attr_device = attr_device or self.device
        self.sched = scheduler
        self.journal = journal
        self.make_room = make_room
        self.deadline_s = deadline_s
        self.slice_size = slice_size
        self.fsync_backing = fsync_backing
        self.on_clean = on_clean
        # private (0700, verified, see tierfs.private); files are reached through its descriptor
        self.dirty_fd = private.subdir(tier.dir_fd, "dirty", os.path.join(tier.path, "dirty"))
        self.dirty_dir = private.fd_path(self.dirty_fd)
        self.quarantine_dir = os.path.join(tier.path, "quarantine")
        self.files = DirtyTable()  # by id; with the index of files ready for write-back
        self._user_files: Counter[int] = Counter()  # dirty files per owner (register/_unregister)
        self.by_path: dict[bytes, DirtyFile] = {}
        self._writing_in: dict[bytes, list[trio.Event]] = {}  # dir -> write-backs with a temp file there
        self._wake = trio.Event()  # a file may be ready (a close, a flush)
        # someone waits for a file (flush, overrun): ends a hold (tierfs.writeback.hold)
        self._urgent = trio.Event()
        self.hold_s = hold_s
        self.burst = hold.BurstMeter()
        self.holding = False  # the worker waits for a burst of writes to end
        self.hold_seconds = 0.0  # time the worker spent holding, in all
        self.written_files = 0
        self.written_bytes = 0
        self.writeback_seconds = 0.0
        self.device_seconds = 0.0  # backing-device time spent in write-back transactions
        self.device_bytes = 0
        self.failures = 0
        self.journal_errors = 0
        self.copied_up_in_kernel = 0  # bytes copy-ups copied from the backing store in the kernel (copy_in)
        self.quarantined: list[str] = []  # paths of rows recovery quarantined (all mounts so far)
        self._backing_free = 0
        self._backing_free_at = -math.inf
        # What probes of the backing filesystem's largest file found (:meth:`_check_file_size`)
        self._size_ok = PROBE_FROM
        self._size_too_big = math.inf
        # Passthrough leases of data files (tierfs.cache.lease)
        self.leases = LeaseTable(close=self._close_lease_fd)
        self.passthrough_opens = 0
        self.passthrough_writable_opens = 0
        self.passthrough_refusals = 0
        self.passthrough_changes = 0
        self.passthrough_overrun_bytes = 0
        self.in_place_opens = 0  # counted by the FUSE layer (Handlers.lease)
        self.redirtied = 0  # clean files still open made dirty again in their data file (redirty)
        self.in_place_takes = 0  # files written in place in a tier file, taken in (take_in_place)

    # -- lookup ----------------------------------------------------------------------------
    def get(self, path: bytes) -> DirtyFile | None:
        return self.by_path.get(path)

    def children(self, dir_path: bytes) -> list[tuple[bytes, DirtyFile]]:
        prefix = dir_path + b"/" if dir_path else b""
        out = []
        for p, df in self.by_path.items():
            if p.startswith(prefix) and b"/" not in p[len(prefix):]:
                out.append((p[len(prefix):], df))
        return out

    def writing_in(self, dir_path: bytes) -> trio.Event:
        """Register a write-back that will have a temporary file in ``dir_path``; the event
        it returns goes to :meth:`done_writing_in` once that file is renamed or removed."""
        ev = trio.Event()
        self._writing_in.setdefault(dir_path, []).append(ev)
        return ev

    def done_writing_in(self, dir_path: bytes, ev: trio.Event) -> None:
        waiting = self._writing_in.get(dir_path, [])
        if ev in waiting:
            waiting.remove(ev)
        if not waiting:
            self._writing_in.pop(dir_path, None)
        ev.set()

    async def settle_dir(self, dir_path: bytes) -> None:
        """Wait until no write-back has a temporary file in ``dir_path`` (rmdir of a directory
        whose last file was unlinked while being written back: that write-back stops at its
        next slice and removes its temporary file; until then the backing dir is not empty)."""
        for ev in list(self._writing_in.get(dir_path, [])):
            await ev.wait()

    def has_children(self, dir_path: bytes) -> bool:
        prefix = dir_path + b"/"
        return any(p.startswith(prefix) for p in self.by_path)

    # -- the fd gate -----------------------------------------------------------------------
    async def _enter(self, df: DirtyFile) -> None:
        """Count an operation on ``df.fd`` (waits while the gate is held exclusively)."""
        while df.excl is not None:
            await df.excl.wait()
        df.inflight += 1

    def _leave(self, df: DirtyFile) -> None:
        df.inflight -= 1
        if df.inflight == 0 and df.drained is not None:
            df.drained.set()

    def _gate(self, df: DirtyFile) -> _Gate:
        """``async with self._gate(df)``: one operation on ``df.fd`` (:meth:`_enter`,
        :meth:`_leave`)."""
        return _Gate(self, df)

    @contextlib.asynccontextmanager
    async def exclusive(self, df: DirtyFile) -> AsyncIterator[None]:
        """Hold ``df``'s fd gate alone: no write, truncate, attribute change or read of its fd
        runs meanwhile (the switch to write-through swaps the fd; a written-through file's
        commit sizes and renames it)."""
        while df.excl is not None:
            await df.excl.wait()
        ev = df.excl = trio.Event()
        try:
            while df.inflight:
                df.drained = trio.Event()
                await df.drained.wait()
            yield
        finally:
            df.drained = None
            df.excl = None
            ev.set()

    # -- journal ---------------------------------------------------------------------------
    def _journal(self, fn: Callable[..., object], *args: object) -> object:
        """A journal write; its OSError (ENOSPC: the write tier's filesystem is full) is counted
        and raised for the caller to answer (the step it guards is then not taken)."""
        try:
            return fn(*args)
        except OSError:
            self.journal_errors += 1
            raise

    # -- creating --------------------------------------------------------------------------
    async def create(self, path: bytes | None, mode: int, uid: int, gid: int,
                     times: tuple[int, int] | None = None, *, journal: bool = True) -> DirtyFile:
        """A new, empty dirty file at ``path`` (replacing whatever the mount showed there).
        ``journal=False``: its journal row names no path yet (a copy-up in progress, which a
        crash must discard, never write back over the good backing file); :meth:`copy_up`
        names it once the copy is complete. ``path`` None: an anonymous file (the dirty copy
        of an unlinked file still open: never written back, discarded at its last close).
        Raises OSError (ENOSPC: no room for the journal row or the data file)."""
        self._check_user_bound(uid)
        old = self.by_path.get(path) if path is not None else None
        if old is not None:
            await self.unlink(old)
        # The data file first, then its row (with the path, in one commit): a crash in
        # between leaves a data file nobody journals, which recovery removes (nothing was
        # answered yet), never a row whose data is "missing".
        fd = -1
        for _ in range(DATA_NAME_TRIES):
            id_ = self.journal.new_id()
            data_path = os.path.join(self.dirty_dir, str(id_))
            try:
                fd = await self.attr_device.run(_create_data_file, self.dirty_fd, str(id_), mode, uid, gid, times)
                break
            except FileExistsError:  # debris of a crash that recovery has not removed yet
                continue
        else:
            raise OSError(errno.EEXIST, "no free data file name in the write tier")
        try:
            self._journal(self.journal.add, id_, path if journal else None)
        except BaseException:
            if fd >= 0:
                os.close(fd)
                _unlink_quiet(data_path)
            raise
        df = DirtyFile(id_, path, data_path, fd=fd, owner=uid, no_caps=True)
        self.register(df)
        return df

    def register(self, df: DirtyFile) -> None:
        """Track ``df`` (new, or recovered after a crash) and charge it to ``df.owner``."""
        self.files[df.id] = df
        if df.path is not None:
            self.by_path[df.path] = df
        self._user_files[df.owner] += 1

    def _unregister(self, df: DirtyFile) -> None:
        if self.files.pop(df.id, None) is not None:
            self._user_files[df.owner] -= 1
            if self._user_files[df.owner] <= 0:
                del self._user_files[df.owner]

    def user_dirty_bound(self) -> int:
        """How many dirty files one user other than root may hold: each keeps one of the
        daemon's descriptors until it is written back, and a user who makes its write-backs
        fail (a backing directory it swaps for a symlink) would otherwise hold them all, and
        every open through the mount would fail with EMFILE. A quarter of the descriptor limit
        (read now: ``prlimit`` may change it), so that two users still leave half to root and
        to everyone's reads."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            return 1 << 30
        return max(16, int(soft * USER_DIRTY_SHARE))

    def _check_user_bound(self, uid: int) -> None:
        if uid != 0 and self._user_files[uid] >= self.user_dirty_bound():
            raise DirtyLimit(f"uid {uid} holds {self._user_files[uid]} dirty files, the most one user may")

    async def copy_up(self, path: bytes | None, st: os.stat_result, read: Callable[[int, int], object],
                      xattr_src: bytes | None, segments: list[tuple[int, int]] | None = None,
                      kernel: KernelSource | None = None) -> DirtyFile:
        """A dirty copy of an existing backing file, read through ``await read(offset, n)``
        (``path`` None: an anonymous copy, see :meth:`create`). ``segments``: its data
        segments (:func:`~tierfs.writeback.backing_ops.data_segments`), the only bytes copied:
        its holes stay holes in the copy, costing no room in the write tier (None: copied
        whole). ``kernel``: the backing file itself, from which the pieces the cache holds
        none of are copied in the kernel (:meth:`copy_in`) instead of through ``read``."""
        df = await self.create(path, st.st_mode, st.st_uid, st.st_gid, (st.st_atime_ns, st.st_mtime_ns),
                               journal=False)
        piece = kernel.piece if kernel is not None else COPY_UP_PIECE
        # Until the copy is complete it counts as a writer, and as filling (which a waiter does
        # not override: a flush waits for every file): the write-back worker must not commit a
        # partial copy over the good backing file.
        df.writers += 1
        df.filling += 1
        try:
            try:
                if xattr_src is not None:
                    await self.device.run(_copy_xattrs, xattr_src, df.fd)
                for start, end in [(0, st.st_size)] if segments is None else segments:
                    off = start
                    while off < end:
                        # a piece of at most one chunk, chunk-aligned: the cache returns its
                        # bytes without joining pieces, and each piece's copies stay short on
                        # the event loop (32 MiB slices, read, sliced and joined there, held it
                        # 140 ms on CPU in one step of a loaded test run); a kernel copy is one
                        # bounded transfer, so a demand read waits at most one piece for it
                        n = min(piece - off % piece, end - off)
                        if kernel is not None and not kernel.cached(off, n):
                            # not cached anywhere: straight from the backing file. Through the
                            # cache it went backing -> RAM tier -> Python -> write tier, and
                            # filled the RAM tier with bytes now in the write tier
                            got = await self.copy_in(df, off, kernel.fd, n, kernel.route)
                            self.copied_up_in_kernel += got
                            if got < n:
                                # the backing file shrank behind tierfs' back: a copy padded
                                # with zeros to the old size would be written back over it
                                # (the cache's read fails the same way)
                                raise BackingIOError(os.fsdecode(path or b"(unlinked)"),
                                                     OSError(errno.EIO, "backing file shrank during the copy"))
                        else:
                            data = await read(off, n)  # type: ignore[misc]
                            await self.write(df, off, data, touch_mtime=False)
                        off += n
                if df.size < st.st_size:  # a hole at the end (an extension costs no room)
                    await self.truncate(df, st.st_size)
                if st.st_size:
                    async with self._gate(df):
                        await self.device.run(partial(os.utime, df.fd, ns=(st.st_atime_ns, st.st_mtime_ns)))
            finally:
                df.writers -= 1
        except BaseException:
            # A copy cut short (ENOSPC, EIO, a cancel): nothing may be left of it. Left
            # registered, its data file, journal row, descriptor and tier room stayed until the
            # next mount, one more per retried write; and once its writer count was back to
            # zero, a named one was ready for write-back with a partial copy.
            with trio.CancelScope(shield=True):
                await self._abandon(df)
            raise
        if df.path is not None:
            self._journal(self.journal.set_path, df.id, df.path)  # complete: from now on it is a dirty file
        # (only now: a copy cut short stays "filling" through its abandon, which awaits)
        df.filling -= 1
        if df.waiters:
            self._wake.set()  # a flush waits for it: ready now that it is whole
        return df

    # -- data ------------------------------------------------------------------------------
    async def _charge(self, df: DirtyFile, need: int) -> bool:
        """Charge the write tier ``need`` more bytes for ``df``; False if it cannot hold them."""
        if need <= 0:
            return True
        if self.tier.room() < need:
            await self.make_room(self.tier_index, need)  # type: ignore[misc]
        if self.tier.room() < need:
            return False
        self.tier.dirty += need
        df.accounted += need
        if self.holding and self.tier.dirty > hold.HOLD_DIRTY_FRACTION * self.tier.effective_capacity:
            self._urgent.set()  # the tier fills up: the burst's files go back now
        return True

    def _check_backing_room(self, need: int) -> None:
        """Raise OSError(ENOSPC) if the backing store cannot take ``need`` more bytes on top of
        every dirty byte waiting for write-back: the writer is told at ``write`` (as the docs
        promise), not left with a file that can never be written back. Free space is
        ``fstatvfs`` of the backing root (one cheap call, on the loop), re-read at most every
        BACKING_FREE_TTL_S and whenever the answer would be no."""
        if need <= 0:
            return
        now = time.monotonic()
        pending = self.tier.dirty
        for _ in range(2):
            if now - self._backing_free_at > BACKING_FREE_TTL_S:
                sv = self.tree.statvfs()
                self._backing_free = sv.f_bavail * sv.f_frsize
                self._backing_free_at = now
            if pending + need <= self._backing_free:
                return
            self._backing_free_at = -math.inf  # re-read before saying no
            # and count exactly (near full only: one pass over the dirty files): unlinked files
            # still open, or kept for the kernel, are never written back
            pending = sum(df.accounted for df in self.files.values() if df.path is not None)
        msg = (f"backing store full: {format_size(self._backing_free)} free, "
               f"{format_size(pending + need)} to write back")
        log.info("a write answered ENOSPC: %s", msg)
        raise OSError(errno.ENOSPC, msg)

    def _uncharge(self, df: DirtyFile, new_size: int) -> None:
        """Charge ``df`` at most what a file of ``new_size`` bytes can occupy."""
        self._charge_down(df, blocks(new_size))

    def _charge_down(self, df: DirtyFile, keep: int) -> None:
        if keep < df.accounted:
            self.tier.dirty -= df.accounted - keep
            df.accounted = keep

    async def _check_file_size(self, df: DirtyFile, end: int) -> None:
        """Raise OSError(EFBIG) if the backing filesystem cannot hold a file of ``end`` bytes
        (a sparse truncate or a write far past the end: the write tier may hold it, the write-back
        never could). Sizes up to PROBE_FROM, and up to the largest one a probe allowed, pass at
        once; beyond, one probe (:func:`_probe_size`: an empty temporary file sized and removed
        on the backing store, as DEMAND work) answers for the next power of two, or, if that is
        too big, for ``end`` itself. A probe that fails otherwise (read-only, EACCES) lets the
        size pass: the write-back reports it."""
        if df.through or end <= max(df.size, self._size_ok):
            return
        if end < self._size_too_big:
            sizes = [1 << (end - 1).bit_length(), end]
        else:
            sizes = [end]
        for size in sizes:
            if size >= self._size_too_big:
                continue
            try:
                ok = await self.sched.io(partial(_probe_size, self.tree, TMP_PREFIX + b"probe.", size),
                                         Klass.DEMAND, nbytes=0, what=b"")
            except (OSError, BackingIOError) as e:
                log.info("cannot probe the backing store's largest file (%s): not checked", e)
                return
            if ok:
                self._size_ok = max(self._size_ok, size)
                return
            self._size_too_big = min(self._size_too_big, size)
        raise OSError(errno.EFBIG, "larger than the backing filesystem's largest file")

    async def _enter_sized(self, df: DirtyFile, end: int, grow: int) -> None:
        """Enter the gate with room for ``grow`` more bytes (at most: what the operation may
        newly allocate) in a file of ``end`` bytes: in the write tier, or (switching to
        write-through first if the tier cannot hold them) on the backing store. Room is counted
        in allocated bytes, not sizes: a hole costs nothing, in the tier or on the backing store.
        Raises OSError: ENOSPC (the backing store is full), EFBIG (larger than the backing
        filesystem's largest file)."""
        await self._check_file_size(df, end)
        while True:
            if df.excl is not None:
                await df.excl.wait()
                continue
            need = min(grow, blocks(end) - df.accounted)
            if not df.through and need > 0:
                self._check_backing_room(need)
                if not await self._charge(df, need):
                    if df.leases:
                        # the kernel holds the data file (passthrough): it cannot move now
                        self._overrun(df, need)
                    else:
                        await self.to_through(df)
                        continue
            if df.excl is not None:
                continue  # a switch began while room was being made: look again after it
            df.inflight += 1
            return

    @_pins_df
    async def write(self, df: DirtyFile, offset: int, data: bytes, touch_mtime: bool = True) -> int:
        """Write at ``offset``. Raises OSError(ENOSPC) only if the backing store is full."""
        await self._store(df, offset, len(data), lambda fd: pwrite_all(fd, data, offset), in_loop_device=True)
        return len(data)

    @_pins_df
    async def copy_in(self, df: DirtyFile, offset: int, src_fd: int, length: int, route: object = None) -> int:
        """Copy ``length`` bytes at ``offset`` of backing file ``src_fd`` to the same offset of
        ``df``, in the kernel (:func:`tierfs.io.copy_range`: the bytes never reach Python), as
        one transfer the scheduler orders with every other backing-store access (it reads the
        backing store). Returns the bytes copied: short only at the end of the source. Raises
        OSError (ENOSPC only if the backing store is full; EIO of either file). ``route``: the
        pair of filesystems, for :func:`copy_range`'s memory of refused methods."""
        return await self._store(df, offset, length, partial(_copy_piece, src_fd, offset, length, route),
                                 in_loop_device=False)

    async def _store(self, df: DirtyFile, offset: int, length: int, put: Callable[[int], int | None], *,
                     in_loop_device: bool) -> int:
        """Put ``length`` bytes at ``offset`` of ``df`` with blocking ``put(fd)``: in the
        write tier (``in_loop_device``: in the write tier's device thread, else as a scheduled
        backing-store transfer, for a put that reads the backing store), or, for a file written
        through (or once the tier's filesystem fills from outside), on the backing store.
        ``put`` returns the bytes it put (None: all ``length``; fewer: a copy that found the
        end of its source). Returns that count."""
        end = offset + length
        # what it may allocate: the blocks it touches (a write into a hole of a sparse file
        # allocates as much as one past the end)
        span = blocks(end) - (offset - offset % 4096) if length else 0
        before = df.accounted
        await self._enter_sized(df, max(end, df.size), span)
        recount = df.accounted > before and offset < df.size
        entered = True

        async def through() -> int | None:
            return await self.sched.io(partial(put, df.fd), Klass.DEMAND, nbytes=length,  # type: ignore[return-value]
                                       what=_name(df))

        try:
            df.touch()
            if df.through:
                stored = await through()
            else:
                try:
                    if in_loop_device:
                        stored = await self.data_device.run(put, df.fd)
                    else:
                        stored = await self.sched.io(partial(put, df.fd), Klass.DEMAND,  # type: ignore[assignment]
                                                     nbytes=length, written=False, what=_name(df))
                except (OSError, BackingIOError) as e:
                    if getattr(e, "errno", None) not in (errno.ENOSPC, errno.EDQUOT) or df.leases:
                        raise  # (leased: the data file cannot move; its writers see ENOSPC too)
                    # The tier's filesystem filled from outside: write through instead.
                    self._leave(df)
                    entered = False
                    await self.to_through(df)
                    await self._enter(df)
                    entered = True
                    df.touch()
                    stored = await through()
            if stored is not None:
                end = offset + stored
            if end > df.size:
                df.size = end
            if recount and not df.through:
                # charged for a range that may have held data already: charge what the file
                # occupies (fstat of an open fd: no I/O)
                self._charge_down(df, _allocated(df.fd, df.size))
        finally:
            if entered:
                self._leave(df)
        return end - offset

    @_pins_df
    async def read(self, df: DirtyFile, offset: int, size: int) -> bytes:
        # Not gated: a read never waits for a switch or a commit (an fsync of a large file).
        # The pin keeps the descriptor it takes open even if a switch replaces it meanwhile
        # (the old one holds everything written before the switch began).
        if df.lease_writers:
            self._absorb(df)  # the size may have moved behind the daemon
        if offset >= df.size:
            return b""
        size = min(size, df.size - offset)
        if df.through:
            return await self.sched.io(partial(pread_exact, df.fd, size, offset), Klass.DEMAND,  # type: ignore[return-value]
                                       nbytes=size, written=False, what=_name(df))
        return await self.data_device.run(pread_exact, df.fd, size, offset)

    @_pins_df
    async def truncate(self, df: DirtyFile, size: int) -> None:
        """Set the size. The new size is in force (``df.size``, a new generation) before any
        other operation or write-back sees the file again: a write-back starting meanwhile
        used to write the old size back, padded with zeros."""
        # Counted as a writer meanwhile: a write-back finishing during the awaits below must not
        # mark the file clean (and release it) with the truncate still to come, as it did for
        # open(O_TRUNC) right after the last close.
        df.writers += 1
        try:
            await self._enter_sized(df, size, 0)  # an extension is a hole: no room needed
        except BaseException:
            df.writers -= 1
            raise
        try:
            df.touch()
            if df.through:
                await self.sched.io(partial(os.ftruncate, df.fd, size), Klass.DEMAND, nbytes=0, what=_name(df))
            else:
                await self.device.run(os.ftruncate, df.fd, size)
                self._uncharge(df, size)
            df.size = size
            df.touch()
        finally:
            self._leave(df)
            df.writers -= 1

    async def stat(self, df: DirtyFile) -> os.stat_result:
        """The dirty file's attributes: the data file's own (size and mtime are right at once
        also while passthrough writers write it). fstat of an open fd: no I/O."""
        return self.stat_now(df)

    def stat_now(self, df: DirtyFile) -> os.stat_result:
        """:meth:`stat`, which never awaits (for callers that cannot)."""
        st = os.fstat(df.fd)
        if df.lease_writers and not df.through:
            self._absorb(df, st)
        return st

    def size_of(self, df: DirtyFile) -> int:
        """The dirty file's size now (cheap: an fstat while passthrough writers hold it,
        else the size the daemon knows). For ``O_APPEND`` offsets and short reads."""
        if df.lease_writers and not df.through and df.fd >= 0:
            self._absorb(df)
        return df.size

    @_pins_df
    async def set_attrs(self, df: DirtyFile, *, mode: int | None = None, uid: int | None = None,
                        gid: int | None = None, times: tuple[int, int] | None = None) -> None:
        async with self._gate(df):
            df.touch()
            await self.attr_device.run(_apply_attrs, df.fd, mode, uid, gid, times)

    def set_attrs_now(self, df: DirtyFile, *, mode: int | None = None, uid: int | None = None,
                      gid: int | None = None, times: tuple[int, int] | None = None) -> bool:
        """:meth:`set_attrs` with no await, or False (nothing done; then await
        :meth:`set_attrs`): only for a file being written in the write tier (``DIRTY`` or
        ``WRITING``: a write-back in flight sees the new generation), its fd gate free
        (nothing holds it exclusively) and attribute calls running inline now
        (:meth:`Device.inline_now`). With no await nothing can close the fd meanwhile, so
        neither a pin nor a count in the gate is needed. Raises OSError as the calls do."""
        if (df.fd < 0 or df.excl is not None or df.state not in _SET_NOW_STATES
                or not self.attr_device.inline_now()):
            return False
        df.touch()
        self.attr_device.run_now(_apply_attrs, df.fd, mode, uid, gid, times)
        return True

    @_pins_df
    async def xattr(self, df: DirtyFile, fn: Callable[[int], object]) -> object:
        async with self._gate(df):
            return await self.attr_device.run(fn, df.fd)

    async def getxattr(self, df: DirtyFile, name: bytes) -> bytes:
        """The value of xattr ``name`` of ``df``. Raises OSError (ENODATA: it has none). A
        fresh file's ``security.capability`` is known absent without a call: the kernel asks
        for it before writes and attribute changes (2.8 times per file of a ``tar -x``, 210 us
        each as a thread hand-off through ``attr_device``)."""
        if name == CAPS_XATTR and df.no_caps:
            raise OSError(errno.ENODATA, "no such attribute")
        return cast("bytes", await self.xattr(df, lambda fd: os.getxattr(fd, name)))

    async def setxattr(self, df: DirtyFile, name: bytes, value: bytes) -> None:
        """Set xattr ``name`` of ``df`` (a new generation). Raises OSError."""
        df.touch()
        if name == CAPS_XATTR:
            df.no_caps = False  # before the call: a getxattr meanwhile must look
        await self.xattr(df, lambda fd: os.setxattr(fd, name, value))

    async def to_through(self, df: DirtyFile) -> None:
        """Move a file the write tier cannot hold to the backing store (see
        :mod:`tierfs.writeback.through`). Raises OSError / BackingIOError (ENOSPC: the backing
        store is full too); the file then stays in the write tier as it was."""
        from tierfs.writeback.through import switch_to_through

        await switch_to_through(self, df)

    async def remove_tmp(self, tmp: bytes, dir_times: DirTimes | None = None) -> bool:
        """Remove a temporary file of ours, even while being cancelled (unmount): shielded, in
        a thread of its own - not through the scheduler, whose dispatcher may be gone. False if
        it could not be removed (the journal still names it; the next mount removes it)."""
        with trio.CancelScope(shield=True):
            try:
                await trio.to_thread.run_sync(_remove_tmp, self.tree, tmp, dir_times)
                return True
            except OSError as e:
                log.warning("could not remove temporary file %s: %s", os.fsdecode(tmp), e)
        return False

    def new_tmp_name(self, df: DirtyFile, path: bytes | None = None) -> bytes:
        """A fresh, unpredictable temporary name beside ``path`` (default ``df.path``):
        ``.tierfs-wb.<id>.<random>`` (recognisable by :func:`is_tmp_name`, never guessable)."""
        path = df.path if path is None else path
        assert path is not None
        head = _parent(path)
        name = TMP_PREFIX + f"{df.id}.".encode() + secrets.token_hex(8).encode()
        return head + b"/" + name if head else name

    async def create_tmp(self, df: DirtyFile, state: JState, flags: int, klass: Klass, *,
                         deadline: float = math.inf) -> tuple[int, DirTimes]:
        """Journal a fresh temporary name for ``df`` (as ``state``) and set ``df.tmp`` to it,
        then create it. ``df.tmp`` is the name from then on: a rename of its directory
        meanwhile (:meth:`rename_dir`) moves it. A name someone planted (EEXIST, ELOOP) is
        skipped: another is drawn. Returns ``(fd, dir_times)``. Raises OSError /
        BackingIOError (``df.tmp`` then names a file that may not exist: remove it quietly)."""
        for _ in range(TMP_TRIES):
            tmp = self.new_tmp_name(df)
            self._journal(self.journal.set_tmp, df.id, tmp, state)  # before the file exists
            df.tmp = tmp
            try:
                fd, times = cast("tuple[int, DirTimes]", await self.sched.io(
                    partial(_create_tmp, self.tree, tmp, flags | os.O_CLOEXEC), klass, nbytes=0,
                    deadline=deadline, position=((0, df.id), 0), what=tmp))
                return fd, times
            except (OSError, BackingIOError) as e:
                if e.errno not in (errno.EEXIST, errno.ELOOP):
                    raise
                self.log_taken_tmp(tmp)
        raise OSError(errno.EEXIST, "no free temporary name", os.fsdecode(df.path or b"?"))

    @staticmethod
    def log_taken_tmp(tmp: bytes) -> None:
        log.warning("write-back: temporary name %s was taken (planted?); drawing another",
                    os.fsdecode(tmp))

    # -- namespace -------------------------------------------------------------------------
    def set_in_place(self, df: DirtyFile, st: os.stat_result | None = None) -> None:
        """The backing file has other hard links: write back into that inode (no temporary
        file and rename, which would cut the links). Not atomic under a crash: documented.
        ``st``: the backing file's lstat, whose inode the write-back must find again (a user
        who can write the backing directory may swap the name meanwhile)."""
        if st is not None:
            df.backing_id = (st.st_dev, st.st_ino)
        if not df.in_place:
            df.in_place = True
            self.journal.set_in_place(df.id)

    async def rename(self, df: DirtyFile, new_path: bytes) -> bool:
        """Move a dirty file to ``new_path`` (replacing a dirty file there). Returns False if
        ``df`` was written back (became clean) before the locks were had: the caller then
        renames the backing file instead. Locks are taken in id order: two renames crossing
        each other cannot deadlock."""
        target = self.by_path.get(new_path)
        locks = sorted({id(x): x for x in (df, target) if x is not None}.values(), key=lambda d: d.id)
        async with contextlib.AsyncExitStack() as stack:
            for d in locks:
                await stack.enter_async_context(d.commit_lock)
            if df.state is DirtyState.CLEAN or df.path is None:
                return False
            target = self.by_path.get(new_path)
            if target is not None and target is not df:
                if target.commit_lock.locked() and target not in locks:
                    async with target.commit_lock:
                        await self._unlink_locked(target)
                else:
                    await self._unlink_locked(target)
            new_tmp = None
            committed = df.through and df.tmp is None  # its bytes are the backing file at df.path
            if committed:
                # move that file along (journaled as a commit from the old name: recovery
                # completes the move); else it stayed at the old name, which the caller then
                # removes as a shadow, and the next write-back found nothing at the new one
                self._journal(self.journal.set_tmp, df.id, df.path, JState.COMMIT)
            elif df.through and df.tmp is not None:
                # the temporary file must sit in the new directory for an atomic rename;
                # journaled first with the old name kept as ``prev`` (recovery looks there too)
                new_tmp = self.new_tmp_name(df, new_path)
                self._journal(self.journal.set_tmp, df.id, new_tmp, JState.THROUGH, df.tmp)
            self._journal(self.journal.set_path, df.id, new_path)
            old_path = df.path
            if self.by_path.get(df.path) is df:
                del self.by_path[df.path]
            df.path = new_path
            df.touch()
            self.by_path[new_path] = df
            if committed:
                await self.sched.io(partial(self.tree.rename, old_path, new_path), Klass.DEMAND, nbytes=0,
                                    what=old_path)
                self.journal.set_tmp(df.id, None, JState.THROUGH)
            if new_tmp is not None:
                assert df.tmp is not None
                await self.sched.io(partial(self.tree.rename, df.tmp, new_tmp), Klass.DEMAND, nbytes=0,
                                    what=df.tmp)
                df.tmp = new_tmp
                self.journal.set_tmp(df.id, new_tmp, JState.THROUGH)
            return True

    def rename_dir(self, old: bytes, new: bytes) -> None:
        moved = [(p, df) for p, df in self.by_path.items() if p.startswith(old + b"/")]
        for p, df in moved:
            del self.by_path[p]
            df.path = new + p[len(old):]
            self.by_path[df.path] = df
            if df.tmp is not None and df.tmp.startswith(old + b"/"):
                df.tmp = new + df.tmp[len(old):]
        if moved:
            self.journal.rename_prefix(old, new)

    async def unlink(self, df: DirtyFile) -> bool:
        """Forget a dirty file's changes. False if it was written back before the lock was had
        (the caller then removes the backing file, which now holds it)."""
        async with df.commit_lock:
            if df.state is DirtyState.CLEAN:
                return False
            await self._unlink_locked(df)
            return True

    async def _unlink_locked(self, df: DirtyFile) -> None:
        self.journal.set_path(df.id, None)
        if df.path is not None and self.by_path.get(df.path) is df:
            del self.by_path[df.path]
        df.path = None
        df.touch()
        if df.handles == 0 and df.keep == 0:
            await self._discard(df)

    async def _abandon(self, df: DirtyFile) -> None:
        """Forget a dirty file nothing uses yet (a copy-up that failed): as an unlink of it
        would, at once."""
        if df.path is not None and self.by_path.get(df.path) is df:
            del self.by_path[df.path]
        df.path = None
        if df.id in self.files:
            await self._discard(df)

    async def _discard(self, df: DirtyFile) -> None:
        """Forget an unlinked dirty file whose last handle closed."""
        self._unregister(df)
        self._uncharge(df, 0)
        if df.through and df.tmp is not None:
            tmp = df.tmp
            await self.remove_tmp(tmp, df.dir_times)
        if df.state is not DirtyState.GONE:
            df.advance(DirtyState.GONE)
        if df.pins:
            df.close_pending = True  # closed when the last user is done
        else:
            _close_released(df, self._remove_data)
        if df.tmp is not None and not df.through:
            # A write-back is copying into the temporary file the row names: the row stays
            # until that write-back (stopping at its next slice) has removed the file, so a
            # crash meanwhile leaves the file to recovery. Removed here, the row left it on the
            # backing store for good (the crash loop found one: a file replaced by os.replace
            # while written back, the daemon killed before the copy's next slice).
            df.drop_row = True
        else:
            with contextlib.suppress(OSError):
                self.journal.remove(df.id)
        self._notify(df, math.inf)

    # -- handles ---------------------------------------------------------------------------
    def opened(self, df: DirtyFile, writer: bool) -> None:
        df.handles += 1
        if writer:
            df.writers += 1

    async def closed(self, df: DirtyFile, writer: bool) -> None:
        df.handles -= 1
        if writer:
            df.writers -= 1
            if df.writers == 0 and df.path is not None:
                now = trio.current_time()
                # Written back already (fsynced while open, on a RAM tier or with
                # fsync=backing): due now, to be counted clean (an lstat, no copy). Held for
                # the deadline, it was skipped by wait_durable, which waits only for bytes not
                # yet durable, and an unmount right after reported it "not written back".
                due = now if df.durable_gen >= df.gen else now + self.deadline_s
                df.deadline = df.due = due
                self.burst.closed(now)
                self._wake.set()
        if df.handles == 0 and df.path is None and df.keep == 0:
            await self._discard(df)
        elif df.handles == 0 and df.state is DirtyState.CLEAN:
            self._release_clean(df)

    @_pins_df
    async def unkeep(self, df: DirtyFile) -> None:
        """The kernel forgot an inode that kept an unlinked dirty file reachable."""
        df.keep -= 1
        if df.keep == 0 and df.handles == 0 and df.path is None and df.id in self.files:
            await self._discard(df)

    @_pins_df
    async def fsync(self, df: DirtyFile) -> None:
        """Durable on the write tier (or, with ``--fsync=backing``, on the backing store)."""
        async with self._gate(df):
            if df.through:
                await self.sched.io(partial(os.fsync, df.fd), Klass.DEMAND, nbytes=0, what=_name(df))
            else:
                await self.device.run(os.fsync, df.fd)
        await trio.to_thread.run_sync(self.journal.sync)  # never on the loop: an fsync
        if self.fsync_backing:
            await self.wait_durable([df], timeout=math.inf)

    # -- passthrough -----------------------------------------------------------------------
    async def lease_data(self, df: DirtyFile, writable: bool) -> Lease | None:
        """A lease on ``df``'s data file in the write tier, for kernel passthrough of an open
        of the dirty file (``writable``: an open for writing; the descriptor is then
        ``O_RDWR``, else ``O_RDONLY``), or None: the daemon serves the open as before.

        All concurrent leases of ``df`` with the same ``writable`` share one descriptor
        (opened relative to the private ``dirty/`` directory with ``O_NOFOLLOW``, a regular
        file with one link), closed at the last release.

        Refused (None) when the bytes are not in the data file or are about to leave it: the
        file is written through, switching, gone, or (``writable``) clean - a write to a clean
        file makes a new dirty copy first, so the FUSE layer leases that one. A writable lease
        is also refused when the write tier has less than 1/``WRITE_LEASE_ROOM_DIVISOR`` of its
        capacity free of dirty data, or its filesystem less free space than that, or the
        backing store could not take that much more (the daemon then serves the writes, and
        switches the file to write-through or answers ENOSPC as documented).

        While any lease of ``df`` is held the file never switches to write-through; what the
        tier cannot hold overruns its capacity (``passthrough_overrun_bytes``) and the file is
        written back as soon as its writers close. The caller must call
        :meth:`after_passthrough_write` at flush, fsync and release of a writable passthrough
        handle, and release the lease before :meth:`closed`. Never raises for a tier problem.
        """
        if not self._leasable(df, writable):
            return self._refuse()
        if writable and not await self._room_for_write_lease():
            return self._refuse()
        lkey = ("data", df.id, writable)
        on_release = partial(self._lease_released, df, writable)
        lease = await self.leases.share(lkey, tier=self.tier.name, size=df.size, writable=writable,
                                        on_release=on_release)
        if lease is None:
            if not self._leasable(df, writable):
                return self._refuse()
            self.leases.begin(lkey)
            try:
                if writable:
                    # a duplicate of the daemon's own descriptor (leasable: the data file,
                    # O_RDWR), not an open of its name: one call, no check of what the name
                    # holds (each file a tar -x creates takes one)
                    fd = os.dup(df.fd)
                else:  # a descriptor that cannot write, for readers
                    # (the attribute device: inline on a RAM write tier)
                    fd = await self.attr_device.run(partial(private.open_file, self.dirty_fd,
                                                            os.path.basename(df.data_path), os.O_RDONLY,
                                                            create=False, attrs=False))
            except OSError as e:
                self.leases.abort(lkey)
                log.warning("cannot open the data file of %s for passthrough: %s",
                            logevents.user_text(_name(df)), e)
                return self._refuse()
            except BaseException:
                self.leases.abort(lkey)
                raise
            if not self._leasable(df, writable):  # switched or gone while it was opened
                os.close(fd)
                self.leases.abort(lkey)
                return self._refuse()
            lease = self.leases.finish(lkey, fd, tier=self.tier.name, size=df.size,
                                       writable=writable, on_release=on_release)
        elif not self._leasable(df, writable):
            lease.release()
            return self._refuse()
        # granted: from here on synchronously (no await) up to the counts
        df.leases += 1
        self.passthrough_opens += 1
        if writable:
            df.lease_writers += 1
            df.pt_written = True
            self.passthrough_writable_opens += 1
            if df.pt_seen is None:
                df.pt_seen = _fingerprint(os.fstat(df.fd))  # what the daemon knows so far
        lease.size = df.size
        return lease

    def _leasable(self, df: DirtyFile, writable: bool) -> bool:
        ok = (DirtyState.DIRTY, DirtyState.WRITING) if writable else (
            DirtyState.DIRTY, DirtyState.WRITING, DirtyState.CLEAN)
        return (df.state in ok and not df.through and df.fd >= 0 and df.excl is None
                and not df.close_pending)

    def _refuse(self) -> Lease | None:
        """Count a refused lease; None (for ``return self._refuse()``)."""
        self.passthrough_refusals += 1
        return None

    async def _room_for_write_lease(self) -> bool:
        tier = self.tier
        need = max(tier.capacity // WRITE_LEASE_ROOM_DIVISOR, 1)
        if tier.effective_capacity - tier.dirty < need:
            return False
        try:
            self._check_backing_room(need)
            # Read at every writable lease, never cached: a filesystem filled behind the
            # daemon's back (test_writeback_enospc: a 1 s cache let the kernel write into a
            # full tier and the writer got ENOSPC) must refuse the next lease. Through the
            # dirty directory's descriptor: no walk of the tier's path.
            sv = await self.attr_device.run(os.fstatvfs, self.dirty_fd)
        except OSError:
            return False
        return sv.f_bavail * sv.f_frsize >= need

    def _lease_released(self, df: DirtyFile, writable: bool) -> None:
        df.leases -= 1
        if writable:
            df.lease_writers -= 1

    def _close_lease_fd(self, fd: int) -> None:
        """Close a data-file lease's descriptor at its last release: in the tier's device
        thread when that close frees an unlinked file that :meth:`_inline_removal` keeps off
        the loop (the last reference), else here."""
        try:
            st = os.fstat(fd)
        except OSError:
            st = None
        if st is not None and st.st_nlink == 0 and not self._inline_removal(st.st_size):
            assert self._removals is not None
            self._removals.send_nowait(fd)
        else:
            os.close(fd)

    def _absorb(self, df: DirtyFile, st: os.stat_result | None = None) -> bool:
        """Take in what passthrough writers changed in ``df``'s data file: if its size, mtime
        or ctime moved since last seen, ``df.size`` follows and the generation is bumped (a
        write-back in flight then starts again; a clean file becomes dirty). Returns True if
        it changed. fstat of an open descriptor: no I/O."""
        if df.through or df.fd < 0:
            return False
        if st is None:
            st = os.fstat(df.fd)
        fp = _fingerprint(st)
        if fp == df.pt_seen:
            return False
        df.pt_seen = fp
        df.size = st.st_size
        df.touch()
        self.passthrough_changes += 1
        return True

    async def after_passthrough_write(self, df: DirtyFile) -> None:
        """Take in writes made through a writable passthrough lease of ``df`` (the FUSE layer
        calls it at flush, fsync - before :meth:`fsync` - and release of such a handle): size
        and mtime from the data file (``df.size``), a new generation (so a write-back copies
        them; one in flight starts again; also when size and times look unchanged, since
        timestamps may be coarser than the writes), and the write tier charged for what the
        file now occupies (evicting clean chunks; past the tier's capacity if it must: the file is then
        written back as soon as its writers close, and the overrun counted and logged).

        Raises:
            OSError: ENOSPC when the backing store cannot take the bytes the file grew by
                (as a daemon-served write would; the bytes stay in the write tier and the
                write-back is retried).
        """
        if df.through or df.fd < 0 or df.state is DirtyState.GONE or not df.pt_written:
            return
        if not self._absorb(df):
            # Size and times look unchanged, yet a write may have landed within one tick of
            # the last look (coarse timestamps: kernels before 6.13, filesystems without
            # multigrain ctime): a new generation all the same, so the next write-back copies
            # the file again rather than calling an older copy current.
            df.touch()
            return
        await self._charge_what_it_holds(df)

    async def _charge_what_it_holds(self, df: DirtyFile) -> None:
        """Charge the write tier for what ``df``'s data file occupies now (written behind the
        daemon): evicting clean chunks, past capacity if it must (counted and logged). Raises
        OSError(ENOSPC) when the backing store could not take what it grew by."""
        alloc = _allocated(df.fd, df.size)  # fstat of an open descriptor: no I/O
        need = alloc - df.accounted
        if need <= 0:
            self._charge_down(df, alloc)
            return
        err: OSError | None = None
        try:
            self._check_backing_room(need)
        except OSError as e:
            err = e
        if not await self._charge(df, need):
            self._overrun(df, need)
        if err is not None:
            raise err

    async def take_in_place(self, path: bytes, df: DirtyFile | None, src_fd: int,
                            st: os.stat_result, xattr_src: bytes | None) -> DirtyFile:
        """Take in a file the kernel wrote *in place*, in a tier file (an open for writing
        passed through to the tier copy its readers were reading: the kernel wants one backing
        file per inode): the dirty file of ``path`` is made to hold exactly the bytes of
        ``src_fd`` (a copy in the kernel, ``copy_file_range``), journalled as any dirty file,
        with a new generation. ``df``: its dirty file if it has one (refreshed under the fd
        gate, so a write-back never copies a half-refreshed file), else one is made like a
        copy-up with ``st``'s owner, mode and atime (``xattr_src``: where its xattrs are read).
        The mtime is the tier file's (the kernel's writes set it). Returns the dirty file.

        Raises:
            OSError: ENOSPC (no room for the data file, or the backing store could not take
                the bytes), EIO.
        """
        src = os.fstat(src_fd)  # an open descriptor: no I/O
        size = src.st_size
        fresh = df is None or df.state is DirtyState.CLEAN or df.through
        if fresh:
            df = await self.create(path, st.st_mode, st.st_uid, st.st_gid,
                                   (st.st_atime_ns, src.st_mtime_ns), journal=False)
            df.writers += 1  # a partial copy is never written back (as copy_up)
            df.filling += 1
        assert df is not None
        try:
            if fresh and xattr_src is not None:
                await self.device.run(_copy_xattrs, xattr_src, df.fd)
            async with self.exclusive(df):
                await self.data_device.run(_copy_whole, src_fd, df.fd, size)
                await self.device.run(partial(os.utime, df.fd, ns=(st.st_atime_ns, src.st_mtime_ns)))
            df.size = size
            df.pt_seen = None
            df.touch()
            await self._charge_what_it_holds(df)
        finally:
            if fresh:
                df.writers -= 1
        if fresh:
            self._journal(self.journal.set_path, df.id, path)  # complete: a dirty file from now on
            df.filling -= 1  # (only now: a take-in cut short is never written back)
        if df.writers == 0:
            now = trio.current_time()
            df.deadline = df.due = now + self.deadline_s
            self.burst.closed(now)
            self._wake.set()
        self.in_place_takes += 1
        return df

    def _overrun(self, df: DirtyFile, need: int) -> None:
        """Charge ``need`` bytes the write tier cannot hold to a leased file anyway (its
        writers put them there behind the daemon, or the file cannot switch to write-through
        while the kernel holds it): counted, logged, and the file made due at once so its
        write-back gives the room back after its writers close."""
        self.tier.dirty += need
        df.accounted += need
        self.passthrough_overrun_bytes += need
        self.tier.full_events += 1
        df.deadline = min(df.deadline, trio.current_time())
        self._wake.set()
        self._urgent.set()
        logevents.event(log, logging.WARNING, "write-tier-overrun",
                        "write tier %s over its capacity by %s: %s is written by the kernel "
                        "directly (passthrough) and cannot switch to write-through; written back "
                        "as soon as it is closed", self.tier.name,
                        format_size(max(0, -self.tier.room())), logevents.user_text(_name(df)))

    # -- holding for a burst ---------------------------------------------------------------
    def hold_until(self, df: DirtyFile) -> float | None:
        """When the worker should look again instead of writing ``df`` back now (a burst of
        writes is going on: :mod:`tierfs.writeback.hold`), or None to write it back now."""
        if self.hold_s <= 0:
            return None
        now = trio.current_time()
        return hold.hold_until(
            now=now, burst_end=self.burst.ends_at(now), closed_at=df.due - self.deadline_s,
            # (never more than half the deadline: writeback_deadline=0 means at once)
            hold_s=min(self.hold_s, self.deadline_s / 2), urgent=df.waited_for,
            dirty_bytes=self.tier.dirty, tier_capacity=self.tier.effective_capacity)

    # -- durability ------------------------------------------------------------------------
    def _notify(self, df: DirtyFile, gen: float) -> None:
        keep = []
        for want, ev in df.waiters:
            if want <= gen:
                ev.set()
            else:
                keep.append((want, ev))
        if len(keep) != len(df.waiters):
            df.waiters = tuple(keep)

    async def wait_durable(self, files: list[DirtyFile] | None, timeout: float) -> list[str]:  # noqa: ASYNC109
        """Wait until the given (or all) dirty files, as they are now, are on the backing
        store. Files still open for writing are written back now. Returns the paths waited
        for; raises NotDurableYet (a TimeoutError, naming the files that did get there), or
        BackingIOError if a write-back failed."""
        todo = list(self.files.values()) if files is None else files
        events = []
        waited = []
        now = trio.current_time()
        for df in todo:
            if df.lease_writers:
                self._absorb(df)  # passthrough writes so far count as "as they are now"
            if df.path is None or df.state is DirtyState.CLEAN or (df.durable_gen >= df.gen and df.writers):
                continue  # (on the backing store as it is now; clean once closed)
            # (durable and closed but not yet counted clean: waited for too, due now; an lstat.
            # An unmount's write-back of a RAM tier then counts it clean, not "not written back")
            ev = trio.Event()
            df.waiters = (*df.waiters, (df.gen, ev))
            df.deadline = min(df.deadline, now)  # someone waits: due now
            df.retry_at = 0.0
            events.append(ev)
            waited.append(os.fsdecode(df.path))
        self._wake.set()
        self._urgent.set()
        # not trio.fail_after: its TooSlowError is no TimeoutError, and the control command
        # (which answers "timed_out" and lets the client ask again) catches TimeoutError
        with trio.move_on_after(timeout) as scope:
            for ev in events:
                await ev.wait()
        if scope.cancelled_caught:
            raise NotDurableYet(sum(not ev.is_set() for ev in events), len(events), timeout,
                                [p for p, ev in zip(waited, events, strict=True) if ev.is_set()])
        failed = [os.fsdecode(df.path) for df in todo if df.error and df.path is not None and df.durable_gen < df.gen]
        if failed:
            raise BackingIOError(", ".join(failed), OSError(errno.EIO, "write-back failed"))
        return waited

    # -- the worker ------------------------------------------------------------------------
    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
        """The write-back worker (:func:`tierfs.writeback.worker.run`)."""
        from tierfs.writeback.worker import run

        # unbounded: one short path per released file, each removed within a device call
        send, receive = trio.open_memory_channel[str | int](math.inf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._remover, receive)
            self._removals = send
            try:
                await run(self, task_status=task_status)
            finally:
                self._removals = None
                for item in _drain(receive):  # shutdown: what is left, inline
                    _remove_item(item)

    def _failed(self, df: DirtyFile, e: BaseException) -> None:
        self.failures += 1
        df.error = str(e)
        df.retry_at = trio.current_time() + RETRY_S
        logevents.event(log, logging.WARNING, "writeback-failed",
                        "write-back of %s failed (retrying in %.0fs): %s",
                        logevents.user_text(_name(df)), RETRY_S, _one_line(str(e)))
        self._notify(df, math.inf)

    def _finish_success(self, df: DirtyFile, gen: int, st: os.stat_result, copied: int | None = None) -> None:
        """``copied``: bytes this write-back moved (a sparse file's data only; default: its size),
        what the write-back rate is measured in."""
        if df.state is DirtyState.GONE:
            return
        if df.state is DirtyState.WRITING:
            df.advance(DirtyState.DIRTY)  # -> CLEAN below, if it stayed unchanged and closed
        elif df.state is DirtyState.THROUGH_WRITING:
            df.advance(DirtyState.THROUGH)
        df.error = None
        df.durable_gen = gen
        self.written_files += 1
        self.written_bytes += df.size
        self.device_bytes += df.size if copied is None else copied
        self._notify(df, gen)
        if df.gen == gen and df.writers == 0:
            self._mark_clean(df, st)

    def _check(self, df: DirtyFile, gen: int) -> None:
        if df.gen != gen or df.path is None:
            raise _Abort

    async def _io(self, df: DirtyFile, fn: Callable[[], object], nbytes: int,
                  remaining: int = 0) -> object:
        """One write-back transaction. Its deadline is the file's, moved forward to *now*
        (so the scheduler escalates it) once the projected finish - the remaining bytes at the
        measured write-back rate, with a 2x margin for sharing the disk with demand reads -
        would pass the deadline."""
        deadline = df.deadline
        if remaining and deadline < math.inf:
            rate = self.rate_bytes_per_s()
            if trio.current_time() + 2 * remaining / rate >= deadline:
                deadline = trio.current_time()
        timed = _Timed(fn)
        try:
            return await self.sched.io(timed, Klass.DEADLINE, deadline=deadline, nbytes=nbytes,
                                       position=((0, df.id), 0), what=_name(df))
        finally:
            self.device_seconds += timed.seconds

    def rate_bytes_per_s(self) -> float:
        """Measured write-back rate (bytes per second of backing-device time), or 100 MB/s
        (a conservative HDD figure) before anything was measured."""
        if self.device_seconds > 0.5 and self.device_bytes:
            return self.device_bytes / self.device_seconds
        return 100e6

    def _mark_clean(self, df: DirtyFile, st: os.stat_result) -> None:
        try:
            self.journal.remove(df.id)
        except OSError as e:
            # cannot record it (disk full): stays dirty; a later write-back tries again
            self.journal_errors += 1
            self._failed(df, e)
            return
        df.advance(DirtyState.CLEAN)
        df.clean_as = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if df.path is not None and self.by_path.get(df.path) is df:
            del self.by_path[df.path]
        if self.on_clean is not None:
            self.on_clean(df, st)
        if df.handles == 0:
            self._release_clean(df)

    def redirty(self, df: DirtyFile, st: os.stat_result) -> bool:
        """Make a clean file that is still open dirty again, with its own data file, rather than
        copying the backing file up into a new one: its open handles read that data file (the
        kernel may pass them through to it, and wants every open of the file on one backing
        file), so a writer or a truncate must change that very file. Only while the data file
        holds exactly the backing file it was written back as (``st``: the backing file's
        ``lstat`` now; a change behind tierfs' back since makes it stale). Journalled again
        under its id before anything changes. Returns False when it cannot (the caller copies
        up); raises OSError (ENOSPC: no room for the journal row)."""
        if (df.state is not DirtyState.CLEAN or df.through or df.fd < 0 or df.close_pending
                or df.path is None or df.id not in self.files or df.path in self.by_path
                or df.clean_as != (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)):
            return False
        self._journal(self.journal.readd, df.id, df.path)
        if df.in_place:
            self._journal(self.journal.set_in_place, df.id)
        self.by_path[df.path] = df
        df.clean_as = None
        df.touch()  # CLEAN -> DIRTY, a new generation
        self.redirtied += 1
        return True

    def _release_clean(self, df: DirtyFile) -> None:
        self._unregister(df)
        self._uncharge(df, 0)
        if df.pins:
            df.close_pending = True  # closed when the last user is done
        else:
            _close_released(df, self._remove_data)

    def _inline_removal(self, size: int) -> bool:
        """Whether removing (or closing the last descriptor of) an unlinked data file of
        ``size`` bytes may run on the event loop: only a small one in a RAM tier. The unlink
        frees the file's pages then and there: for a 1 GiB file that held the event loop
        51-89 ms (test_umount_does_not_wait_for_writeback under the loop watch); under
        ``BIG_UNLINK_BYTES`` it costs well under a millisecond on tmpfs. On a disk tier the
        kernel first waits for any of the file's pages still being written out: with ``dd``
        filling the page cache beside a test, 24 unlinks of small data files on an SSD tier
        (ext4) held the loop 2.2 s in all, up to 391 ms each."""
        return self._removals is None or (size < BIG_UNLINK_BYTES and self.tier.inline)

    def _remove_data(self, data_path: str, size: int) -> None:
        """Remove a released data file: inline when :meth:`_inline_removal` allows, else in
        the tier's device thread."""
        if self._inline_removal(size):
            _unlink_quiet(data_path)
        else:
            assert self._removals is not None
            self._removals.send_nowait(data_path)

    async def _remover(self, receive: trio.MemoryReceiveChannel[str | int]) -> None:
        async for item in receive:
            await self.device.run(_remove_item, item)

    # -- recovery --------------------------------------------------------------------------
    async def _reopen_data(self, data_path: str) -> int:
        """A journaled data file, opened again at recovery: only a regular file of the
        daemon's user with one link, never through a symlink (:func:`tierfs.private.open_file`).
        Raises OSError (recovery then quarantines the row)."""
        return await self.device.run(partial(private.open_file, self.dirty_fd, os.path.basename(data_path),
                                             os.O_RDWR, create=False, attrs=False))

    async def recover(self) -> int:
        """Resume after a crash (see :mod:`tierfs.writeback.recovery`). Returns the number of
        dirty files found; never raises for a row it cannot honour (that row is quarantined)."""
        from tierfs.writeback.recovery import recover

        return await recover(self)

    def close(self) -> None:
        self.leases.close_all()
        for df in list(self.files.values()):
            _close_retired(df)
            if df.fd >= 0:
                os.close(df.fd)
                df.fd = -1
        self.journal.close()
        if self.dirty_fd >= 0:
            os.close(self.dirty_fd)
            self.dirty_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self._own_tree:
            self.tree.close()

    # -- statistics ------------------------------------------------------------------------
    def statistics(self) -> WriteBackStats:
        now_m = time.monotonic()
        dirty = [df for df in self.files.values()
                 if df.state not in (DirtyState.CLEAN, DirtyState.GONE) and df.path is not None]
        # (passthrough writers grow a file behind the daemon: its data file's size, no I/O)
        dirty_bytes = sum(os.fstat(df.fd).st_size if df.lease_writers and not df.through else df.size
                          for df in dirty)
        thr = self.device_bytes / self.device_seconds if self.device_seconds > 0 else 0.0
        deadlines = [df.deadline for df in dirty if df.deadline < math.inf]
        now_t = trio.current_time()
        return WriteBackStats(
            dirty_files=len(dirty),
            dirty_bytes=dirty_bytes,
            oldest_dirty_age_s=max((now_m - df.since for df in dirty), default=0.0),
            writing=sum(df.state in (DirtyState.WRITING, DirtyState.THROUGH_WRITING) for df in dirty),
            written_files=self.written_files,
            written_bytes=self.written_bytes,
            writeback_seconds=self.writeback_seconds,
            throughput_bytes_per_s=thr,
            eta_s=(dirty_bytes / thr) if thr > 0 else (0.0 if not dirty_bytes else None),
            through_files=sum(df.through for df in dirty),
            failures=self.failures,
            next_deadline_s=(min(deadlines) - now_t) if deadlines else None,
            write_tier=self.tier.name,
            late_files=sum(df.writers == 0 and df.due < now_t for df in dirty),
            quarantined=len(self.quarantined),
            quarantined_paths=tuple(self.quarantined[:QUARANTINE_LISTED]),
            journal_errors=self.journal_errors,
            copied_up_in_kernel=self.copied_up_in_kernel,
            passthrough_opens=self.passthrough_opens,
            passthrough_writable_opens=self.passthrough_writable_opens,
            passthrough_refusals=self.passthrough_refusals,
            passthrough_changes=self.passthrough_changes,
            passthrough_overrun_bytes=self.passthrough_overrun_bytes,
            in_place_opens=self.in_place_opens, in_place_takes=self.in_place_takes,
            redirtied=self.redirtied,
            leased_files=sum(df.leases > 0 for df in self.files.values()),
            holding=self.holding, hold_seconds=self.hold_seconds,
        )
