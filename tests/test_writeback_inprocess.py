"""The write path without a mount: WriteBack, Journal and recovery driven in-process.

``kill -9`` leaves exactly what is on disk (the kernel's page cache included): the backing
directory, the data files and the journal. So a crash at a step is simulated by *snapshotting*
those directories at that step (every journal write, before and after it, and the write-through
steps no journal write separates), then recovering a fresh instance from each snapshot - no
cleanup of the first instance runs for the snapshot. For every step: nothing closed is lost, and
the backing store never shows a partial file under a final name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from tierfs.cache.tier import Tier
from tierfs.io import Device
from tierfs.sched.scheduler import TransactionScheduler
from tierfs.writeback import manager as wbm
from tierfs.writeback.backing_ops import data_segments
from tierfs.writeback.journal import Journal
from tierfs.writeback.manager import WriteBack

KiB = 1024
MUTATORS = ("add", "set_path", "set_tmp", "set_tmps", "set_in_place", "remove", "rename_prefix", "quarantine")


class SpyJournal(Journal):
    """A Journal that calls ``hook("before:<method>")`` / ``hook("after:<method>")`` around
    every write (the crash points)."""

    hook: Callable[[str], None] | None = None


def _spy(name: str):  # type: ignore[no-untyped-def]
    def method(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.hook is not None:
            self.hook(f"before:{name}")
        r = getattr(Journal, name)(self, *args, **kwargs)
        if self.hook is not None:
            self.hook(f"after:{name}")
        return r
    return method


for _name in MUTATORS:
    if hasattr(Journal, _name):
        setattr(SpyJournal, _name, _spy(_name))


# Held by every backing-store transaction of an instance() and by Disks.snapshot: a snapshot
# shows the disks between two transactions, as kill -9 leaves them between two system calls. (A
# copy taken while a device thread renamed a file it had listed failed with ENOENT; a small
# file's write-back creates, copies and renames in one transaction.)
BACKING_IO = threading.RLock()


class Disks:
    """The directories a daemon keeps: the backing store and the write tier."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.back = base / "back"
        self.tier = base / "tier"
        self.back.mkdir(parents=True, exist_ok=True)
        self.tier.mkdir(parents=True, exist_ok=True)
        self.tier.chmod(0o700)  # a tier directory must be private (tierfs.private refuses it else)

    def snapshot(self, dest: Path) -> Disks:
        """What ``kill -9`` now would leave (files as the page cache has them)."""
        dest.mkdir(parents=True)
        with BACKING_IO:
            shutil.copytree(self.back, dest / "back", symlinks=True)
            shutil.copytree(self.tier, dest / "tier", symlinks=True,
                            ignore=shutil.ignore_patterns("*-shm"))  # rebuilt from the WAL
        return Disks(dest)


@contextlib.asynccontextmanager
async def instance(disks: Disks, *, tier_bytes: int = 1 << 30, slice_size: int = 16 * KiB,
                   deadline_s: float = 0.0, journal_cls: type[Journal] = Journal,
                   recover: bool = True, tier_inline: bool = False,
                   attr_device: Device | None = None, hold_s: float = 0.0) -> AsyncIterator[WriteBack]:
    """A WriteBack on ``disks`` with its scheduler and worker running. Leaving the block stops
    it the way ``kill -9`` does as far as the disks go: tasks are cancelled, descriptors closed
    (the kernel would), nothing is cleaned up or written back."""
    tier = Tier("ram" if tier_inline else "ssd", str(disks.tier), tier_bytes, inline=tier_inline)
    backing_dev = Device("backing", 1)

    async def read(f, off, n):  # type: ignore[no-untyped-def]
        raise AssertionError("no cache reads in these tests")

    def locked(fn):  # type: ignore[no-untyped-def]
        with BACKING_IO:
            return fn()

    async def run_io(fn):  # type: ignore[no-untyped-def]
        return await backing_dev.run(partial(locked, fn))

    sched = TransactionScheduler(read, chunk_size=slice_size, slice_size=slice_size, run_io=run_io)

    async def make_room(index: int, n: int) -> None:
        return None

    journal = journal_cls(str(disks.tier / "journal.sqlite"))
    wb = WriteBack(backing_root=os.fsencode(disks.back), tier=tier, tier_index=0,
                   device=Device("ssd", 4), data_device=Device("data", 4, inline_under=1.0),
                   scheduler=sched, journal=journal, make_room=make_room, deadline_s=deadline_s,
                   slice_size=slice_size, attr_device=attr_device, hold_s=hold_s)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.run)
            if recover:
                await wb.recover()
            await nursery.start(wb.run)
            yield wb
            nursery.cancel_scope.cancel()
    finally:
        wb.close()


