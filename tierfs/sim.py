"""``tierfs sim``: replay access traces through the real cache, policy, scheduler and hint code
on a simulated clock and disk, and compare policies side by side.

Nothing here re-implements a policy: each run builds the daemon's own :class:`Cache`,
:class:`Policy`, :class:`TransactionScheduler`, :class:`Readahead` and :class:`HintService`
over real (small) files in a temporary directory, and only the backing store's *timing* is
simulated: trio's ``MockClock`` stands in for the wall clock, and a disk model charges a seek
(``seek_s``) whenever a transfer does not continue where the last one ended, plus
``transfer_s`` per chunk. Training jobs are trio tasks that read chunk by chunk and compute
``compute_s`` per chunk. Belady's MIN (Belady 1966) is computed offline on each trace's access
sequence with the same capacity (tiers + staging), as demand paging with bypass.

Policies:

* ``lru``: admit everything, evict least recently used; no prefetch (what users have today).
* ``minio``: CoorDL's MinIO cache (Mohan et al., VLDB 2021): once full, never replace.
* ``tierfs``: tierfs without hints: no-thrash admission, sequential readahead and next-file
  prediction (:mod:`tierfs.predict.nextfile`).
* ``tierfs+hints``: the same with the hints :mod:`tierfs_hints` sends (each epoch's order and
  the next one, as ``HintedSampler(lookahead_epochs=1)`` does; eval phases ahead of time).
* ``hints-evict-only``: the hint plan's eviction (MIN order) without its prefetcher or
  readahead: compares the eviction itself with Belady's.
* ``belady``: the offline optimum without prefetch.

Metrics per (trace, policy): ``hit_ratio`` (chunk reads that found the chunk in a tier or in
staging, i.e. did not wait for the backing store), ``backing_bytes`` (read from the backing
store), ``deadline_misses`` (reads of a phase that has a deadline which did not hit),
``data_wait_s`` (simulated seconds the jobs spent waiting for data rather than computing).
Deterministic: fixed seeds, trio's scheduling shuffle is seeded, and the cyclic garbage collector
is off during each run (see :func:`run_trace`).
"""

from __future__ import annotations

import gc
import heapq
import math
import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
import trio.testing

from tierfs.cache.manager import AccessState, Cache
from tierfs.cache.plan import HintPlan
from tierfs.cache.policy import Policy
from tierfs.cache.tier import Tier
from tierfs.io import Device, pread_exact
from tierfs.predict.hints import HintService
from tierfs.predict.readahead import Readahead, ReadaheadState
from tierfs.sched.backing import BackingFile, Identity
from tierfs.sched.scheduler import TransactionScheduler

POLICIES = ("lru", "minio", "tierfs", "hints-evict-only", "tierfs+hints", "belady")
CHUNK = 64 * 1024  # simulated chunk: stands for a 4 MiB chunk (timings are per chunk)


@dataclass
class Read:
    file: str
    chunk: int
    phase: str | None = None  # reads of a phase with a deadline


@dataclass
class Hint:
    """A hint a job sends before its next read: ``epoch`` (order) or ``phase``."""

    op: str
    files: list[str]
    name: str = ""
    at_s: float = 0.0


@dataclass
class Job:
    name: str
    steps: list[Read | Hint]


@dataclass
class Trace:
    name: str
    description: str
    files: dict[str, int]  # name -> chunks
    jobs: list[Job]
    ram_chunks: int
    ssd_chunks: int = 0
    staging_chunks: int = 4
    compute_s: float = 0.010  # per chunk read
    seek_s: float = 0.008
    transfer_s: float = 0.006  # per chunk (a 4 MiB chunk at ~140 MB/s would be 0.029)
    phase_deadlines: dict[str, float] = field(default_factory=dict)


# -- traces ----------------------------------------------------------------------------------
def _file_reads(name: str, chunks: int, phase: str | None = None) -> list[Read | Hint]:
    return [Read(name, c, phase) for c in range(chunks)]


def _epoch_steps(order_by_epoch: list[list[str]], files: dict[str, int], lookahead: int = 1) -> list[Read | Hint]:
    steps: list[Read | Hint] = []
    for e, order in enumerate(order_by_epoch):
        announced = [f for k in range(e, min(len(order_by_epoch), e + 1 + lookahead)) for f in order_by_epoch[k]]
        steps.append(Hint("epoch", announced))
        for f in order:
            steps.extend(_file_reads(f, files[f]))
    return steps


