"""How long the daemon's event loop is blocked: a trio instrument timing each task step.

Every FUSE request, write-back and prefetch shares one trio event loop; a task step (the code a
task runs between two checkpoints) that takes long holds up all of them. The rule (see
docs/concurrency.md) is that blocking work runs in a thread; this instrument enforces it. It
times every step with ``time.perf_counter`` and, for a step longer than the bound, counts it,
keeps the worst, and logs once per offender: the task's name, the line where the step began
(where the task resumed) and where it ended (where it awaited next, or "end"); the code that
blocked lies between the two.

A step's time excludes the time its thread waited on the CPU run queue (``run_delay`` of
``/proc/thread-self/schedstat``, Documentation/scheduler/sched-stats.rst): on a loaded machine
(2 cores, a test suite and other processes) the kernel can leave the loop's thread runnable but
unscheduled for seconds (measured: a 2,129 ms "step" while pjdfstest ran beside the suite), which
no code in the daemon caused. Time spent waiting for the GIL held by one of the daemon's own
threads, or blocked in a syscall, is not run-queue time and still counts. Where schedstat is
unavailable the wall time is used. Reading it costs one ``pread`` per step (0.6 us measured).

The cyclic garbage collector runs inside whatever step allocated when a collection fell due;
a ``gc.callbacks`` hook sums its time, and a step over the bound that was mostly a collection
is named with ``(in gc)``.

Enabled by the environment variable ``TIERFS_LOOP_BOUND_MS`` (milliseconds, > 0) in the
daemon's environment; off otherwise (two clock reads per step are cheap but not free). The test
suite's mount fixtures enable it and fail a test whose daemon exceeded the bound.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import Any

import trio

ENV = "TIERFS_LOOP_BOUND_MS"
MAX_OFFENDERS = 64  # distinct offenders kept (each a task name and line); the rest are counted only

log = logging.getLogger("tierfs.loop")

# The request a transport's handler began last (pyfuse3's compiled request loop hides the
# handler's frames from a step that ran one to its end): set by the transport, cleared at each
# step's start, named beside an offending step.
request = [""]


@dataclass(frozen=True)
class Offender:
    """Steps of one task (at one suspension point) that exceeded the bound."""

    count: int
    worst_ms: float
    worst_cpu_ms: float = 0.0  # CPU time the loop's thread used in the worst step (the rest: off CPU)


@dataclass(frozen=True)
class LoopStats:
    """Counters of :class:`LoopWatch` (``stats.json`` key ``loop``). Times in milliseconds."""

    bound_ms: float
    steps: int  # task steps timed
    over: int  # steps longer than the bound
    worst_ms: float  # the longest step
    worst_task: str  # its task and suspension point ("" if no step exceeded the bound)
    runqueue_ms: float = 0.0  # run-queue wait excluded from the steps over the bound (summed)
    gc_ms: float = 0.0  # time in the cyclic garbage collector (summed; it runs inside a step)
    gc_worst_ms: float = 0.0  # the longest collection
    offenders: dict[str, Offender] = field(default_factory=dict)


# Frames of these (trio's traps, contextlib, pyfuse3) are where every task suspends; the
# interesting frame is the innermost one outside them: tierfs' own code (or a test's).
_LIBRARY_DIRS = tuple({sysconfig.get_path(k) + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def _frame(task: trio.lowlevel.Task) -> tuple[FrameType, int] | None:
    """The innermost frame of our own code (library frames skipped) the task is suspended in,
    with its line then (a frame's line moves on when it runs again), or None (not started, or
    finished)."""
    found: tuple[FrameType, int] | None = None
    coro: Any = task.coro
    for _ in range(64):  # an await chain is never this deep; the cap only guards a cycle
        f = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if f is not None and not f.f_code.co_filename.startswith(_LIBRARY_DIRS):
            found = (f, f.f_lineno)
        nxt = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        if nxt is None and f is not None and f.f_code.co_name == "__await__":
            # an awaitable that drives a coroutine by hand keeps it in its local ``coro``
            # (tierfs.transport.native._Inline: every request handler runs in one)
            nxt = f.f_locals.get("coro")
        if nxt is None:
            break
        coro = nxt
    return found


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _at(place: tuple[FrameType, int] | None) -> str:
    if place is None:
        return "?"
    path = place[0].f_code.co_filename
    # relative to the package (a checkout may itself live in a directory named tierfs)
    short = path[len(_PACKAGE):] if path.startswith(_PACKAGE) else os.path.basename(path)
    return f"{short}:{place[1]}"


def _task_name(task: trio.lowlevel.Task) -> str:
    """The task's name without a per-request number (pyfuse3 names its workers pyfuse-N)."""
    return re.sub(r"-\d+$", "", task.name)


