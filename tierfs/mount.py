"""Wiring of a mount: validation, tiers, scheduler, cache, FUSE session, clean shutdown.

Everything is built in one function whose ``finally`` tears down what was set up (the FUSE
session, the tiers' catalogs, the RAM tier's memory). ``trio.run`` is only called from the CLI.
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import math
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import trio
import xxhash

from tierfs import io, logevents, loopwatch, private
from tierfs import stats as stats_mod
from tierfs.backing_tree import BackingTree
from tierfs.cache.catalog import SsdCatalog
from tierfs.cache.manager import Cache
from tierfs.cache.plan import HintPlan
from tierfs.cache.policy import Policy
from tierfs.cache.tier import Tier
from tierfs.config import (
    Config,
    default_ram_size,
    default_ssd_size,
    effective_allow_other,
    who_can_use,
)
from tierfs.errors import MountError, TierfsError
from tierfs.fs.control import ControlPlane
from tierfs.fs.ctl import ControlCommands
from tierfs.fs.handlers import Handlers
from tierfs.fs.inodes import InodeTable
from tierfs.predict.hints import HintService
from tierfs.predict.readahead import Readahead
from tierfs.sched import profile as backing_profile
from tierfs.sched.backing import BackingFile
from tierfs.sched.scheduler import TransactionScheduler
from tierfs.transport import Session, start_session
from tierfs.units import format_size
from tierfs.writeback.journal import Journal
from tierfs.writeback.journal import summary as journal_summary
from tierfs.writeback.manager import WriteBack
from tierfs_hints import wire

log = logging.getLogger("tierfs.mount")
META_THREADS = 4  # concurrent stat/readdir/open calls on the backing store
META_INLINE_UNDER_S = 0.001  # metadata calls run inline while each takes less (see io.Device)
# after a slow metadata call, calls go to threads for this long before inline is tried again:
# one 15 ms listdir (a sleep in the kernel) sent a whole small-file epoch to threads with the
# default 30 s, and warm-cache epochs ran at 1,100 files/s instead of 4,150 (a thread hand-off
# per open); on a slow disk, 2 s costs at most two slow inline calls (~10 ms) every 2 s, and
# each failed try doubles the period (io.Device.PROBE_CALLS: up to 32 s)
META_THREAD_PERIOD_S = 2.0
DIRTY_INLINE_UNDER_S = 0.002  # dirty-file data writes likewise (a 1 MiB page-cache copy ~0.3 ms)
DIRTY_THREAD_PERIOD_S = 2.0
BACKING_INLINE_UNDER_S = 0.0005  # backing-store reads on a local parallel store likewise
# Attribute and xattr calls on data files in a RAM write tier (tmpfs: fchmod, fchown,
# futimens, the data file's creation; microseconds, never I/O) run inline while each takes less:
# in threads, tar -x of 10,000 files made 4 hand-offs per file (see WriteBack.attr_device)
ATTR_INLINE_UNDER_S = 0.001
WILLNEED_OVER = 1 << 20  # backing reads longer than one 1 MiB device request are announced  # after which writes try inline again: throttling comes and goes


@dataclass(frozen=True)
class TierPlan:
    name: str
    path: str
    capacity: int


@dataclass(frozen=True)
class MountPlan:
    cfg: Config
    backing: str
    mountpoint: str
    tiers: tuple[TierPlan, ...]
    state_dir: str


def mount_id(mountpoint: str) -> str:
    return xxhash.xxh3_64_hexdigest(os.path.realpath(mountpoint).encode())[:12]


def state_dir_for(mountpoint: str) -> str:
    """The daemon's state directory (its log when logging to stderr or syslog):
    ``/run/tierfs/<id>``, or ``/tmp/tierfs/<id>`` where ``/run`` is not writable. Both levels
    are private to the daemon's user (see :func:`open_state_dir`)."""
    base = "/run/tierfs" if os.access("/run", os.W_OK) else "/tmp/tierfs"
    return os.path.join(base, mount_id(mountpoint))


def open_state_dir(state_dir: str) -> int:
    """Create or verify the state directory and its parent, private (0700, the daemon's user,
    no symlink). Returns its descriptor. Raises PrivateStateError (a MountError) or MountError."""
    return private.open_in(os.path.dirname(state_dir), os.path.basename(state_dir))


RAM_PARENT = "tierfs"  # <ram_dir>/tierfs/: private (0700), holds one directory per mount


def ram_tier_path(ram_dir: str, mountpoint: str) -> str:
    """``<ram_dir>/tierfs/<id>``: the RAM tier of the mount on ``mountpoint``. The name is
    predictable (a restarted daemon finds a RAM write tier's dirty files), so the parent is
    private and verified: nobody else can plant or remove anything in it."""
    return os.path.join(ram_dir, RAM_PARENT, mount_id(mountpoint))