async def write_file(wb: WriteBack, path: bytes, data: bytes, *, chunk: int = 8 * KiB) -> None:
    """create + write + close, as the FUSE layer does for ``open(O_CREAT|O_TRUNC)``."""
    df = await wb.create(path, 0o100644, os.getuid(), os.getgid())
    wb.opened(df, True)
    for off in range(0, len(data), chunk):
        await wb.write(df, off, data[off : off + chunk])
    await wb.closed(df, True)


async def open_write(wb: WriteBack, files: dict[bytes, bytes]) -> list[wbm.DirtyFile]:
    """Create every file and write it, leaving it open for writing."""
    dfs = []
    for path, data in files.items():
        df = await wb.create(path, 0o100644, os.getuid(), os.getgid())
        wb.opened(df, True)
        await wb.write(df, 0, data)
        dfs.append(df)
    return dfs


def count_transactions(wb: WriteBack) -> list[int]:
    """From now on, ``[n]``: the backing-store transactions ``wb``'s scheduler ran."""
    calls = [0]
    run_io = wb.sched._run_io

    async def counted(fn):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return await run_io(fn)  # type: ignore[misc]

    wb.sched._run_io = counted
    return calls


def counting_journal(writes: list[str]) -> type[Journal]:
    """A journal class that appends the name of every write it makes to ``writes``."""

    class Counting(SpyJournal):
        def hook(self, where: str) -> None:  # type: ignore[override]
            if where.startswith("after:"):
                writes.append(where[6:])

    return Counting


async def close_together(wb: WriteBack, files: dict[bytes, bytes]) -> None:
    """Create and write every file, then close them all with no checkpoint in between: the
    write-back worker finds them ready at once (a group)."""
    dfs = await open_write(wb, files)
    for df in dfs:
        await wb.closed(df, True)  # (a writer's close reaches no checkpoint: nothing runs between)


async def copy_up(wb: WriteBack, disks: Disks, name: str) -> wbm.DirtyFile:
    """The FUSE layer's first write to a clean file: a dirty copy of the backing file."""
    fd = os.open(disks.back / name, os.O_RDONLY)
    try:
        async def read(off: int, n: int) -> bytes:
            return os.pread(fd, n, off)

        return await wb.copy_up(name.encode(), os.fstat(fd), read, None)
    finally:
        os.close(fd)


def backing_bytes(disks: Disks, name: str) -> bytes | None:
    p = disks.back / name
    return p.read_bytes() if p.exists() else None


def tmp_names(disks: Disks) -> list[str]:
    return [n for n in os.listdir(disks.back) if n.startswith(".tierfs-wb.")]


