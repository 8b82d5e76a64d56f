"""Eviction and admission policy.

Training reads every item once per epoch in a fresh random order, so recency predicts nothing
and LRU evicts exactly the items the rest of the epoch still needs: with a dataset larger than
the cache, LRU's hit ratio in epoch 2 falls towards zero (Alluxio #10322, Mosaic streaming #658).
CoorDL's MinIO cache (Mohan et al., VLDB 2021) avoids that by never replacing once full, which
gives the ideal ``capacity / dataset`` hit ratio for such reads but never adapts.

tierfs' ``nothrash`` policy keeps MinIO's behaviour on epoch data and still adapts, using
frequency-based *admission* in the style of TinyLFU (Einziger, Friedman, Manes, "TinyLFU: A
Highly Efficient Cache Admission Policy", ACM ToS 2017): a newcomer replaces the resident with
the lowest access count (least recently used among equals) only if the newcomer was accessed
*strictly more often before this access* than that victim. On epoch data everyone has the same
count, so nothing churns; data read repeatedly (a hot eval set, a new dataset read for several
epochs) wins its place. Counts are halved every ``window`` accesses (TinyLFU's reset), so old
popularity fades.

Promotion from a slower tier needs a clear margin (two accesses more than the faster tier's
victim), so epoch reads do not swap chunks between RAM and SSD for no gain.

With hints (:mod:`tierfs.cache.plan`), the plan decides first: released chunks are evicted
before anything, planned chunks are evicted furthest-next-use first (Belady's MIN), and a
newcomer replaces a victim only if it is needed sooner; chunks no hint mentions fall back to
the rules above and never displace a planned chunk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from tierfs.cache.plan import HintPlan

ChunkId = tuple[str, int]  # (file identity key, chunk index)

POLICIES = ("nothrash", "lru", "minio")


class FrequencyTable:
    """Access counts per chunk, halved every ``window`` recorded accesses.

    ``on_age`` is called after each halving so residency buckets can be rebuilt.
    """

    def __init__(self, window: int) -> None:
        self.window = max(1, window)
        self.counts: dict[ChunkId, int] = {}
        self.since_age = 0
        self.agings = 0
        self.on_age: list[Callable[[], None]] = []

    def get(self, cid: ChunkId) -> int:
        return self.counts.get(cid, 0)

    def record(self, cid: ChunkId) -> int:
        """Count one access; return the count *before* it."""
        prior = self.counts.get(cid, 0)
        self.counts[cid] = prior + 1
        self.since_age += 1
        if self.since_age >= self.window:
            self.age()
        return prior

    def set(self, cid: ChunkId, count: int) -> None:
        if count > 0:
            self.counts[cid] = count

    def forget(self, cid: ChunkId) -> None:
        self.counts.pop(cid, None)

    def age(self) -> None:
        self.since_age = 0
        self.agings += 1
        self.counts = {c: n // 2 for c, n in self.counts.items() if n > 1}
        for cb in self.on_age:
            cb()


class Residency:
    """The chunks resident in one tier, ordered for eviction: lowest count first, least recently
    used first among equal counts. O(1) add/remove/touch; victim search visits buckets in
    ascending count order (few distinct counts)."""

    def __init__(self, freq: FrequencyTable, *, use_counts: bool, plan: HintPlan | None = None) -> None:
        self._freq = freq
        self._use_counts = use_counts
        self._plan = plan
        self._buckets: dict[int, OrderedDict[ChunkId, None]] = {}
        self._bucket_of: dict[ChunkId, int] = {}
        freq.on_age.append(self.rebucket)

    def __contains__(self, cid: ChunkId) -> bool:
        return cid in self._bucket_of

    def __len__(self) -> int:
        return len(self._bucket_of)

    def _count(self, cid: ChunkId) -> int:
        return self._freq.get(cid) if self._use_counts else 0

    def add(self, cid: ChunkId) -> None:
        self.remove(cid)
        b = self._count(cid)
        self._buckets.setdefault(b, OrderedDict())[cid] = None
        self._bucket_of[cid] = b

    def remove(self, cid: ChunkId) -> None:
        b = self._bucket_of.pop(cid, None)
        if b is not None:
            bucket = self._buckets[b]
            del bucket[cid]
            if not bucket:
                del self._buckets[b]

    def touch(self, cid: ChunkId) -> None:
        """An access: move to its (new) count's bucket, most recently used end."""
        if cid in self._bucket_of:
            self.add(cid)

    def victims(self, skip: Callable[[ChunkId], bool]) -> Iterator[ChunkId]:
        """Residents in eviction order, without those ``skip`` rejects (pinned chunks).

        With an active hint plan: released chunks, then unplanned ones in count/LRU order, then
        planned ones from the furthest next use down (O(residents) once the unplanned ones are
        exhausted)."""
        plan = self._plan
        if plan is None or not plan.active:
            for b in sorted(self._buckets):
                for cid in list(self._buckets.get(b, ())):
                    if not skip(cid):
                        yield cid
            return
        for cid in list(plan.released):
            if cid in self._bucket_of and not skip(cid):
                yield cid
        planned = []
        for b in sorted(self._buckets):
            for cid in list(self._buckets.get(b, ())):
                if cid in plan.released:
                    continue
                rank = plan.next_use(cid)
                if rank is not None:
                    planned.append((rank, cid))
                elif not skip(cid):
                    yield cid
        planned.sort(reverse=True)
        for _, cid in planned:
            if cid in self._bucket_of and not skip(cid):
                yield cid

    def rebucket(self) -> None:
        members = list(self._bucket_of)
        self._buckets.clear()
        self._bucket_of.clear()
        for cid in members:
            self.add(cid)


