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
import struct
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import overload

ChunkId = tuple[str, int]  # (file identity key, chunk index); same as tierfs.cache.policy
Rank = tuple[float, int, int, int]

EXPIRE_AFTER_S = 600.0  # a need whose deadline passed this long ago is dropped from the plan
SWEEP_INLINE = 4096  # a removed need of at most this many chunks is swept out at once (~2 ms)

# Records of the plan kept per chunk and per file are of types Python's cyclic garbage collector
# does not track (str, bytes, int, bytearray, tuples of those), or columns of them; only a few
# containers per need are tracked. A full (generation 2) collection visits every tracked object
# and runs inside whatever task step allocated, on the event loop: with one tracked record per
# file and per chunk occurrence, 100 000 hinted paths made 425 000 tracked objects and full
# collections of up to 112 ms (over the 50 ms loop bound); now 25 500 (the idle daemon's 24 900)
# and no full collection while the plan is built. Chosen over gc.freeze() (collections during
# the build remain; cycles among frozen objects are never freed) and gc.set_threshold (fewer
# collections, each as long): docs/concurrency.md, "Large hint plans and the garbage
# collector". Note that ``array.array`` *is* tracked (Python >= 3.10): one object per column
# is fine, one per chunk is not, so the occurrence index packs into bytearrays.
_OCC = struct.Struct("=qq")  # one occurrence in HintPlan._occ: (need seq, index in its chunk list)
_SEQ = struct.Struct("=q")


@dataclass(frozen=True)
class PlannedFile:
    """A file of a need: relative path, identity key, size (bytes), and the range of the
    need's chunk list that belongs to it ``[first, first + count)``."""

    path: bytes
    key: str
    size: int
    first: int
    count: int


class FileTable(Sequence[PlannedFile]):
    """A need's files in columns (a :class:`PlannedFile` is made on access): one per hinted
    path, and a need may name 500 000 of them; as columns of bytes, str and ints they are five
    objects for the garbage collector to visit, not one per file (see ``_OCC``'s comment).
    ``firsts`` ascends (a file of no chunks is never added)."""

    __slots__ = ("paths", "keys", "sizes", "firsts", "counts")

    def __init__(self, files: Iterable[PlannedFile] = ()) -> None:
        self.paths: list[bytes] | tuple[bytes, ...] = []
        self.keys: list[str] | tuple[str, ...] = []
        self.sizes = array("q")
        self.firsts = array("q")
        self.counts = array("q")
        for f in files:
            self.add(f.path, f.key, f.size, f.first, f.count)

    def add(self, path: bytes, key: str, size: int, first: int, count: int) -> None:
        """Append a file (not after :meth:`seal`)."""
        assert isinstance(self.paths, list) and isinstance(self.keys, list), "sealed"
        self.paths.append(path)
        self.keys.append(key)
        self.sizes.append(size)
        self.firsts.append(first)
        self.counts.append(count)

    def __len__(self) -> int:
        return len(self.paths)

    @overload
    def __getitem__(self, j: int) -> PlannedFile: ...
    @overload
    def __getitem__(self, j: slice) -> list[PlannedFile]: ...
    def __getitem__(self, j: int | slice) -> PlannedFile | list[PlannedFile]:
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(len(self)))]
        return PlannedFile(self.paths[j], self.keys[j], self.sizes[j], self.firsts[j], self.counts[j])

    def seal(self) -> None:
        """No more changes: the path and key columns become tuples (see Need.__post_init__)."""
        self.paths = tuple(self.paths)
        self.keys = tuple(self.keys)

    def cut(self, n: int) -> None:
        """Keep the chunks ``[0, n)`` only: drop the files starting at or after ``n`` and
        shorten the last one."""
        assert isinstance(self.paths, list) and isinstance(self.keys, list), "sealed"
        keep = bisect_left(self.firsts, n)
        for col in (self.paths, self.keys, self.sizes, self.firsts, self.counts):
            del col[keep:]
        if keep and self.firsts[-1] + self.counts[-1] > n:
            self.counts[-1] = n - self.firsts[-1]


