"""Sequential readahead: windows grow, are issued whole, and share the staging budget."""

from __future__ import annotations

from tierfs.predict.readahead import Readahead, ReadaheadState

CS = 4 << 20


def sequential(ra: Readahead, st: ReadaheadState, size: int, step: int = 1 << 20) -> list[list[int]]:
    issued = []
    for off in range(0, size, step):
        got = ra.on_read(st, off, min(step, size - off), size)
        if got:
            issued.append(got)
    return issued


def test_windows_grow_and_are_issued_whole() -> None:
    ra = Readahead(CS, 32 * CS)
    batches = sequential(ra, ReadaheadState(), 200 * CS)
    sizes = [len(b) for b in batches]
    assert sizes[:5] == [2, 4, 8, 16, 32]
    flat = [i for b in batches for i in b]
    assert flat == sorted(set(flat)) and flat[0] == 1  # each chunk once, in order
    assert flat[-1] == 199  # up to the end of the file, never past it
    assert all(b == list(range(b[0], b[-1] + 1)) for b in batches)  # contiguous batches


def test_random_reads_get_no_readahead() -> None:
    ra = Readahead(CS, 32 * CS)
    st = ReadaheadState()
    assert ra.on_read(st, 50 * CS, 4096, 100 * CS) == []
    assert ra.on_read(st, 10 * CS, 4096, 100 * CS) == []
    assert ra.streams == 0


def test_streams_share_the_budget() -> None:
    ra = Readahead(CS, 64 * CS, budget=64 * CS)
    states = [ReadaheadState() for _ in range(8)]
    for st in states:
        ra.on_read(st, 0, 1 << 20, 1000 * CS)
    assert ra.streams == 8
    for st in states:
        sequential(ra, st, 300 * CS)
    assert max(st.window for st in states) <= 64 // 8
    for st in states:
        ra.forget(st)
    assert ra.streams == 0
