"""The life of a dirty file: one enum and one transition helper that refuses illegal moves.

::

              write-back starts                    commit (rename into place)
    DIRTY ---------------------------> WRITING -------------------------------> CLEAN
      ^  ^   changed / failed / abort     |                                      |
      |  +--------------------------------+                                      |
      |                                                                          |
      |  write tier full                      switched                           |
      +------------------> SWITCHING ------------------> THROUGH                 |
      |   copy failed (temp file removed)   |               |  ^                 |
      +<------------------------------------+               |  | changed/failed  |
                                                            v  |                 |
                                                      THROUGH_WRITING -----------+
    (any state but CLEAN) --- unlinked and closed ---> GONE
    CLEAN --- written again through a handle still open ---> DIRTY (or THROUGH)

Each move that has a crash story is journaled (:class:`tierfs.writeback.journal.JState`)
*before* its effect; docs/concurrency.md gives what ``kill -9`` in each state leaves and what
recovery does with it.
"""

from __future__ import annotations

import enum


class DirtyState(enum.Enum):
    DIRTY = "dirty"  # bytes in the write tier's data file; queued for write-back once closed
    WRITING = "writing"  # a write-back copies one generation to a temporary file (or in place)
    SWITCHING = "switching"  # the write tier is full: copying the data file to the backing store
    THROUGH = "through"  # bytes in a complete temporary file on the backing store (or, after an
    # earlier commit, in the final file itself)
    THROUGH_WRITING = "through-writing"  # a written-through file being fsynced and renamed
    CLEAN = "clean"  # on the backing store as it is; the tiers read it from there again
    GONE = "gone"  # unlinked and closed: forgotten


class IllegalTransition(AssertionError):
    """A move the diagram above does not have (a bug, never user input)."""


_S = DirtyState
TRANSITIONS: dict[DirtyState, frozenset[DirtyState]] = {
    _S.DIRTY: frozenset({_S.WRITING, _S.SWITCHING, _S.CLEAN, _S.GONE}),
    _S.WRITING: frozenset({_S.DIRTY, _S.CLEAN, _S.GONE}),
    _S.SWITCHING: frozenset({_S.DIRTY, _S.THROUGH, _S.GONE}),
    _S.THROUGH: frozenset({_S.THROUGH_WRITING, _S.CLEAN, _S.GONE}),
    _S.THROUGH_WRITING: frozenset({_S.THROUGH, _S.CLEAN, _S.GONE}),
    _S.CLEAN: frozenset({_S.DIRTY, _S.THROUGH, _S.GONE}),
    _S.GONE: frozenset(),
}


def check_move(old: DirtyState, new: DirtyState) -> None:
    """Raises IllegalTransition unless ``old -> new`` is in :data:`TRANSITIONS` (or a no-op)."""
    if new is not old and new not in TRANSITIONS[old]:
        raise IllegalTransition(f"dirty file: illegal move {old.value} -> {new.value}")
