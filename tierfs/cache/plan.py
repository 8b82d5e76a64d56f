"""The hint plan: one timeline of the future accesses training code declared.

Every hint (``need``, ``epoch``, ``phase``; see :mod:`tierfs_hints`) becomes a :class:`Need`:
chunks in the order they will be read, a deadline (clock seconds; ``inf`` for none) and a
priority. The plan orders all of them into one timeline by *rank*
``(deadline, -priority, distance from the need's read position, registration order)``: earliest
deadline first (EDF), as the prefetcher serves them, and needs of equal deadline and priority
(several workers' or ranks' epoch orders) interleaved as their readers advance.

The rank of a chunk's first unread occurrence is its *next use*. Eviction with a plan follows
Belady's MIN (L. A. Belady, "A study of replacement algorithms for a virtual-storage computer",
IBM Systems Journal 5(2), 1966): evict what is needed furthest ahead. Released chunks go first,
then chunks no hint mentions (in the policy's own order), then planned chunks from the furthest
next use down; a prefetched chunk never evicts one needed sooner than itself. A read consumes
the occurrence it serves, so a chunk read for the last time in the plan becomes a victim (MIN's
"never needed again"), and each epoch's order, announced at its start, replaces the last one.

Pure logic: no I/O, no trio; the clock comes in as arguments. Used by the daemon and, unchanged,
by the policy simulator (``tierfs sim``).
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

ChunkId = tuple[str, int]  # (file identity key, chunk index); same as tierfs.cache.policy
Rank = tuple[float, int, int, int]

EXPIRE_AFTER_S = 600.0  # a need whose deadline passed this long ago is dropped from the plan
SWEEP_INLINE = 4096  # a removed need of at most this many chunks is swept out at once (~2 ms)


@dataclass(frozen=True)
class PlannedFile:
    """A file of a need: relative path, identity key, size (bytes), and the range of the
    need's chunk list that belongs to it ``[first, first + count)``."""

    path: bytes
    key: str
    size: int
    first: int
    count: int


@dataclass(eq=False)
class Need:
    """Declared future reads. ``chunks[i]`` is read before ``chunks[i+1]``; ``sizes[i]`` its
    bytes. ``deadline`` in clock seconds (``inf``: none)."""

    id: str
    label: str
    source: str
    chunks: list[ChunkId]
    sizes: array  # type: ignore[type-arg]
    files: list[PlannedFile]
    deadline: float
    priority: int
    created: float
    seq: int = 0
    consumed: bytearray = field(default_factory=bytearray)
    cursor: int = 0  # every occurrence before it is consumed
    cancelled: bool = False
    missed: bool = False
    at_risk: bool = False  # projected to miss its deadline (reported once)
    finished_at: float | None = None  # when every chunk was first resident or consumed
    uid: int = 0  # who declared it (the caller of the control request; 0 for the daemon's own)
    total_bytes: int = -1  # each chunk once, however often the need reads it (-1: computed here)
    shed: bool = False  # removed from the plan and its chunk lists freed (see :meth:`shed_lists`)
    removed: bool = False  # left the plan; its occurrences are being swept out (HintPlan.sweep)
    swept: int = 0  # chunks of it swept so far

    def __post_init__(self) -> None:
        if not self.consumed:
            self.consumed = bytearray(len(self.chunks))
        if self.total_bytes < 0:
            seen: set[ChunkId] = set()
            total = 0
            for cid, size in zip(self.chunks, self.sizes, strict=True):
                if cid not in seen:
                    seen.add(cid)
                    total += size
            self.total_bytes = total

    def shed_lists(self) -> None:
        """Free the chunk lists of a need that left the plan (cancelled, replaced, expired,
        fully read): only its summary stays for late progress queries. A need of 1 M chunks
        holds ~150 MB; the plan keeps the last 1000 removed needs."""
        self.shed = True
        self.chunks = []
        self.sizes = array("q")
        self.files = []
        self.consumed = bytearray()
        self.cursor = 0

    def unique(self) -> Iterator[int]:
        """Indexes of each chunk's first occurrence."""
        seen: set[ChunkId] = set()
        for i, cid in enumerate(self.chunks):
            if cid not in seen:
                seen.add(cid)
                yield i

    def rank(self, i: int) -> Rank:
        """``(deadline, -priority, distance from the read position, registration order)``:
        needs with the same deadline and priority interleave by how far ahead of their reader a
        chunk is. Ranked by registration alone, one DataLoader worker's (or DDP rank's) whole
        epoch order came before another's first shard: measured 14.3% epoch-2 data wait with
        per-worker orders vs 5.0% with one interleaved order (docs/benchmarks.md)."""
        return (self.deadline, -self.priority, i - self.cursor, self.seq)

    def file_of(self, i: int) -> PlannedFile:
        lo, hi = 0, len(self.files) - 1
        while lo < hi:  # the last file whose first chunk is at or before i
            mid = (lo + hi + 1) // 2
            if self.files[mid].first <= i:
                lo = mid
            else:
                hi = mid - 1
        return self.files[lo]


