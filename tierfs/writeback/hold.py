"""When write-back waits for a burst of writes to end.

``tar -x`` or ``cp -a`` of thousands of small files through the mount closes a file every few
milliseconds. Writing each one back as soon as it closed ran the write-back worker beside the
burst: every CREATE, SETATTR and WRITE of the command then waited behind the write-back's
journal commits, thread hand-offs and event-loop steps of the files closed a moment earlier.
Measured on the 2-core VM (docs/benchmarks.md, "where tar -x's time goes"): ``tar -x`` of
10,000 files of 1-16 KiB took 45.7 and 56.0 s with write-back at once, 19.1, 27.3 and 27.7 s
with write-back held until the command ended.

The kernel's page cache answers the same question with ``dirty_expire_centisecs`` (30 s: how
long dirty data may wait) and ``dirty_background_ratio`` (how much may wait before background
write-back starts anyway): Documentation/admin-guide/sysctl/vm.rst. tierfs does the same for
the write-back of whole files, with one more condition, since its write-back competes with the
writer for the daemon and not only for the disk: it holds write-back only *while a burst
lasts*. A file's write-back is held (:func:`hold_until`) when all of these are true:

* holding is on (``writeback_hold`` > 0 s, the longest a file is held after its close);
* nobody waits for the file (no ``tierfs flush``, ``fsync`` that waits for the backing store,
  ``wait_durable`` hint, or write-tier overrun moved its deadline forward);
* a burst is going on (:class:`BurstMeter`): at least :data:`BURST_FILES` written files were
  closed within :data:`BURST_WINDOW_S`, the last less than :data:`QUIET_S` ago. A checkpoint
  saved now and then, or a log file appended to every second, is no burst: its write-back
  starts at once, as before;
* the file was closed less than ``writeback_hold`` ago (it never waits longer, however long
  the burst);
* dirty data fills at most :data:`HOLD_DIRTY_FRACTION` of the write tier (past it, write-back
  runs beside the burst again, so that the burst's files keep fitting in the tier instead of
  being written through).

Holding changes when a file reaches the backing store, never whether: its ``writeback_deadline``
and the crash-safety of the write tier are as before (docs/writes.md).
"""

from __future__ import annotations

import collections
import math

BURST_FILES = 16  # written files closed within BURST_WINDOW_S that make a burst (>= 16 files/s)
BURST_WINDOW_S = 1.0
QUIET_S = 0.5  # a burst has ended when no written file was closed for this long
HOLD_DIRTY_FRACTION = 0.25  # of the write tier's capacity: dirty data past it is not held
LOOK_AGAIN_S = 0.5  # the longest the worker holds before it looks at the state again


class BurstMeter:
    """The times of the last :data:`BURST_FILES` closes of written files (trio clock, s)."""

    def __init__(self) -> None:
        self._closes: collections.deque[float] = collections.deque(maxlen=BURST_FILES)

    def closed(self, now: float) -> None:
        """A written file was closed (or created: a create is the start of one) at ``now``."""
        self._closes.append(now)

    def ends_at(self, now: float) -> float:
        """When the burst going on at ``now`` ends unless another file is closed (``now`` + up
        to QUIET_S), or -inf when there is none."""
        c = self._closes
        if len(c) < BURST_FILES or c[-1] - c[0] > BURST_WINDOW_S:
            return -math.inf
        end = c[-1] + QUIET_S
        return end if end > now else -math.inf


def hold_until(*, now: float, burst_end: float, closed_at: float, hold_s: float,
               urgent: bool, dirty_bytes: int, tier_capacity: int) -> float | None:
    """When to look again at a file whose write-back is held now (trio clock, s), or None to
    write it back now. ``closed_at``: when its last writer closed; ``urgent``: someone waits
    for it; ``dirty_bytes``: of every dirty file in the write tier, of ``tier_capacity`` bytes.
    The time returned is at most LOOK_AGAIN_S ahead (the write tier may fill up meanwhile;
    WriteBack also wakes the worker when it does)."""
    if hold_s <= 0 or urgent or burst_end <= now:
        return None
    expires = closed_at + hold_s
    if expires <= now or dirty_bytes > HOLD_DIRTY_FRACTION * tier_capacity:
        return None
    return min(burst_end, expires, now + LOOK_AGAIN_S)