# -- an unlink while the file is written back ------------------------------------------------------
async def test_unlink_during_write_back_leaves_no_temporary_file_after_a_crash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dirty file unlinked (or replaced by a rename) while its write-back copies it into a
    temporary file: the journal row keeps naming that temporary file until the write-back has
    removed it, so ``kill -9`` in between leaves it to recovery. (The crash loop found one left
    on the backing store for good: the row had been removed at the unlink.)"""
    from tierfs.writeback import worker

    copying, release = threading.Event(), threading.Event()
    real = worker._copy_data
    slices = 0

    def held_copy(*args):  # type: ignore[no-untyped-def]
        nonlocal slices
        slices += 1
        if slices == 2:  # the copy has started: hold it here
            copying.set()
            release.wait(10)
        return real(*args)

    monkeypatch.setattr(worker, "_copy_data", held_copy)
    disks = Disks(tmp_path / "d")
    async with instance(disks, slice_size=4 * KiB, deadline_s=3600) as wb:
        await write_file(wb, b"f", b"x" * (64 * KiB))
        df = wb.get(b"f")
        assert df is not None
        async with trio.open_nursery() as nursery:
            # someone waits for it: written back now, not at its deadline
            nursery.start_soon(partial(wb.wait_durable, None, timeout=30))
            await trio.to_thread.run_sync(copying.wait, 10)
            assert df.tmp is not None and tmp_names(disks)
            assert await wb.unlink(df)
            crashed = disks.snapshot(tmp_path / "snap")  # kill -9 now
            release.set()
        for _ in range(500):  # the write-back stops at its next slice
            if df.wb_done is None:
                break
            await trio.sleep(0.01)
        assert tmp_names(disks) == []  # no crash: the write-back removed it
        assert [r for r in wb.journal.rows() if r.id == df.id] == []
    assert tmp_names(crashed)  # it was there at the kill
    monkeypatch.setattr(worker, "_copy_data", real)
    async with instance(crashed) as wb:
        await wb.wait_durable(None, timeout=30)
        assert wb.journal.rows() == []
    assert tmp_names(crashed) == []
    assert os.listdir(crashed.back) == []


# -- a flush that waits longer than one request ----------------------------------------------------
async def test_a_flush_longer_than_one_request_answers_timed_out_and_the_client_asks_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``wait_durable`` raises TimeoutError (its docstring's promise), which the control
    command's flush turns into ``timed_out`` so that ``tierfs flush`` asks again. It used trio's
    ``fail_after``, whose TooSlowError is no TimeoutError: every flush of a write-back longer than
    one request's wait (10 s) failed with an empty error, as ``bench_smallfiles.py``'s
    ``tar -x`` of 10,000 files showed."""
    from tierfs.access import ROOT
    from tierfs.fs import ctl
    from tierfs.writeback import worker

    copying, release = threading.Event(), threading.Event()
    real = worker._copy_data

    def held_copy(*args):  # type: ignore[no-untyped-def]
        copying.set()
        release.wait(10)
        return real(*args)

    monkeypatch.setattr(worker, "_copy_data", held_copy)
    monkeypatch.setattr(ctl, "MAX_WAIT_S", 0.2)
    disks = Disks(tmp_path / "d")
    async with instance(disks, slice_size=4 * KiB, deadline_s=3600) as wb:
        await write_file(wb, b"f", b"x" * (64 * KiB))
        commands = ctl.ControlCommands(hints=None, writeback=wb, tree=None, meta=None)  # type: ignore[arg-type]
        try:
            with pytest.raises(TimeoutError, match="1 of 1 file"):
                await wb.wait_durable(None, timeout=0.2)
            assert copying.is_set()
            # longer than one request may wait: answered, and the client asks again
            assert ctl.parse_now(await commands(b'{"op": "flush", "timeout": 60}', ROOT)) == {
                "ok": True, "waited": [], "timed_out": True}
            # the client's own time is up: a timeout, reported as one
            reply = ctl.parse_now(await commands(b'{"op": "flush", "timeout": 0.1}', ROOT))
            assert reply["ok"] is False and reply["kind"] == "timeout"
            assert commands.refused["timeout"] == 1 and commands.refused["error"] == 0
        finally:
            release.set()
        assert ctl.parse_now(await commands(b'{"op": "flush", "timeout": 60}', ROOT)) == {
            "ok": True, "waited": ["f"]}
        assert backing_bytes(disks, "f") == b"x" * (64 * KiB)


async def test_a_flush_that_timed_out_names_the_files_that_got_there_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``timed_out`` reply names the files its request waited for that are durable now, and
    the next request names the rest: so ``tierfs flush``, which adds up the replies, reports
    every file. (A timed-out reply named none: a 10,000-file flush of 22 s reported 760.)"""
    from tierfs.access import ROOT
    from tierfs.fs import ctl
    from tierfs.writeback import worker

    release = threading.Event()
    real = worker._copy_data

    def held_copy(*args):  # type: ignore[no-untyped-def]
        release.wait(10)
        return real(*args)

    monkeypatch.setattr(worker, "_copy_data", held_copy)  # multi-slice files only
    monkeypatch.setattr(ctl, "MAX_WAIT_S", 0.5)
    disks = Disks(tmp_path / "d")
    async with instance(disks, slice_size=4 * KiB, deadline_s=3600) as wb:
        await write_file(wb, b"small", b"s" * KiB)  # one slice: written back, not held
        await write_file(wb, b"big", b"b" * (64 * KiB))
        commands = ctl.ControlCommands(hints=None, writeback=wb, tree=None, meta=None)  # type: ignore[arg-type]
        try:
            assert ctl.parse_now(await commands(b'{"op": "flush", "timeout": 60}', ROOT)) == {
                "ok": True, "waited": ["small"], "timed_out": True}
        finally:
            release.set()
        assert ctl.parse_now(await commands(b'{"op": "flush", "timeout": 60}', ROOT)) == {
            "ok": True, "waited": ["big"]}


# -- the event loop never waits for a disk ------------------------------------------------------
@pytest.mark.parametrize("tier_inline", [False, True], ids=["disk-tier", "ram-tier"])
async def test_small_data_files_are_removed_off_the_loop_on_a_disk_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tier_inline: bool) -> None:
    """On a disk write tier, the unlink of a data file may wait for its pages being written out
    (up to 391 ms measured under a full page cache): it runs in the tier's device thread, even
    for a small file. A RAM tier writes nothing out, and a small file's unlink stays inline."""
    removed: list[tuple[str, bool]] = []
    real = wbm._unlink_quiet

    def spy(path: bytes | str) -> None:
        removed.append((os.fsdecode(path), threading.current_thread() is threading.main_thread()))
        real(path)

    monkeypatch.setattr(wbm, "_unlink_quiet", spy)
    disks = Disks(tmp_path / "d")
    async with instance(disks, deadline_s=3600, tier_inline=tier_inline) as wb:
        await write_file(wb, b"small", b"s" * 5000)
        df = wb.get(b"small")
        assert df is not None
        assert await wb.unlink(df)
        for _ in range(100):
            if removed:
                break
            await trio.sleep(0.01)
        assert [on_loop for _, on_loop in removed] == [tier_inline], removed
        assert not os.listdir(disks.tier / "dirty")


