"""Every blocking syscall tierfs makes on file data goes through this module.

Each physical device gets its own :class:`Device` with a thread limiter, so a slow device never
takes threads from a fast one. Reads of a tmpfs tier are the one exception that runs inline on
the event loop: moving tmpfs ``pread`` into worker threads made reads 2-3x slower (design brief,
"Facts measured on this kind of machine").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import resource
import stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

if TYPE_CHECKING:
    from tierfs.backing_tree import BackingTree

T = TypeVar("T")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_uint]
# SYNC_FILE_RANGE_WAIT_BEFORE | WRITE | WAIT_AFTER: the range is on the device when it returns
SYNC_RANGE_ALL = 1 | 2 | 4


def _voluntary_switches() -> int:
    """This thread's voluntary context switches so far (it slept: I/O, a lock)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


class Device:
    """A physical device (the backing store, the SSD, ...) with its own thread limiter.

    ``depth`` is how many blocking calls may run on it at once.

    ``inline_under`` (seconds, or None): calls run on the event loop itself while an
    exponentially weighted mean of their durations (weight ``EWMA_WEIGHT``) stays under this
    and no call took ``SPIKE_FACTOR`` times as long (one that slept: two within
    ``CONFIRM_CALLS`` calls); otherwise all calls go to threads for ``thread_period`` seconds,
    after which inline is tried again (a probe: see ``PROBE_CALLS``, the period doubles each
    time a probe fails, like a retransmission timeout). For backing-store
    metadata this measured 4x faster ``ls -lR`` (1.05 s -> 0.26 s for 1000 files: a thread hop
    costs more than a cached ``lstat``), while a cold HDD lookup (~10 ms) costs the loop one
    stall. For writes into the write tier, one call slowed by the kernel's dirty-page throttling
    used to send every later write to threads (751 inline, 2321 in threads for 3 GiB written);
    the mean keeps them inline through such outliers.
    """

    THREAD_PERIOD_S = 30.0
    EWMA_WEIGHT = 0.1
    SPIKE_FACTOR = 10.0
    CONFIRM_CALLS = 64  # a slow call that slept sends calls to threads if another did within these
    # Back-off: inline calls after a thread period are a probe; if calls go back to threads
    # within PROBE_CALLS of them, the next period is twice as long (at most MAX_PERIOD_FACTOR
    # times ``thread_period``). With ``dd`` keeping the page cache full beside a test,
    # backing-store lookups and readdirs retried inline every 2 s and slept 50-105 ms each
    # time (9 times in one test). A probe that lasts PROBE_CALLS calls ends the back-off (the
    # period is ``thread_period`` again). A probe still needs two slow calls that slept, as
    # any other inline run: one alone is as often a short sleep and a long wait for a CPU.
    PROBE_CALLS = 256
    MAX_PERIOD_FACTOR = 16

    def __init__(self, name: str, depth: int, *, inline_under: float | None = None,
                 thread_period: float = THREAD_PERIOD_S, yield_every: int = 1) -> None:
        """``yield_every``: inline calls between two yields to the scheduler (1: each call).
        Metadata calls (~10-30 us each) yield every 8th; data calls (a chunk written into the
        write tier, ~1-5 ms) at each one."""
        self.yield_every = yield_every
        self.name = name
        self.limiter = trio.CapacityLimiter(depth)
        self.inline_under = inline_under
        self.thread_period = thread_period
        self._threads_until = 0.0
        self._mean_s = 0.0
        self.inline_calls = 0
        self.thread_calls = 0
        self.slow_inline_calls = 0
        self._unyielded = 0
        self._spike_call = -(1 << 30)  # inline_calls at the last unconfirmed spike
        self.period = thread_period  # the next thread period (seconds; grows in a back-off)
        self._probe_from: int | None = None  # inline_calls when calls last went to threads

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run blocking ``fn(*args)``: in a worker thread under this device's limiter, or
        inline while measured cheap (see the class docstring)."""
        if self.inline_under is not None:
            if time.monotonic() >= self._threads_until:
                self._unyielded += 1
                if self._unyielded >= self.yield_every:
                    self._unyielded = 0
                    await trio.lowlevel.checkpoint()
                else:
                    # A cancel is seen here as at any checkpoint, but the other tasks do not
                    # run: yielding at every inline call cost a request ~30 us of latency (the
                    # loop polls epoll and runs the transport's next reader before the call),
                    # a third of a lookup's round trip; every yield_every-th call still yields
                    await trio.lowlevel.checkpoint_if_cancelled()
                # timed from here, not from before the checkpoint: other tasks run there, and
                # their time was charged to this call (every call under load looked slow)
                return self.run_now(fn, *args)
        return await self.in_thread(fn, *args)

    def inline_now(self) -> bool:
        """Whether a call made now would run inline (see the class docstring)."""
        return self.inline_under is not None and time.monotonic() >= self._threads_until

    def run_now(self, fn: Callable[..., T], *args: object) -> T:
        """Run blocking ``fn(*args)`` inline now, on the loop, its time judged (the class
        docstring): :meth:`run`'s inline calls, and a caller that cannot await (a request the
        transport answers as it reads it) which checked :meth:`inline_now` first. No yield."""
        under = self.inline_under or 0.0  # (set: the callers checked)
        now = time.monotonic()
        cpu = time.thread_time()
        switches = _voluntary_switches()
        try:
            return fn(*args)
        finally:
            took = time.monotonic() - now
            slept = True
            if took > under and _voluntary_switches() == switches:
                # it never slept (no I/O wait): the wall time beyond its CPU time was
                # preemption by other processes (a loaded machine: DataLoader workers
                # on every core), which a thread would suffer too and then add a
                # hand-off; charge the CPU time it held the loop for
                took = time.thread_time() - cpu
                slept = False
            self.inline_calls += 1
            probing = self._probe_from is not None
            if probing and self.inline_calls - self._probe_from > self.PROBE_CALLS:  # type: ignore[operator]
                self._probe_from, self.period, probing = None, self.thread_period, False
            spike_at = self.SPIKE_FACTOR * under
            # one outlier moves the mean by at most half the limit: alone it is judged
            # as a spike, below
            self._mean_s += self.EWMA_WEIGHT * (min(took, spike_at / 2) - self._mean_s)
            spike = took > spike_at
            if took > under:
                self.slow_inline_calls += 1
            if spike and slept and self.inline_calls - self._spike_call > self.CONFIRM_CALLS:
                # A call that slept that long is a slow device (a cold HDD lookup) or
                # a short sleep followed by a long wait for a CPU (4 DataLoader workers
                # on 2 cores): only a second one soon after says which. One such stall
                # sent every call to threads for 30 s, and a small-file epoch to a
                # third of its speed (2,100 instead of 6,000 files/s)
                self._spike_call = self.inline_calls
                spike = False
            if self._mean_s > under or spike:
                if probing:
                    self.period = min(2 * self.period, self.MAX_PERIOD_FACTOR * self.thread_period)
                self._threads_until = now + took + self.period
                self._probe_from = self.inline_calls
                self._spike_call = -(1 << 30)  # the probe starts afresh
                self._mean_s = 0.0

    async def in_thread(self, fn: Callable[..., T], *args: object) -> T:
        """Run blocking ``fn(*args)`` in a worker thread under this device's limiter, never
        inline: for calls that are cheap on average but may wait in the kernel on locks the
        device's threads hold (see :meth:`Namespace.rmdir`)."""
        self.thread_calls += 1
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)


