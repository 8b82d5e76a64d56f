"""The cache: serves chunk reads from the fastest tier that holds them, places fetched chunks,
demotes on eviction (RAM -> SSD), promotes on repeated hits (SSD -> RAM).

Invariants kept here (each is a test):
* a tier never holds more than its capacity (:meth:`Tier.reserve` refuses first);
* a full or failing tier never fails a read: the chunk comes from the next tier, the staging
  area or the backing store;
* a chunk being read in a device thread is pinned and is never evicted or moved under the
  reader; the kernel's page cache (and so every mapping) is never invalidated by eviction;
* a file with a passthrough lease (:meth:`Cache.lease_resident`) keeps every chunk where it
  is: no eviction, demotion, promotion, hole punch or removal of its tier file until the last
  lease is released (the kernel reads that file directly);
* only the scheduler reads the backing store.

Concurrency: everything runs on the trio event loop; awaits happen only around device-thread
calls (SSD reads and writes) and the scheduler. State that must not change across an await is
protected by pins (readers) and the ``_moving`` set (chunks being demoted, promoted or placed).
See docs/concurrency.md.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio
import xxhash

from tierfs import tasks
from tierfs.cache.catalog import Catalog, ChunkEntry, SsdCatalog, tier_file_size
from tierfs.cache.lease import Lease, LeaseTable
from tierfs.cache.policy import ChunkId, Policy, Residency
from tierfs.cache.tier import Tier, blocks
from tierfs.errors import TierIOError
from tierfs.io import Device, is_enospc, pread_exact
from tierfs.sched.backing import BackingFile
from tierfs.sched.scheduler import FetchRequest, Klass, TransactionScheduler

log = logging.getLogger("tierfs.cache")
WHOLE_CHUNK_AFTER = 2  # random touches of a chunk before it is fetched whole


def _pread_range(f: BackingFile, offset: int, length: int) -> bytes:
    """A partial (uncached) read of a backing file, in the backing device thread."""
    data = pread_exact(f.fd, min(length, max(0, f.size - offset)), offset)
    if not f.kernel_reads:
        os.posix_fadvise(f.fd, offset, length, os.POSIX_FADV_DONTNEED)
    return data


def _copy_checked(f: BackingFile, tier: Tier, offset: int, length: int) -> bool:
    """Copy ``[offset, offset+length)`` of backing file ``f`` into its tier file in ``tier``
    (in the backing device's thread), then check that ``f`` did not change meanwhile. True if
    every byte is there and current. Raises TierIOError."""
    if length > 1 << 20:
        # The kernel copy reads the source through its page cache, one readahead window
        # (128 KiB by default) after the other; announced, the whole range is queued at the
        # device at once, as many requests in flight as the store takes.
        os.posix_fadvise(f.fd, offset, length, os.POSIX_FADV_WILLNEED)
    n = tier.copy_in(f.key, offset, f.fd, length, f.identity.dev)
    # The bytes live in the tier now: the backing store's page cache need not keep a copy,
    # unless readers pass through to the backing file: the fill runs beside them, often ahead
    # of them, and dropping the pages it read made them read each range from the store again
    # (8 readers of a 2 GiB file on an emulated parallel store, nbdkit: 0.73x direct).
    if not f.kernel_reads:
        os.posix_fadvise(f.fd, offset, length, os.POSIX_FADV_DONTNEED)
    st = os.fstat(f.fd)
    if st.st_size != f.identity.size or st.st_mtime_ns != f.identity.mtime_ns:
        f.stale = True
    return n == length and not f.stale


@dataclass(eq=False)
class Staged:
    """A fetched chunk held in memory: not (yet) admitted to a tier, or readahead not yet read."""

    data: bytes
    speculative: bool
    accessed: bool = False
    placing: bool = False
    served: int = 0  # bytes handed to readers; a chunk served whole is dropped first


MAX_FILLING = 4096  # file keys fill() remembers (their queued chunks survive a close)


@dataclass
class AccessState:
    """Per open handle: which chunk it read last, so one pass over a chunk counts as one access;
    ``random``: the handle's current read is not part of a sequential run (set by the caller);
    ``reading``: the chunk the handle is in (not evicted until it moves on or is forgotten,
    :meth:`Cache.forget_access`)."""

    last_chunk: int = -1
    random: bool = False
    reading: tuple[str, int] | None = None


@dataclass
class _FilePin:
    """A file whose tier file is leased (:meth:`Cache.lease_resident`): all its chunks sit
    in tier ``tier`` and stay there. ``doomed``: the file changed (or its tier file failed)
    while leased; its chunks are dropped at the last release."""

    tier: int
    size: int
    doomed: bool = False
    # written in place: a writer opened the file while its readers read the tier file through
    # passthrough, so the kernel passed the writer through to the same file (Handlers.lease).
    # Its chunks no longer hold the backing file's bytes: dropped at the last release.
    modified: bool = False


@dataclass(frozen=True)
class CacheStats:
    staging_bytes: int
    staging_capacity_bytes: int
    staging_hits: int
    staging_bytes_served: int
    backing_hits: int
    backing_bytes_served: int
    prefetch_used_bytes: int
    prefetch_wasted_bytes: int
    placements: int
    bypassed: int
    checksum_failures: int
    partial_fetches: int
    policy: str
    direct_fetches: int = 0  # chunks copied backing -> tier file in the kernel (parallel profile)
    leased_files: int = 0  # files with a passthrough lease now (all tiers)
    passthrough_refusals: int = 0  # lease_resident answered None (not whole in one tier, ...)


class Cache:
    """Args:
        tiers: fastest first. devices: one per tier (its thread limiter).
        policy: admission/eviction. scheduler: the only way to the backing store.
        staging_bytes: memory cap of the staging area.
        ssd_catalog: persistent record of the last tier, if it persists.
    """

    def __init__(
        self,
        tiers: list[Tier],
        devices: list[Device],
        policy: Policy,
        scheduler: TransactionScheduler,
        *,
        chunk_size: int,
        staging_bytes: int,
        ssd_catalog: SsdCatalog | None = None,
    ) -> None:
        self.tiers = tiers
        self.devices = devices
        self.policy = policy
        self.plan = policy.plan
        self.residency: list[Residency] = [policy.new_residency() for _ in tiers]
        self.scheduler = scheduler
        scheduler.on_fetched = self._on_fetched
        # A parallel backing store's misses go straight into a tier file in the kernel (see
        # _transfer). An HDD's keep today's path: one pread of the whole run queued at the
        # disk at once (a kernel copy reads through the source's readahead window instead).
        if not scheduler.elevator and scheduler.can_run_io:
            scheduler.transfer = self._transfer
        self.direct_fetches = 0  # chunks copied backing -> tier in the kernel
        # runs those copies: the scheduler's backing device, unless the mount gives a device
        # for backing reads alone (a local parallel store: inline while cheap)
        self.copy_io: Callable[[Callable[[], bool]], Awaitable[bool]] = scheduler.run_io
        self.chunk_size = chunk_size
        self.catalog = Catalog()
        self.ssd_catalog = ssd_catalog
        self.persistent_tier = len(tiers) - 1 if ssd_catalog is not None else -1
        self.staging: OrderedDict[ChunkId, Staged] = OrderedDict()
        self.staging_capacity = staging_bytes
        self.staging_used = 0
        self._moving: set[ChunkId] = set()
        # Punches (key (tier, chunk id)) and file removals (key (tier, file key)) running in a
        # tier's threads; a chunk is not written to that tier file until they are done, or the
        # late punch or unlink would destroy it (see _quiet).
        self._tier_busy: dict[tuple[int, ChunkId | str], trio.Event] = {}
        # bytes per tier whose chunks are being punched: still accounted, out of the catalog
        self._freeing = [0] * len(tiers)
        self._nursery: trio.Nursery | None = None
        self.staging_hits = 0
        self.staging_bytes_served = 0
        self.backing_hits = 0
        self.backing_bytes_served = 0
        self.prefetch_used = 0
        self.prefetch_wasted = 0
        self.placements = 0
        self.bypassed = 0
        self.checksum_failures = 0
        self.partial_fetches = 0
        self.background = 0  # placement/promotion tasks running (tests wait for 0)
        self._unread_prefetch: dict[ChunkId, int] = {}  # readahead placed in a tier, not read yet
        self._reading: dict[ChunkId, int] = {}  # chunk -> open handles reading it now (not evicted)
        # Passthrough: leased tier files (tierfs.cache.lease) and the files they pin
        self.leases = LeaseTable()
        self._pinned: dict[str, _FilePin] = {}  # file key -> pin
        # Kept leases (:meth:`keep_lease`): file key -> (lease key, revoke()). A pin held only
        # by its kept lease yields to eviction and to drops: revoke() lets it go at once.
        self._kept: dict[str, tuple[Hashable, Callable[[], None]]] = {}
        self.filling: OrderedDict[str, None] = OrderedDict()  # file keys queued by fill(), newest last
        self.passthrough_refusals = 0
        self.unparks = 0  # parked kept leases given a descriptor again (reuse_kept)

    def attach(self, nursery: trio.Nursery) -> None:
        """Background placement and promotion tasks run in ``nursery`` (owned by the mount)."""
        self._nursery = nursery

    # -- reading ---------------------------------------------------------------------------
    async def read(self, f: BackingFile, offset: int, size: int, access: AccessState) -> bytes:
        """Bytes ``[offset, offset+size)`` of ``f`` (short at end of file). Raises BackingIOError
        only when the backing store itself fails."""
        end = min(offset + size, f.size)
        cs = self.chunk_size
        parts: list[bytes] = []
        pos = offset
        while pos < end:
            idx = pos // cs
            cstart = idx * cs
            take = min(end, cstart + cs) - pos
            first_touch = idx != access.last_chunk
            access.last_chunk = idx
            if first_touch or access.reading is None:
                self._enter(access, (f.key, idx))
            parts.append(await self._read_chunk(f, idx, pos - cstart, take, first_touch, access.random))
            pos += take
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_resident_now(self, f: BackingFile, offset: int, size: int, access: AccessState) -> bytes | None:
        """:meth:`read` with no await, for a read within one chunk that a tier whose calls
        run inline (RAM: a tmpfs ``pread``, measured cheap) holds, verified; None otherwise
        (nothing read: call :meth:`read`). What :meth:`read` records of an access (the chunk
        entered, its frequency, its planned use, the hit) is recorded the same way."""
        end = min(offset + size, f.size)
        cs = self.chunk_size
        idx = offset // cs
        if end <= offset or end > (idx + 1) * cs:
            return None
        cid = (f.key, idx)
        entry = self.catalog.get(cid)
        if entry is None or not entry.verified or not self.tiers[entry.tier].inline:
            return None
        try:
            data = self.tiers[entry.tier].read(f.key, offset, end - offset)
        except TierIOError:
            return None  # read() drops the chunk and reads elsewhere
        first_touch = idx != access.last_chunk
        access.last_chunk = idx
        if first_touch or access.reading is None:
            self._enter(access, cid)
        if first_touch:
            self.policy.freq.record(cid)
            if self.plan is not None:
                self.plan.consume(cid)
        self._count_hit(cid, entry, first_touch, end - offset)
        return data

    def _enter(self, access: AccessState, cid: ChunkId) -> None:
        """The handle of ``access`` now reads ``cid``: it stays in its tier until the handle
        moves on. A read consumes the chunk's planned use at its first piece, which makes it
        the first victim for hinted prefetch; without this it was evicted between the pieces
        of that very read and fetched a second time for the rest."""
        if access.reading == cid:
            return
        self.forget_access(access)
        access.reading = cid
        self._reading[cid] = self._reading.get(cid, 0) + 1

    def forget_access(self, access: AccessState) -> None:
        """The handle of ``access`` is closed (or left its chunk): its chunk may be evicted."""
        cid = access.reading
        if cid is None:
            return
        access.reading = None
        n = self._reading.get(cid, 0) - 1
        if n > 0:
            self._reading[cid] = n
        else:
            self._reading.pop(cid, None)

    async def _read_chunk(
        self, f: BackingFile, idx: int, start: int, n: int, first_touch: bool, random: bool = False
    ) -> bytes:
        cid = (f.key, idx)
        prior = self.policy.freq.record(cid) if first_touch else self.policy.freq.get(cid) - 1
        if first_touch and self.plan is not None:
            self.plan.consume(cid)
        skip_tier = False
        while True:
            entry = self.catalog.get(cid)
            if entry is not None and not skip_tier:
                data = await self._read_resident(cid, entry, start, n)
                if data is not None:
                    self._count_hit(cid, entry, first_touch, n)
                    return data
                # the tier failed; the chunk was dropped (look again), or, pinned by a
                # passthrough lease, kept until the last release: read it elsewhere
                skip_tier = self.catalog.get(cid) is entry
                continue
            if first_touch:
                for t in self.tiers:
                    t.misses += 1
            staged = self.staging.get(cid)
            if staged is not None:
                self.staging.move_to_end(cid)
                self.staging_hits += 1
                self.staging_bytes_served += n
                staged.served += n
                self._staged_access(cid, staged, prior, first_touch)
                return staged.data[start : start + n]
            if random and prior < WHOLE_CHUNK_AFTER and self.scheduler.lookup(cid) is None:
                # A random read of a chunk read fewer than WHOLE_CHUNK_AFTER times before: fetch
                # what is asked, not 4 MiB (whole-chunk fetches made random 4 KiB reads 3x slower
                # than direct on the emulated HDD; after the 2nd touch still 0.6x). A chunk read
                # that often, or read sequentially, is fetched whole and cached.
                self.backing_hits += 1
                self.backing_bytes_served += n
                self.partial_fetches += 1
                return await self.scheduler.io(
                    partial(_pread_range, f, idx * self.chunk_size + start, n), Klass.DEMAND,
                    nbytes=n, position=(f.order, idx), written=False)  # type: ignore[return-value]
            data = await self.scheduler.fetch(f, idx, Klass.DEMAND)
            if data is None:  # copied straight into a tier: read it there
                entry = self.catalog.get(cid)
                got = await self._read_resident(cid, entry, start, n) if entry is not None else None
                if got is None:
                    continue  # evicted or failed meanwhile: look again
                self.backing_hits += 1
                self.backing_bytes_served += n
                assert entry is not None
                self.tiers[entry.tier].bytes_served += n
                return got
            self.backing_hits += 1
            self.backing_bytes_served += n
            staged = self.staging.get(cid)
            if staged is not None:
                self._staged_access(cid, staged, prior, True)
            return data[start : start + n]

    async def _read_resident(self, cid: ChunkId, entry: ChunkEntry, start: int, n: int) -> bytes | None:
        tier = self.tiers[entry.tier]
        offset = cid[1] * self.chunk_size
        try:
            if tier.inline and entry.verified:
                return tier.read(cid[0], offset + start, n)
            entry.pins += 1
            try:
                if entry.verified:
                    return await self.devices[entry.tier].run(tier.read, cid[0], offset + start, n)
                whole = await self.devices[entry.tier].run(tier.read, cid[0], offset, entry.length)
            finally:
                entry.pins -= 1
        except TierIOError as e:
            log.warning("%s; dropping chunk %s/%d and reading elsewhere", e, cid[0], cid[1])
            tier.errors += 1
            if not self._doom(cid[0]):  # (leased: dropped at the last release)
                await self._drop_chunk(cid)
            return None
        if xxhash.xxh3_64_intdigest(whole) != entry.checksum:
            log.warning("checksum mismatch in tier %s for %s/%d: dropped", tier.name, *cid)
            self.checksum_failures += 1
            if not self._doom(cid[0]):
                await self._drop_chunk(cid)
            return None
        entry.verified = True
        return whole[start : start + n]

    def _count_hit(self, cid: ChunkId, entry: ChunkEntry, first_touch: bool, n: int) -> None:
        tier = self.tiers[entry.tier]
        tier.bytes_served += n
        unread = self._unread_prefetch.pop(cid, None)
        if unread is not None:
            self.prefetch_used += unread
        if not first_touch:
            return
        tier.hits += 1
        for t in self.tiers[: entry.tier]:
            t.misses += 1
        self.residency[entry.tier].touch(cid)
        if entry.tier == self.persistent_tier and self.ssd_catalog is not None:
            self.ssd_catalog.record_freq(cid, self.policy.freq.get(cid))
        if entry.tier > 0 and cid not in self._moving:
            victim = next(self.residency[0].victims(self._unmovable), None)
            room = self.tiers[0].cache_room() >= blocks(entry.length)
            if self.policy.promotes(cid, None if room else victim):
                self._spawn(self._promote, cid)

    def _staged_access(self, cid: ChunkId, staged: Staged, prior: int, first_touch: bool) -> None:
        """A read of a staged chunk. Each new access (not each kernel-sized piece of one)
        retries admission, so a chunk that keeps being read earns a tier."""
        if not staged.accessed:
            staged.accessed = True
            if staged.speculative:
                self.prefetch_used += len(staged.data)
        elif not first_touch:
            return
        if not staged.placing:
            staged.placing = True
            self._spawn(self._place_staged, cid, staged, prior)

    def _spawn(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        if self._nursery is None:
            return

        async def counted() -> None:
            self.background += 1
            try:
                await fn(*args)
            finally:
                self.background -= 1

        # guarded: a failed placement costs that chunk its tier copy, not the daemon
        tasks.spawn(self._nursery, f"cache.{getattr(fn, '__name__', 'task')}", counted)

    # -- passthrough leases ------------------------------------------------------------------
    def resident_tier(self, f: BackingFile) -> int | None:
        """The tier holding every byte of ``f`` now, current and verified, with no chunk of it
        moving (being placed, demoted or promoted); None if there is none (an empty file, a
        file split across tiers or partly resident, chunks of an SSD tier not yet verified
        against their checksum since the mount). No I/O."""
        if f.size <= 0 or f.stale:
            return None
        key = f.key
        n = -(-f.size // self.chunk_size)
        idxs = self.catalog.by_file.get(key)
        if idxs is None or len(idxs) < n:
            return None
        tier: int | None = None
        for idx in range(n):
            cid = (key, idx)
            entry = self.catalog.entries.get(cid)
            if entry is None or not entry.verified or cid in self._moving:
                return None
            if tier is None:
                tier = entry.tier
            elif entry.tier != tier:
                return None
            want = min(self.chunk_size, f.size - idx * self.chunk_size)
            if entry.length != want:
                return None
        return tier

    async def lease_resident(self, f: BackingFile,
                             on_release: Callable[[], None] | None = None) -> Lease | None:
        """A read-only lease on the tier file holding all of ``f`` (for kernel passthrough of
        a read-only open), or None: the daemon serves the open as before.

        Granted when every byte of the current version of ``f`` is resident, verified and in
        one tier (:meth:`resident_tier`) and that tier file's ``st_size`` is exactly ``f.size``
        (the kernel reads the backing file up to *its* size). From then until the last lease
        of the file is released, its chunks are pinned: no eviction, demotion, promotion, hole
        punch or removal of the tier file; capacity accounting is unchanged (the chunks stay
        counted where they are). All concurrent leases of a file share one descriptor (opened
        ``O_RDONLY | O_NOFOLLOW`` relative to the tier's verified directory), closed at the
        last release. ``on_release()`` runs when this lease is released.

        Reads through the lease never reach the daemon: they count in the tier's
        ``passthrough_opens`` and ``passthrough_bytes`` (``f.size`` per lease), not in its
        hits, misses or ``bytes_served``. Never raises for a tier problem (None instead).
        """
        pin = self._pinned.get(f.key)
        if pin is not None and pin.doomed:
            return self._refuse()  # changed or failed while leased: nothing new on it
        lkey = None
        if pin is not None:
            lkey = ("tier", self.tiers[pin.tier].name, f.key)
            if not self._unpark(lkey, f):
                return self._refuse()
            lease = await self.leases.share(lkey, tier=self.tiers[pin.tier].name, size=f.size,
                                            writable=False, on_release=on_release)
            if lease is not None:
                self._count_lease(f, pin.tier)
                return lease
        t = self.resident_tier(f)
        if t is None:
            return self._refuse()
        tier = self.tiers[t]
        lkey = ("tier", tier.name, f.key)
        if lkey in self.leases:  # another task is opening it (pinned already)
            lease = await self.leases.share(lkey, tier=tier.name, size=f.size, writable=False,
                                            on_release=on_release)
            if lease is None:
                return self._refuse()
            self._count_lease(f, t)
            return lease
        # Pinned before the first await: nothing can move a chunk of it from here on
        self._pin(f.key, t, f.size)
        self.leases.begin(lkey)
        fd = -1
        try:
            fd = tier.open_readonly(f.key) if tier.inline else await self.devices[t].run(
                tier.open_readonly, f.key)
            size = os.fstat(fd).st_size  # an open descriptor: no I/O
        except OSError as e:
            log.warning("tier %s: cannot open the tier file of %s for passthrough: %s",
                        tier.name, f.path, e)
            size = -1
        except BaseException:
            if fd >= 0:
                os.close(fd)
            self.leases.abort(lkey)
            self._unpin(f.key)
            raise
        if size != f.size:
            if fd >= 0:
                os.close(fd)
            self.leases.abort(lkey)
            self._unpin(f.key)
            return self._refuse()
        self._count_lease(f, t)
        return self.leases.finish(lkey, fd, tier=tier.name, size=f.size, writable=False,
                                  on_last=partial(self._unpin, f.key), on_release=on_release)

    def share_lease(self, lkey: Hashable, *, writable: bool,
                    on_release: Callable[[], None] | None = None) -> Lease | None:
        """One more lease on the tier file that lease key ``lkey`` (``("tier", tier, file
        key)``, from :meth:`lease_resident`) holds now, whatever became of the file since (it
        may be dirty, written in place, or changed on the backing store): for an open of an
        inode whose other opens the kernel passes through to that tier file, which it must then
        pass through to the same file (one backing file per inode). ``writable``: the open
        writes (the file is then written in place: :meth:`mark_modified` first). None when no
        lease of ``lkey`` is held any more."""
        sh_lease = self.leases.share_now(lkey, tier=str(lkey[1]), size=0,  # type: ignore[index]
                                         writable=writable, on_release=on_release)
        if sh_lease is not None:
            sh_lease.size = os.fstat(sh_lease.fd).st_size  # an open descriptor: no I/O
            self.tiers[self._tier_index(sh_lease.tier)].passthrough_opens += 1
        return sh_lease

    def keep_lease(self, lkey: Hashable, revoke: Callable[[], None]) -> Lease | None:
        """One more lease on the tier file that ``lkey`` (from :meth:`lease_resident`) holds
        now, kept by the caller after its opens close so that the next open of the file costs
        no tier open, no pin and no kernel registration (the transport keeps its backing id
        as long). Unlike an open's lease it yields: when eviction wants one of the file's
        chunks, or the file is dropped (changed, failed), and no other lease holds it,
        ``revoke()`` is called (synchronously; it must release the lease). Not counted as an
        open. None when no lease of ``lkey`` is held."""
        lease = self.leases.share_now(lkey, tier=str(lkey[1]), size=0,  # type: ignore[index]
                                      writable=False)
        if lease is not None:
            self._kept[str(lkey[2])] = (lkey, revoke)  # type: ignore[index]
        return lease

    def parks(self, lkey: Hashable) -> bool:
        """Whether a kept lease of ``lkey`` can be parked (:meth:`park_kept`): its tier's calls
        run inline (RAM)."""
        return self.tiers[self._tier_index(str(lkey[1]))].inline  # type: ignore[index]

    def park_kept(self, lkey: Hashable) -> bool:
        """Close the descriptor of the kept lease of ``lkey`` while nothing else holds it
        (:meth:`LeaseTable.park`): kept leases then cost no descriptors, so as many files
        can stay registered as a small-file dataset has, where a descriptor each limited them
        to an eighth of ``RLIMIT_NOFILE`` (2,500 of an 8,000-file dataset under a 20,000
        limit; LRU over an epoch then kept none of the files read next). The next open
        opens the tier file again (:meth:`reuse_kept`, ~10 us on tmpfs, against ~125 us
        for a lease and a kernel registration). Only in a tier whose calls run inline (RAM):
        elsewhere that open would take a thread. True if parked."""
        return self.parks(lkey) and self.leases.park(lkey)

    def _unpark(self, lkey: Hashable, f: BackingFile) -> bool:
        """Give parked ``lkey`` its descriptor back (the tier file of ``f``, which its pin kept
        in place). False if that fails (the kept lease is let go: nothing can use it)."""
        if not self.leases.is_parked(lkey):
            return True
        tier = self.tiers[self._tier_index(str(lkey[1]))]  # type: ignore[index]
        fd = -1
        try:
            fd = tier.open_readonly(f.key)
            ok = os.fstat(fd).st_size == f.size
        except OSError as e:
            log.warning("tier %s: cannot open the kept tier file of %s again: %s", tier.name, f.path, e)
            ok = False
        if ok:
            self.leases.unpark(lkey, fd)
            self.unparks += 1
            return True
        if fd >= 0:
            os.close(fd)
        kept = self._kept.pop(str(lkey[2]), None)  # type: ignore[index]
        if kept is not None:
            kept[1]()  # releases the parked lease, and the pin with it
        return False

    def unkeep(self, key: str) -> None:
        """The kept lease of file ``key`` is being released by its keeper."""
        self._kept.pop(key, None)

    def reuse_kept(self, lkey: Hashable, f: BackingFile,
                   on_release: Callable[[], None] | None = None) -> Lease | None:
        """A lease for an open of ``f`` on the tier file its kept lease (:meth:`keep_lease`)
        holds, counted as :meth:`lease_resident` counts one; None if that is no longer ``f``'s
        current tier copy (doomed, or not the same identity)."""
        key = str(lkey[2])  # type: ignore[index]
        pin = self._pinned.get(key)
        if pin is None or pin.doomed or pin.modified or key != f.key or key not in self._kept:
            return None
        if not self._unpark(lkey, f):
            return None
        lease = self.leases.share_now(lkey, tier=str(lkey[1]), size=f.size,  # type: ignore[index]
                                      writable=False, on_release=on_release)
        if lease is not None:
            self._count_lease(f, pin.tier)
        return lease

    def _pinned_now(self, key: str) -> bool:
        """Whether file ``key`` is pinned by a lease, after letting go of a kept lease that
        was the only one holding it."""
        if key not in self._pinned:
            return False
        kept = self._kept.get(key)
        if kept is not None and self.leases.refs(kept[0]) <= 1:
            kept[1]()  # releases the lease (the pin goes with the last one)
            self._kept.pop(key, None)
        return key in self._pinned

    def _tier_index(self, name: str) -> int:
        return next(i for i, t in enumerate(self.tiers) if t.name == name)

    def mark_modified(self, key: str) -> None:
        """The tier file of leased file identity ``key`` is being written in place (see
        :class:`_FilePin`): its chunks are dropped at the last release, never served again as
        the backing file's bytes."""
        pin = self._pinned.get(key)
        if pin is not None:
            pin.modified = True

    async def truncate_leased(self, lkey: Hashable, size: int) -> None:
        """Set the size of the leased tier file of ``lkey`` (a truncate of a file written in
        place), in the tier's threads. Raises TierIOError."""
        assert isinstance(lkey, tuple)
        tier_name, key = str(lkey[1]), str(lkey[2])
        t = self._tier_index(tier_name)
        self.mark_modified(key)
        await self.devices[t].run(self.tiers[t].truncate_file, key, size)

    def is_leased(self, key: str) -> bool:
        """A passthrough lease holds the tier file of file identity ``key`` now."""
        return key in self._pinned

    def _refuse(self) -> Lease | None:
        """Count a refused lease; None (for ``return self._refuse()``)."""
        self.passthrough_refusals += 1
        return None

    def _count_lease(self, f: BackingFile, t: int) -> None:
        """Count a passthrough open of ``f`` (in tier ``t``). The kernel will read it without
        telling the daemon, so the open stands for one pass over the file: each chunk counts
        one access for the eviction policy (frequency, recency) and uses up its next planned
        use in the hint plan, as a read through the daemon would."""
        tier = self.tiers[t]
        tier.passthrough_opens += 1
        tier.passthrough_bytes += f.size
        for idx in range(-(-f.size // self.chunk_size)):
            cid = (f.key, idx)
            self.policy.freq.record(cid)
            self.residency[t].touch(cid)
            if self.plan is not None:
                self.plan.consume(cid)

    def _pin(self, key: str, t: int, size: int) -> None:
        self._pinned[key] = _FilePin(t, size)
        tier = self.tiers[t]
        tier.leased_files += 1
        tier.leased_bytes += size

    def _unpin(self, key: str) -> None:
        """The last lease of ``key`` is gone (or its open failed): its chunks may move again;
        a file doomed meanwhile is dropped now."""
        pin = self._pinned.pop(key, None)
        self._kept.pop(key, None)
        if pin is None:
            return
        tier = self.tiers[pin.tier]
        tier.leased_files -= 1
        tier.leased_bytes -= pin.size
        if pin.doomed or pin.modified:
            self._spawn(self.drop_file, key)

    def _doom(self, key: str) -> bool:
        """Mark a leased file to be dropped at its last release. False if it is not leased
        (a kept lease alone is let go: the caller drops it now)."""
        if not self._pinned_now(key):
            return False
        pin = self._pinned.get(key)
        if pin is None:
            return False
        pin.doomed = True
        return True

    # -- prefetch --------------------------------------------------------------------------
    def capacity(self) -> int:
        """Bytes the tiers hold together (their effective capacities)."""
        return sum(t.effective_capacity for t in self.tiers)

    def fill(self, f: BackingFile) -> int:
        """Queue every chunk of ``f`` for a tier (speculative: after demand and hinted work,
        placed only where a tier has room): for a file whose reads the kernel serves from the
        backing file itself (``passthrough_misses``), which the daemon never sees. Unlike
        readahead, not dropped when the file is closed (the reader is usually done by the time
        its chunks are fetched). Returns how many were queued."""
        self.filling[f.key] = None
        self.filling.move_to_end(f.key)
        while len(self.filling) > MAX_FILLING:
            self.filling.popitem(last=False)
        return self.prefetch(f, list(range(-(-f.size // self.chunk_size))))

    def prefetch(self, f: BackingFile, indexes: list[int], klass: Klass = Klass.SPECULATIVE,
                 deadline: float = float("inf")) -> int:
        """Queue fetches of chunks that are not resident, staged or queued. Returns how many."""
        n = 0
        for idx in indexes:
            cid = (f.key, idx)
            if cid in self.catalog.entries or cid in self.staging:
                continue
            req = self.scheduler.lookup(cid)
            if req is not None and req.klass <= klass:
                continue
            self.scheduler.submit(f, idx, klass, deadline)
            n += 1
        return n

    async def _transfer(self, run: list[FetchRequest], offset: int, length: int) -> bool:
        """The scheduler's :data:`~tierfs.sched.scheduler.Transfer`: copy a run of chunks from
        the backing store into the fastest non-persistent tier that has room for all of them
        without evicting anything, in the kernel (copy_file_range/splice: the bytes never reach
        Python), and record them resident. Declines (False: the scheduler reads the run into
        memory, and staging and placement go as before) when no such tier has room, when a
        chunk is already somewhere, or when the copy fails or the file changed. A persistent
        tier is never used: its chunks need a checksum of their bytes."""
        f = run[0].file
        lengths = [min(self.chunk_size, f.size - r.index * self.chunk_size) for r in run]
        cids = [r.cid for r in run]
        need = sum(blocks(n) for n in lengths)
        if f.stale or f.fd < 0 or any(c in self.catalog.entries or c in self.staging or c in self._moving
                                      for c in cids):
            return False
        t = next((i for i, tier in enumerate(self.tiers)
                  if i != self.persistent_tier and tier.cache_room() >= need), None)
        if t is None:
            return False
        tier = self.tiers[t]
        reserved = 0
        for n in lengths:
            if not tier.reserve(n, keep_free=tier.keep_free):
                break
            reserved += 1
        if reserved < len(lengths):
            for n in lengths[:reserved]:
                tier.release(n)
            return False
        self._moving.update(cids)
        ok = False
        try:
            for c in cids:
                await self._quiet(t, c)
            try:
                ok = await self.copy_io(partial(_copy_checked, f, tier, offset, length))
            except OSError as e:  # the backing file's fstat/fadvise: the plain read will tell
                log.debug("kernel copy of %s: %s; reading instead", f.path, e)
            except TierIOError as e:
                if is_enospc(OSError(e.errno, "")):
                    await self._tier_write_failed(t, cids[0], e)
                else:
                    log.debug("kernel copy into tier %s failed (%s); reading instead", tier.name, e)
            if not ok:
                await self._punch(t, cids[0], length)
                return False
            for c, n in zip(cids, lengths, strict=True):
                self.catalog.add(c, ChunkEntry(t, n, 0))
                self.residency[t].add(c)
                self.placements += 1
                self.direct_fetches += 1
            for r, n in zip(run, lengths, strict=True):
                if r.klass is not Klass.DEMAND and r.waiters == 0:
                    self._unread_prefetch[r.cid] = n  # readahead nobody has read yet
            return True
        finally:
            if not ok:
                for n in lengths:
                    tier.release(n)
            self._moving.difference_update(cids)

    def _on_fetched(self, req: FetchRequest, data: bytes) -> None:
        """Scheduler callback: every fetched chunk is staged first (memory, instant)."""
        cid = req.cid
        if cid in self.staging or cid in self.catalog.entries or req.file.stale:
            return
        staged = Staged(data, speculative=req.klass is not Klass.DEMAND and req.waiters == 0)
        self.staging[cid] = staged
        self.staging_used += len(data)
        if self.plan is not None and self.plan.next_use(cid) is not None:
            # Hinted prefetch goes to a tier at once, admitted by its place in the plan.
            staged.placing = True
            self._spawn(self._place_staged, cid, staged, self.policy.freq.get(cid))
        elif staged.speculative and any(t.cache_room() >= blocks(len(data)) for t in self.tiers):
            # Readahead lands in a tier that has room at once (prior -1: it evicts nothing),
            # so staging stays free for readahead no tier has room for.
            staged.placing = True
            self._spawn(self._place_staged, cid, staged, -1)
        self._trim_staging()

    def _trim_staging(self) -> None:
        """Keep staging within its capacity: first drop chunks readers have had whole (a
        sequential reader will not come back for them), then the least recently used; never
        a chunk whose placement is under way."""
        if self.staging_used <= self.staging_capacity:
            return
        for consumed_only in (True, False):
            for cid in list(self.staging):
                if self.staging_used <= self.staging_capacity:
                    return
                staged = self.staging[cid]
                if staged.placing or (consumed_only and staged.served < len(staged.data)):
                    continue
                self._unstage(cid)
                if staged.speculative and not staged.accessed:
                    self.prefetch_wasted += len(staged.data)

    def _unstage(self, cid: ChunkId) -> None:
        staged = self.staging.pop(cid, None)
        if staged is not None:
            self.staging_used -= len(staged.data)

    # -- hints -------------------------------------------------------------------------------
    def holds_any(self, f: BackingFile, offset: int, length: int) -> bool:
        """Whether the cache has any of bytes ``[offset, offset+length)`` of ``f``: a chunk
        they touch is in a tier, in memory (staged) or being fetched. A copy of the rest may
        go straight from the backing file (:meth:`tierfs.writeback.manager.WriteBack.copy_in`)."""
        if length <= 0:
            return False
        cs = self.chunk_size
        for idx in range(offset // cs, (offset + length - 1) // cs + 1):
            cid = (f.key, idx)
            if cid in self.catalog.entries or cid in self.staging or self.scheduler.lookup(cid) is not None:
                return True
        return False

    def is_resident(self, cid: ChunkId) -> bool:
        """In a tier or in staging (a read would not wait for the backing store)."""
        return cid in self.catalog.entries or cid in self.staging

    def in_tier(self, cid: ChunkId) -> bool:
        """In a tier: what a hint waits for (staging is a transit area and may be trimmed)."""
        return cid in self.catalog.entries

    def is_present(self, cid: ChunkId) -> bool:
        """Resident, or queued / in flight at the scheduler."""
        return self.is_resident(cid) or self.scheduler.lookup(cid) is not None

    def can_admit(self, cid: ChunkId, length: int, ahead: int = 0) -> bool:
        """Would a tier take ``cid`` now (room, or a victim the policy lets it replace)?
        What the prefetcher asks before fetching a planned chunk.

        ``ahead``: bytes of chunks the prefetcher has already queued and not yet placed (needed
        sooner than ``cid``). They take the free room and the first victims when they arrive,
        so ``cid`` is weighed against what is left: without this, every chunk queued in one
        round was checked against the same room or the same victim, and the ones no tier took
        on arrival were fetched for nothing."""
        need = blocks(length)
        for t, tier in enumerate(self.tiers):
            room = tier.cache_room() - ahead
            if room >= need:
                return True
            skip = -room  # bytes of victims the chunks ahead take first (<= 0: none)
            for victim in self.residency[t].victims(self._unmovable):
                if skip > 0:
                    entry = self.catalog.get(victim)
                    skip -= blocks(entry.length) if entry is not None else need
                    continue
                if self.policy.admits(self.policy.freq.get(cid), victim, cid):
                    return True
                break
        return False

    async def evict_chunks(self, cids: list[ChunkId]) -> tuple[int, int]:
        """Drop these chunks from every tier and staging now (``tierfs evict``); pinned or
        moving chunks are skipped. Returns (chunks, bytes) dropped."""
        n = nbytes = 0
        for cid in cids:
            staged = self.staging.get(cid)
            if staged is not None and not staged.placing:
                self._unstage(cid)
                n += 1
                nbytes += len(staged.data)
            entry = self.catalog.get(cid)
            if entry is not None and entry.pins == 0 and cid not in self._moving and not self._pinned_now(cid[0]):
                await self._drop_chunk(cid)
                self.tiers[entry.tier].evictions += 1
                n += 1
                nbytes += entry.length
        return n, nbytes

    async def keep_free(self, t: int, nbytes: int) -> None:
        """Keep ``nbytes`` of tier ``t`` free for writes (checkpoint hints): cached chunks are
        not placed into that room and are evicted from it now."""
        tier = self.tiers[t]
        tier.keep_free = max(0, min(nbytes, tier.capacity))
        if tier.room() < tier.keep_free:
            await self.evict_for(t, tier.keep_free)

    # -- placement, eviction, promotion ----------------------------------------------------
    def _unmovable(self, cid: ChunkId) -> bool:
        if cid in self._moving or cid in self._reading or self._pinned_now(cid[0]):
            return True
        entry = self.catalog.get(cid)
        return entry is None or entry.pins > 0

    async def _place_staged(self, cid: ChunkId, staged: Staged, prior: int) -> None:
        try:
            if cid in self.catalog.entries or cid in self._moving:
                return  # resident, or another task is moving it
            self._moving.add(cid)
            try:
                placed = await self._place(cid, staged.data, prior, range(len(self.tiers)))
            finally:
                self._moving.discard(cid)
            if placed is None:
                self.bypassed += 1
            else:
                self.placements += 1
                if staged.speculative and not staged.accessed:
                    self._unread_prefetch[cid] = len(staged.data)
        finally:
            staged.placing = False
            if cid in self.catalog.entries:
                self._unstage(cid)
            else:
                self._trim_staging()

    async def _place(self, cid: ChunkId, data: bytes, prior: int, tier_range: range) -> int | None:
        """Put ``data`` in the fastest tier of ``tier_range`` that has room or can make room
        by the policy. Returns the tier index, or None (not admitted anywhere)."""
        length = len(data)
        for t in tier_range:
            tier = self.tiers[t]
            if tier.cache_room() < blocks(length) and not await self._make_room(t, blocks(length), prior, cid):
                continue
            if not tier.reserve(length, keep_free=tier.keep_free):
                tier.full_events += 1
                continue
            checksum = xxhash.xxh3_64_intdigest(data) if t == self.persistent_tier else 0
            try:
                await self._quiet(t, cid)
                # Even on tmpfs a 4 MiB write costs ~3 ms of page allocation: measured at 25% of
                # the event loop's time on a cold sequential read, so it runs in the tier's
                # thread (reads of tmpfs stay inline; they are cheap).
                await self.devices[t].run(tier.write, cid[0], cid[1] * self.chunk_size, data)
            except TierIOError as e:
                tier.release(length)
                await self._tier_write_failed(t, cid, e)
                continue
            except BaseException:  # cancelled (unmount): the reservation must not leak
                tier.release(length)
                raise
            other = self.catalog.entries.get(cid)
            if other is not None:  # raced with another placement; keep the other
                if other.tier == t:  # the same blocks, written twice
                    tier.release(length)
                else:  # these blocks would be allocated with no chunk to account them
                    await self._punch_then_release(t, cid, length)
                return other.tier
            self.catalog.add(cid, ChunkEntry(t, length, checksum))
            self.residency[t].add(cid)
            if t == self.persistent_tier and self.ssd_catalog is not None:
                self.ssd_catalog.record_add(cid, length, checksum)
            return t
        return None

    async def _tier_write_failed(self, t: int, cid: ChunkId, e: TierIOError) -> None:
        tier = self.tiers[t]
        tier.errors += 1
        if is_enospc(OSError(e.errno, "")):
            # The filesystem filled from outside (cvmfs#3083): never exceed what it has left.
            tier.effective_capacity = max(0, tier.used)
            tier.full_events += 1
            log.warning("tier %s: filesystem full at %d bytes; capacity lowered to that",
                        tier.name, tier.used)
        else:
            log.warning("%s", e)
        await self._punch(t, cid, self.chunk_size)  # what the failed write did allocate

    async def _quiet(self, t: int, cid: ChunkId) -> None:
        """Wait until no punch of ``cid`` and no removal of its file runs on tier ``t``."""
        while True:
            busy = self._tier_busy.get((t, cid))
            if busy is None:  # (a trio.Event has no truth value: `a or b` raised, killing the daemon)
                busy = self._tier_busy.get((t, cid[0]))
            if busy is None:
                return
            await busy.wait()

    async def _in_tier_thread(self, t: int, busy: ChunkId | str, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` in tier ``t``'s threads, marked busy for :meth:`_quiet` meanwhile."""
        done = self._tier_busy[(t, busy)] = trio.Event()
        try:
            await self.devices[t].run(fn, *args)
        finally:
            del self._tier_busy[(t, busy)]
            done.set()

    async def _punch(self, t: int, cid: ChunkId, length: int) -> None:
        """Free a chunk's blocks in tier ``t``. A persistent tier's punch runs in its threads
        (an SSD busy with writes takes ms to tens of ms for one); a RAM tier's (tmpfs frees
        its pages) stays inline."""
        tier = self.tiers[t]
        if tier.inline:
            tier.punch(cid[0], cid[1] * self.chunk_size, length)
            return
        await self._quiet(t, cid)
        await self._in_tier_thread(t, cid, tier.punch, cid[0], cid[1] * self.chunk_size, length)

    async def _punch_then_release(self, t: int, cid: ChunkId, length: int) -> None:
        """Free a chunk's blocks, then give its bytes back to tier ``t``'s accounting. In this
        order: a chunk placed while a punch runs in the tier's thread must not find room whose
        blocks are still allocated (released first, the tier directory grew ~1.3 MiB past a
        48 MiB tier's limit in a test of 1 MiB chunks)."""
        self._freeing[t] += blocks(length)
        try:
            await self._punch(t, cid, length)
        finally:
            self._freeing[t] -= blocks(length)
            self.tiers[t].release(length)

    async def _make_room(self, t: int, need: int, prior: int, newcomer: ChunkId | None = None) -> bool:
        """Evict victims of tier ``t`` (demoting them) until ``need`` bytes are free, if the
        policy lets ``newcomer`` with ``prior`` accesses replace every one of them."""
        tier = self.tiers[t]
        victims: list[ChunkId] = []
        freed = tier.cache_room()
        for victim in self.residency[t].victims(self._unmovable):
            if freed >= need:
                break
            if not self.policy.admits(prior, victim, newcomer):
                return False
            victims.append(victim)
            freed += blocks(self.catalog.entries[victim].length)
        if freed < need:
            return False
        for victim in victims:
            await self._evict(t, victim)
        return tier.cache_room() >= need

    async def evict_for(self, t: int, need: int) -> None:
        """Evict clean chunks of tier ``t`` (demoting them where a slower tier admits them)
        until ``need`` bytes are free or nothing more can go. Dirty data outranks any cached
        chunk, so no admission test applies here."""
        tier = self.tiers[t]
        for victim in list(self.residency[t].victims(self._unmovable)):
            if tier.room() >= need:
                return
            await self._evict(t, victim)

    async def _evict(self, t: int, cid: ChunkId) -> None:
        """Remove ``cid`` from tier ``t``, demoting it to a slower tier if one admits it."""
        entry = self.catalog.get(cid)
        if entry is None or entry.tier != t or entry.pins or cid in self._moving or cid[0] in self._pinned:
            return
        tier = self.tiers[t]
        data: bytes | None = None
        if t + 1 < len(self.tiers):
            try:
                if tier.inline:
                    data = tier.read(cid[0], cid[1] * self.chunk_size, entry.length)
                else:
                    data = await self.devices[t].run(tier.read, cid[0], cid[1] * self.chunk_size, entry.length)
            except TierIOError:
                data = None
            if cid[0] in self._pinned or self.catalog.get(cid) is not entry or cid in self._moving:
                return  # leased (or moved) while its bytes were read: it stays
        await self._drop_chunk(cid)
        tier.evictions += 1
        if data is not None:
            self._moving.add(cid)
            self._hold(cid, data)
            try:
                placed = await self._place(cid, data, self.policy.freq.get(cid), range(t + 1, len(self.tiers)))
                if placed is not None:
                    self.tiers[placed].demotions += 1
            finally:
                self._moving.discard(cid)
                self._unstage(cid)

    def _hold(self, cid: ChunkId, data: bytes) -> None:
        """Keep a moving chunk's bytes readable from staging (never trimmed while held), so a
        reader never refetches a chunk that is between two tiers."""
        staged = self.staging.get(cid)
        if staged is None:
            self.staging[cid] = Staged(data, speculative=False, accessed=True, placing=True)
            self.staging_used += len(data)
        else:
            staged.placing = True

    async def _promote(self, cid: ChunkId) -> None:
        entry = self.catalog.get(cid)
        if entry is None or entry.tier == 0 or cid in self._moving or cid[0] in self._pinned:
            return
        src = entry.tier
        self._moving.add(cid)
        try:
            entry.pins += 1
            try:
                data = await self.devices[src].run(self.tiers[src].read, cid[0], cid[1] * self.chunk_size, entry.length)
            except TierIOError:
                return
            finally:
                entry.pins -= 1
            if self.catalog.get(cid) is not entry or cid[0] in self._pinned:
                return  # dropped meanwhile (the file changed), or leased: it stays
            self._hold(cid, data)
            self.catalog.remove(cid)
            self.residency[src].remove(cid)
            # Admit over victims with fewer accesses than this chunk has now.
            placed = await self._place(cid, data, self.policy.freq.get(cid), range(0, src))
            if placed is None:  # no room after all: it stays where it was
                self.catalog.add(cid, entry)
                self.residency[src].add(cid)
                return
            self.tiers[placed].promotions += 1
            # Readers that found the chunk in the slower tier before it moved may still be
            # reading it there (in device threads): punch only after the last one is done.
            # Punching at once served 1 MiB of zeros to a concurrent read (kill -9 + remount
            # + fio verify: ~1 run in 6; a 20 ms delay before pread made it 3 in 4).
            while entry.pins > 0:  # noqa: ASYNC110 - pins are counters; a pread ends within ms
                await trio.sleep(0.001)
            if src == self.persistent_tier and self.ssd_catalog is not None:
                self.ssd_catalog.record_remove(cid)
            await self._punch_then_release(src, cid, entry.length)
            await self._maybe_remove_file(src, cid[0])
        finally:
            self._moving.discard(cid)
            staged = self.staging.get(cid)
            if staged is not None and staged.placing:
                self._unstage(cid)

    async def _drop_chunk(self, cid: ChunkId) -> None:
        entry = self.catalog.remove(cid)
        if entry is None:
            return
        unread = self._unread_prefetch.pop(cid, None)
        if unread is not None:
            self.prefetch_wasted += unread
        t = entry.tier
        self.residency[t].remove(cid)
        if self.plan is not None:
            self.plan.forget_chunk(cid)
        if t == self.persistent_tier and self.ssd_catalog is not None:
            self.ssd_catalog.record_remove(cid)
        await self._punch_then_release(t, cid, entry.length)
        await self._maybe_remove_file(t, cid[0])

    async def _maybe_remove_file(self, t: int, key: str) -> None:
        """Delete tier ``t``'s file of ``key`` once no chunk of it is there or on its way. In
        the tier's threads: unlinking a multi-GB file frees its blocks (or pages) for tens to
        hundreds of ms. A chunk placed meanwhile waits for it (:meth:`_quiet`)."""
        if (t, key) in self._tier_busy or self.catalog.file_has_tier(key, t) or any(
            c[0] == key for c in self._moving
        ):
            return
        await self._in_tier_thread(t, key, self.tiers[t].remove_file, key)

    async def drop_file(self, key: str) -> int:
        """Forget every cached chunk of a file identity (the backing file changed). Returns
        the number of chunks dropped."""
        for cid in [c for c in self.staging if c[0] == key]:
            self._unstage(cid)
        if self._doom(key):
            return 0  # leased: the kernel reads its tier file; dropped at the last release
        idxs = self.catalog.chunks_of(key)
        for idx in idxs:
            entry = self.catalog.get((key, idx))
            if entry is not None and entry.pins == 0:
                await self._drop_chunk((key, idx))
        return len(idxs)

    # -- persistence -----------------------------------------------------------------------
    def load_persistent(self) -> int:
        """Restore the last tier's chunks from its catalog (blocking; call at mount time).

        Chunks whose tier file is missing or too short are dropped; tier files nobody records
        are deleted; recorded files get unrecorded ranges punched (a crash between a write and
        the next catalog flush). Every restored chunk is verified against its checksum at its
        first read. Returns the number of chunks restored.
        """
        if self.ssd_catalog is None:
            return 0
        t = self.persistent_tier
        tier = self.tiers[t]
        restored = 0
        sizes: dict[str, int] = {}
        for key, idx, length, checksum, freq in self.ssd_catalog.load():
            if key not in sizes:
                sizes[key] = tier_file_size(tier.file_path(key))
            cid = (key, idx)
            if sizes[key] < idx * self.chunk_size + length or not tier.reserve(length):
                self.ssd_catalog.record_remove(cid)
                continue
            self.catalog.add(cid, ChunkEntry(t, length, checksum, verified=False))
            self.policy.freq.set(cid, freq)
            self.residency[t].add(cid)
            restored += 1
        for key in tier.existing_keys():
            idxs = self.catalog.chunks_of(key)
            if not idxs:
                tier.remove_file(key)
                continue
            pos = 0
            for idx in idxs:
                if idx * self.chunk_size > pos:
                    tier.punch(key, pos, idx * self.chunk_size - pos)
                pos = idx * self.chunk_size + self.catalog.entries[(key, idx)].length
            size = sizes.get(key, 0)
            if size > pos:
                tier.punch(key, pos, size - pos)
        self.ssd_catalog.write(self.ssd_catalog.take_pending())
        return restored

    async def flush_catalog(self) -> None:
        if self.ssd_catalog is not None:
            batch = self.ssd_catalog.take_pending()
            await self.devices[self.persistent_tier].run(self.ssd_catalog.write, batch)

    def _recover_capacity(self) -> None:
        """A tier whose filesystem filled from outside got its capacity lowered; give it back
        as space frees up (blocking statvfs: run in a thread)."""
        for tier in self.tiers:
            if tier.effective_capacity < tier.capacity:
                sv = os.statvfs(tier.path)
                free = sv.f_bavail * sv.f_frsize
                margin = 4 * self.chunk_size  # stay clear of the edge of the filesystem
                tier.effective_capacity = max(tier.effective_capacity, min(
                    tier.capacity, tier.used + getattr(tier, "dirty", 0) + max(0, free - margin)))

    async def run_flusher(self, interval: float = 2.0) -> None:
        """Write the SSD catalog every ``interval`` seconds and give tiers back capacity their
        filesystem has freed. A failure is logged and retried at the next interval (the records
        stay pending); it never stops the daemon."""
        while True:
            await trio.sleep(interval)
            if any(t.effective_capacity < t.capacity for t in self.tiers):
                await trio.to_thread.run_sync(self._recover_capacity)
            try:
                await self.flush_catalog()
            except Exception:  # noqa: BLE001 - sqlite/disk errors must not kill the mount
                log.exception("writing the SSD catalog failed; will retry")

    def close(self) -> None:
        try:
            if self.ssd_catalog is not None:
                self.ssd_catalog.write(self.ssd_catalog.take_pending())
                self.ssd_catalog.close()
        except Exception:  # noqa: BLE001 - teardown goes on; reconcile fixes it next mount
            log.exception("writing the SSD catalog at unmount failed")
        self.leases.close_all()
        for tier in self.tiers:
            tier.close()

    # -- introspection ---------------------------------------------------------------------
    def check(self) -> list[str]:
        """Invariant violations (empty when healthy): capacity, accounting, residency."""
        problems = []
        for t, tier in enumerate(self.tiers):
            entries = [(c, e) for c, e in self.catalog.entries.items() if e.tier == t]
            # chunks being punched are out of the catalog and still accounted
            accounted = sum(blocks(e.length) for _, e in entries) + self._freeing[t]
            if tier.used + tier.dirty > tier.capacity:
                problems.append(f"{tier.name}: used {tier.used} + dirty {tier.dirty} > capacity {tier.capacity}")
            if accounted > tier.used:
                problems.append(f"{tier.name}: catalog holds {accounted} bytes, accounted {tier.used}")
            if not self._moving and accounted != tier.used:
                problems.append(f"{tier.name}: catalog {accounted} != accounted {tier.used} at rest")
            if len(self.residency[t]) != len(entries) or any(c not in self.residency[t] for c, _ in entries):
                problems.append(f"{tier.name}: residency and catalog disagree")
        if self.staging_used != sum(len(s.data) for s in self.staging.values()):
            problems.append("staging accounting is off")
        for key, pin in self._pinned.items():
            if pin.doomed or pin.modified:
                continue
            n = -(-pin.size // self.chunk_size)
            if any((e := self.catalog.get((key, i))) is None or e.tier != pin.tier for i in range(n)):
                problems.append(f"leased file {key}: a chunk left tier {self.tiers[pin.tier].name}")
        for t, tier in enumerate(self.tiers):
            pins = [p for p in self._pinned.values() if p.tier == t]
            if tier.leased_files != len(pins) or tier.leased_bytes != sum(p.size for p in pins):
                problems.append(f"{tier.name}: leased_files/leased_bytes disagree with the pins")
        return problems

    def residency_of(self, key: str, size: int) -> dict[str, int]:
        """Bytes of a file identity resident per tier (for ``tierfs where``)."""
        out = {t.name: 0 for t in self.tiers}
        for idx in self.catalog.chunks_of(key):
            e = self.catalog.entries[(key, idx)]
            out[self.tiers[e.tier].name] += e.length
        out["staging"] = sum(len(s.data) for c, s in self.staging.items() if c[0] == key)
        return out

    def statistics(self) -> CacheStats:
        return CacheStats(
            staging_bytes=self.staging_used,
            staging_capacity_bytes=self.staging_capacity,
            staging_hits=self.staging_hits,
            staging_bytes_served=self.staging_bytes_served,
            backing_hits=self.backing_hits,
            backing_bytes_served=self.backing_bytes_served,
            prefetch_used_bytes=self.prefetch_used,
            prefetch_wasted_bytes=self.prefetch_wasted,
            placements=self.placements,
            bypassed=self.bypassed,
            checksum_failures=self.checksum_failures,
            partial_fetches=self.partial_fetches,
            policy=self.policy.name,
            direct_fetches=self.direct_fetches,
            leased_files=len(self._pinned),
            passthrough_refusals=self.passthrough_refusals,
        )


def tier_dir_usage(path: str) -> int:
    """Bytes really allocated under a tier directory (for tests and ``doctor``)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total