class Policy:
    """Admission and promotion rules; ``name`` is one of :data:`POLICIES`.

    * ``nothrash``: see the module docstring.
    * ``lru``: admit always, evict least recently used (the baseline users know).
    * ``minio``: CoorDL's MinIO: once full, never replace (for comparison in ``tierfs sim``).

    ``plan``: the hint plan, consulted before these rules (see the module docstring).
    """

    PROMOTE_MARGIN = 2

    def __init__(self, name: str, window: int, plan: HintPlan | None = None) -> None:
        if name not in POLICIES:
            raise ValueError(f"eviction policy must be one of {POLICIES}, got {name!r}")
        self.name = name
        self.freq = FrequencyTable(window)
        self.plan = plan

    def new_residency(self) -> Residency:
        return Residency(self.freq, use_counts=self.name == "nothrash", plan=self.plan)

    def _plan_says(self, newcomer: ChunkId | None, victim: ChunkId) -> bool | None:
        """The plan's verdict on ``newcomer`` replacing ``victim``; None: the plan has none."""
        plan = self.plan
        if plan is None or not plan.active:
            return None
        if plan.is_released(victim):
            return True
        if newcomer is not None and plan.is_released(newcomer):
            return False
        victim_next = plan.next_use(victim)
        new_next = plan.next_use(newcomer) if newcomer is not None else None
        if new_next is not None:
            return victim_next is None or new_next < victim_next
        if victim_next is not None:
            return False  # a chunk no hint mentions never displaces a planned one
        return None

    def admits(self, prior: int, victim: ChunkId, newcomer: ChunkId | None = None) -> bool:
        """May ``newcomer``, accessed ``prior`` times before now, replace ``victim``? A negative
        ``prior`` (unread readahead) never replaces anything the plan does not rank lower."""
        verdict = self._plan_says(newcomer, victim)
        if verdict is not None:
            return verdict
        if prior < 0 or self.name == "minio":
            return False
        if self.name == "lru":
            return True
        return prior > self.freq.get(victim)

    def promotes(self, cid: ChunkId, victim: ChunkId | None) -> bool:
        """Should a hit on ``cid`` in a slower tier move it up over ``victim`` (None: room)?"""
        if victim is None:
            return True
        verdict = self._plan_says(cid, victim)
        if verdict is not None:
            return verdict
        if self.name == "lru":
            return True
        if self.name == "minio":
            return False
        return self.freq.get(cid) >= self.freq.get(victim) + self.PROMOTE_MARGIN
