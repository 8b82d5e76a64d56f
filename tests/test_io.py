"""tierfs.io.Device: when blocking calls run inline on the event loop and when in threads.

The device measures its calls with ``time.monotonic``; here it reads a fake clock that each
stand-in call advances by the duration it pretends to take, so every decision is exact."""

from __future__ import annotations

import threading
import types
from collections.abc import Callable

import pytest

from tierfs import io
from tierfs.io import Device


class FakeClock:
    """Wall time, the loop thread's CPU time and its voluntary context switches (sleeps)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.cpu = 5.0
        self.switches = 0

    def monotonic(self) -> float:
        return self.now

    def thread_time(self) -> float:
        return self.cpu


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(io, "time", types.SimpleNamespace(monotonic=c.monotonic, thread_time=c.thread_time))
    monkeypatch.setattr(io, "_voluntary_switches", lambda: c.switches)
    return c


def on_loop_thread(clock: FakeClock, took_s: float = 0.0, *, cpu_s: float | None = None) -> Callable[[], bool]:
    """A blocking call that takes ``took_s`` seconds of the fake clock, sleeping (waiting for
    I/O) unless ``cpu_s`` is given: then it never sleeps and uses ``cpu_s`` of CPU (the rest
    of ``took_s`` it was preempted). True if it ran on the event loop's thread."""
    main = threading.get_ident()

    def call() -> bool:
        clock.now += took_s
        if cpu_s is None:
            clock.switches += 1
        else:
            clock.cpu += cpu_s
        return threading.get_ident() == main
    return call


async def test_inline_until_the_mean_is_slow_then_threads_for_a_period(clock: FakeClock) -> None:
    dev = Device("t", 2, inline_under=0.002, thread_period=0.3)
    assert await dev.run(on_loop_thread(clock))
    # one outlier (3x the limit, under the spike factor) does not leave inline mode ...
    assert await dev.run(on_loop_thread(clock, 0.006))
    assert await dev.run(on_loop_thread(clock))
    assert dev.slow_inline_calls == 1 and dev.thread_calls == 0
    # ... a run of slow calls does: the mean of 4 ms calls passes 2 ms at the 6th of them
    inline = 0
    while await dev.run(on_loop_thread(clock, 0.004)):
        inline += 1
        tripped_at = clock.now  # the end of the last inline call
        assert inline < 30
    assert inline == 6 and dev.thread_calls == 1
    assert not await dev.run(on_loop_thread(clock))  # still threaded within the period ...
    clock.now = tripped_at + 0.299
    assert not await dev.run(on_loop_thread(clock))  # ... which counts from the slow call's end
    clock.now = tripped_at + 0.301
    assert await dev.run(on_loop_thread(clock))  # tried inline again after it


async def test_a_second_spike_sends_calls_to_threads(clock: FakeClock) -> None:
    """A call that slept 15x the limit is a cold HDD lookup, or a short sleep and a long wait
    for a CPU on a loaded machine: one alone keeps calls inline, a second one soon after (a
    slow device does it again) sends them to threads. One far apart is a new first one."""
    dev = Device("t", 2, inline_under=0.001, thread_period=30)
    assert await dev.run(on_loop_thread(clock, 0.015))
    for _ in range(Device.CONFIRM_CALLS):
        assert await dev.run(on_loop_thread(clock))
    assert await dev.run(on_loop_thread(clock, 0.015))  # long after the first: a first again
    assert await dev.run(on_loop_thread(clock))
    assert dev.thread_calls == 0 and dev.slow_inline_calls == 2
    assert await dev.run(on_loop_thread(clock, 0.015))  # a cold HDD: the next lookup is slow too
    assert not await dev.run(on_loop_thread(clock))
    assert dev.thread_calls == 1


