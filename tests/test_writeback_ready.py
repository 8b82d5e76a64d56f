"""The write-back worker's choice (tierfs.writeback.ready) equals the scan of every dirty file it
replaced: on random states and changes (hypothesis), and on the choices of real write-backs."""

from __future__ import annotations

import math
import os
import random
import shutil
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_writeback_inprocess import Disks, backing_bytes, instance
from tierfs.errors import BackingIOError
from tierfs.writeback import worker
from tierfs.writeback.manager import DirtyFile, DirtyState, WriteBack
from tierfs.writeback.ready import READY_FIELDS, DirtyTable, scan_choice

scan = scan_choice  # the choice as it was made before the index: a scan of every dirty file


# Small domains, so that ties (equal deadlines), retries coming due and every condition flipping
# all happen often. The first value of each keeps a file ready; it is drawn most often (_pick).
_EV = trio.Event()
VALUES: dict[str, list[object]] = {
    "state": [DirtyState.DIRTY, DirtyState.THROUGH, DirtyState.WRITING, DirtyState.CLEAN,
              DirtyState.SWITCHING, DirtyState.THROUGH_WRITING, DirtyState.GONE],
    "path": [b"a", None, b"b/c"],
    "retry_at": [0.0, 1.0, 2.0, 5.0],
    "inflight": [0, 1, 2],
    "excl": [None, _EV],
    "writers": [0, 1, 2],
    "waiters": [(), ((1, _EV),)],
    "durable_gen": [-1, 0, 1, 2],
    "gen": [0, 1, 2, 3],
    "deadline": [0.0, 1.0, 2.0, math.inf],
    "filling": [0, 1],
    "size": [0, 10],  # not read by the choice: changing it must change nothing
}
NOWS = [0.0, 0.5, 1.0, 2.0, 3.0, 6.0]
VARIED = ("deadline", "retry_at", "gen", "durable_gen")  # what differs between new ready files


def _pick(name: str, k: int) -> object:
    vals = VALUES[name]
    return vals[k] if k < len(vals) else vals[0]


_set = st.tuples(st.just("set"), st.integers(0, 30), st.sampled_from(sorted(VALUES)), st.integers(0, 7))
_op = st.one_of(
    _set, _set, _set, _set,  # changes of fields most often
    st.tuples(st.just("add"), st.integers(0, 30), st.integers(0, 10), st.integers(0, 40)),
    st.tuples(st.just("replace"), st.integers(0, 30), st.integers(0, 10), st.integers(0, 40)),
    st.tuples(st.just("remove"), st.integers(0, 30), st.integers(0, 10), st.integers(0, 40)),
)


