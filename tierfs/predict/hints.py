"""The daemon side of hints: requests from :mod:`tierfs_hints` become a :class:`HintPlan`, and a
prefetcher fetches what the plan needs, in EDF order, as DEADLINE work of the scheduler.

* Prefetch walks the plan's timeline (earliest deadline first, then each need's order) and
  queues chunks that are not resident, staged or queued, while (a) the bytes it has queued stay
  under ``budget`` (enough to keep the backing store streaming: two slices) and (b) a tier would
  admit the chunk (room, or a victim needed later than it: never evict what is needed sooner).
  The first chunk no tier admits ends the round: everything after it ranks lower.
* Each need is projected against its deadline: the bytes still to fetch of it and of every need
  ranked before it, over the backing store's measured throughput. A need projected to miss is
  logged once (early, with the numbers); one whose deadline passes with bytes missing counts as
  a deadline miss.
* ``checkpoint`` hints keep write-tier room free (:meth:`Cache.keep_free`), so a checkpoint's
  writes never wait for eviction.

Paths in requests are relative to the mount root; absolute paths, ``..`` and symlinks that
leave the backing store are refused (:class:`~tierfs.errors.HintError`). Every request acts with
its caller's credentials (:class:`tierfs.access.Caller`): a path the caller could not read
through the mount is refused (:class:`~tierfs.errors.HintDenied`), and a user's declared
prefetch volume and checkpoint reservations are bounded by ``user_share`` of the tiers.
Paths are resolved through the :class:`~tierfs.backing_tree.BackingTree` into the canonical
relative path the read path keys files by (:func:`tierfs.sched.backing.key_path`), in batches
of :data:`BATCH` on the metadata device, so a request of 500 000 paths never holds the event
loop for more than a few milliseconds at a time.
"""

from __future__ import annotations

import errno
import heapq
import json
import logging
import math
import os
import stat
from array import array
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict
from typing import Any

import trio

from tierfs import logevents, tasks
from tierfs.access import R_OK, ROOT, W_OK, Caller, Resolver, normalize
from tierfs.backing_tree import BackingTree
from tierfs.cache.manager import Cache
from tierfs.cache.plan import (
    ChunkId,
    FileTable,
    HintPlan,
    Need,
    PlannedFile,
    chunk_bytes,
    chunk_ranges,
)
from tierfs.errors import HintDenied, HintError
from tierfs.io import Device, Pacer, free_in_slices
from tierfs.predict.nextfile import NextFilePredictor
from tierfs.sched.backing import BackingFile, Identity, Openings, key_path
from tierfs.sched.scheduler import FetchRequest, Klass, ReqState, TransactionScheduler
from tierfs_hints import wire

log = logging.getLogger("tierfs.hints")
# One "wait" request blocks at most this long; clients loop. A process blocked in a FUSE
# request cannot be interrupted by Ctrl-C (pyfuse3 does not handle FUSE_INTERRUPT), so keep it short.
MAX_WAIT_S = 10.0
FALLBACK_RATE = 100e6  # bytes/s assumed for projections before any backing read was measured
RESCAN_S = 2.0  # full rescans of the timeline (evicted planned chunks are fetched again)
LISTING_TTL_S = 30.0  # directory listings kept for next-file prediction
MAX_LISTING = 200_000  # larger directories: successor prediction only
ROOM_FRACTION = 8  # a predicted resident file registers nothing while its tier has 1/8 free
MAX_EVENTS = 4096  # opens and read ends queued for the next-file predictor (more: dropped)
BATCH = 64  # paths resolved per call on the metadata device (~0.3 ms when cached)
INDEX_BATCH = 2048  # chunk occurrences indexed into the plan between two chances to pause (~0.5 ms)
# Planned chunk occurrences (all needs) up to which stats.json counts a plan's resident and
# remaining bytes when it is read; a larger plan's are counted by the service's loop in paced
# slices and shown up to SUMMARY_MAX_AGE_S old. Counted inline, a plan of 100,000 paths (two
# needs) held the event loop 129 ms per stats.json read on the loaded 2-core VM.
STATS_INLINE_CHUNKS = 20_000
SUMMARY_MAX_AGE_S = 1.0
DEFAULT_USER_SHARE = 0.5  # see the user_hint_share option (tierfs.config)
MAX_CHECKPOINT_DIRS = 64  # checkpoint declarations per user
MAX_BAD_KEYS = 100_000  # remembered unreadable files (cleared beyond)
# Prefetched files held open for their reader's open (see _close_idle_files): a DataLoader
# worker opens the file it was predicted to read within its batch time, well under 10 s; 64
# descriptors cover the predictions of 16 workers several files deep.
HANDOFF_S = 10.0
HANDOFF_MAX = 64


class EncodedList(list):  # type: ignore[type-arg]
    """A long list of a control reply held as JSON text: each entry a fragment of the list's
    items, already encoded (``'{"a": 1}, {"a": 2}'``); the reply encoder joins them with
    ``", "``. Strings are not tracked by the garbage collector, while each of 500,000 ``where``
    entries holding a dict was: with them alive, every full collection held the event loop
    100-280 ms, ten times in one request (2-core VM)."""


