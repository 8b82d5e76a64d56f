"""Which file a reader opens next, without hints: the successor it opened last time (an epoch
that repeats the last one's order), else the next name in its directory (shards read in name
order). Sequential readahead stops at the end of a file; this predictor carries it across files.

Per reader (pid) and directory it remembers the last file opened. A transition ``a -> b`` seen
once is predicted again (epoch repetition); the directory's name order is predicted only after
it was right twice in that directory. Predictions are counted: when more than two thirds of the
recent ones were wrong (an epoch-shuffled reader), the predictor stays quiet, so shuffled
epochs cost nothing but a few early guesses. Pure logic; the daemon's :class:`HintService`
fetches what it predicts as a low-priority, no-deadline need that a wrong guess cancels.
"""

from __future__ import annotations

import os
from collections import OrderedDict, deque

MAX_ENTRIES = 100_000  # remembered transitions and readers (oldest dropped first)


class NextFilePredictor:
    def __init__(self) -> None:
        self.successor: OrderedDict[bytes, bytes] = OrderedDict()
        self.last: OrderedDict[tuple[int, bytes], bytes] = OrderedDict()
        self.dir_order_right: dict[bytes, int] = {}
        self.outcomes: deque[bool] = deque(maxlen=32)
        self.predicted: dict[tuple[int, bytes], bytes] = {}
        self.hits = 0
        self.misses = 0

    def confident(self) -> bool:
        return len(self.outcomes) < 6 or sum(self.outcomes) * 3 >= len(self.outcomes)

    def opened(self, pid: int, rel: bytes, listing: list[bytes] | None) -> bytes | None:
        """``pid`` opened ``rel`` for reading (``listing``: sorted names of its directory, if
        known). Learns the transition; returns the file a wrong earlier prediction named (to
        cancel), else None."""
        d = os.path.dirname(rel)
        key = (pid, d)
        wrong = None
        guess = self.predicted.pop(key, None)
        if guess is not None:
            right = guess == rel
            self.outcomes.append(right)
            if right:
                self.hits += 1
            else:
                self.misses += 1
                wrong = guess
        prev = self.last.get(key)
        if prev is not None and prev != rel:
            self.successor[prev] = rel
            self.successor.move_to_end(prev)
            if listing is not None and _next_name(listing, prev) == os.path.basename(rel):
                self.dir_order_right[d] = self.dir_order_right.get(d, 0) + 1
        self.last[key] = rel
        self.last.move_to_end(key)
        for od in (self.successor, self.last):
            while len(od) > MAX_ENTRIES:
                od.popitem(last=False)
        return wrong

    def predict(self, pid: int, rel: bytes, listing: list[bytes] | None) -> bytes | None:
        """``pid`` is reading the end of ``rel``: the file it will open next, or None."""
        if not self.confident():
            return None
        d = os.path.dirname(rel)
        nxt = self.successor.get(rel)
        if nxt is None and listing is not None and self.dir_order_right.get(d, 0) >= 2:
            name = _next_name(listing, rel)
            nxt = os.path.join(d, name) if name is not None else None
        if nxt is None or nxt == rel:
            return None
        self.predicted[(pid, d)] = nxt
        return nxt


def _next_name(listing: list[bytes], rel: bytes) -> bytes | None:
    import bisect

    base = os.path.basename(rel)
    i = bisect.bisect_right(listing, base)
    return listing[i] if i < len(listing) else None
