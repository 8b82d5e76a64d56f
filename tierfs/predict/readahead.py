"""Sequential readahead per open handle, in chunks.

Like the kernel's on-demand readahead (Documentation/mm/readahead, Wu Fengguang's 2007 rework):
a read at offset 0, or one that continues where the handle's last read ended, is sequential;
each sequential step doubles the window, from 2 chunks up to ``max_window`` bytes; a random read
resets it. The window is queued as SPECULATIVE work, which the scheduler serves only when no one
waits, and which it coalesces behind a demand read of the same file into one long transfer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReadaheadState:
    next_offset: int = 0
    window: int = 0  # chunks
    issued_until: int = 0  # first chunk index not yet queued


class Readahead:
    def __init__(self, chunk_size: int, max_window: int) -> None:
        self.chunk_size = chunk_size
        self.max_chunks = max(1, max_window // chunk_size)

    def on_read(self, st: ReadaheadState, offset: int, length: int, file_size: int) -> list[int]:
        """Record a read; return chunk indexes to prefetch (possibly none)."""
        sequential = offset == st.next_offset
        st.next_offset = offset + length
        if not sequential:
            st.window = 0
            st.issued_until = 0
            return []
        cs = self.chunk_size
        last_chunk = (file_size - 1) // cs if file_size else -1
        cur = (offset + length - 1) // cs if length else offset // cs
        if st.window == 0:
            st.window = min(2, self.max_chunks)
        elif cur >= st.issued_until - st.window // 2:
            st.window = min(self.max_chunks, st.window * 2)
        start = max(cur + 1, st.issued_until)
        end = min(last_chunk, cur + st.window)
        if start > end:
            return []
        st.issued_until = end + 1
        return list(range(start, end + 1))