class LoopWatch(trio.abc.Instrument):
    """Counts task steps longer than ``bound_s`` seconds (see the module docstring).

    Runs in the event loop's thread only (trio calls instruments there); not thread-safe.
    """

    def __init__(self, bound_s: float, logger: logging.Logger = log) -> None:
        if not bound_s > 0:
            raise ValueError(f"loop bound must be > 0 s, got {bound_s!r}")
        self.bound_s = bound_s
        self.log = logger
        self.steps = 0
        self.over = 0
        self.worst_s = 0.0
        self.worst_task = ""
        self._offenders: dict[str, list[float]] = {}  # where -> [count, worst seconds, its CPU seconds]
        self._started: float | None = None  # None: the step began before the watch was added
        self._resumed_at: tuple[FrameType, int] | None = None
        self.runqueue_s = 0.0
        self._schedstat: int | None = None  # fd of the loop thread's schedstat (-1: unavailable)
        self._waited = 0  # run_delay (ns) at the step's start
        self._cpu = 0.0  # the thread's CPU time at the step's start
        self.gc_s = 0.0
        self.gc_worst_s = 0.0
        self._gc_started = 0.0
        self._gc_in_step = 0.0  # collector time inside the current step

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        """A ``gc.callbacks`` hook: a full collection pauses whatever step triggered it, so a
        step over the bound says how much of it the collector took."""
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        took = time.perf_counter() - self._gc_started
        self.gc_s += took
        self._gc_in_step += took
        self.gc_worst_s = max(self.gc_worst_s, took)

    def _run_delay_ns(self) -> int:
        """Nanoseconds this thread has waited on a run queue so far (0 if unknown). The file is
        opened from the loop's thread on first use (trio calls instruments there)."""
        if self._schedstat is None:
            try:
                self._schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._schedstat = -1
        if self._schedstat < 0:
            return 0
        try:
            return int(os.pread(self._schedstat, 64, 0).split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._resumed_at = _frame(task)
        self._waited = self._run_delay_ns()
        self._gc_in_step = 0.0
        request[0] = ""
        self._cpu = time.thread_time()
        self._started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._started is None:
            return
        wall = time.perf_counter() - self._started
        self._started = None
        self.steps += 1
        took = wall
        if wall > self.bound_s:
            starved = max(0.0, (self._run_delay_ns() - self._waited) / 1e9)
            took = max(0.0, wall - starved)
            self.runqueue_s += min(starved, wall)
        if took > self.worst_s:
            self.worst_s = took
        if took <= self.bound_s:
            return
        self.over += 1
        cpu = time.thread_time() - self._cpu
        # from where the task resumed to where it suspended next (or ended): the code between
        after = _frame(task)
        what = f" [{request[0]}]" if request[0] else ""
        where = f"{_task_name(task)}{what} @ {_at(self._resumed_at)} -> {_at(after) if after else 'end'}"
        if self._gc_in_step > self.bound_s / 2:  # the collector, not the code between
            where += " (in gc)"
        if took >= self.worst_s:
            self.worst_task = where
        known = self._offenders.get(where)
        if known is not None:
            known[0] += 1
            if took > known[1]:
                known[1], known[2] = took, cpu
            return
        if len(self._offenders) < MAX_OFFENDERS:
            self._offenders[where] = [1, took, cpu]
        self.log.warning("event loop blocked %.1f ms (bound %.0f ms; %.1f ms of it on CPU) in %s",
                         took * 1e3, self.bound_s * 1e3, cpu * 1e3, where)

    def statistics(self) -> LoopStats:
        return LoopStats(
            bound_ms=self.bound_s * 1e3, steps=self.steps, over=self.over,
            worst_ms=round(self.worst_s * 1e3, 3), worst_task=self.worst_task,
            runqueue_ms=round(self.runqueue_s * 1e3, 3),
            gc_ms=round(self.gc_s * 1e3, 3), gc_worst_ms=round(self.gc_worst_s * 1e3, 3),
            offenders={k: Offender(int(c), round(w * 1e3, 3), round(u * 1e3, 3))
                       for k, (c, w, u) in self._offenders.items()})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self.statistics())


def bound_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> float | None:
    """The bound in seconds from ``TIERFS_LOOP_BOUND_MS``, or None when unset or empty.

    Raises:
        ValueError: a value that is not a number > 0 (naming the variable).
    """
    text = environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        ms = float(text)
    except ValueError:
        raise ValueError(f"{ENV}: expected milliseconds > 0, got {text!r}") from None
    if not ms > 0:
        raise ValueError(f"{ENV}: expected milliseconds > 0, got {text!r}")
    return ms / 1e3


def install(watch: LoopWatch) -> None:
    """Add ``watch`` to the running trio loop (steps are timed from the next one on)."""
    trio.lowlevel.add_instrument(watch)
    if watch.on_gc not in gc.callbacks:
        gc.callbacks.append(watch.on_gc)
    log.debug("event loop watch: steps longer than %.0f ms are counted and logged", watch.bound_s * 1e3)
