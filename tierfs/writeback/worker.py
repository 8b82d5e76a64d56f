"""The write-back worker: picks the dirty file due first and writes it back, one at a time.

A file in the write tier goes DIRTY -> WRITING -> CLEAN: its name is journaled, a fresh
temporary file is created beside the target (``O_EXCL | O_NOFOLLOW``), one generation is copied
in slices (each a DEADLINE transaction of the scheduler), attributes applied, fsynced, renamed
into place. A written-through file is committed by :func:`tierfs.writeback.through.commit_through`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from functools import partial
from typing import TYPE_CHECKING, cast

import trio

from tierfs.errors import TierfsError
from tierfs.sched.scheduler import Klass
from tierfs.writeback.backing_ops import (
    _allocated,
    _commit,
    _copy_data,
    _copy_small,
    _finish_in_place,
    _finish_tmp,
    _parent,
    _size_tmp,
    atime_before_copy,
)
from tierfs.writeback.group import gather, write_back_group
from tierfs.writeback.journal import JState
from tierfs.writeback.manager import RETRY_S, DirtyFile, DirtyState, _Abort, _pins_df

if TYPE_CHECKING:
    from tierfs.writeback.manager import WriteBack


def next_job(wb: WriteBack) -> DirtyFile | None:
    """The file to write back next: the earliest deadline among those whose writers closed (or
    that someone waits for), with no operation in flight and not retrying a failure yet
    (:mod:`tierfs.writeback.ready`: an index, not a scan of every dirty file)."""
    return wb.files.ready.first(trio.current_time())


async def run(wb: WriteBack, task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
    """Write back forever, one file at a time; sleeps until woken (a close, a flush) or
    RETRY_S, and while a burst of writes holds the write-back (:mod:`tierfs.writeback.hold`)
    until it ends or someone waits for a file."""
    task_status.started()
    while True:
        df = next_job(wb)
        if df is None:
            wb._wake = trio.Event()
            with trio.move_on_after(RETRY_S):
                await wb._wake.wait()
            continue
        again = wb.hold_until(df)
        if again is not None:
            # a burst of writes is going on: its files are written back after it (or when
            # someone waits for one, or they have waited hold_s), not beside it
            t0 = trio.current_time()
            wb.holding = True
            wb._urgent = trio.Event()
            try:
                with trio.move_on_at(again):
                    await wb._urgent.wait()
            finally:
                wb.holding = False
                wb.hold_seconds += trio.current_time() - t0
            continue
        group = gather(wb, df)
        try:
            if len(group) > 1:
                await write_back_group(wb, group)  # small files of one directory, together
            else:
                await write_back(wb, df)
        except OSError as e:
            # a journal write failed (the write tier's filesystem is full): the file stays
            # dirty as it was and is retried; the daemon goes on
            wb._failed(df, e)


@_pins_df
async def write_back(wb: WriteBack, df: DirtyFile) -> None:
    df.wb_done = trio.Event()
    try:
        if df.through:
            from tierfs.writeback.through import commit_through

            await commit_through(wb, df)
        else:
            await _write_back_dirty(wb, df)
    finally:
        df.wb_done.set()
        df.wb_done = None


async def _write_back_dirty(wb: WriteBack, df: DirtyFile) -> None:
    """DIRTY -> WRITING -> CLEAN (or back to DIRTY): copy one generation to a fresh
    temporary file (its name journaled first), fsync, rename into place.

    A file passthrough writers may have changed (``df.pt_written``) is looked at first (its
    size and times, :meth:`WriteBack._absorb`) and again just before the commit: a write that
    landed behind the daemon during the copy makes it a new generation, so this copy is
    dropped and the file stays dirty (never marked clean with an older content)."""
    if df.pt_written:
        wb._absorb(df)
    gen = df.gen
    path0 = df.path
    df.advance(DirtyState.WRITING)
    t0 = time.monotonic()
    settled: trio.Event | None = None
    tmp_dir = b""
    st: os.stat_result | None = None
    dir_times = None
    copied = 0
    try:
        if df.durable_gen >= gen:
            # Written back while still open (a flush); closed since, unchanged: it is
            # clean as it is, no second copy needed.
            assert df.path is not None
            st0 = cast("os.stat_result", await wb._io(df, partial(wb.tree.lstat, df.path), 0))
            async with df.commit_lock:
                wb._check(df, gen)
            st = st0
        elif df.in_place:
            st, copied = await _write_in_place(wb, df, gen)
        else:
            assert df.path is not None
            tmp_dir = _parent(df.path)
            settled = wb.writing_in(tmp_dir)
            out, dir_times = await wb.create_tmp(df, JState.DIRTY, os.O_WRONLY, Klass.DEADLINE,
                                                 deadline=df.deadline)
            # (``df.tmp`` from here on: a rename of its directory moves it, and rename_dir
            # updates it)
            if df.size <= wb.slice_size:
                copied = await _copy_small_file(wb, df, out)  # (closes out)
                wb._check(df, gen)
            else:
                try:
                    atime_ns = atime_before_copy(df.fd)
                    copied = await _copy_slices(wb, df, gen, out)
                    wb._check(df, gen)
                except BaseException:
                    os.close(out)
                    raise
                await wb._io(df, partial(_finish_tmp, out, df.fd, df.size, atime_ns), 0)
            async with df.commit_lock:
                if df.pt_written:
                    wb._absorb(df)
                wb._check(df, gen)
                assert df.path is not None and df.tmp is not None
                st = cast("os.stat_result", await wb._io(
                    df, partial(_commit, wb.tree, df.tmp, df.path, dir_times), 0))
                df.tmp = None
    except _Abort:
        pass
    except (OSError, TierfsError) as e:
        if df.pt_written:
            wb._absorb(df)  # (a torn copy of a file written behind us may fail: not its fault)
        if df.path == path0 and df.gen == gen:
            wb._failed(df, e)
        # else renamed (its directory too) or changed meanwhile: start again, not a failure
    finally:
        wb.writeback_seconds += time.monotonic() - t0
        if st is None and df.state is DirtyState.WRITING:
            df.advance(DirtyState.DIRTY)
        tmp, df.tmp = df.tmp, None
        # our own temporary file, whatever became of the file meanwhile
        removed = tmp is not None and await wb.remove_tmp(tmp, dir_times)
        if df.drop_row and (removed or tmp is None):
            # unlinked meanwhile: its row waited for this (a file we could not remove stays
            # named, for the next mount's recovery)
            df.drop_row = False
            with contextlib.suppress(OSError):
                wb.journal.remove(df.id)
        # A file about to be marked clean (below, with no await between) has its row removed
        # at once: forgetting its temporary name first was one more journal commit per file
        # (5 -> 4 per file of tar -x); if the removal fails, the stale name is harmless.
        cleaning = st is not None and df.gen == gen and df.writers == 0 and not df.pt_written
        if (removed or st is not None) and df.state is not DirtyState.GONE and not cleaning:
            with contextlib.suppress(OSError):  # the name is gone now; a stale one is harmless
                wb.journal.set_tmp(df.id, None, JState.DIRTY)
        if settled is not None:
            wb.done_writing_in(tmp_dir, settled)
    if st is not None:
        if df.pt_written:
            wb._absorb(df)  # in place: written behind us meanwhile -> not clean, copied again
        wb._finish_success(df, gen, st, copied)


async def _copy_slices(wb: WriteBack, df: DirtyFile, gen: int, out: int, in_place: bool = False) -> int:
    """Copy generation ``gen`` of ``df`` to ``out`` on the backing store: ``out`` is sized
    first, then only the data segments are copied (holes stay holes: a sparse file stays
    sparse and costs only its data), one scheduler transaction per slice of at most
    ``slice_size`` bytes of data (each pushed to the disk before the next is picked). Returns
    the bytes copied; raises _Abort as soon as the file changes or is unlinked, OSError (EFBIG:
    the backing filesystem cannot hold a file that large)."""
    size = df.size
    await wb._io(df, partial(_size_tmp, out, size, in_place), 0)
    remaining = _allocated(df.fd, size)  # fstat of an open fd: no I/O
    off = copied = 0
    while off < size:
        wb._check(df, gen)
        n = min(wb.slice_size, max(remaining, 1))
        off, done = cast("tuple[int, int]", await wb._io(
            df, partial(_copy_data, df.fd, out, off, size, wb.slice_size, True), n,
            remaining=max(remaining, 1)))
        copied += done
        remaining = max(0, remaining - done)
    return copied


async def _copy_small_file(wb: WriteBack, df: DirtyFile, out: int) -> int:
    """A file of one slice or less onto its temporary file ``out`` in one transaction
    (:func:`_copy_small`): three thread hand-offs per small file were one (``tar -x`` of
    small files writes back thousands). ``out`` is closed, whether the call ran or not.
    Returns the bytes copied; the caller checks the generation afterwards (a file changed
    meanwhile is aborted as after a multi-slice copy)."""
    ran = False
    size = df.size

    def copy() -> int:
        nonlocal ran
        ran = True
        return _copy_small(out, df.fd, size, wb.slice_size)

    try:
        return cast("int", await wb._io(df, copy, max(_allocated(df.fd, size), 1),
                                        remaining=max(size, 1)))
    except BaseException:
        if not ran:
            os.close(out)
        raise


def _open_in_place(wb: WriteBack, df: DirtyFile) -> int:
    """(blocking) The backing file a hard-linked dirty file is written back into, opened again
    by name: never through a symlink, never blocking (a fifo swapped in used to hold the
    backing store's transaction slot, and so every user's reads, forever), and only if it is
    still the file that was copied up - the same inode when known, else a regular file with
    the dirty file's owner and group. A user who can write the backing directory may have
    renamed another user's file (one they cannot write) under the name: the write-back then
    wrote into it and chmod'ed it, as root. Raises OSError (EPERM: not the same file)."""
    assert df.path is not None
    out = wb.tree.open(df.path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(out)
        own = os.fstat(df.fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EPERM, "in-place write-back: not a regular file any more", os.fsdecode(df.path))
        if df.backing_id is not None:
            same = (st.st_dev, st.st_ino) == df.backing_id
        else:
            same = (st.st_uid, st.st_gid) == (own.st_uid, own.st_gid)
        if not same:
            raise OSError(errno.EPERM, "in-place write-back: the backing file was replaced",
                          os.fsdecode(df.path))
        os.set_blocking(out, True)
        return out
    except BaseException:
        os.close(out)
        raise


async def _write_in_place(wb: WriteBack, df: DirtyFile, gen: int) -> tuple[os.stat_result, int]:
    assert df.path is not None
    out = cast("int", await wb._io(df, partial(_open_in_place, wb, df), 0))
    try:
        atime_ns = atime_before_copy(df.fd)
        copied = await _copy_slices(wb, df, gen, out, in_place=True)
        st = await wb._io(df, partial(_finish_in_place, out, df.fd, df.size, atime_ns), 0)
    finally:
        os.close(out)
    return cast("os.stat_result", st), copied