def open_backing(tree: BackingTree, rel: bytes) -> tuple[int, os.stat_result]:
    """Open regular file ``rel`` of the backing tree (relative to its root) read-only and fstat
    it, resolved beneath the root without following any symlink. ``O_NONBLOCK``: a fifo put
    in the file's place never blocks the caller (it is refused, as anything not a regular file).
    Returns (fd, stat). Raises OSError (ELOOP: a symlink on the way; EISDIR: a directory;
    EINVAL: another non-regular file)."""
    fd = tree.open(rel, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            e = errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL
            raise OSError(e, os.strerror(e), rel)
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def pread_exact(fd: int, length: int, offset: int) -> bytes:
    """Read ``length`` bytes at ``offset``; shorter only at end of file."""
    data = os.pread(fd, length, offset)
    if len(data) == length or not data:
        return data
    parts = [data]
    got = len(data)
    while got < length:
        more = os.pread(fd, length - got, offset + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (loops on short writes)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


# Errors that say "this kernel or this pair of filesystems cannot do it this way": fall back to
# the next method (copy_file_range between two filesystems of different types gives EXDEV;
# before Linux 5.3 always; some FUSE and network filesystems EOPNOTSUPP/EINVAL/ENOSYS).
_NOT_THIS_WAY = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF})
COPY_METHODS = ("copy_file_range", "splice", "pread")


class CopyStats:
    """How many copies and bytes each method of :func:`copy_range` carried (per process)."""

    def __init__(self) -> None:
        self.calls = dict.fromkeys(COPY_METHODS, 0)
        self.bytes = dict.fromkeys(COPY_METHODS, 0)
        # (method, route) pairs that failed with a "not this way" error
        self.broken: set[tuple[str, object]] = set()


copy_stats = CopyStats()


def _copy_file_range(src: int, dst: int, length: int, src_off: int, dst_off: int) -> int:
    done = 0
    while done < length:
        n = os.copy_file_range(src, dst, length - done, src_off + done, dst_off + done)
        if n == 0:
            break  # end of the source file
        done += n
    return done


def _splice(src: int, dst: int, length: int, src_off: int, dst_off: int) -> int:
    """File -> pipe -> file with explicit offsets (no file position is used: other threads
    write other chunks of the same tier file through the same descriptor)."""
    r, w = os.pipe()
    try:
        try:  # a 1 MiB pipe: 16x fewer round trips than the 64 KiB default
            import fcntl

            fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
        except OSError:
            pass
        done = 0
        while done < length:
            n = os.splice(src, w, length - done, offset_src=src_off + done)
            if n == 0:
                break
            moved = 0
            while moved < n:
                moved += os.splice(r, dst, n - moved, offset_dst=dst_off + done + moved)
            done += n
        return done
    finally:
        os.close(r)
        os.close(w)


