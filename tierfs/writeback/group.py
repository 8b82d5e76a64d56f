"""Group write-back: several small dirty files of one directory written back together.

``tar -x`` or ``cp -a`` of thousands of small files leaves them dirty, and once the burst that
wrote them ends (:mod:`tierfs.writeback.hold`) the worker writes them back. One file at a
time, each one cost a journal commit for its temporary name, three scheduler transactions
(create; copy, attributes, fsync; rename and fsync of the directory: a thread hand-off each),
and a journal commit to forget it: ~2 ms per file on the 2-core VM, 19-22 s for 10,000 files of 1-16 KiB, with the
event loop and the threads each idle a third of the time (py-spy): latency, not work.

A group is up to :data:`GROUP_FILES` files, all of at most one slice and together at most one
slice (``slice_size``), in one directory, taken from the front of the ready queue (the files
due first: nothing is written back out of its turn to fill a group; a file someone waits for
takes along only files that are waited for too). It costs one journal transaction for every
temporary name, two scheduler transactions
(:func:`~tierfs.writeback.backing_ops._group_create`: every file created, copied and fsynced,
with no lock held, as a single file's copy; then, with the files' commit locks,
:func:`~tierfs.writeback.backing_ops._group_commit`: every current file renamed, one fsync of
the directory), and the per-file journal commits that mark them clean. Holding the commit locks
through the copies as well made a rename of a group member (``os.replace`` of a checkpoint
saved in a loop) wait for the whole group, and a reader of the replaced file got ESTALE
(``test_c07_replace_loop_with_reader`` under load, 4 runs in 6). Crash safety is that of a
single file's write-back: every temporary name is journaled before it is created, every file
is fsynced before its rename, and no journal row is removed before the directory holding the
renames was fsynced.

Measured (``tar -x`` of 10,000 files of 1-16 KiB into a RAM write tier, then ``tierfs
flush``): the write-back of what was left took 18-22 s one file at a time, 2.6-3.9 s in groups.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from functools import partial
from typing import TYPE_CHECKING, cast

import trio

from tierfs.errors import TierfsError
from tierfs.writeback.backing_ops import (
    DirTimes,
    GroupItem,
    _allocated,
    _group_commit,
    _group_create,
    _parent,
)
from tierfs.writeback.journal import JState
from tierfs.writeback.manager import DirtyFile, DirtyState, _fingerprint, _unpin

if TYPE_CHECKING:
    from tierfs.writeback.manager import WriteBack

GROUP_FILES = 16  # files in one group at most (16 fsyncs on an HDD: ~0.15 s, under one 32 MiB slice)


def eligible(wb: WriteBack, df: DirtyFile) -> bool:
    """A file that may be written back in a group: closed (no writable passthrough lease
    either), of one slice or less, not written through or in place, and not being renamed or
    unlinked (its commit lock free)."""
    return (df.state is DirtyState.DIRTY and not df.through and not df.in_place
            and df.path is not None and df.writers == 0 and df.lease_writers == 0 and df.fd >= 0
            and df.durable_gen < df.gen and df.size <= wb.slice_size
            and not df.commit_lock.locked())


def gather(wb: WriteBack, df: DirtyFile) -> list[DirtyFile]:
    """``df`` (the file due first) and the files due right after it that can join it in a
    group: eligible, in its directory, together at most one slice of data, and waited for if
    ``df`` is (an ``fsync`` of one file does not wait for others' write-back, nor does a burst's
    hold end for files nobody asked for)."""
    if not eligible(wb, df):
        return [df]
    urgent = df.waited_for
    assert df.path is not None
    parent = _parent(df.path)
    group = [df]
    total = max(_allocated(df.fd, df.size), 1)
    for other in wb.files.ready.first_n(trio.current_time(), 2 * GROUP_FILES):
        if len(group) >= GROUP_FILES:
            break
        if (other is df or not eligible(wb, other) or _parent(other.path or b"") != parent
                or urgent and not other.waited_for):
            continue
        n = max(_allocated(other.fd, other.size), 1)  # (fstat of an open descriptor: no I/O)
        if total + n > wb.slice_size:
            break
        group.append(other)
        total += n
    return group


def _current(df: DirtyFile, gen: int, path: bytes, seen: tuple[int, int, int] | None) -> bool:
    """(device thread) Whether the copy just made is still of the file's current generation
    and name. ``seen``: the data file's fingerprint when the copy began, for a file the kernel
    may have written behind the daemon (passthrough, a shared mapping): a write since changed
    it. A write that lands after this look is caught after the commit (``_absorb``, then the
    generation check of ``_finish_success``): the file stays dirty and is written back again."""
    if df.gen != gen or df.path != path:
        return False
    return seen is None or _fingerprint(os.fstat(df.fd)) == seen


async def write_back_group(wb: WriteBack, group: list[DirtyFile]) -> None:
    """Write back ``group`` (from :func:`gather`, two files or more) in two transactions. Each
    file ends as a single write-back would leave it: clean (or dirty again if it changed
    meanwhile), or failed and retried. Raises OSError only if the journal could not record the
    temporary names (nothing was created; the files stay dirty)."""
    for df in group:
        df.pins += 1
    try:
        done = await _write_back_group_pinned(wb, group)
        for df, gen, st, copied in done:
            if df.pt_written:
                wb._absorb(df)  # written behind us after the last look: not clean, copied again
            wb._finish_success(df, gen, st, copied)
    finally:
        for df in group:
            _unpin(wb, df)


async def _write_back_group_pinned(wb: WriteBack, group: list[DirtyFile],
                                   ) -> list[tuple[DirtyFile, int, os.stat_result, int]]:
    """Create and copy every file (no lock held: a rename or unlink of one goes on meanwhile,
    as during a single file's copy), then, with their commit locks, rename the current ones;
    returns the committed files as ``(file, generation, stat, bytes copied)`` for
    ``_finish_success`` (after the locks)."""
    assert group[0].path is not None
    parent = _parent(group[0].path)
    for df in group:
        if df.pt_written:
            wb._absorb(df)  # what the kernel wrote behind the daemon: size, a new generation
    gens = [df.gen for df in group]
    paths = [df.path for df in group]
    seens = [df.pt_seen if df.pt_written else None for df in group]
    items: list[GroupItem] = []
    settled = wb.writing_in(parent)
    t0 = time.monotonic()
    done: list[tuple[DirtyFile, int, os.stat_result, int]] = []
    locked: list[DirtyFile] = []
    finished = False  # both transactions ran to their end: each item's tmp_left is known
    try:
        for df in group:
            df.wb_done = trio.Event()
            df.advance(DirtyState.WRITING)
        names = [wb.new_tmp_name(df) for df in group]
        wb._journal(wb.journal.set_tmps, [(df.id, t) for df, t in zip(group, names, strict=True)],
                    JState.DIRTY)  # before any of them exists
        for df, tmp, gen, path, seen in zip(group, names, gens, paths, seens, strict=True):
            assert path is not None
            df.tmp = tmp
            items.append(GroupItem(tmp, path, df.fd, df.size, partial(_current, df, gen, path, seen)))
        total = sum(max(_allocated(df.fd, df.size), 1) for df in group)
        try:
            dir_times = await wb._io(group[0], partial(_group_create, wb.tree, parent, items, wb.slice_size),
                                     total, remaining=total)
        except (OSError, TierfsError) as e:  # nothing was created (the directory is gone)
            for it in items:
                it.outcome = e
        else:
            for df in sorted(group, key=lambda d: d.id):  # (the order renames take them in)
                await df.commit_lock.acquire()
                locked.append(df)
            if any(it.tmp_left for it in items):  # (renames, or only removals and the times)
                await wb._io(group[0], partial(_group_commit, wb.tree, parent, items,
                                               cast("DirTimes", dir_times)), 0)
        finished = True
        for df, it, gen in zip(group, items, gens, strict=True):
            if isinstance(it.outcome, os.stat_result):
                df.tmp = None
                done.append((df, gen, it.outcome, it.copied))
    finally:
        with trio.CancelScope(shield=True):
            await _settle(wb, group, items, gens, paths, done, finished)
        wb.writeback_seconds += time.monotonic() - t0
        wb.done_writing_in(parent, settled)
        for df in locked:
            df.commit_lock.release()
        for df in group:
            if df.wb_done is not None:
                df.wb_done.set()
                df.wb_done = None
    return done


async def _settle(wb: WriteBack, group: list[DirtyFile], items: list[GroupItem], gens: list[int],
                  paths: list[bytes | None], done: list[tuple[DirtyFile, int, os.stat_result, int]],
                  finished: bool) -> None:
    """After the transaction (or its failure or cancellation): each file not committed loses
    its temporary file (if one may be left, or was moved with its directory) and its journaled
    name, goes back to DIRTY, and a failure is counted for a retry; a committed file that
    changed meanwhile forgets its name too (it stays dirty)."""
    committed = {id(df) for df, *_ in done}
    for i, df in enumerate(group):
        gen, path = gens[i], paths[i]
        it = items[i] if i < len(items) else None
        if id(df) in committed:
            if df.state is not DirtyState.GONE and not (
                    df.gen == gen and df.writers == 0 and not df.pt_written):
                with contextlib.suppress(OSError):
                    wb.journal.set_tmp(df.id, None, JState.DIRTY)
            continue
        tmp, df.tmp = df.tmp, None
        removed = True
        if tmp is not None and (not finished or it is None or it.tmp_left or tmp != it.tmp):
            # left behind (its removal failed, or the transaction was cancelled), or moved
            # with its directory meanwhile: removed by the name it has now
            removed = await wb.remove_tmp(tmp)
        if df.drop_row and removed:
            # unlinked meanwhile: its row waited for its temporary file to go (a file that
            # could not be removed stays named, for the next mount's recovery)
            df.drop_row = False
            with contextlib.suppress(OSError):
                wb.journal.remove(df.id)
        elif tmp is not None and removed and df.state is not DirtyState.GONE:
            with contextlib.suppress(OSError):  # the name is gone; a stale one is harmless
                wb.journal.set_tmp(df.id, None, JState.DIRTY)
        if df.state is DirtyState.WRITING:
            df.advance(DirtyState.DIRTY)
        if it is None:
            continue
        e = it.outcome
        if isinstance(e, OSError | TierfsError) and df.path == path and df.gen == gen:
            if e.errno in (errno.EEXIST, errno.ELOOP):
                wb.log_taken_tmp(it.tmp)  # a planted name: another is drawn next time
            else:
                wb._failed(df, e)