async def write_back_before_exit(writeback: WriteBack) -> None:
    """After a clean unmount (``umount``, ``tierfs umount``, a signal) of a mount whose write
    tier is the RAM tier: write every dirty file back before the daemon exits. A RAM tier is
    gone at the next reboot, and a user who unmounted expects the data on the backing store,
    as after the unmount of a local filesystem (its journal there only helps a daemon that is
    restarted before the machine is). A write-back that fails (the backing store full or
    gone), or a second SIGTERM/SIGINT meanwhile, ends the wait: the files not written back
    stay journaled in the RAM tier, for a next mount before a reboot, and the log says so."""
    st = writeback.statistics()
    if not st.dirty_files:
        return
    log.info("unmounted; writing back %d dirty files (%s) from the RAM tier before exiting (a "
             "second SIGTERM stops this: they then stay in memory until the next mount or reboot)",
             st.dirty_files, format_size(st.dirty_bytes))
    with trio.CancelScope() as scope:
        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
                async for sig in sigs:
                    log.warning("signal %s: stopped writing back", signal.Signals(sig).name)
                    scope.cancel()
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(on_signal)
            try:
                await writeback.wait_durable(None, math.inf)
            except (TierfsError, OSError) as e:
                log.error("write-back before exit: %s", e)
            nursery.cancel_scope.cancel()
    left = writeback.statistics()
    if left.dirty_files:
        log.error("%d dirty files (%s) were not written back: they stay in the RAM tier, lost at "
                  "the next reboot unless the backing directory is mounted again before it",
                  left.dirty_files, format_size(left.dirty_bytes))


def remove_ram_tier(path: str, *, keep_dirty: bool) -> None:
    """Free a RAM tier's memory: its cached data, and (unless ``keep_dirty`` and a journal, or
    data files in ``dirty/`` or ``quarantine/``, are there) the whole tier directory, then
    ``<ram_dir>/tierfs`` if no other mount uses it. Everything is removed relative to verified
    descriptors, never through a redirected path."""
    private.remove_dir(path, "data")
    if keep_dirty and (os.path.exists(os.path.join(path, "journal.sqlite"))
                       or any(has_entries(os.path.join(path, d)) for d in ("dirty", "quarantine"))):
        return
    parent = os.path.dirname(path)
    private.remove_dir(parent, os.path.basename(path))
    private.remove_dir(os.path.dirname(parent), os.path.basename(parent), only_if_empty=True)


def mount_entry(path: str) -> tuple[str, str] | None:
    """(source, fstype) of what is mounted on ``path`` (the one on top), or None."""
    real = os.path.realpath(path)
    found = None
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and fields[1].encode().decode("unicode_escape") == real:
                found = (fields[0].encode().decode("unicode_escape"), fields[2])
    return found


def mount_options(path: str) -> set[str]:
    """The options of what is mounted on ``path`` (the one on top), as the kernel lists them in
    /proc/self/mounts (``allow_other``, ``user_id=0``, ...); empty if nothing is mounted.
    Resolves ``path`` (an ``lstat`` of each component): never from the daemon of that very
    mount, whose loop would be the one to answer (:func:`mount_options_at`)."""
    return mount_options_at(os.path.realpath(path))


def mount_options_at(real: str) -> set[str]:
    """:func:`mount_options` of ``real``, a path already resolved (no system call on it)."""
    found: set[str] = set()
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 3 and fields[1].encode().decode("unicode_escape") == real:
                found = set(fields[3].split(","))
    return found


def is_mounted(path: str) -> bool:
    return mount_entry(path) is not None


def unmount(path: str, *, lazy: bool = False) -> bool:
    """``fusermount3 -u`` (``-z`` when lazy). True on success."""
    cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [path]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 and shutil.which("umount"):
        r = subprocess.run(["umount"] + (["-l"] if lazy else []) + [path], capture_output=True, text=True)
    return r.returncode == 0


RAM_TIER_RECORD = "ram_tier"  # in the state directory: where the mount's RAM tier is


def record_ram_tier(state_dir: str, path: str) -> None:
    """Write down, in the mount's private state directory, where its RAM tier is (its
    ``ram_dir`` may be any tmpfs): :func:`free_dead_ram_tier` finds it there after the daemon
    died. Raises OSError or MountError (the state directory is not private)."""
    fd = open_state_dir(state_dir)
    try:
        private.remove(fd, RAM_TIER_RECORD)
        wfd = private.create_file(fd, RAM_TIER_RECORD, os.O_WRONLY)
        try:
            os.write(wfd, os.fsencode(path))
        finally:
            os.close(wfd)
    finally:
        os.close(fd)


def recorded_ram_tier(mountpoint: str) -> str | None:
    """The RAM tier :func:`record_ram_tier` wrote down for ``mountpoint``, or None (none
    written, not private, or not a RAM tier's path for this mountpoint: ``.../tierfs/<id>``)."""
    state_dir = state_dir_for(mountpoint)
    if not os.path.isdir(state_dir):
        return None
    try:
        fd = open_state_dir(state_dir)
    except MountError:
        return None
    try:
        rfd = private.open_file(fd, RAM_TIER_RECORD, os.O_RDONLY, create=False)
        try:
            path = os.fsdecode(os.read(rfd, 8192))
        finally:
            os.close(rfd)
    except OSError:
        return None
    finally:
        os.close(fd)
    parent = os.path.dirname(path)
    if not os.path.isabs(path) or os.path.basename(path) != mount_id(mountpoint) \
            or os.path.basename(parent) != RAM_PARENT:
        return None
    return path


