"""Recovery after ``kill -9``: every journal row is resumed, finished or quarantined.

What each recorded state means and what recovery does with it (see
:class:`tierfs.writeback.journal.JState` and docs/concurrency.md):

* ``DIRTY`` / ``TO_THROUGH``: the data file in the write tier holds the file. A temporary file
  (a write-back's, or a partial copy for write-through) is removed; the file is queued for
  write-back again.
* ``THROUGH``: the (complete) temporary file holds the file: fsync, rename into place. Without
  a temporary file it was committed already and written in place since: nothing to do.
* ``COMMIT``: rename the temporary file into place if it is still there, else the commit was
  done (the final file exists).

A row that cannot be honoured - its bytes are gone (the data file was deleted, the temporary
file of a written-through file vanished), or any error while handling it - is *quarantined*:
its data file (if any) moves to ``<write tier>/quarantine/<id>``, the row to the journal's
quarantine table, it is logged and counted in :meth:`WriteBack.statistics` (``tierfs stats``,
``tierfs doctor``). Every other file proceeds: recovery never refuses a mount.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from functools import partial
from typing import TYPE_CHECKING

import trio

from tierfs.backing_tree import BackingTree
from tierfs.sched.scheduler import Klass
from tierfs.writeback.backing_ops import _allocated, _commit
from tierfs.writeback.journal import JournalRow, JState
from tierfs.writeback.manager import DirtyFile, DirtyState, _unlink_quiet

if TYPE_CHECKING:
    from tierfs.writeback.manager import WriteBack

log = logging.getLogger("tierfs.writeback")


def _fsync_rel(tree: BackingTree, rel: bytes) -> None:
    """fsync the temporary file ``rel``. It lies in a directory users may write: opened without
    blocking (a fifo put there made the mount hang at recovery) and refused unless it is a
    regular file (OSError EPERM: the row is quarantined, nothing is renamed)."""
    fd = tree.open(rel, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EPERM, "temporary file is not a regular file any more", os.fsdecode(rel))
        os.fsync(fd)
    finally:
        os.close(fd)


async def _backing(wb: WriteBack, fn, *args):  # type: ignore[no-untyped-def]
    what = next((a for a in args if isinstance(a, bytes)), None)  # the path it acts on
    return await wb.sched.io(partial(fn, *args), Klass.DEMAND, nbytes=0, what=what)


async def _exists(wb: WriteBack, rel: bytes | None) -> bool:
    if rel is None:
        return False
    return await _backing(wb, wb.tree.lstat_or_none, rel) is not None


async def _promote(wb: WriteBack, row: JournalRow, tmp: bytes) -> None:
    """A complete temporary file of ``row``: durable, then renamed to its final name."""
    assert row.path is not None
    await _backing(wb, _fsync_rel, wb.tree, tmp)
    wb.journal.set_tmp(row.id, tmp, JState.COMMIT)  # a crash after the rename finds it done
    await _backing(wb, _commit, wb.tree, tmp, row.path)


async def _recover_row(wb: WriteBack, row: JournalRow) -> str | None:
    """Handle one row. Returns None when done, or why it must be quarantined."""
    data_path = os.path.join(wb.dirty_dir, str(row.id))
    if row.state is JState.COMMIT:
        if await _exists(wb, row.tmp):
            assert row.tmp is not None
            await _promote(wb, row, row.tmp)
        elif not await _exists(wb, row.path):
            return "committing a written-through file: neither its temporary nor its final file exists"
        await wb.device.run(_unlink_quiet, data_path)
        wb.journal.remove(row.id)
        return None
    if row.state is JState.THROUGH:
        if row.path is None:  # unlinked: nothing to keep
            for t in (row.tmp, row.prev):
                if t is not None:
                    await _backing(wb, wb.tree.unlink_quiet, t)
        elif row.tmp is not None:
            src = None
            for t in (row.tmp, row.prev):
                if await _exists(wb, t):
                    src = t
                    break
            if src is None:
                return "written-through file: its temporary file on the backing store is gone"
            await _promote(wb, row, src)
        # (row.tmp None: committed before and written in place since; the final file holds it)
        await wb.device.run(_unlink_quiet, data_path)
        wb.journal.remove(row.id)
        return None
    if (row.state is JState.TO_THROUGH and row.path is not None and row.tmp is not None
            and not await wb.device.run(os.path.exists, data_path) and await _exists(wb, row.tmp)):
        # a row of an older daemon (schema 1 wrote ``through`` before the copy and removed the
        # data file only after it): no data file means the copy was complete
        await _promote(wb, row, row.tmp)
        wb.journal.remove(row.id)
        return None
    # DIRTY or TO_THROUGH: the data file holds the bytes; a temporary file is partial
    for t in (row.tmp, row.prev):
        if t is not None:
            await _backing(wb, wb.tree.unlink_quiet, t)
    if row.tmp is not None or row.prev is not None:
        wb.journal.set_tmp(row.id, None, JState.DIRTY)
    if row.path is None:  # unlinked, or a copy-up that never completed
        await wb.device.run(_unlink_quiet, data_path)
        wb.journal.remove(row.id)
        return None
    if not await wb.device.run(os.path.exists, data_path):
        return "its data file in the write tier is gone"
    fd = await wb._reopen_data(data_path)
    st = os.fstat(fd)
    size = st.st_size
    allocated = _allocated(fd, size)  # a sparse file's holes cost nothing
    due = trio.current_time() + wb.deadline_s
    df = DirtyFile(row.id, row.path, data_path, fd=fd, size=size, gen=1,
                   deadline=due, due=due, in_place=row.in_place, state=DirtyState.DIRTY,
                   owner=st.st_uid)
    wb.tier.dirty += allocated
    df.accounted = allocated
    wb.register(df)
    return None


def _keep_data(data_path: str, qdir: str, id_: int) -> str | None:
    """Move a quarantined row's data file out of the dirty dir (never deleted); its new path."""
    kept = os.path.join(qdir, str(id_))
    if not os.path.exists(data_path):
        return kept if os.path.exists(kept) else None
    os.makedirs(qdir, mode=0o700, exist_ok=True)
    os.rename(data_path, kept)
    return kept


