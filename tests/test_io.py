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
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(io, "time", types.SimpleNamespace(monotonic=c.monotonic))
    return c


def on_loop_thread(clock: FakeClock, took_s: float = 0.0) -> Callable[[], bool]:
    """A blocking call that takes ``took_s`` seconds of the fake clock; True if it ran on the
    event loop's thread."""
    main = threading.get_ident()

    def call() -> bool:
        clock.now += took_s
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


async def test_one_spike_sends_calls_to_threads(clock: FakeClock) -> None:
    dev = Device("t", 2, inline_under=0.001, thread_period=30)
    assert await dev.run(on_loop_thread(clock, 0.015))  # a cold HDD lookup: 15x the limit
    assert not await dev.run(on_loop_thread(clock))
    assert dev.inline_calls == 1 and dev.thread_calls == 1


async def test_without_inline_limit_every_call_is_threaded(clock: FakeClock) -> None:
    dev = Device("t", 1)
    assert not await dev.run(on_loop_thread(clock))
    assert dev.inline_calls == 0 and dev.thread_calls == 1
