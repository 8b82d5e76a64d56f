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
leave the backing store are refused (:class:`~tierfs.errors.HintError`).
"""

from __future__ import annotations

import heapq
import logging
import math
import os
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import trio

from tierfs.cache.manager import Cache
from tierfs.cache.plan import ChunkId, HintPlan, Need, PlannedFile, chunk_bytes, chunk_ranges
from tierfs.errors import HintError
from tierfs.io import Device, open_backing
from tierfs.predict.nextfile import NextFilePredictor
from tierfs.sched.backing import BackingFile, Identity
from tierfs.sched.scheduler import FetchRequest, Klass, ReqState, TransactionScheduler

log = logging.getLogger("tierfs.hints")
# One "wait" request blocks at most this long; clients loop. A process blocked in a FUSE
# request cannot be interrupted by Ctrl-C (pyfuse3 does not handle FUSE_INTERRUPT), so keep it short.
MAX_WAIT_S = 10.0
FALLBACK_RATE = 100e6  # bytes/s assumed for projections before any backing read was measured
RESCAN_S = 2.0  # full rescans of the timeline (evicted planned chunks are fetched again)
LISTING_TTL_S = 30.0  # directory listings kept for next-file prediction
MAX_LISTING = 200_000  # larger directories: successor prediction only


class HintService:
    """Args:
        cache: its ``plan`` must be set (``Policy(plan=...)``).
        backing_root: the backing store's directory (bytes).
        meta: the device for backing-store metadata calls (stat, open).
        write_tier: index of the write tier (for checkpoint room). budget: bytes of prefetch
        queued at once. clock: seconds (trio's clock, so the simulator can run it mocked).
    """

    def __init__(self, *, cache: Cache, scheduler: TransactionScheduler, backing_root: bytes,
                 meta: Device, chunk_size: int, write_tier: int, budget: int,
                 dirty_bytes: Callable[[bytes], int] | None = None, predict_bytes: int = 0) -> None:
        assert cache.plan is not None
        self.cache = cache
        self.plan: HintPlan = cache.plan
        self.scheduler = scheduler
        self.root = backing_root.rstrip(b"/") or b"/"
        self._real_root = os.path.realpath(self.root)
        self.meta = meta
        self.chunk_size = chunk_size
        self.write_tier = write_tier
        self.budget = budget
        self.dirty_bytes = dirty_bytes or (lambda rel: 0)
        self._queued: dict[ChunkId, FetchRequest] = {}
        self._files: dict[str, BackingFile] = {}
        self._bad_keys: set[str] = set()
        self._kick = trio.Event()
        self._progress = trio.Event()
        self._scan: dict[str, int] = {}  # need id -> first index not known present
        self._last_rescan = -math.inf
        self._checkpoints: dict[bytes, int] = {}
        self.prefetched_bytes = 0
        self.requests = 0
        self.stalled_rounds = 0  # rounds in a row where no tier admitted the next planned chunk
        self.predictor = NextFilePredictor()
        self.predict_bytes = predict_bytes  # 0: no next-file prediction
        self._predicted: dict[tuple[int, bytes], str] = {}  # (pid, dir) -> need id
        self._listings: dict[bytes, tuple[float, list[bytes]]] = {}
        self._nursery: trio.Nursery | None = None

    # -- requests -----------------------------------------------------------------------------
    async def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        """Answer one control request (see :mod:`tierfs_hints.wire`). Raises HintError for
        bad input (the caller answers ``{"ok": false, "kind": "value"}``)."""
        op = req.get("op")
        self.requests += 1
        handler = getattr(self, f"_op_{op}", None) if isinstance(op, str) else None
        if handler is None:
            raise HintError(f"unknown op {op!r}")
        reply: dict[str, Any] = await handler(req)
        reply["ok"] = True
        return reply

    async def _op_need(self, req: dict[str, Any]) -> dict[str, Any]:
        items = _items(req.get("items"))
        deadline = _deadline(req.get("deadline_s"))
        return await self._register(items, deadline, _int(req.get("priority", 0), "priority"),
                                    _str(req.get("source", ""), "source"), _str(req.get("label", "need"), "label"))

    async def _op_epoch(self, req: dict[str, Any]) -> dict[str, Any]:
        items = [(p, 0, None) for p in _paths(req.get("paths"))]
        return await self._register(items, math.inf, 0, _str(req.get("source", ""), "source"), "epoch",
                                    replaces="epoch")

    async def _op_phase(self, req: dict[str, Any]) -> dict[str, Any]:
        name = _str(req.get("name"), "name")
        if not name:
            raise HintError("phase: name must not be empty")
        at = _deadline(req.get("at_s"))
        if math.isinf(at):
            raise HintError("phase: at_s is required (seconds from now)")
        items = [(p, 0, None) for p in _paths(req.get("paths"))]
        return await self._register(items, at, 0, _str(req.get("source", ""), "source"), name,
                                    replaces=f"phase:{name}")

    async def _register(self, items: Sequence[tuple[str, int, int | None]], deadline_in: float, priority: int,
                        source: str, label: str, replaces: str | None = None) -> dict[str, Any]:
        resolved, missing = await self.meta.run(self._resolve, [i[0] for i in items])
        chunks: list[ChunkId] = []
        sizes = array("q")
        files: list[PlannedFile] = []
        for (_rel, offset, length), res in zip(items, resolved, strict=True):
            if res is None:
                continue
            abs_path, st = res
            key = Identity.of(os.fsdecode(abs_path), st).key
            idxs = chunk_ranges(st.st_size, offset, length, self.chunk_size)
            if not idxs:
                continue
            files.append(PlannedFile(abs_path, key, st.st_size, len(chunks), len(idxs)))
            for idx in idxs:
                chunks.append((key, idx))
                sizes.append(chunk_bytes(st.st_size, idx, self.chunk_size))
        now = trio.current_time()
        need = Need(id=self.plan.new_id(), label=label, source=source, chunks=chunks, sizes=sizes,
                    files=files, deadline=now + deadline_in, priority=priority, created=now)
        self.plan.add(need, replaces_source_kind=replaces if source or replaces == "epoch" else None)
        self._kick.set()
        log.debug("hint %s (%s): %d files, %d bytes, deadline in %.1f s", need.id, label, len(files),
                  need.total_bytes, deadline_in)
        return {"id": need.id, "bytes": need.total_bytes, "files": len({f.key for f in files}), "missing": missing,
                "missing_count": len(missing)}

    def _progress_doc(self, need: Need) -> dict[str, Any]:
        per_tier = {t.name: 0 for t in self.cache.tiers}
        per_tier["staging"] = 0
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
        now = trio.current_time()
        return {
            "id": need.id, "label": need.label, "total_bytes": need.total_bytes,
            "resident_bytes": per_tier, "remaining_bytes": remaining,
            "deadline_in_s": None if math.isinf(need.deadline) else need.deadline - now,
            "projected_s": self._projection().get(need.id),
            "done": need.finished_at is not None or remaining == 0, "missed": need.missed,
            "cancelled": need.cancelled,
        }

    def _need(self, req: dict[str, Any]) -> Need:
        nid = _str(req.get("id"), "id")
        need = self.plan.needs.get(nid) or self.plan.recent.get(nid)
        if need is None:
            raise HintError(f"no hint with id {nid!r} (expired long ago, or never made)")
        return need

    async def _op_progress(self, req: dict[str, Any]) -> dict[str, Any]:
        return self._progress_doc(self._need(req))

    async def _op_wait(self, req: dict[str, Any]) -> dict[str, Any]:
        need = self._need(req)
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

    async def _op_cancel(self, req: dict[str, Any]) -> dict[str, Any]:
        need = self._need(req)
        self.plan.cancel(need.id)
        self._kick.set()
        return {"id": need.id}

    async def _op_release(self, req: dict[str, Any]) -> dict[str, Any]:
        cids = await self._chunks_of(_paths(req.get("paths")))
        n = self.plan.release(cids)
        return {"chunks": n}

    async def _op_evict(self, req: dict[str, Any]) -> dict[str, Any]:
        cids = await self._chunks_of(_paths(req.get("paths")))
        self.plan.release(cids)
        n, nbytes = await self.cache.evict_chunks(cids)
        return {"chunks": n, "bytes": nbytes}

    async def _op_checkpoint(self, req: dict[str, Any]) -> dict[str, Any]:
        rel = self._check_rel(_str(req.get("dir"), "dir"))
        nbytes = _int(req.get("nbytes"), "nbytes")
        if nbytes < 0:
            raise HintError("checkpoint: nbytes must be >= 0")
        every = _seconds(req.get("every_s"), "every_s")
        if every <= 0:
            raise HintError("checkpoint: every_s must be > 0 (seconds between checkpoints)")
        self._checkpoints[rel] = nbytes
        want = sum(self._checkpoints.values())
        tier = self.cache.tiers[self.write_tier]
        await self.cache.keep_free(self.write_tier, want)
        log.info("checkpoint hint: %s gets %d bytes of %s tier room (every %.0f s); %d kept free in all",
                 os.fsdecode(rel) or "/", nbytes, tier.name, every, tier.keep_free)
        return {"reserved_bytes": tier.keep_free, "tier": tier.name, "capacity_bytes": tier.capacity}

    async def _op_where(self, req: dict[str, Any]) -> dict[str, Any]:
        paths = _paths(req.get("paths"))
        resolved, _ = await self.meta.run(self._resolve, paths)
        files = []
        for rel, res in zip(paths, resolved, strict=True):
            if res is None:
                files.append({"path": rel, "missing": True})
                continue
            abs_path, st = res
            key = Identity.of(os.fsdecode(abs_path), st).key
            files.append({"path": rel, "size": st.st_size, "resident_bytes": self.cache.residency_of(key, st.st_size),
                          "dirty_bytes": self.dirty_bytes(self._check_rel(rel))})
        return {"files": files}

    async def _chunks_of(self, paths: list[str]) -> list[ChunkId]:
        resolved, _ = await self.meta.run(self._resolve, paths)
        cids: list[ChunkId] = []
        for res in resolved:
            if res is not None:
                abs_path, st = res
                key = Identity.of(os.fsdecode(abs_path), st).key
                cids.extend((key, i) for i in chunk_ranges(st.st_size, 0, None, self.chunk_size))
        return cids

    # -- paths --------------------------------------------------------------------------------
    def _check_rel(self, rel: str) -> bytes:
        if rel.startswith("/"):
            raise HintError(f"{rel!r}: paths are relative to the mount root")
        norm = os.path.normpath(rel) if rel else "."
        if norm == ".." or norm.startswith("../"):
            raise HintError(f"{rel!r} is outside the mount")
        return b"" if norm == "." else os.fsencode(norm)

    def _resolve(self, paths: list[str]) -> tuple[list[tuple[bytes, os.stat_result] | None], list[str]]:
        """(blocking) For each relative path: (absolute backing path, stat) or None if it does
        not exist or is not a regular file. Raises HintError for a path outside the mount."""
        out: list[tuple[bytes, os.stat_result] | None] = []
        missing: list[str] = []
        for rel in paths:
            r = self._check_rel(rel)
            abs_path = self.root + b"/" + r if r else self.root
            try:
                st = os.stat(abs_path)
            except OSError:
                out.append(None)
                missing.append(rel)
                continue
            real = os.path.realpath(abs_path)
            if os.path.islink(abs_path) or real != abs_path:
                if not (real + b"/").startswith(self._real_root.rstrip(b"/") + b"/"):
                    raise HintError(f"{rel!r} resolves outside the mount")
                abs_path = real
            if not _is_regular(st):
                out.append(None)
                missing.append(rel)
                continue
            out.append((abs_path, st))
        return out, missing

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
            except Exception:  # noqa: BLE001 - a hint must never take the daemon down
                log.exception("hint prefetch round failed")
            progress, self._progress = self._progress, trio.Event()
            progress.set()

    def kick(self) -> None:
        self._kick.set()

    # -- next-file prediction (no hints) ----------------------------------------------------------
    def file_opened(self, pid: int, rel: bytes) -> None:
        """Operations callback (must not block): learn; cancel a wrong prediction."""
        if self.predict_bytes and self._nursery is not None:
            self._nursery.start_soon(self._opened, pid, rel)

    def file_read_end(self, pid: int, rel: bytes) -> None:
        """Operations callback: ``pid``'s readahead reached the end of ``rel``."""
        if self.predict_bytes and self._nursery is not None:
            self._nursery.start_soon(self._predict, pid, rel)

    async def _listing(self, d: bytes) -> list[bytes] | None:
        now = trio.current_time()
        cached = self._listings.get(d)
        if cached is not None and now - cached[0] < LISTING_TTL_S:
            return cached[1]
        try:
            names: list[bytes] = await self.meta.run(os.listdir, self.root + b"/" + d if d else self.root)
        except OSError:
            return None
        if len(names) > MAX_LISTING:
            return None  # name-order prediction is not worth sorting this on every refresh
        if len(self._listings) > 1024:
            self._listings.clear()
        listing = sorted(names)
        self._listings[d] = (now, listing)
        return listing

    async def _opened(self, pid: int, rel: bytes) -> None:
        d = os.path.dirname(rel)
        wrong = self.predictor.opened(pid, rel, await self._listing(d))
        nid = self._predicted.pop((pid, d), None)
        if wrong is not None and nid is not None:
            self.plan.cancel(nid)

    async def _predict(self, pid: int, rel: bytes) -> None:
        d = os.path.dirname(rel)
        nxt = self.predictor.predict(pid, rel, await self._listing(d))
        if nxt is None:
            return
        try:
            reply = await self._register([(os.fsdecode(nxt), 0, self.predict_bytes)], math.inf, -1,
                                         f"predict:{pid}:{os.fsdecode(d)}", "predicted", replaces="predicted")
        except HintError:
            return
        self._predicted[(pid, d)] = reply["id"]

    def _check_deadlines(self) -> None:
        now = trio.current_time()
        for need in self.plan.check_deadlines(now, self.cache.in_tier):
            left = self.plan.remaining(need, self.cache.in_tier)
            log.warning("hint %s (%s) missed its deadline: %d of %d bytes not resident", need.id, need.label,
                        left, need.total_bytes)
        proj = self._projection()
        for need in self.plan.needs.values():
            p = proj.get(need.id)
            if p is not None and not need.at_risk and not need.missed and not math.isinf(need.deadline) \
                    and need.finished_at is None and now + p > need.deadline:
                need.at_risk = True
                log.warning("hint %s (%s) is projected to miss its deadline by %.1f s (%.1f s to go)",
                            need.id, need.label, now + p - need.deadline, need.deadline - now)

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
            if need.finished_at is not None:
                continue
            ahead += self.plan.remaining(need, self.cache.in_tier)
            if not math.isinf(need.deadline):
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
                while i < n:  # skip what is read or present, then fetch one chunk
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
                    if not self.cache.can_admit(cid, need.sizes[i], ahead=queued_bytes):
                        stop = blocked = True
                        break
                    f = await self._file(need.file_of(i))
                    if f is not None:
                        self._queued[cid] = self.scheduler.submit(f, cid[1], Klass.DEADLINE, need.deadline)
                        queued_bytes += need.sizes[i]
                        self.prefetched_bytes += need.sizes[i]
                        submitted += 1
                    i += 1
                    break
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

    async def _file(self, pf: PlannedFile) -> BackingFile | None:
        f = self._files.get(pf.key)
        if f is not None and f.fd >= 0:
            return f
        try:
            fd, st = await self.meta.run(open_backing, pf.path)
        except OSError as e:
            log.info("hinted file %s cannot be opened (%s); skipped", os.fsdecode(pf.path), e.strerror)
            self._bad_keys.add(pf.key)
            return None
        identity = Identity.of(os.fsdecode(pf.path), st)
        if identity.key != pf.key:
            os.close(fd)
            log.info("hinted file %s changed since the hint; skipped", os.fsdecode(pf.path))
            self._bad_keys.add(pf.key)
            return None
        f = BackingFile(identity, fd)
        f.acquire()
        self._files[pf.key] = f
        return f

    def _close_idle_files(self) -> None:
        busy = {cid[0] for cid in self._queued}
        for key in [k for k in self._files if k not in busy]:
            self._files.pop(key).release()

    def close(self) -> None:
        for f in self._files.values():
            f.release()
        self._files.clear()

    # -- stats ----------------------------------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        ps = asdict(self.plan.statistics())
        proj = self._projection()
        now = trio.current_time()
        resident = 0
        to_fetch = 0
        pending: list[dict[str, Any]] = []
        for need in self.plan.by_rank():
            left = self.plan.remaining(need, self.cache.in_tier)
            to_fetch += left
            resident += sum(need.sizes[i] for i in need.unique() if self.cache.in_tier(need.chunks[i]))
            if not math.isinf(need.deadline) and need.finished_at is None and len(pending) < 20:
                p = proj.get(need.id, 0.0)
                pending.append({"id": need.id, "label": need.label, "deadline_in_s": need.deadline - now,
                                "projected_s": p, "slack_s": need.deadline - now - p,
                                "remaining_bytes": left, "missed": need.missed})
        ps.update({"resident_bytes": resident, "to_fetch_bytes": to_fetch, "prefetched_bytes": self.prefetched_bytes,
                   "queued_chunks": len(self._queued), "pending_deadlines": pending,
                   "write_tier_kept_free_bytes": self.cache.tiers[self.write_tier].keep_free,
                   "next_file_predictions": {"right": self.predictor.hits, "wrong": self.predictor.misses,
                                             "active": self.predictor.confident()},
                   "requests": self.requests})
        return ps


# -- validation of request fields (the client validates too; the daemon trusts nothing) -------
def _is_regular(st: os.stat_result) -> bool:
    import stat as stat_mod

    return stat_mod.S_ISREG(st.st_mode)


def _str(v: object, name: str) -> str:
    if not isinstance(v, str):
        raise HintError(f"{name} must be a string, got {type(v).__name__}")
    if "\0" in v:
        raise HintError(f"{name} must not contain NUL")
    return v


def _int(v: object, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise HintError(f"{name} must be an integer, got {v!r}")
    return v


def _seconds(v: object, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
        raise HintError(f"{name} must be a number of seconds >= 0, got {v!r}")
    return float(v)


def _deadline(v: object) -> float:
    if v is None:
        return math.inf
    s = _seconds(v, "deadline")
    return s


def _paths(v: object) -> list[str]:
    if not isinstance(v, list):
        raise HintError("paths must be a list of relative paths")
    return [_str(p, "path") for p in v]


def _items(v: object) -> list[tuple[str, int, int | None]]:
    if not isinstance(v, list):
        raise HintError("items must be a list of [path, offset, length]")
    out: list[tuple[str, int, int | None]] = []
    for it in v:
        if isinstance(it, str):
            out.append((it, 0, None))
            continue
        if not isinstance(it, list) or len(it) != 3:
            raise HintError(f"item {it!r}: expected [path, offset, length]")
        path, offset, length = it
        offset = _int(offset, "offset")
        if offset < 0:
            raise HintError(f"item {path!r}: offset must be >= 0")
        if length is not None:
            length = _int(length, "length")
            if length <= 0:
                raise HintError(f"item {path!r}: length must be > 0")
        out.append((_str(path, "path"), offset, length))
    return out