def trace_epoch_shuffle(seed: int = 1) -> Trace:
    files = {f"train/{i:03d}": 4 for i in range(64)}
    rng = random.Random(seed)
    orders = [rng.sample(sorted(files), len(files)) for _ in range(3)]
    return Trace("epoch-shuffle", "3 epochs, shuffled file order, dataset 2x the RAM tier",
                 files, [Job("train", _epoch_steps(orders, files))], ram_chunks=128)


def trace_sequential_shards() -> Trace:
    files = {f"shards/{i:03d}.tar": 8 for i in range(32)}
    orders = [sorted(files)] * 3
    return Trace("sequential-shards", "3 epochs over 32 shards in the same order, dataset 2x RAM",
                 files, [Job("train", _epoch_steps(orders, files))], ram_chunks=128)


def trace_two_jobs(seed: int = 2) -> Trace:
    files = {f"train/{i:03d}": 4 for i in range(64)}
    jobs = []
    for j in range(2):
        rng = random.Random(seed * 10 + j)
        orders = [rng.sample(sorted(files), len(files)) for _ in range(2)]
        jobs.append(Job(f"job{j}", _epoch_steps(orders, files)))
    return Trace("two-jobs", "2 jobs shuffle the same dataset, 2 epochs each, dataset 2x RAM",
                 files, jobs, ram_chunks=128)


def trace_train_eval(seed: int = 3) -> Trace:
    """Training on 64 files with an eval pass over 8 files after every 16 training files; the
    eval set must be resident when the pass starts (its deadline)."""
    train = {f"train/{i:03d}": 4 for i in range(64)}
    evals = {f"eval/{i:02d}": 4 for i in range(8)}
    files = {**train, **evals}
    rng = random.Random(seed)
    compute = 0.010
    steps: list[Read | Hint] = []
    every = 16
    for _epoch in range(2):
        order = rng.sample(sorted(train), len(train))
        steps.append(Hint("epoch", list(order)))
        for k, f in enumerate(order):
            if k % every == 0:
                # announced one training block ahead: the time the next block takes to compute
                steps.append(Hint("phase", sorted(evals), name="eval", at_s=every * 4 * compute))
            steps.extend(_file_reads(f, train[f]))
            if (k + 1) % every == 0:
                for ef in sorted(evals):
                    steps.extend(_file_reads(ef, evals[ef], phase="eval"))
    return Trace("train-eval", "training with an eval pass every 16 files; eval data due when it starts",
                 files, [Job("train", steps)], ram_chunks=96, compute_s=compute,
                 phase_deadlines={"eval": every * 4 * compute})


TRACES: dict[str, Callable[[], Trace]] = {
    "epoch-shuffle": trace_epoch_shuffle,
    "sequential-shards": trace_sequential_shards,
    "two-jobs": trace_two_jobs,
    "train-eval": trace_train_eval,
}


# -- Belady ----------------------------------------------------------------------------------
def access_sequence(trace: Trace) -> list[tuple[tuple[str, int], str | None]]:
    """The trace's chunk reads in the order they happen when no read waits (jobs interleave by
    their compute time); ties go to the lower job index."""
    events: list[tuple[float, int, int, tuple[str, int], str | None]] = []
    for j, job in enumerate(trace.jobs):
        t = 0.0
        for step in job.steps:
            if isinstance(step, Read):
                events.append((t, j, len(events), (step.file, step.chunk), step.phase))
                t += trace.compute_s
    events.sort()
    return [(cid, phase) for _, _, _, cid, phase in events]


def belady(trace: Trace, capacity: int) -> dict[str, Any]:
    """MIN with bypass over the access sequence: hits, misses, deadline misses."""
    seq = access_sequence(trace)
    nxt = [math.inf] * len(seq)
    last: dict[tuple[str, int], int] = {}
    for i in range(len(seq) - 1, -1, -1):
        cid = seq[i][0]
        nxt[i] = last.get(cid, math.inf)
        last[cid] = i
    cache: dict[tuple[str, int], float] = {}
    heap: list[tuple[float, tuple[str, int]]] = []  # (-next use, chunk), lazily invalidated
    hits = misses = dmiss = 0
    for i, (cid, phase) in enumerate(seq):
        if cid in cache:
            hits += 1
        else:
            misses += 1
            if phase is not None:
                dmiss += 1
        n = nxt[i]
        if cid in cache or len(cache) < capacity:
            cache[cid] = n
            heapq.heappush(heap, (-n, cid))
            continue
        while heap and cache.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)
        far = -heap[0][0]
        if n < far:
            _, victim = heapq.heappop(heap)
            del cache[victim]
            cache[cid] = n
            heapq.heappush(heap, (-n, cid))
    total = hits + misses
    return {"hit_ratio": hits / total if total else 0.0, "backing_bytes": misses * CHUNK,
            "deadline_misses": dmiss, "reads": total, "data_wait_s": None}


