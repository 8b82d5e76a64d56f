"""Background tasks that cost one piece of work when they fail, never the daemon.

The daemon runs everything in one trio nursery (``mount.serve``): an exception that escapes a
task started there cancels the nursery, which unmounts the filesystem under every reader. A task
started on behalf of one request (placing a fetched chunk in a tier, dropping a stale file's
chunks, a next-file prediction) must therefore catch what it raises: :func:`spawn` starts it
wrapped so that an ``Exception`` is logged (through the event throttle, with its traceback at
most once a minute per task kind) and counted in :data:`failures`, and the daemon goes on.
Cancellation (``trio.Cancelled``, a ``BaseException``) still propagates, so unmount works.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from tierfs import logevents

log = logging.getLogger("tierfs.tasks")

#: background task failures by task kind (``what``), since the daemon started; in ``tierfs stats``
failures: Counter[str] = Counter()


async def guarded(what: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """Await ``fn(*args)``; an ``Exception`` it raises is logged and counted, not propagated."""
    try:
        await fn(*args)
    except Exception as e:  # noqa: BLE001 - one failed background step must not end the mount
        failures[what] += 1
        logevents.event(log, logging.ERROR, f"task-failed:{what}",
                        "background task %s failed (the daemon goes on): %r", what, e, exc_info=True)


def spawn(nursery: trio.Nursery, what: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """``nursery.start_soon(fn, *args)``, guarded by :func:`guarded` under the name ``what``."""
    nursery.start_soon(guarded, what, fn, *args, name=what)