def free_dead_ram_tier(mountpoint: str) -> bool:
    """After a daemon died: remove its RAM tier's cached data (it holds memory), unless a live
    daemon holds the tier or it has dirty files waiting for write-back (their journal is there;
    the next mount writes them back). The tier is the one the daemon wrote down at its mount
    (:func:`record_ram_tier`: any ``ram_dir``), else ``/dev/shm``'s. A tier directory that is not
    private to us (a symlink, another user's) is never touched. Returns True if memory was
    freed."""
    path = recorded_ram_tier(mountpoint) or ram_tier_path("/dev/shm", mountpoint)
    return free_unheld_ram_tier(path, whole=False)


def free_unheld_ram_tier(path: str, *, whole: bool) -> bool:
    """Free the RAM tier directory ``path`` if no daemon holds it (its lock is taken for the
    time, so no mount starts on it meanwhile): its cached data always; with ``whole``, the whole
    directory too when its journal holds no file to write back and no quarantined row (``tierfs
    doctor --free``). Files not yet written back are never removed, nor a journal that cannot
    be read. A directory not private to us is never touched. Returns True if it freed anything."""
    if not os.path.isdir(path):
        return False
    try:
        fd = private.open_in(os.path.dirname(path), os.path.basename(path))
    except MountError:
        return False  # not ours: leave it alone
    try:
        lock = private.lock(fd, path)
    except (MountError, OSError):
        os.close(fd)
        return False  # a live daemon uses it
    try:
        keep = True
        if whole:
            try:
                held = journal_summary(os.path.join(path, "journal.sqlite"))
                keep = bool(held.dirty or held.quarantined)
            except OSError:
                # unreadable: it may name files not written back; or none: data files left in
                # dirty/ or quarantine/ are someone's bytes whose names are lost (kept too)
                keep = True
        remove_ram_tier(path, keep_dirty=keep)
    finally:
        os.close(lock)
        os.close(fd)
    return True


def has_entries(path: str) -> bool:
    """Whether directory ``path`` holds anything (False if it is gone). Raises OSError."""
    try:
        with os.scandir(path) as it:
            return next(it, None) is not None
    except FileNotFoundError:
        return False


def unheld_ram_tiers(ram_dir: str) -> list[str]:
    """The RAM tier directories under ``<ram_dir>/tierfs`` that no daemon holds: left by a
    daemon that died, or whose write-back at unmount failed, with files still to write back. They
    keep memory, and maybe files a reboot loses, until their mountpoint is mounted again
    (``tierfs doctor`` says what each keeps). Raises OSError (the directory cannot be listed;
    ENOENT: no RAM tier at all)."""
    parent = os.path.join(os.path.abspath(ram_dir), RAM_PARENT)
    holders = private.flock_holders()
    out = []
    for name in sorted(os.listdir(parent)):
        path = os.path.join(parent, name)
        if os.path.isdir(path) and not os.path.islink(path) and private.lock_holder(path, holders) is None:
            out.append(path)
    return out