# -- a stale journal row never bricks a mount ---------------------------------------------------
def _raw_through_row(db: Path, path: bytes, tmp: bytes) -> None:
    """A written-through row whose temporary file is gone (a kill between the commit and the
    journal's removal, as the field saw it): written by hand, as an older daemon left it."""
    con = sqlite3.connect(db)
    cols = [r[1] for r in con.execute("PRAGMA table_info(dirty)")]
    cur = con.execute("INSERT INTO dirty (path, tmp, through) VALUES (?, ?, 1)", (path, tmp))
    if "state" in cols:
        con.execute("UPDATE dirty SET state='through' WHERE id=?", (cur.lastrowid,))
    con.commit()
    con.close()


async def test_stale_journal_rows_are_quarantined_and_the_rest_proceeds(tmp_path: Path) -> None:
    disks = Disks(tmp_path / "d")
    async with instance(disks, deadline_s=3600) as wb:
        await write_file(wb, b"good", b"G" * 5000)  # dirty, closed, not yet written back
        await write_file(wb, b"lost-data", b"L" * 100)
        victim = wb.get(b"lost-data")
        assert victim is not None
        data_path = disks.tier / "dirty" / os.path.basename(victim.data_path)  # (data_path names it through a descriptor)
    os.unlink(data_path)  # the data file vanished (deleted by hand, a disk error)
    _raw_through_row(disks.tier / "journal.sqlite", b"stale", b".tierfs-wb.999.1")
    async with instance(disks) as wb:  # must not raise: the mount proceeds
        await wb.wait_durable(None, timeout=30)
        st = wb.statistics()
        assert st.quarantined == 2
        assert set(st.quarantined_paths) == {"stale", "lost-data"}
        assert not [r for r in wb.journal.rows() if r.path in (b"stale", b"lost-data")]
    assert backing_bytes(disks, "good") == b"G" * 5000
    # kept, not deleted: the quarantine table still names them at the next mount
    async with instance(disks) as wb:
        assert wb.statistics().quarantined == 2


# -- a crash at every journal step --------------------------------------------------------------
async def _scenario(wb: WriteBack, disks: Disks, marks: list[tuple[str, dict[str, object]]],
                    snap: Callable[[str], None]) -> dict[str, bytes]:
    """v0 of ``keep`` is durable on the backing store; it is changed (v1, closed, written
    back), then grown past the write tier (written through, v2, closed, written back); a small
    file ``small`` is created and written back meanwhile, and four more (``group0``-``group3``),
    closed together, are written back as a group. ``marks`` records which versions were
    closed at each snapshot."""
    v0 = bytes(range(256)) * 160  # 40 KiB
    (disks.back / "keep").write_bytes(v0)
    closed: dict[str, object] = {"keep": v0}
    wb.journal.hook = None  # type: ignore[attr-defined]

    def hook(step: str) -> None:
        marks.append((step, dict(closed)))
        snap(step)

    wb.journal.hook = hook  # type: ignore[attr-defined]
    try:
        from tierfs.writeback import through
        through.STEP_HOOK = hook
    except ImportError:
        through = None  # type: ignore[assignment]
    try:
        df = await copy_up(wb, disks, "keep")
        wb.opened(df, True)
        await wb.write(df, 5, b"\xff")
        v1 = v0[:5] + b"\xff" + v0[6:]
        await wb.closed(df, True)
        closed["keep"] = v1
        await wb.wait_durable(None, timeout=30)
        await write_file(wb, b"small", b"s" * 3000)
        closed["small"] = b"s" * 3000
        await close_together(wb, {f"group{i}".encode(): bytes([65 + i]) * (500 + i) for i in range(4)})
        closed.update({f"group{i}": bytes([65 + i]) * (500 + i) for i in range(4)})
        # v2: grown past the write tier (tier_bytes is small): written through
        df = wb.get(b"keep")
        if df is None or df.state.value == "clean":
            df = await copy_up(wb, disks, "keep")
        wb.opened(df, True)
        extra = b"".join(bytes([i % 251]) * KiB for i in range(120))
        v2 = v1 + extra
        for off in range(0, len(extra), 8 * KiB):
            await wb.write(df, len(v1) + off, extra[off : off + 8 * KiB])
        await wb.closed(df, True)
        closed["keep"] = v2
        await wb.wait_durable(None, timeout=30)
        return {"v0": v0, "v1": v1, "v2": v2}
    finally:
        wb.journal.hook = None  # type: ignore[attr-defined]
        if through is not None:
            through.STEP_HOOK = None