@dataclass
class PlanStats:
    needs: int
    declared_bytes: int
    consumed_bytes: int
    released_chunks: int
    deadline_misses: int
    missed_bytes: int
    needs_finished: int
    at_risk: int


class HintPlan:
    """All live needs and released chunks. See the module docstring."""

    def __init__(self) -> None:
        self.needs: dict[str, Need] = {}
        self._occ: dict[ChunkId, list[tuple[Need, int]]] = {}
        self.released: OrderedDict[ChunkId, None] = OrderedDict()
        self._seq = 0
        self.version = 0  # bumped whenever the timeline changes
        self.deadline_misses = 0
        self.missed_bytes = 0
        self.needs_finished = 0
        self._by_source: dict[tuple[str, str], str] = {}
        self.recent: OrderedDict[str, Need] = OrderedDict()  # removed needs, for late progress queries
        self._dead: deque[Need] = deque()  # removed needs whose occurrences are still indexed

    # -- building ---------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return bool(self.needs) or bool(self.released)

    def new_id(self) -> str:
        self._seq += 1
        return f"n{self._seq}"

    def replaced_by(self, source: str, kind: str | None) -> Need | None:
        """The live need that a new one of ``(source, kind)`` would replace, if any."""
        if kind is None:
            return None
        nid = self._by_source.get((source, kind))
        return self.needs.get(nid) if nid is not None else None

    def add(self, need: Need, *, replaces_source_kind: str | None = None, index: bool = True) -> Need:
        """Register ``need``. With ``replaces_source_kind`` (e.g. "epoch"), the previous need of
        the same (source, kind) is removed first: each epoch's order replaces the last. With
        ``index=False`` its chunks are indexed later, by :meth:`index` in slices (a need of a
        million chunks indexed at once holds the event loop ~0.5 s)."""
        if replaces_source_kind is not None:
            old = self._by_source.get((need.source, replaces_source_kind))
            if old is not None:
                self.remove(old)
            self._by_source[(need.source, replaces_source_kind)] = need.id
        self._seq += 1
        need.seq = self._seq
        self.needs[need.id] = need
        if index:
            self.index(need, 0, len(need.chunks))
        self.version += 1
        return need

    def index(self, need: Need, lo: int, hi: int) -> bool:
        """Index occurrences ``[lo, hi)`` of a need added with ``index=False``. False (and
        nothing done) if the need left the plan meanwhile."""
        if self.needs.get(need.id) is not need:
            return False
        occ = self._occ
        released = self.released
        chunks = need.chunks
        for i in range(lo, min(hi, len(chunks))):
            cid = chunks[i]
            occ.setdefault(cid, []).append((need, i))
            if released:
                released.pop(cid, None)  # needed again: no longer "evict first"
        self.version += 1
        return True

    def remove(self, need_id: str) -> Need | None:
        """Take a need out of the plan at once (it ranks nothing from now on). Its indexed
        occurrences are swept out by :meth:`sweep`: here for a small need, else in slices by
        the caller (removing a need of 500 000 chunks in one pass held the event loop 0.5 s,
        and an epoch order is replaced at every epoch)."""
        need = self.needs.pop(need_id, None)
        if need is None:
            return None
        self.recent[need_id] = need
        while len(self.recent) > 1000:
            self.recent.popitem(last=False)
        for key, nid in list(self._by_source.items()):
            if nid == need_id:
                del self._by_source[key]
        need.removed = True
        self._dead.append(need)
        if len(need.chunks) <= SWEEP_INLINE:
            self.sweep(SWEEP_INLINE)
        self.version += 1
        return need

    @property
    def sweeping(self) -> bool:
        return bool(self._dead)

    def sweep(self, budget: int) -> bool:
        """Drop up to ``budget`` chunk occurrences of removed needs from the index, then free
        the chunk lists of each need done. Returns True while there is more to sweep."""
        while self._dead and budget > 0:
            need = self._dead[0]
            chunks = need.chunks
            end = min(len(chunks), need.swept + budget)
            occ_map = self._occ
            for j in range(need.swept, end):
                occ = occ_map.get(chunks[j])
                if occ is None:
                    continue
                occ[:] = [o for o in occ if o[0] is not need]
                if not occ:
                    del occ_map[chunks[j]]
            budget -= end - need.swept
            need.swept = end
            if end >= len(chunks):
                self._dead.popleft()
                need.shed_lists()
        return bool(self._dead)

    def cancel(self, need_id: str) -> bool:
        need = self.remove(need_id)
        if need is None:
            return False
        need.cancelled = True
        return True

    def release(self, cids: list[ChunkId]) -> int:
        """These chunks are not needed again soon: evicted before anything else. Their
        unread occurrences in needs are dropped."""
        n = 0
        for cid in cids:
            for need, i in self._occ.pop(cid, []):
                if not need.removed:
                    need.consumed[i] = 1
            self.released[cid] = None
            n += 1
        self.version += 1
        return n

    def forget_chunk(self, cid: ChunkId) -> None:
        """The chunk left every tier: nothing to evict first any more."""
        self.released.pop(cid, None)

    # -- queries ----------------------------------------------------------------------------
    def next_use(self, cid: ChunkId) -> Rank | None:
        """Rank of the chunk's next unread occurrence in the plan; None if no hint needs it."""
        occ = self._occ.get(cid)
        if not occ:
            return None
        best: Rank | None = None
        for need, i in occ:
            if not need.removed and not need.consumed[i]:
                r = need.rank(i)
                if best is None or r < best:
                    best = r
        return best

    def is_released(self, cid: ChunkId) -> bool:
        return cid in self.released

    def by_rank(self) -> list[Need]:
        return sorted(self.needs.values(), key=lambda n: (n.deadline, -n.priority, n.seq))

    # -- progress ---------------------------------------------------------------------------
    def consume(self, cid: ChunkId) -> bool:
        """A read of ``cid``: its next occurrence is used up. True if the plan had it."""
        occ = self._occ.get(cid)
        if not occ:
            return False
        best: tuple[Need, int] | None = None
        for need, i in occ:
            if not need.removed and not need.consumed[i] and (best is None or need.rank(i) < best[0].rank(best[1])):
                best = (need, i)
        if best is None:
            return False
        need, i = best
        need.consumed[i] = 1
        while need.cursor < len(need.consumed) and need.consumed[need.cursor]:
            need.cursor += 1
        self.version += 1
        return True

    def remaining(self, need: Need, resident: Callable[[ChunkId], bool]) -> int:
        """Bytes of ``need`` neither consumed nor resident (each chunk once)."""
        left = 0
        counted: set[ChunkId] = set()
        for i in range(need.cursor, len(need.chunks)):
            cid = need.chunks[i]
            if not need.consumed[i] and cid not in counted and not resident(cid):
                counted.add(cid)
                left += need.sizes[i]
        return left

    def check_deadlines(self, now: float, resident: Callable[[ChunkId], bool]) -> list[Need]:
        """Mark needs done or missed at ``now``; drop long-expired ones. Returns the needs that
        missed their deadline in this call (each is reported once)."""
        missed = []
        for need in list(self.needs.values()):
            if need.cursor >= len(need.chunks):
                # every occurrence read: it ranks nothing any more; free it
                if need.finished_at is None:
                    need.finished_at = now
                    self.needs_finished += 1
                self.remove(need.id)
                continue
            if need.finished_at is not None and not need.missed:
                if now > need.deadline + EXPIRE_AFTER_S:
                    self.remove(need.id)
                continue
            left = self.remaining(need, resident)
            if left == 0 and need.finished_at is None:
                need.finished_at = now
                self.needs_finished += 1
                continue
            if not need.missed and now > need.deadline and left > 0:
                need.missed = True
                self.deadline_misses += 1
                self.missed_bytes += left
                missed.append(need)
            if need.missed and now > need.deadline + EXPIRE_AFTER_S:
                self.remove(need.id)
        return missed

    def statistics(self) -> PlanStats:
        declared = consumed = 0
        for need in self.needs.values():
            declared += need.total_bytes
            for i, size in enumerate(need.sizes):
                if need.consumed[i]:
                    consumed += size
        return PlanStats(
            needs=len(self.needs), declared_bytes=declared, consumed_bytes=consumed,
            released_chunks=len(self.released), deadline_misses=self.deadline_misses,
            missed_bytes=self.missed_bytes, needs_finished=self.needs_finished,
            at_risk=sum(1 for n in self.needs.values() if n.at_risk and not n.missed))


def chunk_ranges(size: int, offset: int, length: int | None, chunk_size: int) -> range:
    """Chunk indexes covering ``[offset, offset+length)`` of a file of ``size`` bytes
    (``length`` None: to the end). Empty for an empty range."""
    end = size if length is None else min(size, offset + length)
    if offset >= end:
        return range(0)
    return range(offset // chunk_size, (end - 1) // chunk_size + 1)


def chunk_bytes(size: int, idx: int, chunk_size: int) -> int:
    return max(0, min(chunk_size, size - idx * chunk_size))


INF = math.inf