def _pread_pwrite(src: int, dst: int, length: int, src_off: int, dst_off: int) -> int:
    data = pread_exact(src, length, src_off)
    pwrite_all(dst, data, dst_off)
    return len(data)


_COPIERS = {"copy_file_range": _copy_file_range, "splice": _splice, "pread": _pread_pwrite}


def copy_range(src: int, dst: int, length: int, src_off: int, dst_off: int, *,
               methods: tuple[str, ...] = COPY_METHODS, route: object = None) -> int:
    """Copy ``length`` bytes at ``src_off`` of file ``src`` to ``dst_off`` of file ``dst``
    without the bytes passing through Python where the kernel allows: ``copy_file_range(2)``
    (in-kernel; a reflink or server-side copy where the filesystems offer one), else
    ``splice(2)`` through a pipe, else ``pread``+``pwrite``. A method that fails with EXDEV,
    EINVAL, ENOSYS, EOPNOTSUPP or EBADF is not tried again on ``route`` (the caller's name for
    the pair of filesystems, e.g. the destination tier) in this process. Neither file's
    position is used or moved. Returns the bytes copied (short only at the end of ``src``).
    Blocking: call in a device thread. Raises OSError (other errors: EIO, ENOSPC, ...).

    Measured (bench/bench_copy.py, docs/benchmarks.md): copy_file_range is the fastest from
    tmpfs and from ext4 into tmpfs; sendfile(2) is not offered because it writes at the
    destination's file position, which threads copying into one tier file would share."""
    last: OSError | None = None
    for m in methods:
        if (m, route) in copy_stats.broken:
            continue
        try:
            n = _COPIERS[m](src, dst, length, src_off, dst_off)
        except OSError as e:
            if e.errno not in _NOT_THIS_WAY:
                raise
            copy_stats.broken.add((m, route))
            last = e
            continue
        copy_stats.calls[m] += 1
        copy_stats.bytes[m] += n
        return n
    raise last if last is not None else OSError(errno.ENOSYS, "no copy method left")


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the blocks of ``[offset, offset+length)`` and keep the file size (fallocate(2)
    ``FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE``; supported by tmpfs, ext4, xfs, btrfs).

    Raises:
        OSError: EOPNOTSUPP where the filesystem cannot punch holes.
    """
    if length <= 0:
        return
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def sync_range(fd: int, offset: int, length: int) -> None:
    """Write ``[offset, offset+length)`` of ``fd`` to its device and wait (sync_file_range(2)).

    Used per write-back slice so the disk writes happen inside the scheduler's transaction, not
    later in kernel writeback or one huge final fsync the scheduler cannot see or order. It does
    not make metadata durable: the final ``fsync`` still does that. Falls back to fdatasync.
    """
    if _libc.sync_file_range(fd, offset, length, SYNC_RANGE_ALL) != 0:
        os.fdatasync(fd)


def allocated_bytes(path: str) -> int:
    """Bytes a file really occupies (``st_blocks * 512``); 0 if it is gone."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def is_enospc(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


class Pacer:
    """Long CPU work on the event loop, sliced: call ``await pacer.step()`` between small
    slices of it (~0.1-1 ms each); after every ``work_s`` of work it sleeps ``pause_s``, so
    FUSE requests are served in between. A bare checkpoint between slices is not enough:
    measured 0.4-0.9 s FUSE stat latency while a task parsed a 30 MB request checkpointing
    every ~1 ms, against 16 ms with a 3 ms sleep between slices. ``enabled=False`` (the
    simulator on its mock clock) never sleeps."""

    WORK_S = 0.002
    PAUSE_S = 0.001

    def __init__(self, *, enabled: bool = True, work_s: float = WORK_S, pause_s: float = PAUSE_S) -> None:
        self.enabled = enabled
        self.work_s = work_s
        self.pause_s = pause_s
        self._since = time.monotonic()
        self.pauses = 0

    async def step(self) -> None:
        if not self.enabled:
            await trio.lowlevel.checkpoint()
            return
        if time.monotonic() - self._since >= self.work_s:
            await trio.sleep(self.pause_s)
            self.pauses += 1
            self._since = time.monotonic()


async def free_in_slices(lists: list[list[Any]], pacer: Pacer, piece: int = 4096) -> None:
    """Empty each of ``lists`` ``piece`` entries at a time, ``await pacer.step()`` between
    pieces. Dropping the last reference to a list of a million objects frees them all in one
    step: the 500,000 entries of a control request's reply held the event loop 418 ms on
    CPU when its task ended (2-core VM, loaded)."""
    for lst in lists:
        while lst:
            del lst[-piece:]
            await pacer.step()