async def _run_scenario(tmp_path: Path) -> tuple[list[tuple[str, Disks, dict[str, object]]], dict[str, bytes]]:
    """Run the scenario once, snapshotting the disks at every crash point."""
    disks = Disks(tmp_path / "live")
    snaps: list[tuple[str, Disks]] = []
    marks: list[tuple[str, dict[str, object]]] = []

    def snap(step: str) -> None:
        snaps.append((step, disks.snapshot(tmp_path / f"snap{len(snaps):03d}")))

    async with instance(disks, tier_bytes=64 * KiB, journal_cls=SpyJournal) as wb:
        versions = await _scenario(wb, disks, marks, snap)
    assert backing_bytes(disks, "keep") == versions["v2"]
    return [(step, d, closed) for (step, d), (_, closed) in zip(snaps, marks, strict=True)], versions


async def _recover_and_check(label: str, d: Disks, closed: dict[str, object], versions: dict[str, bytes],
                             snap: Callable[[str], None] | None = None) -> list[str]:
    """Recover a fresh instance from ``d`` (snapshotting it at every journal write when
    ``snap`` is given: a crash during recovery), write everything back, check."""
    v1, v2 = versions["v1"], versions["v2"]
    problems = []
    # never a partial file under a final name, at the moment of the crash
    on_disk = backing_bytes(d, "keep")
    if on_disk not in (versions["v0"], v1, v2) and not (
            snap is None and closed["keep"] == v1 and on_disk is not None and "during recovery" in label
            and len(on_disk) >= len(v1) and v2.startswith(on_disk)):
        # (a recovery that was itself killed may have promoted what a still-open written-through
        # file held at the first crash: what was written, not a partial copy)
        problems.append(f"{label}: backing 'keep' is partial ({len(on_disk or b'')} bytes)")
    try:
        async with instance(d, tier_bytes=64 * KiB, recover=snap is None,
                            journal_cls=SpyJournal if snap else Journal) as wb2:
            if snap is not None:
                wb2.journal.hook = snap  # type: ignore[attr-defined]
                await wb2.recover()
                wb2.journal.hook = None  # type: ignore[attr-defined]
            await wb2.wait_durable(None, timeout=30)
            quarantined = getattr(wb2.statistics(), "quarantined", 0)
    except Exception as e:  # noqa: BLE001 - reported with the step
        while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
            e = e.exceptions[0]
        return [*problems, f"{label}: recovery failed: {type(e).__name__}: {e}"]
    got = backing_bytes(d, "keep")
    want = closed["keep"]
    if want == v1 and got is not None and got != v1:
        # v2 was being written at the crash: what was written so far may be kept
        ok = len(got) >= len(v1) and v2.startswith(got)
    else:
        ok = got == want
    if not ok:
        problems.append(f"{label}: 'keep' has {len(got or b'')} bytes after recovery, "
                        f"want {len(want)}")  # type: ignore[arg-type]
    for name in closed:
        if name != "keep" and backing_bytes(d, name) != closed[name]:
            problems.append(f"{label}: closed {name!r} lost")
    if quarantined:
        problems.append(f"{label}: {quarantined} row(s) quarantined")
    if tmp_names(d):
        problems.append(f"{label}: temporary files left: {tmp_names(d)}")
    return problems


async def test_kill_at_every_journal_step_loses_nothing_closed(tmp_path: Path) -> None:
    snaps, versions = await _run_scenario(tmp_path)
    assert len(snaps) > 20
    steps = {s for s, _, _ in snaps}
    assert {"to-through:copying", "commit:journaled"} <= steps or any("set_tmp" in s for s in steps)
    problems = []
    for step, d, closed in snaps:
        problems += await _recover_and_check(f"{step} ({d.base.name})", d, closed, versions)
    assert not problems, "\n".join(problems)


async def test_kill_during_recovery_loses_nothing_closed(tmp_path: Path) -> None:
    """A crash at every journal step of the write path, then another at every journal step of
    the recovery from it: the second recovery still loses nothing closed."""
    snaps, versions = await _run_scenario(tmp_path)
    problems = []
    for step, d, closed in snaps:
        inner: list[tuple[str, Disks]] = []
        base = d.base
        pristine = d.snapshot(tmp_path / f"{base.name}-pristine")

        def snap(s: str, d: Disks = pristine, inner: list[tuple[str, Disks]] = inner) -> None:
            inner.append((s, d.snapshot(tmp_path / f"{d.base.name}-r{len(inner):02d}")))

        # recover the snapshot's copy while snapshotting it at each of recovery's journal writes
        problems += await _recover_and_check(f"{step}: first recovery", pristine, closed, versions, snap)
        for rstep, rd in inner:
            problems += await _recover_and_check(f"{step} then {rstep} during recovery ({rd.base.name})",
                                                 rd, closed, versions)
    assert not problems, "\n".join(problems)


