"""TransactionScheduler: every data read of the backing store goes through here.

Why: an HDD serves one request at a time, and concurrent random reads make it seek between
them (measured on the emulated disk of ``bench/``: 8 direct readers got ~0.56x of the
sequential rate). The scheduler owns the device and decides what it does next:

* **Classes**, highest first: ``DEMAND`` (a reader is blocked), ``DEADLINE`` (hinted prefetch,
  write-back; earliest deadline first, and escalated to demand priority once its deadline is
  within ``escalate_s``), ``SPECULATIVE`` (readahead; dispatched only when nothing else waits).
* **Elevator**: within a class, C-SCAN over (device, inode, chunk index) from the head position,
  so the arm sweeps one way (Denning, "Effects of scheduling on file memory operations", 1967;
  Linux's deadline scheduler sorts the same way).
* **Coalescing**: queued requests for the following chunks of the same file, of any class, join
  the run, up to ``slice_size`` bytes; a long transfer is thus a series of slices, and a demand
  read that arrives meanwhile waits for at most one slice.
* **Single-flight**: one request per chunk; a second reader (or a demand for a queued prefetch)
  joins it, raising its class.
* **Depth**: ``depth`` runs in flight (1 for an HDD). With ``elevator=False`` (the
  ``parallel`` backing profile, :mod:`tierfs.sched.profile`) requests of a class are taken in
  arrival order instead of C-SCAN order, and background work (deadline and speculative) holds
  at most ``depth - depth // 4`` of the slots, so a demand read that arrives while readahead
  fills the queue starts at once instead of behind a full queue of it.

Completed chunks are handed to ``on_fetched`` (the cache stages them) before waiters wake.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import trio

from tierfs import logevents, tasks
from tierfs.errors import BackingIOError
from tierfs.sched.backing import BackingFile

ChunkId = tuple[str, int]
T = TypeVar("T")
log = logging.getLogger("tierfs.sched")


class Klass(enum.IntEnum):
    DEMAND = 0
    DEADLINE = 1
    SPECULATIVE = 2


class ReqState(enum.Enum):
    QUEUED = "queued"
    IN_FLIGHT = "in_flight"
    DONE = "done"


@dataclass(eq=False)
class FetchRequest:
    file: BackingFile
    index: int
    klass: Klass
    deadline: float
    enqueued_at: float
    state: ReqState = ReqState.QUEUED
    done: trio.Event = field(default_factory=trio.Event)
    result: bytes | None = None
    error: BaseException | None = None
    waiters: int = 0

    @property
    def cid(self) -> ChunkId:
        return (self.file.key, self.index)

    def advance(self, to: ReqState) -> None:
        legal = {ReqState.QUEUED: ReqState.IN_FLIGHT, ReqState.IN_FLIGHT: ReqState.DONE}
        if legal.get(self.state) is not to:
            raise AssertionError(f"illegal request transition {self.state} -> {to}")
        self.state = to


@dataclass(eq=False)
class IoTask:
    """Any other backing-store transfer (a write-back slice, a write-through write): a blocking
    callable run in the backing device thread when the scheduler picks it. ``position`` places
    it for the elevator; ``nbytes`` is for statistics; ``what`` names the file it concerns
    (a path relative to the backing root) in the BackingIOError of a failure."""

    fn: Callable[[], object]
    klass: Klass
    deadline: float
    position: tuple[tuple[int, int], int]
    nbytes: int
    enqueued_at: float
    what: bytes | str | None = None
    key: tuple[str, int] = field(default=("", 0))
    state: ReqState = ReqState.QUEUED
    done: trio.Event = field(default_factory=trio.Event)
    result: object = None
    error: BaseException | None = None

    @property
    def cid(self) -> tuple[str, int]:
        return self.key

    def advance(self, to: ReqState) -> None:
        legal = {ReqState.QUEUED: ReqState.IN_FLIGHT, ReqState.IN_FLIGHT: ReqState.DONE}
        if legal.get(self.state) is not to:
            raise AssertionError(f"illegal task transition {self.state} -> {to}")
        self.state = to


# Reads ``length`` bytes at ``offset`` of a backing file (in the backing device's thread).
ReadFn = Callable[[BackingFile, int, int], Awaitable[bytes]]
# Runs a blocking callable in the backing device's thread.
RunFn = Callable[[Callable[[], object]], Awaitable[object]]
OnFetched = Callable[[FetchRequest, bytes], None]
# Moves a run of chunks (requests, offset, length) from the backing store straight into a tier
# file, or declines (False: the run is read into memory as before). Set by the cache.
Transfer = Callable[[list["FetchRequest"], int, int], Awaitable[bool]]


class ClassQueue(dict[ChunkId, "FetchRequest | IoTask"]):
    """One class's queue: requests by chunk id in arrival order (a dict keeps it), indexed by
    file key as well, so that dropping one file's requests costs what it drops. A scan of the
    whole speculative queue at every close was 16% of the event loop's busy time in a
    small-file epoch after a first one had queued its fills (py-spy, 8,000 files of ~110 KiB).
    Only item assignment, ``del``, ``pop`` and ``clear`` change it (the index follows them)."""

    __slots__ = ("by_file",)

    def __init__(self) -> None:
        super().__init__()
        self.by_file: dict[str, dict[ChunkId, None]] = {}

    def __setitem__(self, cid: ChunkId, req: FetchRequest | IoTask) -> None:
        super().__setitem__(cid, req)
        self.by_file.setdefault(cid[0], {})[cid] = None

    def __delitem__(self, cid: ChunkId) -> None:
        super().__delitem__(cid)
        self._unindex(cid)

    def pop(self, cid: ChunkId, *default):  # type: ignore[no-untyped-def,override]
        if cid in self:
            self._unindex(cid)
        return super().pop(cid, *default)

    def clear(self) -> None:
        super().clear()
        self.by_file.clear()

    def _bypasses_index(self, *args: object, **kw: object):  # type: ignore[no-untyped-def]
        raise TypeError("ClassQueue: use item assignment, del, pop or clear (the per-file index follows only those)")

    update = setdefault = popitem = __ior__ = _bypasses_index  # type: ignore[assignment]

    def _unindex(self, cid: ChunkId) -> None:
        ids = self.by_file.get(cid[0])
        if ids is not None:
            ids.pop(cid, None)
            if not ids:
                del self.by_file[cid[0]]


def _position(r: FetchRequest | IoTask) -> tuple[tuple[int, int], int]:
    if isinstance(r, IoTask):
        return r.position
    return (r.file.order, r.index)


@dataclass(frozen=True)
class SchedulerStats:
    queued: dict[str, int]
    in_flight: int
    backing_bytes_read: int
    backing_reads: int
    chunks_fetched: int
    coalesced_chunks: int
    io_tasks: int
    bytes_written: int
    busy_seconds: float
    busy_fraction: float
    demand_waits: int
    demand_wait_mean_s: float
    demand_wait_p99_s: float
    deadline_escalations: int
    depth: int
    slice_bytes: int
    elevator: bool = True
    background_slots: int = 1


class TransactionScheduler:
    """See the module docstring. Start with ``await nursery.start(sched.run)``.

    Args:
        read: how a run is read (real: ``pread`` in the backing device thread).
        chunk_size: bytes per chunk. slice_size: longest run, bytes. depth: runs in flight.
        escalate_s: a DEADLINE request this close to its deadline is served as DEMAND.
        on_fetched: called with each completed request and its bytes, before waiters wake.
    """

    WAIT_SAMPLES = 4096  # demand waits kept for mean/p99 (a ring; recent behaviour matters)

    def __init__(
        self,
        read: ReadFn,
        *,
        chunk_size: int,
        slice_size: int,
        depth: int = 1,
        escalate_s: float = 2.0,
        on_fetched: OnFetched | None = None,
        run_io: RunFn | None = None,
        elevator: bool = True,
    ) -> None:
        self._read = read
        self._run_io = run_io
        self.chunk_size = chunk_size
        self.slice_size = max(slice_size, chunk_size)
        self.depth = depth
        self.elevator = elevator
        # Slots deadline and speculative work may hold: all of them on an HDD (depth 1: one
        # request at a time, whatever it is); on a parallel store a quarter stay free for demand.
        self.background_slots = depth if elevator else max(1, depth - depth // 4)
        self._background = 0  # background runs in flight
        self.escalate_s = escalate_s
        self.on_fetched = on_fetched
        self.transfer: Transfer | None = None
        self._queues: dict[Klass, ClassQueue] = {k: ClassQueue() for k in Klass}
        self._in_flight: dict[ChunkId, FetchRequest | IoTask] = {}
        self._task_ids = 0
        self._io_tasks = 0
        self._bytes_written = 0
        self._wakeup = trio.Event()
        self._head: tuple[tuple[int, int], int] = ((0, 0), 0)
        self._started = time.monotonic()
        self._busy = 0.0
        self._bytes = 0
        self._reads = 0
        self._chunks = 0
        self._coalesced = 0
        self._escalations = 0
        self._last_was_demand = False
        self._waits: list[float] = []
        self._wait_pos = 0
        self._wait_count = 0

    # -- submitting ------------------------------------------------------------------------
    def lookup(self, cid: ChunkId) -> FetchRequest | None:
        req = self._in_flight.get(cid)
        if isinstance(req, FetchRequest):
            return req
        for q in self._queues.values():
            req = q.get(cid)
            if isinstance(req, FetchRequest):
                return req
        return None

    async def io(self, fn: Callable[[], object], klass: Klass, *, nbytes: int,
                 position: tuple[tuple[int, int], int] = ((0, 0), 0),
                 deadline: float = math.inf, written: bool = True, what: bytes | str | None = None) -> object:
        """Queue a blocking backing-store call ``fn`` in ``klass`` and wait for its result.
        ``what``: the file it concerns (a path relative to the backing root), named in the
        error. Raises what ``fn`` raises (an OSError becomes BackingIOError naming ``what``)."""
        self._task_ids += 1
        task = IoTask(fn, klass, deadline, position, nbytes, trio.current_time(), what=what,
                      key=("io", self._task_ids))
        self._queues[klass][task.key] = task
        self._wakeup.set()
        try:
            await task.done.wait()
        except trio.Cancelled:
            # The caller owns what ``fn`` touches (a descriptor it closes when it unwinds).
            # A queued call is dropped, so it never runs after the caller has gone; a running
            # one (a bounded slice) is waited for, so the caller never closes a descriptor the
            # device thread still uses (its number may be another file's by then).
            if self._queues[task.klass].pop(task.key, None) is None and not task.done.is_set():
                with trio.CancelScope(shield=True):
                    await task.done.wait()
            raise
        if written:
            self._bytes_written += nbytes
        if task.error is not None:
            raise task.error
        return task.result

    def submit(
        self, f: BackingFile, index: int, klass: Klass, deadline: float = math.inf
    ) -> FetchRequest:
        """Queue a fetch of chunk ``index`` of ``f`` (or join the one queued/in flight)."""
        cid = (f.key, index)
        req = self.lookup(cid)
        if req is not None:
            if req.state is ReqState.QUEUED and klass < req.klass:
                del self._queues[req.klass][cid]
                req.klass = klass
                self._queues[klass][cid] = req
            if req.state is ReqState.QUEUED and deadline < req.deadline:
                req.deadline = deadline
            return req
        f.acquire()
        req = FetchRequest(f, index, klass, deadline, trio.current_time())
        self._queues[klass][cid] = req
        self._wakeup.set()
        return req

    @property
    def can_run_io(self) -> bool:
        """Whether :meth:`run_io` (and :meth:`io`) have a backing device thread to run in."""
        return self._run_io is not None

    async def run_io(self, fn: Callable[[], T]) -> T:
        """Run blocking ``fn`` in the backing device's thread, now (for the caller's own
        transfer: a :data:`Transfer` runs inside a slot the scheduler gave it)."""
        assert self._run_io is not None, "no run_io given to the scheduler"
        return await self._run_io(fn)  # type: ignore[return-value]

    async def fetch(self, f: BackingFile, index: int, klass: Klass = Klass.DEMAND) -> bytes | None:
        """Fetch one chunk and wait for it: its bytes, or None when :attr:`transfer` put it
        straight into a tier (read it there). Raises BackingIOError."""
        req = self.submit(f, index, klass)
        started = trio.current_time()
        req.waiters += 1
        try:
            await req.done.wait()
        finally:
            req.waiters -= 1
        if klass is Klass.DEMAND:
            self._record_wait(trio.current_time() - started)
        if req.error is not None:
            raise req.error
        return req.result

    def cancel_speculative(self, key: str) -> int:
        """Drop queued readahead of a file nobody waits for (the file was closed)."""
        q = self._queues[Klass.SPECULATIVE]
        gone = [cid for cid in q.by_file.get(key, ())
                if isinstance(r := q[cid], FetchRequest) and r.waiters == 0]
        for cid in gone:
            req = q.pop(cid)
            assert isinstance(req, FetchRequest)
            req.file.release()
            req.error = BackingIOError(req.file.path, OSError(125, "readahead cancelled"))
            req.done.set()
        return len(gone)

    # -- dispatching -----------------------------------------------------------------------
    def _pick(self) -> FetchRequest | IoTask | None:
        """The next request: DEMAND first; DEADLINE work whose deadline is within
        ``escalate_s`` alternates 1:1 with DEMAND so a stream of reads cannot starve it; other
        DEADLINE work in EDF order; SPECULATIVE only when nothing else is queued."""
        now = trio.current_time()
        deadline_q = self._queues[Klass.DEADLINE]
        demand_q = self._queues[Klass.DEMAND]
        edf_key = lambda r: (r.deadline, _position(r))  # noqa: E731
        escalated = [r for r in deadline_q.values() if r.deadline - now <= self.escalate_s]
        if escalated and (not demand_q or self._last_was_demand):
            self._escalations += 1
            self._last_was_demand = False
            return min(escalated, key=edf_key)
        if demand_q:
            self._last_was_demand = True
            return self._order(demand_q.values())
        if self._background >= self.background_slots:
            return None  # the slots left are kept for demand reads
        if deadline_q:
            return min(deadline_q.values(), key=edf_key)
        if self._queues[Klass.SPECULATIVE]:
            return self._order(self._queues[Klass.SPECULATIVE].values())
        return None

    def _order(self, reqs) -> FetchRequest | IoTask:  # type: ignore[no-untyped-def]
        """The next of ``reqs`` (one class): C-SCAN on an HDD; on a parallel store the oldest
        (a queue dict keeps arrival order; a raised class re-queues at the end), which with
        several in flight serves readers fairly and keeps a sequential reader's chunks in order."""
        if self.elevator:
            return self._elevator(reqs)
        return next(iter(reqs))

    def _elevator(self, reqs) -> FetchRequest | IoTask:  # type: ignore[no-untyped-def]
        head = self._head
        best_ahead = None
        best_any = None
        for r in reqs:
            pos = _position(r)
            if best_any is None or pos < best_any[0]:
                best_any = (pos, r)
            if pos >= head and (best_ahead is None or pos < best_ahead[0]):
                best_ahead = (pos, r)
        chosen = best_ahead or best_any
        assert chosen is not None
        return chosen[1]

    def _take(self, req: FetchRequest | IoTask) -> None:
        del self._queues[req.klass][req.cid]
        req.advance(ReqState.IN_FLIGHT)
        self._in_flight[req.cid] = req

    def _coalesce(self, first: FetchRequest) -> list[FetchRequest]:
        run = [first]
        self._take(first)
        nbytes = min(self.chunk_size, first.file.size - first.index * self.chunk_size)
        nxt = first.index + 1
        while nbytes + self.chunk_size <= self.slice_size:
            req = None
            for q in self._queues.values():
                cand = q.get((first.file.key, nxt))
                if isinstance(cand, FetchRequest):
                    req = cand
                    break
            if req is None:
                break
            self._take(req)
            run.append(req)
            nbytes += min(self.chunk_size, first.file.size - nxt * self.chunk_size)
            nxt += 1
        self._coalesced += len(run) - 1
        return run

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:  # type: ignore[no-untyped-def]
        """Dispatch forever with ``depth`` runs in flight."""
        async with trio.open_nursery() as nursery:
            slots = trio.Semaphore(self.depth)
            task_status.started()
            while True:
                await slots.acquire()
                req = self._pick()
                while req is None:
                    self._wakeup = trio.Event()
                    await self._wakeup.wait()
                    req = self._pick()
                background = req.klass is not Klass.DEMAND
                self._background += background
                done = partial(self._finished, slots, background)
                if isinstance(req, IoTask):
                    self._take(req)
                    nursery.start_soon(self._execute_io, req, done)
                else:
                    run = self._coalesce(req)
                    nursery.start_soon(self._execute, run, done)
                await trio.lowlevel.checkpoint()

    def _finished(self, slots: trio.Semaphore, background: bool) -> None:
        """A run left the device: its slot is free (and, if it was background work, one of the
        background slots: wake the dispatcher, which may be waiting for one)."""
        slots.release()
        if background:
            self._background -= 1
            self._wakeup.set()

    async def _execute_io(self, task: IoTask, finished: Callable[[], None]) -> None:
        self._head = task.position
        t0 = trio.current_time()  # trio's clock: mocked in tests and tierfs sim
        try:
            assert self._run_io is not None, "no run_io given to the scheduler"
            task.result = await self._run_io(task.fn)
        except BackingIOError as e:
            task.error = e
        except OSError as e:
            # the file's name (escaped: a user's name must not forge a log line), never the
            # elevator position, which tells a reader of the log nothing
            task.error = BackingIOError("backing root" if task.what in (b"", "") else
                                        logevents.user_text(task.what) if task.what is not None else
                                        "a backing-store transfer", e)
        except Exception as e:  # noqa: BLE001 - handed to the waiter, who re-raises it
            task.error = e
        finally:
            self._busy += trio.current_time() - t0
            finished()
            self._io_tasks += 1
            del self._in_flight[task.key]
            task.advance(ReqState.DONE)
            task.done.set()

    async def _execute(self, run: list[FetchRequest], finished: Callable[[], None]) -> None:
        f = run[0].file
        offset = run[0].index * self.chunk_size
        length = min(len(run) * self.chunk_size, f.size - offset)
        self._head = (f.order, run[-1].index + 1)
        t0 = trio.current_time()
        data: bytes | None = None
        error: BaseException | None = None
        moved = False
        try:
            if self.transfer is not None:
                moved = await self.transfer(run, offset, length)
            if not moved:
                data = await self._read(f, offset, length)
        except BackingIOError as e:
            error = e
        except OSError as e:
            error = BackingIOError(f.path, e)
        finally:
            self._busy += trio.current_time() - t0
            finished()
        if error is not None:
            logevents.event(log, logging.WARNING, "backing-read-error",
                            "backing store read failed, the readers get an error: %s", error)
        if data is not None or moved:
            self._bytes += len(data) if data is not None else length
            self._reads += 1
        view = memoryview(data) if data is not None else None
        for i, req in enumerate(run):
            del self._in_flight[req.cid]
            req.advance(ReqState.DONE)
            if moved:
                self._chunks += 1  # in a tier now; result None: readers read it there
            elif view is not None:
                # a run of one chunk hands its bytes on as they are (a 4 MiB copy on the
                # event loop saved: ~1 ms each)
                part = data if len(run) == 1 and data is not None else bytes(
                    view[i * self.chunk_size : (i + 1) * self.chunk_size])
                expected = min(self.chunk_size, f.size - req.index * self.chunk_size)
                if len(part) != expected:
                    req.error = BackingIOError(f.path, OSError(5, "backing file shrank"))
                    f.stale = True
                else:
                    req.result = part
                    self._chunks += 1
                    if self.on_fetched is not None:
                        try:
                            self.on_fetched(req, part)
                        except Exception:  # noqa: BLE001 - the reader still gets its bytes
                            tasks.failures["scheduler.on_fetched"] += 1
                            logevents.event(log, logging.ERROR, "on-fetched-failed",
                                            "staging a fetched chunk failed (the reader is served)",
                                            exc_info=True)
            else:
                req.error = error
            req.done.set()
            req.file.release()
            if view is not None and i + 1 < len(run):
                # Each chunk of a run is copied out of the run's buffer; one step per chunk
                # keeps the loop's steps short and wakes this chunk's readers before the next
                # copy. A 7-chunk run copied in one step held the loop 71.6 ms (30.4 ms on
                # CPU) on a loaded 2-core CI machine. Shielded: the chunks left must still
                # be completed.
                await trio.lowlevel.cancel_shielded_checkpoint()

    # -- statistics ------------------------------------------------------------------------
    def _record_wait(self, seconds: float) -> None:
        if len(self._waits) < self.WAIT_SAMPLES:
            self._waits.append(seconds)
        else:
            self._waits[self._wait_pos] = seconds
            self._wait_pos = (self._wait_pos + 1) % self.WAIT_SAMPLES
        self._wait_count += 1

    def queue_lengths(self) -> dict[str, int]:
        return {k.name.lower(): len(q) for k, q in self._queues.items()}

    def statistics(self) -> SchedulerStats:
        waits = sorted(self._waits)
        p99 = waits[min(len(waits) - 1, int(0.99 * len(waits)))] if waits else 0.0
        up = max(1e-9, time.monotonic() - self._started)
        return SchedulerStats(
            queued=self.queue_lengths(),
            in_flight=len(self._in_flight),
            backing_bytes_read=self._bytes,
            backing_reads=self._reads,
            chunks_fetched=self._chunks,
            coalesced_chunks=self._coalesced,
            io_tasks=self._io_tasks,
            bytes_written=self._bytes_written,
            busy_seconds=self._busy,
            busy_fraction=min(1.0, self._busy / up),
            demand_waits=self._wait_count,
            demand_wait_mean_s=sum(waits) / len(waits) if waits else 0.0,
            demand_wait_p99_s=p99,
            deadline_escalations=self._escalations,
            depth=self.depth,
            slice_bytes=self.slice_size,
            elevator=self.elevator,
            background_slots=self.background_slots,
        )
