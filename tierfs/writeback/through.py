"""Write-through: a dirty file the write tier cannot hold moves to the backing store.

The switch (DIRTY -> SWITCHING -> THROUGH) and a written-through file's commit
(THROUGH -> THROUGH_WRITING -> CLEAN) hold the file's fd gate exclusively
(:meth:`WriteBack.exclusive`: no write, truncate or attribute change runs meanwhile, so none is
lost to the copy and the switch runs once) and its commit lock (a rename waits).

Journal order, each step recorded before its effect (:class:`JState`):

1. ``TO_THROUGH, tmp=T``, then ``T`` is created (``O_EXCL | O_NOFOLLOW``) and the data file
   copied into it, attributes applied, fsynced. A crash here: recovery removes ``T`` and keeps
   the data file (the complete copy of the file).
2. ``THROUGH, tmp=T``: ``T`` is complete. Only then is the data file removed and later writes
   go to ``T``. A crash: recovery renames ``T`` into place.
3. ``COMMIT, tmp=T`` before ``rename(T, path)``; then the row is removed (or, still open for
   writing, ``THROUGH`` without ``tmp``: later writes go to the final file). A crash: recovery
   renames ``T`` if it is still there, or finds the commit done.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, cast

from tierfs import logevents
from tierfs.errors import TierfsError
from tierfs.sched.scheduler import Klass
from tierfs.writeback.backing_ops import (
    _commit,
    _copy_data,
    _finish_attrs_and_times,
    _fsync_lstat,
    _size_tmp,
    atime_before_copy,
)
from tierfs.writeback.journal import JState
from tierfs.writeback.manager import DirtyState, _unlink_quiet, log

if TYPE_CHECKING:
    from tierfs.writeback.manager import DirtyFile, WriteBack

# Test hook: called as ``STEP_HOOK(step)`` between the effects of the switch and the commit that
# no journal write separates (tests/test_writeback_inprocess.py snapshots the disks there, as a
# ``kill -9`` would leave them). None in production.
STEP_HOOK: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if STEP_HOOK is not None:
        STEP_HOOK(name)


async def switch_to_through(wb: WriteBack, df: DirtyFile) -> None:
    """DIRTY -> SWITCHING -> THROUGH. Returns at once if another task switched it meanwhile.
    Raises OSError / BackingIOError (ENOSPC: the backing store is full as well; the file then
    stays in the write tier unchanged, its temporary file removed and closed)."""
    async with wb.exclusive(df):
        while df.state is DirtyState.WRITING and df.wb_done is not None:
            df.touch()  # the write-back in flight stops at its next slice
            await df.wb_done.wait()
        async with df.commit_lock:
            await _switch_locked(wb, df)


async def _switch_locked(wb: WriteBack, df: DirtyFile) -> None:
    if df.through or df.state is DirtyState.GONE:
        return
    if df.path is None:
        raise OSError(errno.ENOSPC, "write tier full and the file is unlinked")
    if df.state is DirtyState.CLEAN:
        df.touch()
    df.advance(DirtyState.SWITCHING)
    logevents.event(log, logging.WARNING, "write-tier-full",
                    "write tier %s full: writing %s through to the backing store "
                    "(checkpoint larger than the tier's free space?)", wb.tier.name,
                    os.fsdecode(df.path))
    out = -1
    dir_times = None
    try:
        # (``df.tmp`` from here on: rename_dir keeps it right if the directory moves)
        out, dir_times = await wb.create_tmp(df, JState.TO_THROUGH, os.O_RDWR, Klass.DEMAND)
        _step("to-through:created")
        # sized first, then only the data segments copied: a sparse file stays sparse
        await wb.sched.io(partial(_size_tmp, out, df.size), Klass.DEMAND, nbytes=0, what=df.tmp)
        atime_ns = atime_before_copy(df.fd)  # (the copy leaves it, unless its reader is refused)
        off = 0
        while off < df.size:
            off, _ = cast("tuple[int, int]", await wb.sched.io(
                partial(_copy_data, df.fd, out, off, df.size, wb.slice_size, False),
                Klass.DEMAND, nbytes=min(wb.slice_size, df.size - off), what=df.tmp))
            _step("to-through:copying")
        # the data file's times too: the file shows those it had through the mount (an atime
        # set by utime included), not the switch's own
        await wb.device.run(_finish_attrs_and_times, out, df.fd, atime_ns)
        await wb.sched.io(partial(os.fsync, out), Klass.DEMAND, nbytes=0, what=df.tmp)
        wb._journal(wb.journal.set_tmp, df.id, df.tmp, JState.THROUGH)  # complete: it holds the bytes
    except BaseException:
        if out >= 0:
            os.close(out)  # a failed switch never keeps its descriptor (nor its space)
        tmp, df.tmp = df.tmp, None
        if tmp is None or await wb.remove_tmp(tmp, dir_times):
            with contextlib.suppress(OSError):
                wb.journal.set_tmp(df.id, None, JState.DIRTY)
        df.advance(DirtyState.DIRTY)
        raise
    _step("through:journaled")
    src = df.fd
    df.fd = out
    df.through = True
    df.dir_times = dir_times
    df.touch()
    df.advance(DirtyState.THROUGH)
    if df.pins:
        df.retired_fds.append(src)  # a pinned user may still hold the old fd number
    else:
        os.close(src)
    await wb.device.run(_unlink_quiet, df.data_path)
    wb._uncharge(df, 0)


async def commit_through(wb: WriteBack, df: DirtyFile) -> None:
    """THROUGH -> THROUGH_WRITING -> CLEAN (or back to THROUGH): size and fsync the temporary
    file and rename it into place (or, committed before, fsync the final file)."""
    async with wb.exclusive(df), df.commit_lock:
        if df.state is not DirtyState.THROUGH or df.path is None:
            return
        gen = df.gen
        df.advance(DirtyState.THROUGH_WRITING)
        st = None
        try:
            if df.tmp is None:
                # committed before: its fd is the file under its final name, so later writes
                # (np.memmap w+ after a flush) only need to be made durable
                st = cast("os.stat_result", await wb._io(df, partial(_fsync_lstat, wb.tree, df.fd, df.path), 0))
            else:
                await wb._io(df, partial(_sized_fsync, df.fd, df.size), 0)
                wb._journal(wb.journal.set_tmp, df.id, df.tmp, JState.COMMIT)
                _step("commit:journaled")
                st = cast("os.stat_result", await wb._io(df, partial(_commit, wb.tree, df.tmp, df.path,
                                                                     df.dir_times), 0))
                df.tmp = None
                _step("commit:renamed")
                if not (df.gen == gen and df.writers == 0):
                    # still open for writing: later writes go to the final file
                    wb._journal(wb.journal.set_tmp, df.id, None, JState.THROUGH)
        except (OSError, TierfsError) as e:
            wb._failed(df, e)
        finally:
            if st is None and df.state is DirtyState.THROUGH_WRITING:
                df.advance(DirtyState.THROUGH)
        if st is not None:
            wb._finish_success(df, gen, st)


def _sized_fsync(fd: int, size: int) -> None:
    os.ftruncate(fd, size)
    os.fsync(fd)