# -- races on one file ----------------------------------------------------------------------
async def test_writes_racing_the_switch_to_write_through_are_kept(tmp_path: Path) -> None:
    """Writes that arrive while the switch copies the data file to the backing store, one of
    them needing more room (a second switch): none is lost, and the switch runs once."""
    disks = Disks(tmp_path / "d")
    async with instance(disks, tier_bytes=64 * KiB, slice_size=4 * KiB, deadline_s=3600) as wb:
        base = bytes(range(256)) * 192  # 48 KiB: fits the tier
        df = await wb.create(b"f", 0o100644, os.getuid(), os.getgid())
        wb.opened(df, True)
        await wb.write(df, 0, base)
        want = bytearray(base)
        copies = 0
        orig_run_io = wb.sched._run_io

        async def racing_io(fn):  # type: ignore[no-untyped-def]
            nonlocal copies
            if isinstance(fn, partial) and fn.func is wbm._copy_data:
                copies += 1
                if copies == 3:  # the switch has copied two slices: race it now
                    nursery.start_soon(wb.write, df, 0, b"A" * 100)  # into an already-copied slice
                    nursery.start_soon(wb.write, df, len(want) + 40 * KiB, b"C" * 100)  # needs room
                    await trio.testing.wait_all_tasks_blocked()
            return await orig_run_io(fn)  # type: ignore[misc]

        wb.sched._run_io = racing_io
        async with trio.open_nursery() as nursery:
            await wb.write(df, len(want), b"B" * (40 * KiB))  # past the tier: switches
        want[0:100] = b"A" * 100
        want += b"B" * (40 * KiB)
        want += b"C" * 100
        await wb.closed(df, True)
        await wb.wait_durable(None, timeout=30)
        assert copies <= len(base) // (4 * KiB) + 2, f"the switch ran twice ({copies} slice copies)"
    assert backing_bytes(disks, "f") == bytes(want)
    assert not tmp_names(disks)


@pytest.mark.parametrize("round_", range(8))  # trio varies the order of ready tasks: several tries
async def test_truncate_right_after_close_of_written_through_file(tmp_path: Path, round_: int) -> None:
    """open(O_TRUNC) of a written-through file right after its last close (the FUSE layer
    truncates, then counts the new handle) while its write-back starts: the new content wins,
    never the old size padded with zeros."""
    disks = Disks(tmp_path / "d")
    async with instance(disks, tier_bytes=16 * KiB, slice_size=4 * KiB) as wb:
        await write_file(wb, b"t", os.urandom(64 * KiB))  # written through; write-back due now
        df = wb.get(b"t")
        assert df is not None and df.through
        orig_run_io = wb.sched._run_io

        async def let_writeback_start(fn):  # type: ignore[no-untyped-def]
            # the window: the truncate is on its way to the backing store; the write-back
            # worker (woken by the close) gets every chance to start now
            if isinstance(fn, partial) and fn.func is os.ftruncate:
                await trio.testing.wait_all_tasks_blocked()
            return await orig_run_io(fn)  # type: ignore[misc]

        wb.sched._run_io = let_writeback_start
        await wb.truncate(df, 0)  # what Operations.open does for O_TRUNC ...
        wb.opened(df, True)  # ... then counts the handle
        # the write-back that started in the window ends before the first write comes (a FUSE
        # round trip later; here: wait for it)
        await wb.wait_durable([df], timeout=30)
        if df.state.value == "clean":  # the first write then copies the backing file up
            df = await copy_up(wb, disks, "t")
            wb.opened(df, True)
        await wb.write(df, 0, b"new")
        await wb.closed(df, True)
        await wb.wait_durable(None, timeout=30)
    assert backing_bytes(disks, "t") == b"new"