def _new_file(id_: int, seed: int) -> DirtyFile:
    """Mostly a ready file (its deadline, retry time and generations drawn from ``seed``)."""
    df = DirtyFile(id_, b"f%d" % id_, f"/nonexistent/{id_}")
    for name in VALUES:
        setattr(df, name, _pick(name, 0))
    for i, name in enumerate(VARIED):
        vals = VALUES[name]
        setattr(df, name, vals[(seed // (i + 1)) % len(vals)])
    return df


@settings(max_examples=500, deadline=None, derandomize=True)
@given(ops=st.lists(_op, max_size=60), first=st.lists(st.integers(0, 40), max_size=8))
def test_the_index_chooses_as_the_scan_did(ops: list[tuple[str, int, object, int]], first: list[int]) -> None:
    """After every change to any field, any file added, replaced or removed, and at any time,
    the index's choice is the scan's (the same object: the earliest deadline, ties to the file
    registered first). A field the index did not hear of would make them differ."""
    files = DirtyTable()
    next_id = 0
    for seed in first:
        files[next_id] = _new_file(next_id, seed)
        next_id += 1
    for op, i, a, b in ops:
        ids = list(files)
        if op == "add":
            files[next_id] = _new_file(next_id, b)
            next_id += 1
        elif ids and op == "set":
            setattr(files[ids[i % len(ids)]], str(a), _pick(str(a), b))
        elif ids and op == "replace":  # a new object under an id already there: keeps its place
            key = ids[i % len(ids)]
            files[key] = _new_file(key, b)
        elif ids and op == "remove":
            key = ids[i % len(ids)]
            gone = files.pop(key) if b % 2 else files[key]
            if not b % 2:
                del files[key]
            gone.deadline = 0.0  # a file no longer in the table is never chosen, whatever it does
            gone.writers = 0
        for now in NOWS:
            assert files.ready.first(now) is scan(files, now), (op, a, now)
    files.clear()
    assert files.ready.first(math.inf) is None


# the fields scan() reads
SCANNED = ("state", "path", "retry_at", "inflight", "excl", "writers", "waiters", "durable_gen", "gen",
           "deadline", "filling")


def test_every_field_the_choice_reads_is_varied() -> None:
    assert set(SCANNED) <= set(VALUES) and READY_FIELDS <= set(VALUES)


@pytest.mark.parametrize("name", SCANNED)
def test_a_change_of_each_field_is_heard(name: str) -> None:
    """For each field the choice reads: random states in which changing only that field
    changes the scan's choice at some time, and the index makes the same choice after it
    (fails for any field whose assignment the index does not hear of)."""
    rnd = random.Random(name)
    mattered = 0
    for _ in range(3000):
        files = DirtyTable()
        other = _new_file(0, 0)
        other.deadline, other.retry_at = 1.0, 0.0
        df = _new_file(1, 0)
        for field_name, vals in VALUES.items():  # near a ready state: most changes matter
            setattr(df, field_name, vals[0] if rnd.random() < 0.6 else rnd.choice(vals))
        if rnd.random() < 0.5:
            files[0], files[1] = other, df
        else:
            files[1], files[0] = df, other
        for now in rnd.sample(NOWS, rnd.randint(0, len(NOWS))):  # (moves entries between heaps)
            files.ready.first(now)
        before = [scan(files, now) for now in NOWS]
        setattr(df, name, rnd.choice(VALUES[name]))
        after = [scan(files, now) for now in NOWS]
        mattered += before != after
        assert [files.ready.first(now) for now in NOWS] == after
    assert mattered >= 5, f"only {mattered} changes of {name} changed the choice"


def test_the_table_refuses_changes_it_cannot_follow() -> None:
    files = DirtyTable()
    for call in (lambda: files.setdefault(1, _new_file(1, 0)), lambda: files.update({}),
                 lambda: files.popitem()):
        with pytest.raises(TypeError):
            call()


def test_stale_entries_are_compacted() -> None:
    """Many changes of one file leave a bounded number of entries behind."""
    files = DirtyTable()
    df = _new_file(0, 0)
    df.state, df.path, df.writers, df.inflight, df.excl, df.retry_at = \
        DirtyState.DIRTY, b"x", 0, 0, None, 0.0
    files[0] = df
    for i in range(10_000):
        df.deadline = float(i)
    assert len(files.ready) == 1
    assert len(files.ready._heap) + len(files.ready._later) <= 2 + 64 + 1
    assert files.ready.first(0.0) is df


async def test_real_write_backs_choose_as_the_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every choice the worker makes while files are written, kept open, flushed together
    (equal deadlines), renamed, unlinked, and fail and are retried, is the scan's."""
    seen: list[tuple[object, object]] = []
    calls = 0

    def checked(wb: WriteBack) -> DirtyFile | None:
        nonlocal calls
        now = trio.current_time()
        got, want = wb.files.ready.first(now), scan(wb.files, now)
        calls += 1
        if got is not want:
            seen.append((got, want))
        return got

    monkeypatch.setattr(worker, "next_job", checked)
    disks = Disks(tmp_path / "d")
    (disks.back / "sub").mkdir()
    async with instance(disks, deadline_s=3600) as wb:
        held = {}
        for name in [b"f%d" % i for i in range(30)] + [b"sub/g%d" % i for i in range(5)]:
            df = await wb.create(name, 0o100644, os.getuid(), os.getgid())
            wb.opened(df, True)
            await wb.write(df, 0, b"v1 " + name)
            held[name] = df
        for i in range(0, 30, 7):
            assert await wb.unlink(held[b"f%d" % i])
        assert await wb.rename(held[b"f1"], b"renamed")
        shutil.rmtree(disks.back / "sub")  # their write-backs fail: retried later

        async def flush_open_files() -> None:
            with pytest.raises(BackingIOError):  # (sub/ is gone)
                await wb.wait_durable(None, timeout=30)  # all due now: equal deadlines

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flush_open_files)
            for name in list(held)[::3]:
                await wb.write(held[name], 0, b"v2 " + name)  # changed during the flush
        (disks.back / "sub").mkdir()
        for df in held.values():  # all closed in one step: ready together
            await wb.closed(df, True)
        await wb.wait_durable(None, timeout=30)  # the failed ones are retried at once
    assert not seen, f"{len(seen)} of {calls} choices differ from the scan"
    assert calls > 30
    assert backing_bytes(disks, "renamed") == b"v1 f1"
    assert backing_bytes(disks, "f3") == b"v2 f3"
    assert backing_bytes(disks, "sub/g4") == b"v1 sub/g4"
    assert backing_bytes(disks, "f7") is None and backing_bytes(disks, "f1") is None