class HintService:
    """Args:
        cache: its ``plan`` must be set (``Policy(plan=...)``).
        tree: the backing tree (every path is resolved through it). backing_root: instead of
            ``tree`` (tests, the simulator): a tree is opened on it and closed by :meth:`close`.
        meta: the device for backing-store metadata calls (stat, open).
        write_tier: index of the write tier (for checkpoint room). budget: bytes of prefetch
        queued at once. clock: seconds (trio's clock, so the simulator can run it mocked).
        user_share: the fraction of the tiers' capacity one non-root user may declare as
            prefetch volume (bytes of its live needs), and of the write tier it may reserve
            for checkpoints (the ``user_hint_share`` option). uid 0 is not bounded.
        mountpoint: the mount's path (bytes), to resolve absolute symlinks pointing into it.
        pace: large requests are worked through in slices with short sleeps between them
            (:class:`tierfs.io.Pacer`); False for the simulator, whose mock clock must not move.
    """

    def __init__(self, *, cache: Cache, scheduler: TransactionScheduler, meta: Device, chunk_size: int,
                 write_tier: int, budget: int, tree: BackingTree | None = None, backing_root: bytes | None = None,
                 dirty_bytes: Callable[[bytes], int] | None = None, predict_bytes: int = 0,
                 user_share: float = DEFAULT_USER_SHARE, mountpoint: bytes = b"", pace: bool = True) -> None:
        assert cache.plan is not None
        self.cache = cache
        self.plan: HintPlan = cache.plan
        self.scheduler = scheduler
        self._own_tree = tree is None
        if tree is None:
            assert backing_root is not None, "give tree or backing_root"
            tree = BackingTree(backing_root.rstrip(b"/") or b"/")
        self.tree = tree
        self.mountpoint = mountpoint
        self.meta = meta
        self.chunk_size = chunk_size
        self.write_tier = write_tier
        self.budget = budget
        self.user_share = user_share
        self.pace = pace
        self.dirty_bytes = dirty_bytes or (lambda rel: 0)
        self._queued: dict[ChunkId, FetchRequest] = {}
        self._files: dict[str, BackingFile] = {}
        # prefetched files kept open for the reader they were fetched for: key -> (time, file)
        self._handoff: OrderedDict[str, tuple[float, BackingFile]] = OrderedDict()
        self.openings = Openings()  # opens under way (shared with the namespace by the mount)
        self._key_at: dict[bytes, str] = {}  # path -> key of the file held open there
        self._path_of: dict[str, bytes] = {}  # key -> its path (for forgetting it)
        # the backing files readers hold open, by identity key (set by the mount)
        self.find_open: Callable[[str], BackingFile | None] | None = None
        self._bad_keys: set[str] = set()
        self._kick = trio.Event()
        self._progress = trio.Event()
        self._scan: dict[str, int] = {}  # need id -> first index not known present
        self._last_rescan = -math.inf
        self._checkpoints: dict[tuple[int, bytes], int] = {}  # (uid, dir) -> bytes
        self.prefetched_bytes = 0
        self.requests = 0
        self.refused_perm = 0  # requests refused because the caller may not (kind "perm")
        self.stalled_rounds = 0  # rounds in a row where no tier admitted the next planned chunk
        self.predictor = NextFilePredictor()
        self.predict_bytes = predict_bytes  # 0: no next-file prediction
        self.predictions_resident = 0  # predicted files already in a tier: nothing registered
        self._predicted: dict[tuple[int, bytes], str] = {}  # (pid, dir) -> need id
        self._events: deque[tuple[Callable[[int, bytes], Awaitable[None]], int, bytes]] = deque()
        self._draining = False
        self._listings: dict[bytes, tuple[float, list[bytes] | None]] = {}
        self._nursery: trio.Nursery | None = None
        # a large plan's counts for stats.json: (resident bytes, bytes to fetch, each need's
        # bytes to fetch by id, when counted); see STATS_INLINE_CHUNKS
        self._summary: tuple[int, int, dict[str, int], float] | None = None
        self._summary_wanted = False

    # -- requests -----------------------------------------------------------------------------
    async def handle(self, req: dict[str, Any], caller: Caller = ROOT) -> dict[str, Any]:
        """Answer one control request (see :mod:`tierfs_hints.wire`) on behalf of ``caller``.
        Raises HintError for bad input (answered ``{"ok": false, "kind": "value"}``) and
        HintDenied for what the caller may not do (``"kind": "perm"``)."""
        op = req.get("op")
        self.requests += 1
        handler = getattr(self, f"_op_{op}", None) if isinstance(op, str) else None
        if handler is None:
            raise HintError(f"unknown op {logevents.user_text(str(op), 40)}")
        try:
            reply: dict[str, Any] = await handler(req, caller)
        except HintDenied:
            self.refused_perm += 1
            raise
        reply["ok"] = True
        return reply

    async def _op_need(self, req: dict[str, Any], caller: Caller) -> dict[str, Any]:
        items = await _validated(req.get("items"), "items", _items, self._pacer())
        deadline = _deadline(req.get("deadline_s"))
        return await self._register(items, deadline, _int(req.get("priority", 0), "priority"),
                                    _text(req.get("source", ""), "source"), _text(req.get("label", "need"), "label"),
                                    caller=caller)

    async def _op_epoch(self, req: dict[str, Any], caller: Caller) -> dict[str, Any]:
        items = await _validated(req.get("paths"), "paths", _paths, self._pacer())
        return await self._register(items, math.inf, 0, _text(req.get("source", ""), "source"), "epoch",
                                    replaces="epoch", caller=caller)

    async def _op_phase(self, req: dict[str, Any], caller: Caller) -> dict[str, Any]:
        name = _text(req.get("name"), "name")
        if not name:
            raise HintError("phase: name must not be empty")
        at = _deadline(req.get("at_s"))
        if math.isinf(at):
            raise HintError("phase: at_s is required (seconds from now)")
        items = await _validated(req.get("paths"), "paths", _paths, self._pacer())
        return await self._register(items, at, 0, _text(req.get("source", ""), "source"), name,
                                    replaces=f"phase:{name}", caller=caller)

    def _pacer(self) -> Pacer:
        return Pacer(enabled=self.pace)

    def _user_source(self, source: str, caller: Caller) -> str:
        """Sources are per user: one user's epoch order never replaces another's."""
        return source if caller.is_root else f"{caller.uid}:{source}"

    async def _resolve(self, b: _Builder, items: Sequence[str | tuple[str, int, int | None]]) -> None:
        """Resolve ``items`` into ``b`` in batches on the metadata device; raises HintDenied
        naming the first path the caller may not access (nothing of the request is done)."""
        pacer = self._pacer()
        for lo in range(0, len(items), BATCH):
            await self.meta.run(b.batch, items[lo:lo + BATCH])
            if b.denied is not None:
                raise HintDenied(f"{b.denied[0]}: {b.denied[1]}")
            if len(items) > BATCH:
                await pacer.step()

    async def _register(self, items: Sequence[str | tuple[str, int, int | None]], deadline_in: float, priority: int,
                        source: str, label: str, replaces: str | None = None,
                        caller: Caller = ROOT) -> dict[str, Any]:
        now = trio.current_time()
        source = self._user_source(source, caller)
        b = _Builder(self, caller)
        await self._resolve(b, items)
        kind = replaces if source or replaces == "epoch" else None
        left = self._volume_left(caller, self.plan.replaced_by(source, kind))
        truncated = 0
        if left is not None and b.total > left:
            if replaces != "epoch":
                raise HintDenied(self._over_share(caller, b.total, left))
            # An epoch order is a forecast, often larger than the tiers: its head (read
            # soonest) is announced up to the caller's share, instead of failing the sampler
            truncated = b.total
            await self._truncate(b, left)
            truncated -= b.total
            log.info("epoch order of uid %d cut to its first %d bytes (%d more over its share, user_hint_share=%g)",
                     caller.uid, b.total, truncated, self.user_share)
        need = Need(id=self.plan.new_id(), label=label, source=source, chunks=b.chunks, sizes=b.sizes,
                    files=b.files, deadline=now + deadline_in, priority=priority, created=now,
                    uid=caller.uid, total_bytes=b.total)
        self.plan.add(need, replaces_source_kind=kind, index=False)
        pacer = self._pacer()
        for lo in range(0, len(need.chunks), INDEX_BATCH):
            if not self.plan.index(need, lo, lo + INDEX_BATCH):
                break
            if len(need.chunks) > INDEX_BATCH:
                await pacer.step()
        self._kick.set()
        log.debug("hint %s (%s) of uid %d: %d files, %d bytes, deadline in %.1f s", need.id,
                  logevents.user_text(label, 80), caller.uid, len(b.files), need.total_bytes, deadline_in)
        reply = {"id": need.id, "bytes": need.total_bytes, "files": len(b.keys), "missing": b.missing,
                 "missing_count": len(b.missing)}
        if truncated:
            reply["truncated_bytes"] = truncated
        return reply

    def user_bound(self) -> int:
        """Bytes of live needs one non-root user may declare (``user_share`` of all tiers)."""
        return int(self.user_share * sum(t.capacity for t in self.cache.tiers))

    def _volume_left(self, caller: Caller, replaced: Need | None) -> int | None:
        """Bytes ``caller`` may still declare (None: unbounded, root)."""
        if caller.is_root:
            return None
        have = sum(n.total_bytes for n in self.plan.needs.values() if n.uid == caller.uid and n is not replaced)
        return max(0, self.user_bound() - have)

    def _over_share(self, caller: Caller, adding: int, left: int) -> str:
        bound = self.user_bound()
        return (f"prefetch volume of {bound - left + adding} bytes (this request {adding}, live needs "
                f"{bound - left}) is over the per-user bound of {bound} bytes (user_hint_share="
                f"{self.user_share:g} of the tiers); cancel or finish earlier needs")

    async def _truncate(self, b: _Builder, allowance: int) -> None:
        """Cut ``b``'s chunk lists after the longest head whose distinct chunks fit in
        ``allowance`` bytes."""
        pacer = self._pacer()
        seen: set[ChunkId] = set()
        total = 0
        cut = len(b.chunks)
        for lo in range(0, len(b.chunks), INDEX_BATCH):
            for i in range(lo, min(lo + INDEX_BATCH, len(b.chunks))):
                cid = b.chunks[i]
                if cid not in seen:
                    if total + b.sizes[i] > allowance:
                        cut = i
                        break
                    seen.add(cid)
                    total += b.sizes[i]
            else:
                await pacer.step()
                continue
            break
        del b.chunks[cut:]
        del b.sizes[cut:]
        b.files.cut(cut)
        b.keys = set(b.files.keys)
        b.total = total

    def _progress_doc(self, need: Need) -> dict[str, Any]:
        per_tier = {t.name: 0 for t in self.cache.tiers}
        per_tier["staging"] = 0
        now = trio.current_time()
        if need.shed:  # left the plan (cancelled, replaced, expired, read): a summary only
            done = need.finished_at is not None
            return {
                "id": need.id, "label": need.label, "total_bytes": need.total_bytes,
                "resident_bytes": per_tier, "remaining_bytes": 0 if done else need.total_bytes,
                "deadline_in_s": None if math.isinf(need.deadline) else need.deadline - now,
                "projected_s": None, "done": done, "missed": need.missed, "cancelled": need.cancelled,
            }
        remaining = 0
        read = {need.chunks[j] for j in range(need.cursor)} | {
            need.chunks[j] for j in range(need.cursor, len(need.chunks)) if need.consumed[j]}
        for i in need.unique():
            cid = need.chunks[i]
            entry = self.cache.catalog.entries.get(cid)
            if entry is not None:
                per_tier[self.cache.tiers[entry.tier].name] += need.sizes[i]
            elif cid not in read:  # a chunk counts as done once it was read
                remaining += need.sizes[i]
                if cid in self.cache.staging:  # fetched, on its way into a tier (or refused)
                    per_tier["staging"] += need.sizes[i]
        return {
            "id": need.id, "label": need.label, "total_bytes": need.total_bytes,
            "resident_bytes": per_tier, "remaining_bytes": remaining,
            "deadline_in_s": None if math.isinf(need.deadline) else need.deadline - now,
            "projected_s": self._projection().get(need.id),
            "done": need.finished_at is not None or remaining == 0, "missed": need.missed,
            "cancelled": need.cancelled,
        }

    def _need(self, req: dict[str, Any], caller: Caller) -> Need:
        nid = _text(req.get("id"), "id")
        need = self.plan.needs.get(nid) or self.plan.recent.get(nid)
        if need is None:
            raise HintError(f"no hint with id {logevents.user_text(nid, 40)!r} (expired long ago, or never made)")
        if not caller.is_root and need.uid != caller.uid:
            raise HintDenied(f"hint {nid} belongs to another user")
        return need

    async def _op_progress(self, req: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return self._progress_doc(self._need(req, caller))

    async def _op_wait(self, req: dict[str, Any], caller: Caller) -> dict[str, Any]:
        need = self._need(req, caller)
        timeout = _seconds(req.get("timeout", MAX_WAIT_S), "timeout")
        timed_out = True
        with trio.move_on_after(min(timeout, MAX_WAIT_S)):
            while True:
                doc = self._progress_doc(need)
                if doc["done"] or need.cancelled or (self.stalled_rounds >= 3 and not self._queued):
                    timed_out = False
                    break
                await self._progress.wait()  # after the next prefetch round (<= 0.25 s)
        doc = self._progress_doc(need)
        doc["timed_out"] = timed_out and not doc["done"]
        # The tiers take no more of the plan: full of data needed sooner (or kept free for
        # checkpoints). Waiting longer would not help until something is read or released.
        doc["stalled"] = not doc["done"] and self.stalled_rounds >= 3 and not self._queued
        return doc

    async def _op_cancel(self, req: dict[str, Any], caller: Caller) -> dict[str, Any]:
        need = self._need(req, caller)
        self.plan.cancel(need.id)
        self._kick.set()
        return {"id": need.id}

    async def _op_release(self, req: dict[str, Any], caller: Caller) -> dict[str, Any]:
        n = 0
        async for cids in self._chunks_of(await _validated(req.get("paths"), "paths", _paths, self._pacer()), caller, evict=False):
            n += self.plan.release(cids)
        return {"chunks": n}

    async def _op_evict(self, req: dict[str, Any], caller: Caller) -> dict[str, Any]:
        n = nbytes = 0
        async for cids in self._chunks_of(await _validated(req.get("paths"), "paths", _paths, self._pacer()), caller, evict=True):
            self.plan.release(cids)
            dn, db = await self.cache.evict_chunks(cids)
            n += dn
            nbytes += db
        return {"chunks": n, "bytes": nbytes}

    async def _op_checkpoint(self, req: dict[str, Any], caller: Caller) -> dict[str, Any]:
        rel = _check_rel(_text(req.get("dir"), "dir", wire.MAX_PATH_BYTES))
        nbytes = _int(req.get("nbytes"), "nbytes")
        if nbytes < 0:
            raise HintError("checkpoint: nbytes must be >= 0")
        every = _seconds(req.get("every_s"), "every_s")
        if every <= 0:
            raise HintError("checkpoint: every_s must be > 0 (seconds between checkpoints)")
        resolver = Resolver(self.tree, caller, self.mountpoint)
        try:
            await self.meta.run(resolver.existing_prefix, rel)
        except HintDenied as e:
            raise HintDenied(f"checkpoint dir {_shown(rel)}: {e}") from None
        except NotADirectoryError:
            raise HintError(f"checkpoint dir {_shown(rel)}: not a directory") from None
        tier = self.cache.tiers[self.write_tier]
        key = (caller.uid, rel)
        if not caller.is_root:
            mine = [k for k in self._checkpoints if k[0] == caller.uid and k != key]
            if nbytes and len(mine) >= MAX_CHECKPOINT_DIRS:
                raise HintDenied(f"checkpoint: at most {MAX_CHECKPOINT_DIRS} checkpoint directories per user")
            have = sum(self._checkpoints[k] for k in mine)
            bound = int(self.user_share * tier.capacity)
            if have + nbytes > bound:
                raise HintDenied(f"checkpoint reservation of {have + nbytes} bytes (this dir {nbytes}, others "
                                 f"{have}) is over the per-user bound of {bound} bytes (user_hint_share="
                                 f"{self.user_share:g} of the {tier.name} tier's {tier.capacity})")
        if nbytes:
            self._checkpoints[key] = nbytes
        else:
            self._checkpoints.pop(key, None)
        want = sum(self._checkpoints.values())
        await self.cache.keep_free(self.write_tier, want)
        logevents.event(log, logging.INFO, f"checkpoint-hint:{caller.uid}",
                        "checkpoint hint: %s gets %d bytes of %s tier room (every %.0f s, uid %d); %d kept free in all",
                        logevents.user_text(rel) or "/", nbytes, tier.name, every, caller.uid, tier.keep_free)
        return {"reserved_bytes": tier.keep_free, "tier": tier.name, "capacity_bytes": tier.capacity}

    async def _op_where(self, req: dict[str, Any], caller: Caller) -> dict[str, Any]:
        paths = await _validated(req.get("paths"), "paths", _paths, self._pacer())
        b = _Builder(self, caller, plan=False)
        await self._resolve(b, paths)
        files = EncodedList()
        pacer = self._pacer()
        for lo in range(0, len(paths), BATCH):
            if lo:
                await pacer.step()  # residency_of looks at the staging area: keep slices short
            batch: list[dict[str, Any]] = []
            for rel, res in zip(paths[lo:lo + BATCH], b.resolved[lo:lo + BATCH], strict=True):
                if res is None:
                    batch.append({"path": rel, "missing": True})
                    continue
                canon, key, size = res
                batch.append({"path": rel, "size": size,
                              "resident_bytes": self.cache.residency_of(key, size),
                              "dirty_bytes": self.dirty_bytes(canon)})
            files.append(json.dumps(batch)[1:-1])
        await free_in_slices([b.resolved, paths], pacer)
        return {"files": files}

    async def _chunks_of(self, paths: list[str], caller: Caller, *, evict: bool) -> AsyncIterator[list[ChunkId]]:
        """The chunk ids of ``paths``' whole files, in slices (a checkpoint between them);
        every path is resolved (and checked) before the first slice is yielded."""
        b = _Builder(self, caller, plan=False, evict=evict)
        await self._resolve(b, paths)
        pacer = self._pacer()
        for lo in range(0, len(b.resolved), BATCH):
            cids: list[ChunkId] = []
            for res in b.resolved[lo:lo + BATCH]:
                if res is not None:
                    _, key, size = res
                    cids.extend((key, i) for i in chunk_ranges(size, 0, None, self.chunk_size))
            yield cids
            await pacer.step()

    # -- the prefetcher -----------------------------------------------------------------------
    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await self._loop()

    async def _loop(self) -> None:
        while True:
            with trio.move_on_after(0.25):
                await self._kick.wait()
            self._kick = trio.Event()
            try:
                self._check_deadlines()
                await self.prefetch_round()
                if self._summary_wanted:
                    self._summary_wanted = False
                    await self._count_summary()
                if self.plan.sweeping:  # occurrences of removed needs, in slices
                    pacer = self._pacer()
                    while self.plan.sweep(INDEX_BATCH):
                        await pacer.step()
            except Exception:  # noqa: BLE001 - a hint must never take the daemon down
                log.exception("hint prefetch round failed")
            progress, self._progress = self._progress, trio.Event()
            progress.set()

    def kick(self) -> None:
        self._kick.set()

    # -- next-file prediction (no hints) ----------------------------------------------------------
    def file_opened(self, pid: int, rel: bytes) -> None:
        """Operations callback (must not block): learn; cancel a wrong prediction. Learned
        now when nothing is queued before it and its directory's listing is at hand (the
        open of nearly every file of an epoch): a task per open cost ~6% of the event loop's
        samples in an epoch over resident files, plus the task's start and end (py-spy)."""
        if not self._draining and not self._events and self.predict_bytes and self._nursery is not None:
            d = os.path.dirname(rel)
            cached = self._listings.get(d)
            if cached is not None and trio.current_time() - cached[0] < LISTING_TTL_S:
                self._learn_opened(pid, rel, d, cached[1])
                return
        self._event(self._opened, pid, rel)

    def file_read_end(self, pid: int, rel: bytes) -> None:
        """Operations callback: ``pid``'s readahead reached the end of ``rel``. Nothing while
        the predictor is quiet (it would predict nothing): an event per file, a fifth of
        the next-file work in a shuffled epoch of resident files (about 2% of the event
        loop's samples, py-spy; too little to show in files/s on this 2-core machine)."""
        if self.predictor.confident():
            self._event(self._predict, pid, rel)

    def _event(self, fn: Callable[[int, bytes], Awaitable[None]], pid: int, rel: bytes) -> None:
        """Opens and read ends reach the predictor in the order the requests came, through one
        task: learned and predicted in tasks of their own, a read end answered just before
        the next open could be predicted after that open was learned, and name the file just
        opened (a wrong guess; seen under load). Bounded: past MAX_EVENTS queued, dropped."""
        if not self.predict_bytes or self._nursery is None:
            return
        if len(self._events) >= MAX_EVENTS:
            return
        self._events.append((fn, pid, rel))
        if not self._draining:
            self._draining = True
            tasks.spawn(self._nursery, "hints.next_file", self._drain)

    async def _drain(self) -> None:
        try:
            while self._events:
                fn, pid, rel = self._events.popleft()
                await fn(pid, rel)
        finally:
            self._draining = False

    async def _listing(self, d: bytes) -> list[bytes] | None:
        """The sorted names of directory ``d`` (kept ``LISTING_TTL_S``), or None: unreadable,
        or larger than ``MAX_LISTING`` (kept too: it was listed again at every open)."""
        now = trio.current_time()
        cached = self._listings.get(d)
        if cached is not None and now - cached[0] < LISTING_TTL_S:
            return cached[1]
        try:
            names: list[bytes] = await self.meta.run(self.tree.listdir, d)
        except OSError:
            return None
        # larger: name-order prediction is not worth sorting this on every refresh
        listing = sorted(names) if len(names) <= MAX_LISTING else None
        if len(self._listings) > 1024:
            self._listings.clear()
        self._listings[d] = (now, listing)
        return listing

    async def _opened(self, pid: int, rel: bytes) -> None:
        d = os.path.dirname(rel)
        self._learn_opened(pid, rel, d, await self._listing(d))

    def _learn_opened(self, pid: int, rel: bytes, d: bytes, listing: list[bytes] | None) -> None:
        wrong = self.predictor.opened(pid, rel, listing)
        nid = self._predicted.pop((pid, d), None)
        if wrong is not None and nid is not None:
            self.plan.cancel(nid)

    async def _predict(self, pid: int, rel: bytes) -> None:
        d = os.path.dirname(rel)
        nxt = self.predictor.predict(pid, rel, await self._listing(d))
        if nxt is None:
            return
        try:
            st: os.stat_result | None = await self.meta.run(self.tree.lstat, nxt)
        except OSError:  # gone, or a symlink on the way: the need's own resolution will say
            st = None
        if self._in_tier_now(nxt, st):
            # Nothing to fetch, and nothing will be evicted soon: a need would only cost the
            # loop its registration and the prefetch rounds it kicks, 21% of the loop's samples
            # (py-spy) in a pass in name order over 8,000 resident files. (Under eviction
            # pressure the need is registered as before: it keeps the file from eviction until
            # it is read; without it the simulator's train-eval run missed a deadline.)
            self.predictions_resident += 1
            return
        if len(self._predicted) > 4096:
            self._predicted.clear()
        try:
            reply = await self._register([(os.fsdecode(nxt), 0, self.predict_bytes)], math.inf, -1,
                                         f"predict:{pid}:{os.fsdecode(d)}", "predicted", replaces="predicted")
        except (HintError, HintDenied):
            return
        self._predicted[(pid, d)] = reply["id"]

    def _in_tier_now(self, rel: bytes, st: os.stat_result | None) -> bool:
        """Whether the part of backing file ``rel`` (as ``st``, its ``lstat`` now) that a
        prediction asks for (``predict_bytes`` from its start) is in tiers with at least
        1/ROOM_FRACTION of their capacity free (no eviction soon)."""
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return False
        key = Identity.of(key_path(self.tree.root, rel), st).key
        entries = self.cache.catalog.entries
        tiers = self.cache.tiers
        for i in chunk_ranges(st.st_size, 0, self.predict_bytes, self.chunk_size):
            e = entries.get((key, i))
            if e is None:
                return False
            t = tiers[e.tier]
            if t.cache_room() < t.effective_capacity // ROOM_FRACTION:
                return False  # eviction is near: the need keeps the file from it
        return True

    def _check_deadlines(self) -> None:
        now = trio.current_time()
        for need in self.plan.check_deadlines(now, self.cache.in_tier):
            left = self.plan.remaining(need, self.cache.in_tier)
            log.warning("hint %s (%s) missed its deadline: %d of %d bytes not resident", need.id,
                        logevents.user_text(need.label, 80), left, need.total_bytes)
        proj = self._projection()
        for need in self.plan.needs.values():
            p = proj.get(need.id)
            if p is not None and not need.at_risk and not need.missed and not math.isinf(need.deadline) \
                    and need.finished_at is None and now + p > need.deadline:
                need.at_risk = True
                log.warning("hint %s (%s) is projected to miss its deadline by %.1f s (%.1f s to go)",
                            need.id, logevents.user_text(need.label, 80), now + p - need.deadline, need.deadline - now)

    def _rate(self) -> float:
        st = self.scheduler.statistics()
        if st.backing_reads >= 2 and st.busy_seconds > 0:
            return st.backing_bytes_read / st.busy_seconds
        return FALLBACK_RATE

    def _projection(self) -> dict[str, float]:
        """Seconds from now until each need with a deadline is resident, if the backing store
        serves the needs in EDF order at its measured rate."""
        rate = self._rate()
        ahead = 0
        out: dict[str, float] = {}
        for need in self.plan.by_rank():
            if math.isinf(need.deadline):
                break  # the rest have none either (by_rank: deadline first): nothing to project
            if need.finished_at is not None:
                continue
            ahead += self.plan.remaining(need, self.cache.in_tier)
            out[need.id] = ahead / rate
        return out

    async def prefetch_round(self) -> int:
        """Queue the next planned chunks (see the module docstring). Returns how many."""
        for cid in [c for c, r in self._queued.items() if r.state is ReqState.DONE or r.done.is_set()]:
            del self._queued[cid]
        queued_bytes = len(self._queued) * self.chunk_size
        now = trio.current_time()
        if now - self._last_rescan > RESCAN_S:
            self._scan.clear()
            self._last_rescan = now
        submitted = 0
        blocked = False
        pacer = self._pacer() if self.pace else None
        walked = 0
        # Needs in rank order: by (deadline, -priority) groups; inside a group, interleaved by
        # each chunk's distance from its need's read position (Need.rank).
        groups: dict[tuple[float, int], list[Need]] = {}
        for need in self.plan.by_rank():
            groups.setdefault((need.deadline, -need.priority), []).append(need)
        for key in sorted(groups):
            heap: list[tuple[int, int, int, Need]] = []
            for need in groups[key]:
                start = max(need.cursor, self._scan.get(need.id, 0))
                heapq.heappush(heap, (start - need.cursor, need.seq, start, need))
            first_absent: dict[str, int] = {}
            stop = False
            while heap and not stop:
                _, seq, i, need = heapq.heappop(heap)
                n = len(need.chunks)
                gone = False
                while i < n:  # skip what is read or present, then fetch one chunk
                    walked += 1
                    if self.pace and walked % INDEX_BATCH == 0:
                        # a rescan over a plan of 200 000 present chunks held the loop ~25 ms
                        assert pacer is not None
                        await pacer.step()
                        gone = need.removed  # left the plan meanwhile: its lists may be freed
                        if gone:
                            break
                    if need.consumed[i]:
                        i += 1
                        continue
                    cid = need.chunks[i]
                    if self.cache.is_present(cid) or cid[0] in self._bad_keys:
                        staged = self.cache.staging.get(cid)
                        if staged is not None and not staged.placing and not self.cache.in_tier(cid):
                            blocked = True  # fetched, but no tier took it: the tiers are full
                        i += 1
                        continue
                    first_absent.setdefault(need.id, i)
                    if queued_bytes >= self.budget:
                        stop = True
                        break
                    size = need.sizes[i]
                    if not self.cache.can_admit(cid, size, ahead=queued_bytes):
                        stop = blocked = True
                        break
                    deadline = need.deadline
                    # (an await: the need may leave the plan meanwhile and free its lists, so
                    # nothing of it is indexed after this)
                    f = await self._file(need.file_of(i))
                    if f is not None:
                        self._queued[cid] = self.scheduler.submit(f, cid[1], Klass.DEADLINE, deadline)
                        queued_bytes += size
                        self.prefetched_bytes += size
                        submitted += 1
                    i += 1
                    break
                if gone:
                    continue
                if stop or i >= n:
                    self._scan[need.id] = first_absent.get(need.id, i)
                else:
                    heapq.heappush(heap, (i - need.cursor, seq, i, need))
            for _, _, i, need in heap:
                self._scan[need.id] = first_absent.get(need.id, i)
            if stop:
                break
        self.stalled_rounds = self.stalled_rounds + 1 if blocked and not self._queued else 0
        self._close_idle_files()
        return submitted

    def _bad(self, key: str) -> None:
        if len(self._bad_keys) >= MAX_BAD_KEYS:
            self._bad_keys.clear()
        self._bad_keys.add(key)

    def held_at(self, rel: bytes) -> BackingFile | None:
        """The backing file a prefetch holds open at path ``rel`` (as it was when opened: the
        caller checks the identity), or None."""
        key = self._key_at.get(rel)
        return self.open_file(key) if key is not None else None

    def _hold(self, rel: bytes, f: BackingFile) -> None:
        self._files[f.key] = f
        self._key_at[rel] = f.key
        self._path_of[f.key] = rel

    def _drop(self, f: BackingFile) -> None:
        """Release a file the prefetcher held (and forget where it was)."""
        rel = self._path_of.pop(f.key, None)
        if rel is not None and self._key_at.get(rel) == f.key:
            del self._key_at[rel]
        f.release()

    def open_file(self, key: str) -> BackingFile | None:
        """The backing file of identity ``key`` if a prefetch holds it open now (an open of
        the same file shares it instead of opening it again)."""
        f = self._files.get(key)
        if f is None:
            f = self._handoff[key][1] if key in self._handoff else None
        return f if f is not None and f.fd >= 0 else None

    async def _file(self, pf: PlannedFile) -> BackingFile | None:
        f = self._files.get(pf.key)
        if f is not None and f.fd >= 0:
            return f
        if pf.key in self._handoff:
            f = self._handoff.pop(pf.key)[1]
            if f.fd >= 0:
                self._files[pf.key] = f
                return f
            self._drop(f)
        await self.openings.wait(pf.path)  # a reader opening it: share what it opens
        if self.find_open is not None:  # a reader has it open: share its descriptor
            f = self.find_open(pf.key)
            if f is not None and f.fd >= 0 and not f.stale:
                f.acquire()
                self._hold(pf.path, f)
                return f
        opening = self.openings.begin(pf.path)
        try:
            fd, st = await self.meta.run(_open_regular, self.tree, pf.path)
        except OSError as e:
            log.info("hinted file %s cannot be opened (%s); skipped", logevents.user_text(pf.path),
                     e.strerror)
            self._bad(pf.key)
            return None
        finally:
            self.openings.end(pf.path, opening)
        identity = Identity.of(key_path(self.tree.root, pf.path), st)
        if identity.key != pf.key:
            os.close(fd)
            log.info("hinted file %s changed since the hint; skipped", logevents.user_text(pf.path))
            self._bad(pf.key)
            return None
        f = BackingFile(identity, fd)
        f.acquire()
        self._hold(pf.path, f)
        return f

    def _close_idle_files(self) -> None:
        """Files no queued chunk needs any more are not closed at once: the reader the prefetch
        was for opens them soon, and shares the descriptor (one open(2) per file, not two).
        They wait in a handoff list of at most ``HANDOFF_MAX`` files for ``HANDOFF_S``; one a
        reader has opened leaves it (the reader's reference keeps it open)."""
        busy = {cid[0] for cid in self._queued}
        now = trio.current_time()
        for key in [k for k in self._files if k not in busy]:
            f = self._files.pop(key)
            old = self._handoff.pop(key, None)
            if old is not None and old[1] is not f:
                old[1].release()  # (same key: the index stays with f)
            self._handoff[key] = (now, f)
        for key in list(self._handoff):
            t, f = self._handoff[key]
            if f.opens > 0 or f.fd < 0 or now - t > HANDOFF_S or len(self._handoff) > HANDOFF_MAX:
                del self._handoff[key]
                self._drop(f)

    def close(self) -> None:
        for f in self._files.values():
            f.release()
        self._files.clear()
        for _, f in self._handoff.values():
            f.release()
        self._handoff.clear()
        self._key_at.clear()
        self._path_of.clear()
        if self._own_tree:
            self.tree.close()

    # -- stats ----------------------------------------------------------------------------------
    async def _count_summary(self) -> None:
        """Count every need's resident and remaining bytes as :meth:`statistics` does inline,
        in paced slices (the plan may change meanwhile: the counts are a moment's estimate)."""
        in_tier = self.cache.in_tier
        pacer = self._pacer()
        resident = to_fetch = 0
        lefts: dict[str, int] = {}
        for need in self.plan.by_rank():
            seen: set[ChunkId] = set()
            counted: set[ChunkId] = set()
            left = 0
            chunks, sizes, consumed = need.chunks, need.sizes, need.consumed
            for start in range(0, len(chunks), INDEX_BATCH):
                cursor = need.cursor
                for i in range(start, min(len(chunks), start + INDEX_BATCH)):
                    cid = chunks[i]
                    here = in_tier(cid)
                    if cid not in seen:
                        seen.add(cid)
                        if here:
                            resident += sizes[i]
                    if i >= cursor and not consumed[i] and not here and cid not in counted:
                        counted.add(cid)
                        left += sizes[i]
                await pacer.step()
            lefts[need.id] = left
            to_fetch += left
        self._summary = (resident, to_fetch, lefts, trio.current_time())

    def _counts(self) -> tuple[int, int, dict[str, int], float | None]:
        """(resident bytes, bytes to fetch, each need's bytes to fetch, the count's age in
        seconds): counted now (age 0) for a plan of at most STATS_INLINE_CHUNKS occurrences,
        else the loop's last count, a new one asked for when it is older than
        SUMMARY_MAX_AGE_S (zeros and age None until the first)."""
        if sum(len(n.chunks) for n in self.plan.needs.values()) > STATS_INLINE_CHUNKS:
            now = trio.current_time()
            if self._summary is None or now - self._summary[3] > SUMMARY_MAX_AGE_S:
                self._summary_wanted = True
                self.kick()
            if self._summary is None:
                return 0, 0, {}, None
            resident, to_fetch, lefts, at = self._summary
            return resident, to_fetch, lefts, now - at
        resident = to_fetch = 0
        lefts = {}
        for need in self.plan.needs.values():
            lefts[need.id] = left = self.plan.remaining(need, self.cache.in_tier)
            to_fetch += left
            resident += sum(need.sizes[i] for i in need.unique() if self.cache.in_tier(need.chunks[i]))
        return resident, to_fetch, lefts, 0.0

    def statistics(self) -> dict[str, Any]:
        ps = asdict(self.plan.statistics())
        proj = self._projection()
        now = trio.current_time()
        resident, to_fetch, lefts, age = self._counts()
        pending: list[dict[str, Any]] = []
        for need in self.plan.by_rank():
            left = lefts.get(need.id, 0)
            if not math.isinf(need.deadline) and need.finished_at is None and len(pending) < 20:
                p = proj.get(need.id, 0.0)
                pending.append({"id": need.id, "label": need.label, "deadline_in_s": need.deadline - now,
                                "projected_s": p, "slack_s": need.deadline - now - p,
                                "remaining_bytes": left, "missed": need.missed})
        ps.update({"resident_bytes": resident, "to_fetch_bytes": to_fetch, "counts_age_s": age,
                   "prefetched_bytes": self.prefetched_bytes,
                   "queued_chunks": len(self._queued), "pending_deadlines": pending,
                   "write_tier_kept_free_bytes": self.cache.tiers[self.write_tier].keep_free,
                   "next_file_predictions": {"right": self.predictor.hits, "wrong": self.predictor.misses,
                                             "active": self.predictor.confident(),
                                             "already_resident": self.predictions_resident},
                   "requests": self.requests, "refused_perm": self.refused_perm})
        return ps


class _Builder:
    """One request's paths, resolved for its caller in batches (:meth:`batch` blocks: it runs
    on the metadata device) and, for a need, turned into chunk lists as they come, so that
    no step holds the event loop for long. ``denied``: the first path refused, if any (the
    request is then refused as a whole); ``missing``: paths that do not exist or are not
    regular files, as sent."""

    def __init__(self, svc: HintService, caller: Caller, *, plan: bool = True, evict: bool = False) -> None:
        self.resolver = Resolver(svc.tree, caller, svc.mountpoint)
        self.caller = caller
        self.root = svc.tree.root
        self.chunk_size = svc.chunk_size
        self.plan = plan
        self.evict = evict
        self.chunks: list[ChunkId] = []
        self.sizes = array("q")
        self.files = FileTable()
        self.keys: set[str] = set()
        self._seen: set[ChunkId] = set()
        self.total = 0
        self.missing: list[str] = []
        # (canon, identity key, size) per path when not planning; no stat result kept: a
        # tuple holding one is tracked by the garbage collector for good, and 500,000 of them
        # made each full collection during a `where` hold the loop 250-580 ms (2-core VM)
        self.resolved: list[tuple[bytes, str, int] | None] = []
        self.denied: tuple[str, str] | None = None

    def batch(self, items: Sequence[str | tuple[str, int, int | None]]) -> None:
        if self.denied is not None:
            return
        caller = self.caller
        for item in items:
            rel, offset, length = (item, 0, None) if isinstance(item, str) else item
            try:
                canon, st = self.resolver.file(_check_rel(rel), 0 if self.evict else R_OK)
                if self.evict and not (caller.owns(st) or caller.may(st, W_OK)):
                    raise HintDenied("neither owned nor writable by the caller: others' cached data stays")
                if not stat.S_ISREG(st.st_mode):
                    raise FileNotFoundError(rel)
            except HintDenied as e:
                self.denied = (_shown(rel), str(e))
                return
            except OSError:  # missing, not a directory on the way, not a regular file
                self.missing.append(rel)
                if not self.plan:
                    self.resolved.append(None)
                continue
            key = Identity.of(key_path(self.root, canon), st).key
            if not self.plan:
                self.resolved.append((canon, key, st.st_size))
                continue
            idxs = chunk_ranges(st.st_size, offset, length, self.chunk_size)
            if not idxs:
                continue
            self.keys.add(key)
            self.files.add(canon, key, st.st_size, len(self.chunks), len(idxs))
            for idx in idxs:
                cid = (key, idx)
                size = chunk_bytes(st.st_size, idx, self.chunk_size)
                self.chunks.append(cid)
                self.sizes.append(size)
                if cid not in self._seen:
                    self._seen.add(cid)
                    self.total += size


def _open_regular(tree: BackingTree, rel: bytes) -> tuple[int, os.stat_result]:
    """(blocking) Open a planned file read-only through the tree: ``(fd, stat)``. Non-blocking
    open (a FIFO swapped in never blocks a metadata thread); anything but a regular file is
    refused (OSError EINVAL)."""
    fd = tree.open(rel, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", rel)
        return fd, st
    except BaseException:
        os.close(fd)
        raise


# -- validation of request fields (the client validates too; the daemon trusts nothing) -------
def _shown(rel: str | bytes) -> str:
    """A request path as an error message or log line shows it: escaped and truncated."""
    return repr(logevents.user_text(rel))


def _check_rel(rel: str) -> bytes:
    """A request path as a normalised relative path (see :func:`tierfs.access.normalize`).
    Raises HintError (naming the path, escaped) for an absolute path or one leading out."""
    if len(rel) > wire.MAX_PATH_BYTES:
        raise HintError(f"path {_shown(rel)} is longer than MAX_PATH_BYTES ({wire.MAX_PATH_BYTES})")
    try:
        return normalize(rel)
    except HintError as e:
        raise HintError(f"{_shown(rel)}: {e}") from None


def _text(v: object, name: str, limit: int = wire.MAX_TEXT) -> str:
    if not isinstance(v, str):
        raise HintError(f"{name} must be a string, got {type(v).__name__}")
    if "\0" in v:
        raise HintError(f"{name} must not contain NUL")
    if len(v) > limit:
        raise HintError(f"{name} is longer than {limit} characters "
                        f"({'MAX_PATH_BYTES' if limit == wire.MAX_PATH_BYTES else 'MAX_TEXT'})")
    return v


def _int(v: object, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise HintError(f"{name} must be an integer, got {logevents.user_text(repr(v), 40)}")
    if not -(1 << 63) <= v < (1 << 63):
        raise HintError(f"{name} is out of range (64-bit)")
    return v


def _seconds(v: object, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
        raise HintError(f"{name} must be a number of seconds >= 0, got {logevents.user_text(repr(v), 40)}")
    return float(v)


def _deadline(v: object) -> float:
    if v is None:
        return math.inf
    s = _seconds(v, "deadline")
    return s


def _count(v: list, name: str) -> None:  # type: ignore[type-arg]
    if len(v) > wire.MAX_ITEMS:
        raise HintError(f"{name}: {len(v)} entries is over MAX_ITEMS ({wire.MAX_ITEMS}) per request; "
                        "send fewer per request")


VALIDATE_BATCH = 1024  # request entries checked between two chances to pause (~0.5 ms)


async def _validated(v: object, name: str, check: Callable[[list], list],  # type: ignore[type-arg]
                     pacer: Pacer | None = None) -> list:  # type: ignore[type-arg]
    """``check`` applied to the list ``v`` in slices, with a checkpoint between them (500 000
    entries checked at once hold the event loop ~0.3 s). Raises HintError."""
    if not isinstance(v, list):
        raise HintError(f"{name} must be a list" + (" of [path, offset, length]" if name == "items" else
                                                     " of relative paths"))
    _count(v, name)
    if len(v) <= VALIDATE_BATCH:
        return check(v)
    out: list = []  # type: ignore[type-arg]
    pacer = pacer or Pacer()
    for lo in range(0, len(v), VALIDATE_BATCH):
        out.extend(check(v[lo:lo + VALIDATE_BATCH]))
        await pacer.step()
    return out


def _paths(v: list) -> list[str]:  # type: ignore[type-arg]
    return [_text(p, "path", wire.MAX_PATH_BYTES) for p in v]


def _items(v: list) -> list[tuple[str, int, int | None]]:  # type: ignore[type-arg]
    out: list[tuple[str, int, int | None]] = []
    for it in v:
        if isinstance(it, str):
            out.append((_text(it, "path", wire.MAX_PATH_BYTES), 0, None))
            continue
        if not isinstance(it, (list, tuple)) or len(it) != 3:
            raise HintError(f"item {logevents.user_text(repr(it), 80)}: expected [path, offset, length]")
        path, offset, length = it
        path = _text(path, "path", wire.MAX_PATH_BYTES)
        offset = _int(offset, "offset")
        if offset < 0:
            raise HintError(f"item {_shown(path)}: offset must be >= 0")
        if length is not None:
            length = _int(length, "length")
            if length <= 0:
                raise HintError(f"item {_shown(path)}: length must be > 0")
        out.append((path, offset, length))
    return out


# for the control commands (tierfs.fs.ctl), which validate flush requests the same way
check_rel = _check_rel
seconds = _seconds


async def request_paths(v: object) -> list[str]:
    """A request's ``paths`` field, validated (see :func:`_validated`). Raises HintError."""
    return await _validated(v, "paths", _paths)
