"""Which dirty file the write-back worker takes next, found without looking at every dirty file.

The worker takes, among the files *ready* for write-back, the one with the earliest deadline
(ties: the one registered first). Ready means: state DIRTY or THROUGH, a path (not unlinked),
no operation on its descriptor in flight and its gate not held, its writers closed (or someone
waits for it with changes not yet on the backing store), and not waiting to retry a failure
(``retry_at`` passed). ``tar -x`` or ``cp -a`` of thousands of small files keeps each one
dirty from its creation until its write-back, so the scan of every dirty file per job that
this replaces was quadratic in the files such a command writes.

:class:`DirtyTable` is the dict of dirty files by id (``WriteBack.files``) with a
:class:`ReadyIndex` kept beside it. The index hears of every change that can make a file ready
or not: :class:`~tierfs.writeback.manager.DirtyFile` calls :meth:`ReadyIndex.update` from its
field descriptors whenever one of :data:`READY_FIELDS` is assigned (``waiters`` is a tuple, so
it changes only by assignment too), and the table attaches and detaches files as they come and
go. A change pushes a fresh heap entry ``(deadline, order, version, file)`` if the file is
ready (apart from the retry time); entries of older versions are skipped when they surface
(lazy invalidation) and the heaps are compacted when they hold twice as many entries as
files. A ready file still waiting to retry moves to a second heap ordered by ``retry_at`` and
back once the time has come. So the choice costs O(log n) per change, and equals the scan's
(``tests/test_writeback_ready.py`` compares them on random states and on real write-backs).
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Any

from tierfs.writeback.state import DirtyState

if TYPE_CHECKING:
    from tierfs.writeback.manager import DirtyFile

# Every DirtyFile field the choice depends on; an assignment to any of them updates the index.
READY_FIELDS = frozenset({"state", "path", "retry_at", "inflight", "excl", "writers", "waiters",
                          "durable_gen", "gen", "deadline", "filling"})
COMPACT_SLACK = 64  # entries beyond twice the live ones before the heaps are rebuilt

_Entry = tuple[float, int, int, "DirtyFile"]  # (deadline or retry_at, order, version, file)


def scan_choice(files: dict[int, DirtyFile], now: float) -> DirtyFile | None:
    """The next file as tierfs chose it before this index, by a scan of every dirty file
    (its own statement of the conditions, not :func:`is_ready`): the reference the index is
    tested and benchmarked against (tests/test_writeback_ready.py, bench/bench_next_job.py).
    Not used by the daemon: O(dirty files) per choice."""
    ready = [df for df in files.values()
             if df.state in (DirtyState.DIRTY, DirtyState.THROUGH) and df.path is not None
             and df.retry_at <= now and df.inflight == 0 and df.excl is None and df.filling == 0
             and (df.writers == 0 or df.waiters)
             and (df.durable_gen < df.gen or df.writers == 0)]
    return min(ready, key=lambda d: d.deadline) if ready else None


def is_ready(df: DirtyFile) -> bool:
    """Ready for write-back, whatever the time (``retry_at`` is not looked at). (The writers
    first: a file still open for writing, with nobody waiting for it, is the usual answer.)"""
    return ((df.writers == 0 or bool(df.waiters))
            and df.state in (DirtyState.DIRTY, DirtyState.THROUGH) and df.path is not None
            and df.inflight == 0 and df.excl is None and df.filling == 0
            and (df.durable_gen < df.gen or df.writers == 0))


class ReadyIndex:
    """The ready files of one :class:`DirtyTable`, by ``(deadline, order)``."""

    def __init__(self) -> None:
        self._heap: list[_Entry] = []  # ready files, by (deadline, order)
        self._later: list[_Entry] = []  # ready files whose retry time had not come, by retry_at
        self._live = 0  # files whose current version has an entry (in either heap)
        # versions are unique across files (a file replacing another under its id takes its
        # order): equal (deadline, order) never goes on to compare the files themselves
        self._versions = itertools.count(1)

    def __len__(self) -> int:
        """Ready files (whatever their retry time)."""
        return self._live

    def attach(self, df: DirtyFile, order: int) -> None:
        df._ready_ix = self
        df._ready_order = order
        self.update(df)

    def detach(self, df: DirtyFile) -> None:
        self._invalidate(df)
        df._ready_ix = None

    def _invalidate(self, df: DirtyFile) -> None:
        df._ready_ver = next(self._versions)
        if df._ready_in:
            df._ready_in = False
            self._live -= 1

    def update(self, df: DirtyFile) -> None:
        """``df`` changed (called by the descriptors of :data:`READY_FIELDS` on DirtyFile)."""
        ready = is_ready(df)
        if not ready and not df._ready_in:
            # No entry of its current version to drop (a version is bumped whenever the file
            # leaves the index) and none to add: the common case, a file still open for
            # writing (a tar -x makes ~20 such updates per file)
            return
        self._invalidate(df)
        if ready:
            df._ready_in = True
            self._live += 1
            heapq.heappush(self._heap, (df.deadline, df._ready_order, df._ready_ver, df))
            if len(self._heap) + len(self._later) > 2 * self._live + COMPACT_SLACK:
                self._compact()

    def _compact(self) -> None:
        for h in (self._heap, self._later):
            h[:] = [e for e in h if e[2] == e[3]._ready_ver]
            heapq.heapify(h)

    def first(self, now: float) -> DirtyFile | None:
        """The ready file with the earliest deadline whose ``retry_at <= now`` (ties: the lowest
        order, i.e. registered first), or None. Amortized O(log n)."""
        heap, later = self._heap, self._later
        while later and later[0][0] <= now:
            _, order, ver, df = heapq.heappop(later)
            if ver == df._ready_ver:
                heapq.heappush(heap, (df.deadline, order, ver, df))
        while heap:
            _, order, ver, df = heap[0]
            if ver != df._ready_ver:
                heapq.heappop(heap)
            elif df.retry_at <= now:
                return df
            else:
                heapq.heappop(heap)
                heapq.heappush(later, (df.retry_at, order, ver, df))
        return None


    def first_n(self, now: float, n: int) -> list[DirtyFile]:
        """The ``n`` (or fewer) ready files :meth:`first` would return one after another if
        each were taken in turn, without taking them. O(n log n)."""
        taken: list[_Entry] = []
        try:
            while len(taken) < n and self.first(now) is not None:
                taken.append(heapq.heappop(self._heap))  # the entry first() found valid
        finally:
            for e in taken:
                heapq.heappush(self._heap, e)
        return [e[3] for e in taken]


class DirtyTable(dict[int, "DirtyFile"]):
    """Dirty files by id, in registration order, with their :class:`ReadyIndex` (``ready``).
    Only item assignment, ``del``, ``pop`` and ``clear`` change it (the other mutating dict
    methods raise TypeError): each attaches or detaches the file."""

    def __init__(self) -> None:
        super().__init__()
        self.ready = ReadyIndex()
        self._orders = itertools.count()

    def __setitem__(self, key: int, df: DirtyFile) -> None:
        old = self.get(key)
        if old is df:
            return
        # a replaced value keeps the key's place in the dict's order, so its order too
        order = old._ready_order if old is not None else next(self._orders)
        if old is not None:
            self.ready.detach(old)
        super().__setitem__(key, df)
        self.ready.attach(df, order)

    def __delitem__(self, key: int) -> None:
        df = self[key]
        super().__delitem__(key)
        self.ready.detach(df)

    def pop(self, key: int, *default: Any) -> Any:
        if key in self:
            df = super().pop(key)
            self.ready.detach(df)
            return df
        if default:
            return default[0]
        raise KeyError(key)

    def clear(self) -> None:
        for df in self.values():
            self.ready.detach(df)
        super().clear()

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("DirtyTable: use item assignment, del, pop or clear")

    popitem = setdefault = update = __ior__ = _refuse  # type: ignore[assignment]