# -- the simulated run -----------------------------------------------------------------------
async def _run_policy(trace: Trace, policy: str, root: str) -> dict[str, Any]:
    hinted = policy in ("tierfs+hints", "hints-evict-only")
    prefetching = policy in ("tierfs", "tierfs+hints")
    plan = HintPlan() if hinted or prefetching else None
    pol = Policy(policy if policy in ("lru", "minio") else "nothrash", window=8 * 4096, plan=plan)
    inline = Device("sim", 1, inline_under=math.inf)  # no threads: the mock clock must see all work
    tiers = [Tier("ram", os.path.join(root, f"{policy}-ram"), trace.ram_chunks * CHUNK, inline=True)]
    if trace.ssd_chunks:
        tiers.append(Tier("ssd", os.path.join(root, f"{policy}-ssd"), trace.ssd_chunks * CHUNK, inline=True))
    head: dict[str, tuple[str, int] | None] = {"pos": None}
    reads = {"n": 0, "bytes": 0}

    async def read_backing(f: BackingFile, offset: int, length: int) -> bytes:
        seek = head["pos"] != (f.key, offset)
        await trio.sleep((trace.seek_s if seek else 0.0) + trace.transfer_s * math.ceil(length / CHUNK))
        head["pos"] = (f.key, offset + length)
        reads["n"] += 1
        reads["bytes"] += length
        return pread_exact(f.fd, length, offset)

    async def run_io(fn):  # type: ignore[no-untyped-def]
        await trio.sleep(trace.seek_s + trace.transfer_s)
        return fn()

    sched = TransactionScheduler(read_backing, chunk_size=CHUNK, slice_size=8 * CHUNK, depth=1, run_io=run_io)
    cache = Cache(tiers, [inline for _ in tiers], pol, sched, chunk_size=CHUNK,
                  staging_bytes=trace.staging_chunks * CHUNK)
    backing = os.path.join(root, "backing")
    files: dict[str, BackingFile] = {}
    for name in trace.files:
        p = os.path.join(backing, name)
        fd = os.open(p, os.O_RDONLY)
        files[name] = BackingFile(Identity.of(p, os.fstat(fd)), fd)
        files[name].acquire()
    hints = None
    if plan is not None:  # tierfs: next-file prediction; with hints also the hints themselves
        hints = HintService(cache=cache, scheduler=sched, backing_root=os.fsencode(backing), meta=inline,
                            chunk_size=CHUNK, write_tier=0, budget=16 * CHUNK,
                            predict_bytes=4 * CHUNK if prefetching else 0, pace=False)
    ra = Readahead(CHUNK, 8 * CHUNK, budget=trace.staging_chunks * CHUNK) if prefetching else None
    hits = total = dmiss = 0
    waited = 0.0

    async def job(j: Job) -> None:
        nonlocal hits, total, dmiss, waited
        pid = trace.jobs.index(j) + 1
        started = trio.current_time()
        computed = 0.0
        access: dict[str, AccessState] = {}
        ra_state: dict[str, ReadaheadState] = {}
        prev: BackingFile | None = None
        for step in j.steps:
            if isinstance(step, Hint):
                if hints is not None and hinted:
                    if step.op == "epoch":
                        await hints.handle({"op": "epoch", "paths": step.files, "source": j.name})
                    else:
                        await hints.handle({"op": "phase", "name": step.name, "at_s": step.at_s,
                                            "paths": step.files, "source": j.name})
                continue
            f = files[step.file]
            if hints is not None and step.chunk == 0:
                hints.file_opened(pid, step.file.encode())
            if prev is not None and prev is not f:  # the job closes a file when it moves on
                cache.forget_access(access[prev.key])
            prev = f
            cid = (f.key, step.chunk)
            hit = cache.is_resident(cid)
            total += 1
            hits += hit
            if step.phase is not None and not hit:
                dmiss += 1
            await cache.read(f, step.chunk * CHUNK, CHUNK, access.setdefault(f.key, AccessState()))
            if ra is not None:
                st = ra_state.setdefault(f.key, ReadaheadState())
                idxs = ra.on_read(st, step.chunk * CHUNK, CHUNK, f.size)
                if idxs:
                    cache.prefetch(f, idxs)
                    if hints is not None and idxs[-1] == (f.size - 1) // CHUNK:
                        hints.file_read_end(pid, step.file.encode())
            await trio.sleep(trace.compute_s)
            computed += trace.compute_s
        waited += trio.current_time() - started - computed

    async with trio.open_nursery() as nursery:
        cache.attach(nursery)
        await nursery.start(sched.run)
        if hints is not None and prefetching:
            await nursery.start(hints.run)
        elif hints is not None:  # evict-only: the plan is kept, nothing is prefetched
            hints.predict_bytes = 0
        async with trio.open_nursery() as jobs:
            for j in trace.jobs:
                jobs.start_soon(job, j)
        nursery.cancel_scope.cancel()
    problems = cache.check()
    for f in files.values():
        f.release()
    if hints is not None:
        hints.close()  # its backing tree descriptor
    cache.close()
    out: dict[str, Any] = {"hit_ratio": hits / total if total else 0.0, "backing_bytes": reads["bytes"],
           "deadline_misses": dmiss, "reads": total, "sim_seconds": trio.current_time(),
           "data_wait_s": waited}
    if problems:
        out["invariant_violations"] = problems
    if hints is not None:
        out["plan_deadline_misses"] = hints.plan.deadline_misses
    return out