async def test_failed_switch_to_write_through_closes_and_removes_its_temporary_file(tmp_path: Path) -> None:
    """The backing store fills during the switch: the writer gets ENOSPC, the temporary file
    is removed and its descriptor closed (it used to hold the space until the daemon exited),
    and the file stays intact in the write tier."""
    disks = Disks(tmp_path / "d")

    def tmp_fds() -> list[str]:
        out = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith(str(disks.back)) and ".tierfs-wb." in target:
                    out.append(fd)
        return out

    async with instance(disks, tier_bytes=64 * KiB, slice_size=4 * KiB, deadline_s=3600) as wb:
        base = os.urandom(48 * KiB)
        df = await wb.create(b"f", 0o100644, os.getuid(), os.getgid())
        wb.opened(df, True)
        await wb.write(df, 0, base)
        orig_run_io = wb.sched._run_io

        async def full_backing(fn):  # type: ignore[no-untyped-def]
            if isinstance(fn, partial) and fn.func is wbm._copy_data and fn.args[2] >= 8 * KiB:
                raise OSError(errno.ENOSPC, "No space left on device")
            return await orig_run_io(fn)  # type: ignore[misc]

        wb.sched._run_io = full_backing
        with pytest.raises(Exception) as e:  # noqa: PT011 - OSError or BackingIOError, by errno
            await wb.write(df, len(base), b"B" * (40 * KiB))
        assert getattr(e.value, "errno", None) == errno.ENOSPC
        wb.sched._run_io = orig_run_io
        assert not tmp_fds(), "the failed switch kept its temporary file open"
        assert not tmp_names(disks), "the failed switch left its temporary file"
        assert not df.through
        await wb.closed(df, True)
        await wb.wait_durable(None, timeout=30)
    assert backing_bytes(disks, "f") == base



async def test_rename_of_committed_written_through_file_moves_its_backing_file(tmp_path: Path) -> None:
    """A written-through file made durable while open (its temporary file renamed into place:
    later writes go to the backing file itself), then renamed and written again: the backing
    file moves with it (it stayed under the old name, and every later write-back failed)."""
    disks = Disks(tmp_path / "d")
    async with instance(disks, tier_bytes=16 * KiB, slice_size=4 * KiB, deadline_s=3600) as wb:
        data = bytearray(os.urandom(64 * KiB))
        df = await wb.create(b"a", 0o100644, os.getuid(), os.getgid())
        wb.opened(df, True)
        await wb.write(df, 0, bytes(data))
        assert df.through
        await wb.wait_durable([df], timeout=30)  # committed while open
        assert await wb.rename(df, b"b")
        await wb.write(df, 0, b"new")
        data[0:3] = b"new"
        await wb.closed(df, True)
        await wb.wait_durable(None, timeout=30)
    assert backing_bytes(disks, "b") == bytes(data)
    assert backing_bytes(disks, "a") is None


async def _kernel_copy_up(wb: WriteBack, disks: Disks, name: str, cached: Callable[[int, int], bool],
                          piece: int) -> tuple[wbm.DirtyFile, list[tuple[int, int]]]:
    """:func:`copy_up` with a :class:`~tierfs.writeback.manager.KernelSource`: pieces for
    which ``cached`` says yes are read through ``read`` (recorded), the rest copied in the
    kernel."""
    fd = os.open(disks.back / name, os.O_RDONLY)
    reads: list[tuple[int, int]] = []
    try:
        async def read(off: int, n: int) -> bytes:
            reads.append((off, n))
            return os.pread(fd, n, off)

        st = os.fstat(fd)
        segments = data_segments(fd, st.st_size)
        df = await wb.copy_up(name.encode(), st, read, None, segments,
                              wbm.KernelSource(fd, cached, piece, ("test", st.st_dev)))
        return df, reads
    finally:
        os.close(fd)


