"""The event-loop watch (tierfs.loopwatch), in-process on a fake step clock."""

from __future__ import annotations

import logging

import pytest
import trio

from tierfs import loopwatch
from tierfs.loopwatch import LoopWatch
from tierfs.transport.native import _Inline


@pytest.fixture(autouse=True)
def no_run_queue_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the fake step clock no time passes on a run queue (the real schedstat of a loaded
    machine would be subtracted from fake steps); a test that wants some patches its own."""
    monkeypatch.setattr(LoopWatch, "_run_delay_ns", lambda self: 0)


class StepClock:
    """Stands in for ``time.perf_counter``: a task "blocks" by advancing it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def blocker(clock: StepClock, seconds: list[float]) -> None:
    for s in seconds:
        clock.now += s  # as if the step ran a blocking call this long
        await trio.lowlevel.checkpoint()


def test_counts_steps_over_the_bound_and_keeps_the_worst(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    clock = StepClock()
    monkeypatch.setattr(loopwatch.time, "perf_counter", clock)
    watch = LoopWatch(0.020)

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(blocker, clock, [0.001, 0.030, 0.001, 0.050], name="slowpoke")
            n.start_soon(blocker, clock, [0.005, 0.005], name="fine")

    with caplog.at_level(logging.WARNING, logger="tierfs.loop"):
        trio.run(main, instruments=[watch])
    st = watch.statistics()
    assert st.over == 2 and st.worst_ms == pytest.approx(50.0) and st.bound_ms == 20.0
    assert st.worst_task.startswith("slowpoke @ ") and "test_loopwatch.py:" in st.worst_task
    [(where, off)] = st.offenders.items()
    assert where == st.worst_task and off.count == 2 and off.worst_ms == pytest.approx(50.0)
    # logged once per offender, not once per step
    assert [r.getMessage().split(" in ", 1)[1] for r in caplog.records] == [where]
    assert st.steps >= 6


def test_bound_from_env() -> None:
    assert loopwatch.bound_from_env({}) is None
    assert loopwatch.bound_from_env({loopwatch.ENV: "50"}) == pytest.approx(0.05)
    for bad in ("0", "-1", "fast"):
        with pytest.raises(ValueError, match=loopwatch.ENV):
            loopwatch.bound_from_env({loopwatch.ENV: bad})


def test_names_where_the_step_began_and_ended_and_folds_request_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = StepClock()
    monkeypatch.setattr(loopwatch.time, "perf_counter", clock)
    watch = LoopWatch(0.010)

    async def handler() -> None:
        await trio.lowlevel.checkpoint()
        clock.now += 0.020  # blocks, then ends without another checkpoint

    async def main() -> None:
        trio.lowlevel.add_instrument(watch)  # added mid-step: that step is not timed
        clock.now += 100.0
        async with trio.open_nursery() as n:
            for i in range(3):
                n.start_soon(handler, name=f"pyfuse-{i}")

    trio.run(main)
    st = watch.statistics()
    assert st.over == 3 and st.worst_ms == pytest.approx(20.0)
    [where] = st.offenders
    assert where.startswith("pyfuse @ test_loopwatch.py:") and where.endswith("-> end")


def test_run_queue_wait_is_not_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose thread sat runnable but unscheduled (a loaded machine) did not block the
    loop itself: only the rest of its wall time counts against the bound."""
    clock = StepClock()
    monkeypatch.setattr(loopwatch.time, "perf_counter", clock)
    waited = [0]  # run_delay in ns, as /proc/thread-self/schedstat would report it
    watch = LoopWatch(0.050)
    monkeypatch.setattr(watch, "_run_delay_ns", lambda: waited[0])

    async def stepper() -> None:
        for wall, starved in ((0.080, 0.070), (0.090, 0.010), (2.0, 1.99)):
            clock.now += wall
            waited[0] += int(starved * 1e9)
            await trio.lowlevel.checkpoint()

    trio.run(stepper, instruments=[watch])
    st = watch.statistics()
    assert st.over == 1 and st.worst_ms == pytest.approx(80.0)
    assert st.runqueue_ms == pytest.approx(70.0 + 10.0 + 1990.0)


def test_reads_this_threads_run_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()  # the real one
    watch = LoopWatch(0.050)
    first = watch._run_delay_ns()
    assert first >= 0 and watch._run_delay_ns() >= first


def test_a_step_paused_by_the_collector_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cyclic collector runs inside whatever step allocated last: a step over the bound
    mostly spent collecting is named "(in gc)", and collections are summed apart."""
    clock = StepClock()
    monkeypatch.setattr(loopwatch.time, "perf_counter", clock)
    watch = LoopWatch(0.010)

    async def stepper() -> None:
        for collect, work in ((0.030, 0.002), (0.001, 0.020)):
            watch.on_gc("start", {"generation": 2})
            clock.now += collect
            watch.on_gc("stop", {"generation": 2})
            clock.now += work
            await trio.lowlevel.checkpoint()

    trio.run(stepper, instruments=[watch])
    st = watch.statistics()
    assert st.over == 2
    assert st.gc_ms == pytest.approx(31.0) and st.gc_worst_ms == pytest.approx(30.0)
    assert sorted(w.endswith("(in gc)") for w in st.offenders) == [False, True]


def test_names_the_handler_inside_the_transports_inline_await(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request handler runs inside the native transport's ``_Inline``, which drives its
    coroutine by hand: the watch still names the handler's line, not ``_Inline``'s."""
    clock = StepClock()
    monkeypatch.setattr(loopwatch.time, "perf_counter", clock)
    watch = LoopWatch(0.020)

    async def handler() -> None:
        await trio.lowlevel.checkpoint()
        clock.now += 0.050
        await trio.lowlevel.checkpoint()  # the step that ran long ends here

    async def worker() -> None:
        await _Inline(handler(), lambda: None)

    trio.run(worker, instruments=[watch])
    st = watch.statistics()
    assert st.over == 1 and "test_loopwatch.py:" in st.worst_task, st.worst_task