def run_trace(trace: Trace, policies: tuple[str, ...] = POLICIES) -> dict[str, dict[str, Any]]:
    """Every policy on one trace. Returns {policy: metrics}."""
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tierfs-sim-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:
        for name, chunks in trace.files.items():
            p = os.path.join(root, "backing", name)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as fh:
                fh.write(random.Random(name).randbytes(chunks * CHUNK))
        for policy in policies:
            if policy == "belady":
                results[policy] = belady(trace, trace.ram_chunks + trace.ssd_chunks + trace.staging_chunks)
                continue
            trio._core._run._r.seed(0)  # type: ignore[attr-defined]  # trio shuffles ready tasks
            clock = trio.testing.MockClock(autojump_threshold=0)
            # Without the cyclic collector during a run: trio expires cancel scopes of equal
            # deadline (common on the mock clock) in order of id(), their memory address, and
            # where an object lands depends on what a collection freed before. With it on, the
            # table changed when nothing but the collector's timing did (gc.set_threshold(700,
            # 10, 5) or (900, 10, 10), or code allocating fewer tracked objects).
            gc.collect()
            gc.disable()
            try:
                results[policy] = trio.run(_run_policy, trace, policy, root, clock=clock)
            finally:
                gc.enable()
    return results


def run(traces: list[str] | None = None, policies: tuple[str, ...] = POLICIES) -> dict[str, dict[str, dict[str, Any]]]:
    """Every named trace (default: all). Raises KeyError for an unknown trace name."""
    names = traces or list(TRACES)
    return {n: run_trace(TRACES[n](), policies) for n in names}


def check_targets(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The issue's targets; returns the ones missed (empty: all met)."""
    missed = []
    for name, r in results.items():
        if "tierfs+hints" in r and "belady" in r:
            if r["tierfs+hints"]["hit_ratio"] < 0.97 * r["belady"]["hit_ratio"]:
                missed.append(f"{name}: hints hit ratio {r['tierfs+hints']['hit_ratio']:.3f} < 0.97 x Belady "
                              f"{r['belady']['hit_ratio']:.3f}")
            if r["belady"]["deadline_misses"] == 0 and r["tierfs+hints"]["deadline_misses"] > 0:
                missed.append(f"{name}: hints missed {r['tierfs+hints']['deadline_misses']} deadline reads, Belady none")
        if "tierfs" in r and "minio" in r and r["tierfs"]["hit_ratio"] < r["minio"]["hit_ratio"]:
            missed.append(f"{name}: tierfs without hints {r['tierfs']['hit_ratio']:.3f} < no-thrash "
                          f"{r['minio']['hit_ratio']:.3f}")
    return missed