async def _quarantine(wb: WriteBack, row: JournalRow, reason: str) -> None:
    data_path = os.path.join(wb.dirty_dir, str(row.id))
    kept = None
    try:
        kept = await wb.device.run(_keep_data, data_path, wb.quarantine_dir, row.id)
        wb.journal.quarantine(row, reason, kept)
    except OSError as e:
        # cannot even record it (write tier full?): the row stays for the next mount
        log.error("recovery: could not quarantine journal row %d: %s", row.id, e)
    path = os.fsdecode(row.path) if row.path is not None else f"(unlinked file #{row.id})"
    log.error("recovery: %s quarantined, not written back: %s%s", path, reason,
              f"; its last bytes in the write tier are kept at {kept}" if kept else "")
    wb.files.pop(row.id, None)
    if row.path is not None and (df := wb.by_path.get(row.path)) is not None and df.id == row.id:
        del wb.by_path[row.path]


async def recover(wb: WriteBack) -> int:
    """Resume after a crash: every journaled file is queued for write-back again, finished
    (written through), or quarantined; temporary files a write-back had started are removed.
    Returns the number of dirty files queued. Never raises for one row."""
    n = 0
    for row in wb.journal.rows():
        try:
            why = await _recover_row(wb, row)
        except Exception as e:  # noqa: BLE001 - one row never stops the mount
            why = f"{type(e).__name__}: {e}"
            df = wb.files.get(row.id)
            if df is not None and df.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(df.fd)
                df.fd = -1
        if why is not None:
            await _quarantine(wb, row, why)
        elif row.id in wb.files:
            n += 1
    # data files nobody journals (a crash between creating one and journaling it)
    journaled = {r.id for r in wb.journal.rows()}
    for name in await wb.device.run(os.listdir, wb.dirty_dir):
        if name.isdigit() and int(name) not in wb.files and int(name) not in journaled:
            await wb.device.run(_unlink_quiet, os.path.join(wb.dirty_dir, name))
    wb.quarantined = [os.fsdecode(q.path) if q.path is not None else f"(unlinked file #{q.id})"
                      for q in wb.journal.quarantined()]
    wb._wake.set()
    return n