def check_mountpoint(mountpoint: str) -> None:
    """Raises MountError unless ``mountpoint`` is an empty directory nothing is mounted on.
    A dead FUSE mount ("Transport endpoint is not connected") is cleaned up first."""
    try:
        st = os.stat(mountpoint)
        # the kernel answers stat from its attribute cache for attr_timeout, even after the
        # daemon died; statvfs always asks the daemon, so a dead one shows here
        os.statvfs(mountpoint)
    except OSError as e:
        if e.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            log.warning("%s: stale FUSE mount of a dead daemon; unmounting it", mountpoint)
            if not unmount(mountpoint, lazy=True):
                raise MountError(f"mountpoint {mountpoint} has a dead FUSE mount that could not be unmounted") from None
            st = os.stat(mountpoint)
        elif e.errno == errno.ENOENT:
            raise MountError(f"mountpoint {mountpoint} does not exist") from None
        else:
            raise MountError(f"mountpoint {mountpoint}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MountError(f"mountpoint {mountpoint} is not a directory")
    if is_mounted(mountpoint):
        raise MountError(f"mountpoint {mountpoint} is already mounted")
    if os.listdir(mountpoint):
        raise MountError(f"mountpoint {mountpoint} is not empty")


def _fs_size(path: str) -> int:
    sv = os.statvfs(path)
    return sv.f_blocks * sv.f_frsize


def _inside(path: str, top: str) -> bool:
    path, top = os.path.realpath(path), os.path.realpath(top)
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


def _check_outside(what: str, path: str, backing: str, mountpoint: str) -> None:
    """A tier inside the backing directory would be served through the mount (to every user
    who can read there); one inside the mountpoint would be hidden by it.

    Raises:
        MountError: naming the tier and where it is."""
    for top, name in ((backing, "the backing directory"), (mountpoint, "the mountpoint")):
        if _inside(path, top):
            raise MountError(f"the {what} ({path}) must not be inside {name} ({top}): "
                             "choose a directory outside both")


PROBE_BYTES = 8192  # two 4 KiB blocks: one is punched, one keeps the file non-empty


def check_hole_punch(path: str) -> None:
    """Refuse a tier directory whose filesystem cannot punch holes (fallocate(2)
    ``PUNCH_HOLE``): evicting a chunk frees its blocks that way, so there the tier would
    silently grow past its capacity. Probes with an unnamed file (``O_TMPFILE``; a named one,
    unlinked at once, where that is unsupported). Raises MountError."""
    try:
        try:
            fd = os.open(path, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            fd, name = tempfile.mkstemp(prefix=".tierfs-probe.", dir=path)
            os.unlink(name)
        try:
            io.pwrite_all(fd, bytes(PROBE_BYTES), 0)
            io.punch_hole(fd, 0, PROBE_BYTES // 2)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
            raise MountError(f"tier directory {path}: its filesystem cannot punch holes (fallocate "
                             "PUNCH_HOLE), which tierfs needs to free evicted chunks; put the tier "
                             "on ext4, xfs, btrfs or tmpfs") from None
        raise MountError(f"tier directory {path}: {e.strerror}") from None


def plan_mount(cfg: Config) -> MountPlan:
    """Validate a configuration against the machine. Raises MountError / ConfigError."""
    backing = os.path.abspath(cfg.backing)
    mountpoint = os.path.abspath(cfg.mountpoint)
    if not os.path.isdir(backing):
        raise MountError(f"backing directory {cfg.backing} does not exist or is not a directory")
    if not os.path.exists("/dev/fuse"):
        raise MountError("/dev/fuse is missing: load the fuse module (modprobe fuse) or run where FUSE is available")
    check_mountpoint(mountpoint)
    if os.path.realpath(mountpoint).startswith(os.path.realpath(backing) + os.sep):
        raise MountError("the mountpoint must not be inside the backing directory")
    tiers: list[TierPlan] = []
    ram = cfg.ram
    if ram is None:
        ram = default_ram_size(cfg.ram_dir)
    if ram > 0:
        if not os.path.isdir(cfg.ram_dir):
            raise MountError(f"ram_dir {cfg.ram_dir} does not exist")
        if ram > _fs_size(cfg.ram_dir):
            raise MountError(f"RAM tier of {format_size(ram)} is larger than its filesystem "
                             f"{cfg.ram_dir} ({format_size(_fs_size(cfg.ram_dir))})")
        check_hole_punch(cfg.ram_dir)  # the tier's own directory is made at mount, on this filesystem
        ram_path = ram_tier_path(os.path.abspath(cfg.ram_dir), mountpoint)
        _check_outside("RAM tier", ram_path, backing, mountpoint)
        tiers.append(TierPlan("ram", ram_path, ram))
    if cfg.ssd is not None:
        path, size = cfg.ssd
        path = os.path.abspath(path)
        _check_outside("SSD tier", path, backing, mountpoint)
        os.close(private.open_dir(path))  # created 0700 if missing; verified private if not
        check_hole_punch(path)
        if size is None:
            size = default_ssd_size(path)
        if size > _fs_size(path):
            raise MountError(f"SSD tier of {format_size(size)} is larger than its filesystem "
                             f"at {path} ({format_size(_fs_size(path))})")
        tiers.append(TierPlan("ssd", path, size))
    if not tiers:
        raise MountError("no tier: give --ram SIZE or --ssd DIR (writes need a write tier)")
    if cfg.write_tier == "ssd" and not any(t.name == "ssd" for t in tiers):
        raise MountError("write_tier=ssd needs an SSD tier (--ssd DIR)")
    if cfg.write_tier == "ram" and not any(t.name == "ram" for t in tiers):
        raise MountError("write_tier=ram needs a RAM tier (--ram SIZE)")
    return MountPlan(cfg, backing, mountpoint, tuple(tiers), state_dir_for(mountpoint))


def _read_checked(f: BackingFile, offset: int, length: int) -> bytes:
    """A backing read, then a check that the file did not change under it (then its bytes are
    served to this reader but never cached: ``f.stale``)."""
    # Queue the whole run at the device at once: one pread alone reaches an HDD as a chain of
    # 1 MiB requests with one outstanding, and the disk idles between them (73% busy measured
    # on the emulated HDD with 8 readers). The requests are contiguous, so nothing interleaves.
    if length > WILLNEED_OVER:  # (a read of one request's size needs no announcing: a syscall saved)
        os.posix_fadvise(f.fd, offset, length, os.POSIX_FADV_WILLNEED)
    data = io.pread_exact(f.fd, length, offset)
    # The bytes now live in a tier (and the mount's page cache): a third copy in the backing
    # store's page cache would only push useful pages out (unless readers pass through to it).
    if not f.kernel_reads:
        os.posix_fadvise(f.fd, offset, length, os.POSIX_FADV_DONTNEED)
    st = os.fstat(f.fd)
    if st.st_size != f.identity.size or st.st_mtime_ns != f.identity.mtime_ns:
        f.stale = True
    return data


def unmount_on_signal(mountpoint: str) -> str:
    """What SIGTERM/SIGINT/SIGHUP do: the unmount ``umount`` would do, refused by the kernel
    while the mount is busy (open files, a working directory in it), so a signal never cuts
    off a process that uses the mount. Blocking (runs ``fusermount3 -u``): call in a thread.

    Returns "unmounted", "busy" (still mounted and serving) or "detached" (lazily unmounted
    already: the daemon exits by itself when the last open file is closed)."""
    if not is_mounted(mountpoint):
        return "detached"
    try:
        return "unmounted" if unmount(mountpoint) else "busy"
    except OSError as e:  # fusermount3 missing or not runnable
        log.error("unmounting %s: %s", mountpoint, e)
        return "busy"


def _set_kernel_readahead(mountpoint: str, kb: int) -> str:
    st = os.stat(mountpoint)
    bdi = f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb"
    with open(bdi, "w") as f:
        f.write(str(kb))
    return bdi


def _private_db(tier: Tier, name: str) -> str:
    """The path of the sqlite file ``name`` in ``tier``'s directory, created private (0600,
    ``O_EXCL|O_NOFOLLOW``) or verified, named through the tier's descriptor. sqlite creates its
    ``-wal`` and ``-shm`` files with the database's mode and owner."""
    os.close(private.open_file(tier.dir_fd, name))
    return private.fd_path(tier.dir_fd, name)


async def serve(plan: MountPlan, ready: Callable[[str | None], None]) -> None:
    """Mount and serve until unmounted or signalled. ``ready(None)`` once the mount works,
    ``ready(message)`` if setup fails (then the error is raised too)."""
    cfg = plan.cfg
    started = time.monotonic()
    try:
        loop_bound = loopwatch.bound_from_env()  # the event-loop bound (docs/concurrency.md)
    except ValueError as e:
        raise MountError(str(e)) from None
    watch = loopwatch.LoopWatch(loop_bound) if loop_bound is not None else None
    tiers: list[Tier] = []
    devices: list[io.Device] = []
    lock_fds: list[int] = []
    ssd_catalog: SsdCatalog | None = None
    for tp in plan.tiers:
        dir_fd = None
        if tp.name == "ram":  # <ram_dir>/tierfs/<id>: both levels created or verified private
            dir_fd = private.open_in(os.path.dirname(tp.path), os.path.basename(tp.path))
        tier = Tier(tp.name, tp.path, tp.capacity, inline=tp.name == "ram", dir_fd=dir_fd)
        tiers.append(tier)
        lock_fds.append(private.lock(tier.dir_fd, tp.path))
        if tp.name == "ram":
            tier.wipe()  # a RAM tier never outlives its daemon
            try:
                record_ram_tier(plan.state_dir, tp.path)
            except (OSError, MountError) as e:  # only `tierfs umount` of a dead mount needs it
                log.warning("could not write down where the RAM tier is (%s): after a crash, "
                            "`tierfs doctor --free` frees it", e)
        else:
            ssd_catalog = SsdCatalog(_private_db(tier, "catalog.sqlite"))
        devices.append(io.Device(tp.name, 4))
    profile = backing_profile.resolve(cfg.backing_profile, cfg.sources.get("backing_profile", "default"),
                                      plan.backing, chunk_size=cfg.chunk_size, depth=cfg.depth,
                                      slice_size=cfg.slice_size)
    log.info("backing profile %s (%s): %s; depth %d, slices of %s", profile.name, profile.source,
             profile.reason, profile.depth, format_size(profile.slice_size))
    backing_dev = io.Device("backing", profile.depth)
    # On a local parallel store (an SSD, tmpfs), a chunk the kernel copies from the store's
    # page cache into a tier (a small file's fill after its passthrough reads) takes tens of
    # microseconds, less than a hand-off to a thread: reads and those copies get a device of
    # their own that runs them inline while measured so (io.Device). Shuffled first epochs
    # over 8,000 files of ~110 KiB on tmpfs: +16% files/s, the daemon's CPU -20%, and the
    # epochs after it +27-30% (the fills no longer lag, nor hold the GIL against the loop).
    # The write-back's calls (fsyncs, renames) stay in backing_dev's threads. Never on the hdd
    # profile (one device, its one request in flight in its thread), nor on a network or FUSE
    # store, where a call may wait on a server for as long as it is unreachable and would stop
    # every request with it.
    backing_reads = backing_dev
    if not profile.elevator and backing_profile.local(plan.backing):
        backing_reads = io.Device("backing-reads", profile.depth, inline_under=BACKING_INLINE_UNDER_S,
                                  thread_period=DIRTY_THREAD_PERIOD_S)
    meta = io.Device("backing-meta", META_THREADS, inline_under=META_INLINE_UNDER_S, yield_every=8,
                     thread_period=META_THREAD_PERIOD_S)

    async def read_backing(f: BackingFile, offset: int, length: int) -> bytes:
        return await backing_reads.run(_read_checked, f, offset, length)

    async def run_backing_io(fn):  # type: ignore[no-untyped-def]
        return await backing_dev.run(fn)

    scheduler = TransactionScheduler(read_backing, chunk_size=cfg.chunk_size,
                                     slice_size=profile.slice_size, depth=profile.depth,
                                     run_io=run_backing_io, elevator=profile.elevator)
    total_chunks = sum(t.capacity for t in tiers) // cfg.chunk_size
    policy = Policy(cfg.eviction, window=max(1024, 8 * total_chunks), plan=HintPlan())
    cache = Cache(tiers, devices, policy, scheduler, chunk_size=cfg.chunk_size,
                  staging_bytes=cfg.staging, ssd_catalog=ssd_catalog)
    if backing_reads is not backing_dev:
        cache.copy_io = backing_reads.run
    restored = await trio.to_thread.run_sync(cache.load_persistent)
    if restored:
        log.info("SSD tier: %d chunks restored from %s", restored, plan.tiers[-1].path)
    tree = BackingTree(os.fsencode(plan.backing))  # every backing-store access resolves beneath it
    inodes = InodeTable(tree)
    names = [t.name for t in plan.tiers]
    wt_name = cfg.write_tier if cfg.write_tier != "auto" else ("ssd" if "ssd" in names else "ram")
    wt = names.index(wt_name)
    dirty_data_dev = io.Device(f"{wt_name}-dirty-data", 4, inline_under=DIRTY_INLINE_UNDER_S,
                               thread_period=DIRTY_THREAD_PERIOD_S)
    # yielding every 8th call, as metadata calls do: a yield at each one suspended every
    # CREATE and SETATTR, handing the transport's reading turn to another worker and back
    # (tar -x: 4 suspensions per file, none needed)
    attr_dev = (io.Device(f"{wt_name}-dirty-attrs", 4, inline_under=ATTR_INLINE_UNDER_S,
                          thread_period=DIRTY_THREAD_PERIOD_S, yield_every=8) if wt_name == "ram" else None)
    # the journal's reserve: at most 1/16 of the write tier (5 MiB from an 80 MiB tier up)
    journal = Journal(_private_db(tiers[wt], "journal.sqlite"), reserve_limit=tiers[wt].capacity // 16)
    # the write tier is named after the mountpoint: its files to write back must be this
    # backing directory's, never another's mounted here since (ForeignJournal, at once)
    real_backing, real_mountpoint = await trio.to_thread.run_sync(
        lambda: (os.path.realpath(plan.backing), os.path.realpath(plan.mountpoint)))
    journal.claim(os.fsencode(real_backing), os.fsencode(real_mountpoint))
    tiers[wt].set_aside(journal.reserved_bytes)
    writeback = WriteBack(
        backing_root=os.fsencode(plan.backing), tree=tree, tier=tiers[wt], tier_index=wt, device=devices[wt],
        data_device=dirty_data_dev,
        scheduler=scheduler, journal=journal,
        make_room=cache.evict_for, deadline_s=cfg.writeback_deadline, slice_size=profile.slice_size,
        attr_device=attr_dev, hold_s=cfg.writeback_hold,
        # fsync means durable on a persistent tier: a RAM write tier is not one, so there
        # fsync waits for the backing store
        fsync_backing=cfg.fsync == "backing" or wt_name == "ram")

    def dirty_bytes(rel: bytes) -> int:
        df = writeback.get(rel)
        return df.size if df is not None and df.state.value != "clean" else 0

    hints = HintService(cache=cache, scheduler=scheduler, tree=tree, meta=meta,
                        chunk_size=cfg.chunk_size, write_tier=wt, budget=2 * profile.slice_size,
                        dirty_bytes=dirty_bytes, predict_bytes=min(cfg.readahead_max, 4 * cfg.chunk_size),
                        user_share=cfg.user_hint_share, mountpoint=os.fsencode(plan.mountpoint))
    ctl = ControlCommands(hints=hints, writeback=writeback, tree=tree, meta=meta,
                          mountpoint=os.fsencode(plan.mountpoint))

    def stats_doc() -> dict:
        doc = stats_mod.build(cache=cache, scheduler=scheduler, writeback=writeback, started=started,
                               backing=plan.backing, mountpoint=plan.mountpoint,
                               chunk_size=cfg.chunk_size, open_files=len(ops.open_files),
                               inodes=len(inodes),
                               fuse_reads=(ops.reads, ops.read_bytes, ops.max_read),
                               fuse_writes=(ops.writes, ops.write_bytes),
                               devices=[*devices, backing_dev, *([backing_reads] if backing_reads is not backing_dev else []),
                                        meta, dirty_data_dev,
                                        *([attr_dev] if attr_dev is not None else [])])
        doc["scheduler"]["backing_opens"] = tree.opens  # open(2) calls on the backing tree
        doc["scheduler"]["shared_opens"] = ops.ns.shared_opens  # opens that reused an open file
        doc["scheduler"]["profile"] = {"name": profile.name, "source": profile.source,
                                       "reason": profile.reason, "elevator": profile.elevator}
        doc["fuse"]["requests"] = dict(ops.requests)  # by handler; flush counts its one ENOSYS
        doc["fuse"]["request_seconds"] = dict(ops.request_seconds)  # time in each handler
        doc["fuse"]["stale_opens"] = ops.stale_opens
        doc["fuse"]["getattrs_from_open"] = ops.ns.opened_stats  # answered by the open's fstat
        doc["fuse"]["dir_getattrs_from_change"] = ops.ns.dir_stats  # answered by a change's fstat
        doc["fuse"]["readdir_entries_held_max"] = ops.readdir_held_max
        # tier copies of small files kept leased after their last close, and opens that reused one
        doc["fuse"]["kept_passthrough"] = len(ops.kept_passthrough)
        doc["fuse"]["kept_passthrough_reuses"] = ops.kept_reuses
        doc["fuse"]["kept_passthrough_fds"] = ops.kept_fds  # of those, kept with a descriptor open
        doc["fuse"]["kept_passthrough_reopens"] = cache.unparks  # reuses that reopened a parked one
        # a read-only mount whose opens the kernel answers: implicit read handles (Handlers.read_inode)
        doc["fuse"]["read_only"] = cfg.ro
        doc["fuse"]["kernel_opens"] = control.kernel_opens
        doc["fuse"]["inode_readers"] = len(ops.inode_readers)
        doc["fuse"]["inode_reader_opens"] = ops.inode_reader_opens
        doc["fuse"]["inode_invalidations"] = ops.inode_invalidations  # pages dropped: changed in place
        doc["hints"] = hints.statistics()
        doc["control"] = ctl.statistics()
        doc["loop"] = watch.as_dict() if watch is not None else None
        doc["transport"] = session.statistics() if session is not None else None
        return doc

    def render_stats(uid: int = 0) -> bytes:
        doc = stats_doc()
        if uid != 0:
            # stats.json is open to every user of the mount: what names files or carries
            # another user's text is root's only (a quarantined path may lie in a 0700
            # directory the reader cannot even look into; a need's label is its owner's text)
            doc["writeback"]["quarantined_paths"] = []
            for pd in doc["hints"].get("pending_deadlines", []):
                pd["label"] = ""
        return json.dumps(doc, indent=1).encode() + b"\n"

    def render_config(uid: int = 0) -> bytes:
        d = asdict(cfg)
        d["tiers"] = [asdict(t) for t in plan.tiers]
        return json.dumps(d, indent=1).encode() + b"\n"

    control = ControlPlane({"stats.json": render_stats, "pid": lambda uid: f"{os.getpid()}\n".encode(),
                            "config.json": render_config}, {wire.CTL_FILE: ctl})
    ops = Handlers(tree=tree, inodes=inodes, cache=cache, writeback=writeback,
                   readahead=Readahead(cfg.chunk_size, cfg.readahead_max, budget=cfg.staging),
                   control=control, meta=meta, attr_timeout=cfg.attr_timeout,
                   on_open_read=hints.file_opened, on_read_end=hints.file_read_end)
    # one open(2) per backing file however many readers and prefetches use it
    ops.ns.find_open = hints.open_file
    ops.ns.find_held = hints.held_at
    ops.ns.openings = hints.openings
    hints.find_open = lambda key: (f if (f := ops.ns.open_files.get(key)) is not None and f.fd >= 0 else None)
    # fsname = the backing dir: df shows it, and `mount -a` sees that an fstab line is mounted
    fsname = plan.backing.replace("\\", "\\\\").replace(",", "\\,")
    options = {f"fsname={fsname}", "subtype=tierfs", "default_permissions", "noatime"}
    if effective_allow_other(cfg, os.geteuid()):
        options.add("allow_other")
    if cfg.ro:
        options.add("ro")
    session: Session | None = None
    session = await start_session(cfg.transport, ops, plan.mountpoint, fsname=plan.backing,
                                  options=options, passthrough=cfg.passthrough, kernel_opens=cfg.kernel_opens,
                                  busy_poll_s=cfg.busy_poll_us / 1e6)
    # (before the session serves: its first LOOKUP of a control file must render it)
    control.kernel_opens = bool(getattr(session, "kernel_opens", False))
    # misses straight from a parallel store (never an HDD's: its scheduler orders every access)
    ops.backing_passthrough = cfg.passthrough_misses and not profile.elevator and cfg.passthrough == "on"
    unmounted_cleanly = False
    exporter = None
    try:
        if cfg.metrics_port:
            from tierfs.metrics import Exporter

            exporter = Exporter(cfg.metrics_addr, cfg.metrics_port, stats_doc)
            log.info("metrics on http://%s:%d/metrics", *exporter.address[:2])
        # Everything built so far (modules, classes, the mount's tables) lives as long as the
        # daemon: freezing it keeps the cyclic collector from walking it again at every full
        # collection, a pause of the whole event loop (on a mount serving fio random writes a
        # full collection took 7-12 ms over ~30,000 objects, then 0.3-0.4 ms; docs/concurrency.md).
        # Collected first, so no garbage alive now is frozen with it.
        gc.collect()
        gc.freeze()
        async with trio.open_nursery() as nursery:
            if watch is not None:  # timed from here: the mount serves (setup before is not timed)
                loopwatch.install(watch)
            cache.attach(nursery)
            ops.nursery = nursery
            await nursery.start(scheduler.run)
            nursery.start_soon(cache.run_flusher)
            recovered = await writeback.recover()
            if recovered:
                log.warning("recovery after a crash: %d dirty files will be written back", recovered)
            await nursery.start(writeback.run)
            await nursery.start(hints.run)
            if cfg.ro and recovered:
                # nothing is written through a read-only mount: holding what a crash left in the
                # write tier gains nothing; written back now (`tierfs umount --flush` waits)
                async def write_back_recovered() -> None:
                    try:
                        await writeback.wait_durable(None, math.inf)
                    except (TierfsError, OSError) as e:
                        log.error("write-back of the files a crash left: %s (retried on schedule)", e)

                nursery.start_soon(write_back_recovered)

            async def fuse_main() -> None:
                await session.main()
                left = await ops.release_left()  # (the mount is gone: no RELEASE comes for these)
                if left:
                    log.info("the mount is gone: released %d open handle(s) whose release the kernel "
                             "never sent", left)
                if wt_name == "ram":
                    await write_back_before_exit(writeback)
                nursery.cancel_scope.cancel()

            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
                    async for sig in sigs:
                        name = signal.Signals(sig).name
                        outcome = await trio.to_thread.run_sync(unmount_on_signal, plan.mountpoint)
                        if outcome == "unmounted":
                            log.info("signal %s: unmounted %s", name, plan.mountpoint)
                            session.terminate()
                            return
                        if outcome == "detached":
                            log.warning("signal %s: %s is detached already (umount --lazy); exiting "
                                        "when its last open file is closed (%d open)", name,
                                        plan.mountpoint, len(ops.open_files))
                        else:
                            log.warning("signal %s: not unmounting %s: it is busy (%d files open; "
                                        "find them with `fuser -vm %s`); still serving. Close them and "
                                        "signal again, or `tierfs umount --lazy %s`", name,
                                        plan.mountpoint, len(ops.open_files), plan.mountpoint,
                                        plan.mountpoint)

            nursery.start_soon(fuse_main)
            nursery.start_soon(on_signal)
            if control.kernel_opens:
                nursery.start_soon(ops.sweep_inode_readers)
            nursery.start_soon(logevents.watch, writeback.statistics, log)
            if cfg.read_ahead_kb:
                try:
                    bdi = await trio.to_thread.run_sync(_set_kernel_readahead, plan.mountpoint, cfg.read_ahead_kb)
                    log.info("kernel readahead %d KiB (%s)", cfg.read_ahead_kb, bdi)
                except OSError as e:
                    log.warning("could not raise kernel readahead (needs root): %s", e)
            log.info("mounted %s on %s; tiers: %s; usable by %s", plan.backing, plan.mountpoint,
                     ", ".join(f"{t.name}={format_size(t.capacity)} at {t.path}" for t in plan.tiers) or "none",
                     who_can_use(options | {f"user_id={os.geteuid()}"}))
            log.info("transport: %s%s (%s)%s", session.name,
                     " with kernel passthrough" if session.passthrough else "", session.why,
                     "; misses read straight from the backing store" if ops.backing_passthrough
                     and session.passthrough else "")
            try:
                left = await trio.to_thread.run_sync(unheld_ram_tiers, cfg.ram_dir)
            except OSError:
                left = []
            if left:
                log.warning("%d RAM tier(s) under %s are held by no daemon (left by a crash, or by a "
                            "write-back that failed at unmount): `tierfs doctor` says what each keeps", len(left),
                            os.path.dirname(left[0]))
            ready(None)
        unmounted_cleanly = True
    finally:
        if exporter is not None:
            exporter.close()
        try:
            session.close(unmount=True)
        except Exception as e:  # noqa: BLE001 - teardown must go on
            log.warning("closing the FUSE session: %s", e)
        wb_stats = writeback.statistics()
        pending = wb_stats.dirty_files
        # quarantined journal rows and their data (tierfs doctor shows them) stay with the tier
        keep = bool(pending or wb_stats.quarantined)
        writeback.close()
        hints.close()
        cache.close()
        tree.close()
        for fd in lock_fds:
            os.close(fd)
        if pending:
            log.info("%d dirty files stay in the %s tier; write-back resumes at the next mount",
                     pending, writeback.tier.name)
        for tp in plan.tiers:
            if tp.name == "ram":
                # cached data is freed; dirty files (and their journal) stay for the next mount
                remove_ram_tier(tp.path, keep_dirty=keep)
        log.info("unmounted %s%s", plan.mountpoint, "" if unmounted_cleanly else " (after an error)")