@pytest.mark.parametrize("tier_kib", [1024, 96])
async def test_copy_up_copies_what_the_cache_lacks_in_the_kernel(tmp_path: Path, tier_kib: int) -> None:
    """A copy-up copies the pieces the cache holds none of straight from the backing file
    (``copied_up_in_kernel``), reads the others through the cache, keeps holes, and writes
    back the same bytes; also when the write tier is too small for it (96 KiB: it goes
    write-through midway, and the kernel copies then go to the backing store's temporary
    file)."""
    disks = Disks(tmp_path / "d")
    piece = 16 * KiB
    data = bytearray(os.urandom(200 * KiB))
    data[64 * KiB : 128 * KiB] = bytes(64 * KiB)
    fd = os.open(disks.back / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    os.pwrite(fd, data[: 64 * KiB], 0)
    os.pwrite(fd, data[128 * KiB :], 128 * KiB)
    os.close(fd)
    cached = {32 * KiB, 160 * KiB}  # the pieces "in the cache"
    async with instance(disks, tier_bytes=tier_kib * KiB, slice_size=4 * KiB, deadline_s=3600) as wb:
        df, reads = await _kernel_copy_up(wb, disks, "f", lambda off, n: off in cached, piece)
        assert sorted(off for off, _ in reads) == sorted(cached)
        # everything else but the hole, in the kernel
        assert wb.statistics().copied_up_in_kernel == len(data) - 64 * KiB - len(cached) * piece
        assert df.through == (tier_kib < 200)
        wb.opened(df, True)
        await wb.write(df, 0, b"X")
        data[0:1] = b"X"
        await wb.closed(df, True)
        await wb.wait_durable(None, timeout=30)
    assert backing_bytes(disks, "f") == bytes(data)
    assert os.stat(disks.back / "f").st_blocks * 512 < len(data)  # the hole stayed a hole


async def test_kernel_copy_up_into_a_full_tier_goes_write_through(tmp_path: Path) -> None:
    """The write tier's filesystem fills from outside during a kernel copy-up (ENOSPC from
    the copy into the data file): the copy goes on written through, complete."""
    disks = Disks(tmp_path / "d")
    data = os.urandom(96 * KiB)
    (disks.back / "f").write_bytes(data)
    async with instance(disks, slice_size=4 * KiB, deadline_s=3600) as wb:
        orig_run_io = wb.sched._run_io
        failed = []

        async def tier_full_once(fn):  # type: ignore[no-untyped-def]
            if isinstance(fn, partial) and fn.func is wbm._copy_piece and not failed:
                failed.append(fn.args[1])
                raise OSError(errno.ENOSPC, "No space left on device")
            return await orig_run_io(fn)  # type: ignore[misc]

        wb.sched._run_io = tier_full_once
        df, reads = await _kernel_copy_up(wb, disks, "f", lambda off, n: False, 32 * KiB)
        wb.sched._run_io = orig_run_io
        assert failed == [0] and not reads
        assert df.through
        wb.opened(df, True)
        await wb.closed(df, True)
        await wb.wait_durable(None, timeout=30)
    assert backing_bytes(disks, "f") == data


async def test_a_flush_during_a_copy_up_never_writes_back_the_partial_copy(tmp_path: Path) -> None:
    """A flush (``wait_durable`` of every file) while a copy-up is half done: the write-back
    worker takes a file someone waits for even with writers, and it wrote the half copy over
    the good backing file; cancelled then (the writer interrupted), nothing recovered the
    rest. Now the flush waits for the copy, the cancel leaves the backing file whole, and a
    copy that completes is written back whole."""
    disks = Disks(tmp_path / "d")
    data = os.urandom(200 * KiB)
    (disks.back / "f").write_bytes(data)
    async with instance(disks, slice_size=4 * KiB, deadline_s=3600) as wb:
        fd = os.open(disks.back / "f", os.O_RDONLY)
        st = os.fstat(fd)
        async def copy_up_flushed(finish: bool) -> None:
            stalled, go, cancel = trio.Event(), trio.Event(), trio.CancelScope()

            async def read(off: int, n: int) -> bytes:
                if off >= 64 * KiB and not go.is_set():
                    stalled.set()
                    await go.wait()  # a slow piece (an HDD, a cache miss)
                return os.pread(fd, n, off)

            async def copy() -> None:
                with cancel:
                    df = await wb.copy_up(b"f", st, read, None, None,
                                          wbm.KernelSource(fd, lambda o, n: True, 16 * KiB))
                    wb.opened(df, True)
                    await wb.closed(df, True)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(copy)
                await stalled.wait()
                with trio.move_on_after(1):  # `tierfs flush` meanwhile
                    await wb.wait_durable(None, timeout=30)
                assert backing_bytes(disks, "f") == data, "a partial copy was written back"
                if finish:
                    go.set()
                else:
                    cancel.cancel()  # Ctrl-C on the writer: the copy is abandoned
            await wb.wait_durable(None, timeout=30)
            assert backing_bytes(disks, "f") == data

        await copy_up_flushed(False)
        await copy_up_flushed(True)
        os.close(fd)
    assert backing_bytes(disks, "f") == data


async def test_a_backing_file_that_shrinks_during_a_kernel_copy_up_fails_the_copy(tmp_path: Path) -> None:
    """Another writer truncates the backing file while its copy-up copies it in the kernel: the
    copy fails (EIO, as the cache's read does) and leaves nothing; it used to pad the copy
    with zeros to the old size and write that back over the other writer's file."""
    disks = Disks(tmp_path / "d")
    data = os.urandom(200 * KiB)
    (disks.back / "f").write_bytes(data)
    async with instance(disks, slice_size=4 * KiB, deadline_s=3600) as wb:
        def cached(off: int, n: int) -> bool:
            if off == 64 * KiB:
                os.truncate(disks.back / "f", 70 * KiB)
            return False

        with pytest.raises(wbm.BackingIOError) as e:
            await _kernel_copy_up(wb, disks, "f", cached, 16 * KiB)
        assert e.value.errno == errno.EIO
        assert not wb.files and not tmp_names(disks)
        await wb.wait_durable(None, timeout=30)
    assert backing_bytes(disks, "f") == data[: 70 * KiB]