@dataclass(eq=False)
class Need:
    """Declared future reads. ``chunks[i]`` is read before ``chunks[i+1]``; ``sizes[i]`` its
    bytes. ``deadline`` in clock seconds (``inf``: none)."""

    id: str
    label: str
    source: str
    chunks: Sequence[ChunkId]  # kept as a tuple (see __post_init__)
    sizes: array  # type: ignore[type-arg]
    files: FileTable  # (a list of PlannedFile is taken and converted)
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
        if not isinstance(self.files, FileTable):
            self.files = FileTable(self.files)
        # Tuples of untracked objects: the collector untracks them at its next pass and full
        # collections then skip them, where a list is visited element by element every time
        # (~20 ms per full collection for a need of 500 000 items, half of it these lists).
        self.chunks = tuple(self.chunks)
        self.files.seal()
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
        self.chunks = ()
        self.sizes = array("q")
        self.files = FileTable()
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
        """The file of chunk ``i``: the last one whose first chunk is at or before ``i``."""
        return self.files[max(0, bisect_right(self.files.firsts, i) - 1)]


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


def _has_seq(occ: bytearray, seq: bytes) -> bool:
    """Whether packed occurrences ``occ`` (``_OCC``) include one of the need of packed ``seq``."""
    k = occ.find(seq)
    while k >= 0 and k % _OCC.size:  # a match across two fields: look on
        k = occ.find(seq, k + 1)
    return k >= 0


class HintPlan:
    """All live needs and released chunks. See the module docstring."""

    def __init__(self) -> None:
        self.needs: dict[str, Need] = {}
        # chunk -> its occurrences in needs, packed (_OCC: need seq, index), in indexing order
        self._occ: dict[ChunkId, bytearray] = {}
        self._by_seq: dict[int, Need] = {}  # needs that may have occurrences in _occ (live or being swept)
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
        self._by_seq[need.seq] = need
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
        pack = _OCC.pack
        seq = need.seq
        for i in range(lo, min(hi, len(chunks))):
            cid = chunks[i]
            packed = pack(seq, i)
            have = occ.get(cid)
            if have is None:
                occ[cid] = bytearray(packed)
            else:
                have += packed
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
            mine = _SEQ.pack(need.seq)
            for j in range(need.swept, end):
                occ = occ_map.get(chunks[j])
                if occ is None or not _has_seq(occ, mine):  # (a chunk the need reads often: done at its first)
                    continue
                step = _OCC.size
                kept = bytearray().join(occ[k:k + step] for k in range(0, len(occ), step)
                                        if occ[k:k + _SEQ.size] != mine)
                if kept:
                    occ_map[chunks[j]] = kept
                else:
                    del occ_map[chunks[j]]
            budget -= end - need.swept
            need.swept = end
            if end >= len(chunks):
                self._dead.popleft()
                del self._by_seq[need.seq]
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
        by_seq = self._by_seq
        for cid in cids:
            occ = self._occ.pop(cid, None)
            if occ is not None:
                for seq, i in _OCC.iter_unpack(occ):
                    need = by_seq[seq]
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
        by_seq = self._by_seq
        for seq, i in _OCC.iter_unpack(occ):
            need = by_seq[seq]
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
        by_seq = self._by_seq
        for seq, i in _OCC.iter_unpack(occ):
            need = by_seq[seq]
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

    def remaining(self, need: Need, resident: Callable[[ChunkId], bool], *, any_left: bool = False) -> int:
        """Bytes of ``need`` neither consumed nor resident (each chunk once). With ``any_left``,
        stops at the first such chunk: nonzero exactly when the full count is (a need whose
        head is not resident is answered at once, not by walking all its chunks)."""
        left = 0
        counted: set[ChunkId] = set()
        for i in range(need.cursor, len(need.chunks)):
            cid = need.chunks[i]
            if not need.consumed[i] and cid not in counted and not resident(cid):
                counted.add(cid)
                left += need.sizes[i]
                if any_left and left:
                    break
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
            # Here the need is not finished, or missed its deadline. Counting all its bytes
            # every round held the event loop ~12 ms per 100 000 chunks; only a deadline miss
            # needs the count, the rest whether any are left.
            if need.finished_at is None and not self.remaining(need, resident, any_left=True):
                need.finished_at = now
                self.needs_finished += 1
                continue
            if not need.missed and now > need.deadline:
                left = self.remaining(need, resident)  # > 0: not finished (finished_at is None)
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
            consumed += sum(compress(need.sizes, need.consumed))  # (in C: ~0.5 ms per 100 000 chunks)
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