async def test_a_failed_probe_doubles_the_thread_period(clock: FakeClock) -> None:
    """Back-off: when calls go back to threads within PROBE_CALLS inline calls after a thread
    period, the next period is twice as long (up to MAX_PERIOD_FACTOR times the period); a
    probe that lasts PROBE_CALLS calls ends the back-off. A probe, like any inline run, needs
    two slow calls that slept to go back to threads."""
    dev = Device("t", 2, inline_under=0.001, thread_period=1.0)

    async def threads_for() -> float:
        start = clock.now
        while not await dev.run(on_loop_thread(clock)):
            clock.now += 0.05
        return round(clock.now - start, 1)

    assert await dev.run(on_loop_thread(clock, 0.015))
    assert await dev.run(on_loop_thread(clock, 0.015))  # confirmed: threads for 1 s
    periods = []
    for _ in range(6):
        periods.append(await threads_for())
        assert await dev.run(on_loop_thread(clock, 0.015))  # one alone: still inline
        assert await dev.run(on_loop_thread(clock, 0.015))  # the second: back to threads
    assert periods == [1.0, 2.0, 4.0, 8.0, 16.0, 16.0]
    assert dev.period == 16.0
    await threads_for()
    for _ in range(Device.PROBE_CALLS + 1):  # a probe that lasts
        assert await dev.run(on_loop_thread(clock))
    assert dev.period == 1.0
    assert await dev.run(on_loop_thread(clock, 0.015))
    assert await dev.run(on_loop_thread(clock, 0.015))  # confirmed: threads for 1 s again
    assert await threads_for() == 1.0


async def test_without_inline_limit_every_call_is_threaded(clock: FakeClock) -> None:
    dev = Device("t", 1)
    assert not await dev.run(on_loop_thread(clock))
    assert dev.inline_calls == 0 and dev.thread_calls == 1


async def test_preemption_is_not_charged_to_the_call(clock: FakeClock) -> None:
    """On a loaded machine a call that never slept can take long only because other processes
    held the CPU: it stays inline (a thread would wait for a CPU too, plus a hand-off)."""
    dev = Device("t", 2, inline_under=0.001, thread_period=30)
    for _ in range(20):
        assert await dev.run(on_loop_thread(clock, 0.050, cpu_s=0.0001))
    assert dev.thread_calls == 0 and dev.slow_inline_calls == 0
    # but a call that holds the CPU itself that long blocks the loop: threads
    assert await dev.run(on_loop_thread(clock, 0.050, cpu_s=0.030))
    assert not await dev.run(on_loop_thread(clock))


async def test_time_of_other_tasks_at_the_checkpoint_is_not_charged(clock: FakeClock) -> None:
    """The call yields to other tasks before it runs; their time is theirs."""
    import trio

    dev = Device("t", 2, inline_under=0.001, thread_period=30)

    async def other_task() -> None:
        clock.now += 0.050  # another request's step, run during dev.run's checkpoint

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(other_task)
            assert await dev.run(on_loop_thread(clock, 0.0001))
    assert dev.thread_calls == 0 and dev.slow_inline_calls == 0


async def test_calls_made_now_are_judged_with_the_awaited_ones(clock: FakeClock) -> None:
    """``run_now`` (a request answered as the transport reads it, which cannot await) runs
    inline only where ``inline_now`` says a call would, and its durations count as an awaited
    call's: two slow calls of either kind send both kinds to threads for the period."""
    dev = Device("t", 2, inline_under=0.001, thread_period=30)
    assert dev.inline_now()
    assert dev.run_now(on_loop_thread(clock, 0.015))  # a first spike: still inline
    assert dev.inline_now()
    assert await dev.run(on_loop_thread(clock, 0.015))  # a second: threads from now on
    assert not dev.inline_now() and dev.inline_calls == 2 and dev.slow_inline_calls == 2
    assert not await dev.run(on_loop_thread(clock))
    clock.now += 31
    assert dev.inline_now()
    assert not Device("u", 2).inline_now()  # no inline limit: never inline
