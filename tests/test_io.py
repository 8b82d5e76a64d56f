"""tierfs.io.Device: when blocking calls run inline on the event loop and when in threads."""

from __future__ import annotations

import threading
import time

import trio

from tierfs.io import Device


def on_loop_thread(main: int, sleep_s: float = 0.0):  # type: ignore[no-untyped-def]
    def call() -> bool:
        if sleep_s:
            time.sleep(sleep_s)
        return threading.get_ident() == main
    return call


async def test_inline_until_the_mean_is_slow_then_threads_for_a_period() -> None:
    dev = Device("t", 2, inline_under=0.002, thread_period=0.3)
    main = threading.get_ident()
    assert await dev.run(on_loop_thread(main))
    # one outlier (3x the limit, under the spike factor) does not leave inline mode ...
    assert await dev.run(on_loop_thread(main, 0.006))
    assert await dev.run(on_loop_thread(main))
    assert dev.slow_inline_calls == 1 and dev.thread_calls == 0
    # ... a run of slow calls does
    for _ in range(30):
        if not await dev.run(on_loop_thread(main, 0.004)):
            break
    assert dev.thread_calls == 1
    assert not await dev.run(on_loop_thread(main))  # still threaded within the period
    await trio.sleep(0.35)
    assert await dev.run(on_loop_thread(main))  # tried inline again after it


async def test_one_spike_sends_calls_to_threads() -> None:
    dev = Device("t", 2, inline_under=0.001, thread_period=30)
    main = threading.get_ident()
    assert await dev.run(on_loop_thread(main, 0.015))  # a cold HDD lookup: 15x the limit
    assert not await dev.run(on_loop_thread(main))
    assert dev.inline_calls == 1 and dev.thread_calls == 1


async def test_without_inline_limit_every_call_is_threaded() -> None:
    dev = Device("t", 1)
    assert not await dev.run(on_loop_thread(threading.get_ident()))
    assert dev.inline_calls == 0 and dev.thread_calls == 1
