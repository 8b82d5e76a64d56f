"""Model-based tests of the write path (fsx style).

A hypothesis ``RuleBasedStateMachine`` applies random sequences of operations (create, write at
offsets, append, O_TRUNC, truncate, rename, unlink, mkdir, rmdir, chmod, read, fsync, flush,
clean remount, ``kill -9`` + mount) both to the mount and to a reference directory on a local
filesystem, and compares after every step: the outcome (errno), the tree (names, types, sizes,
modes) and the content of every file. Every rule opens and closes its own descriptors, so at a
``kill -9`` every file is closed and must survive whole. Each example ends with ``tierfs
flush`` and a comparison of the backing store with the reference.

Write-back runs concurrently with the operations (tierfs starts it as soon as a file is closed;
``writeback_deadline`` only bounds it). Races found that way have their own targeted tests at
the end (``xfail`` while the bugs are open).
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.conftest import REPO, needs_fuse, tierfs_cmd

pytestmark = [needs_fuse, pytest.mark.fuse]

MiB = 1 << 20
TMP_PREFIX = ".tierfs-wb."
DIRS = ["", "d1", "d1/d2", "d3"]
NAMES = ["a", "b", "c", "d1", "d3"]  # d1/d3 also name files: type clashes are part of the game
SIZES = [0, 1, 100, 4095, 4096, 65536, 200_000, 1 * MiB + 7]
OFFSETS = [0, 1, 4095, 4096, 70_000, 300_000, 2 * MiB]

paths = st.builds(lambda d, n: f"{d}/{n}" if d else n, st.sampled_from(DIRS), st.sampled_from(NAMES))
sizes = st.sampled_from(SIZES)
offsets = st.sampled_from(OFFSETS)
seeds = st.integers(0, 1 << 30)
modes = st.sampled_from([0o600, 0o640, 0o644, 0o755, 0o700, 0o444])


def payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def listdir(path: Path | str) -> list[str]:
    return os.listdir(path)


def snapshot(root: str, contents: bool = True) -> dict[str, tuple]:
    """relpath -> (kind, size, mode bits, sha256 of the content) for everything under root."""
    out: dict[str, tuple] = {}
    todo = [""]
    while todo:
        rel = todo.pop()
        for name in listdir(os.path.join(root, rel)):
            r = f"{rel}/{name}" if rel else name
            p = os.path.join(root, r)
            s = os.lstat(p)
            if stat.S_ISDIR(s.st_mode):
                out[r] = ("dir", 0, stat.S_IMODE(s.st_mode), None)
                todo.append(r)
            else:
                sha = None
                if contents:
                    with open(p, "rb") as f:
                        sha = hashlib.sha256(f.read()).hexdigest()
                out[r] = ("file", s.st_size, stat.S_IMODE(s.st_mode), sha)
    return out


def outcome(fn, *args):  # type: ignore[no-untyped-def]
    try:
        return ("ok", fn(*args))
    except OSError as e:
        return ("err", errno.errorcode.get(e.errno or 0, e.errno))


# -- file operations: one function, applied to the reference and to the mount -------------------
def op_write(path: str, offset: int, data: bytes, flags: int, do_fsync: bool = False) -> None:
    fd = os.open(path, flags, 0o644)
    try:
        if flags & os.O_APPEND:
            os.write(fd, data)
        else:
            os.pwrite(fd, data, offset)
        if do_fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def op_read(path: str, offset: int, size: int) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return hashlib.sha256(os.pread(fd, size, offset)).hexdigest()
    finally:
        os.close(fd)


def op_fsync_only(path: str) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_machine(m, ref_root: Path, stats: dict):  # type: ignore[no-untyped-def]
    class WritePathMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            stats["examples"] += 1
            self.sub = f"ex{stats['examples']}"
            self.ref = str(ref_root / self.sub)
            self.mnt = str(m.mnt / self.sub)
            os.makedirs(self.ref)
            os.mkdir(self.mnt)
            self.restarts = 0
            self.trace: list[str] = []

        def both(self, what: str, fn, *rel_and_args, paths_n: int = 1):  # type: ignore[no-untyped-def]
            rels, args = rel_and_args[:paths_n], rel_and_args[paths_n:]
            r = outcome(fn, *[os.path.join(self.ref, p) for p in rels], *args)
            t = outcome(fn, *[os.path.join(self.mnt, p) for p in rels], *args)
            self.trace.append(f"{what}{rels}{args if len(repr(args)) < 80 else ''} -> {r}")
            stats["ops"] += 1
            assert t == r, f"{what} {rels}: reference {r}, tierfs {t}\ntrace:\n" + "\n".join(self.trace)
            return r

        # -- data -------------------------------------------------------------------------------
        @rule(p=paths, seed=seeds, size=sizes)
        def create_or_truncate_write(self, p: str, seed: int, size: int) -> None:
            self.both("O_TRUNC write", op_write, p, 0, payload(seed, size),
                      os.O_WRONLY | os.O_CREAT | os.O_TRUNC)

        @rule(p=paths, seed=seeds, size=sizes, off=offsets)
        def write_at(self, p: str, seed: int, size: int, off: int) -> None:
            self.both("pwrite", op_write, p, off, payload(seed, size), os.O_WRONLY | os.O_CREAT)

        @rule(p=paths, seed=seeds, size=sizes, off=offsets)
        def rdwr_existing(self, p: str, seed: int, size: int, off: int) -> None:
            self.both("pwrite O_RDWR", op_write, p, off, payload(seed, size), os.O_RDWR)

        @rule(p=paths, seed=seeds, size=sizes)
        def append(self, p: str, seed: int, size: int) -> None:
            self.both("append", op_write, p, 0, payload(seed, size), os.O_WRONLY | os.O_APPEND)

        @rule(p=paths, seed=seeds, size=sizes, off=offsets)
        def write_fsync(self, p: str, seed: int, size: int, off: int) -> None:
            self.both("pwrite+fsync", op_write, p, off, payload(seed, size), os.O_WRONLY | os.O_CREAT, True)

        @rule(p=paths, size=st.sampled_from([0, 1, 4096, 100_000, 3 * MiB]))
        def truncate(self, p: str, size: int) -> None:
            self.both("truncate", os.truncate, p, size)

        @rule(p=paths, off=offsets, size=st.sampled_from([1, 4096, 1 * MiB]))
        def read(self, p: str, off: int, size: int) -> None:
            self.both("read", op_read, p, off, size)

        @rule(p=paths)
        def fsync(self, p: str) -> None:
            self.both("fsync", op_fsync_only, p)

        # -- namespace --------------------------------------------------------------------------
        @rule(src=paths | st.sampled_from(DIRS[1:]), dst=paths | st.sampled_from(DIRS[1:]))
        def rename(self, src: str, dst: str) -> None:
            self.both("rename", os.rename, src, dst, paths_n=2)

        @rule(p=paths)
        def unlink(self, p: str) -> None:
            self.both("unlink", os.unlink, p)

        @rule(p=st.sampled_from(DIRS[1:]) | paths)
        def mkdir(self, p: str) -> None:
            self.both("mkdir", os.mkdir, p)

        @rule(p=st.sampled_from(DIRS[1:]) | paths)
        def rmdir(self, p: str) -> None:
            self.both("rmdir", os.rmdir, p)

        @rule(p=paths | st.sampled_from(DIRS[1:]), mode=modes)
        def chmod(self, p: str, mode: int) -> None:
            if mode & 0o700 != 0o700 and os.path.isdir(os.path.join(self.ref, p)):
                mode |= 0o700  # keep directories usable (root ignores modes anyway)
            self.both("chmod", os.chmod, p, mode)

        # -- the daemon ------------------------------------------------------------------------
        @rule()
        def flush(self) -> None:
            self.trace.append("flush")
            tierfs_cmd("flush", str(m.mnt))

        @precondition(lambda self: self.restarts < 3)
        @rule()
        def remount(self) -> None:
            self.trace.append("remount")
            self.restarts += 1
            stats["remounts"] += 1
            m.stop()
            m.start()

        @precondition(lambda self: self.restarts < 3)
        @rule()
        def kill9_and_mount(self) -> None:
            self.trace.append("kill -9 + mount")
            self.restarts += 1
            stats["kills"] += 1
            m.kill9()
            m.start()

        # -- after every step -------------------------------------------------------------------
        @invariant()
        def same_tree_and_contents(self) -> None:
            want = snapshot(self.ref)
            got = snapshot(self.mnt)
            assert not [k for k in got if os.path.basename(k).startswith(TMP_PREFIX)]
            if got != want:
                diff = {k: (want.get(k), got.get(k)) for k in set(want) | set(got) if want.get(k) != got.get(k)}
                raise AssertionError(f"mount != reference: {diff}\ntrace:\n" + "\n".join(self.trace))

        def teardown(self) -> None:
            if not os.path.ismount(m.mnt):
                m.start()
            tierfs_cmd("flush", str(m.mnt))
            want = snapshot(self.ref)
            back = snapshot(str(m.backing / self.sub))
            tmp = [k for k in back if os.path.basename(k).startswith(TMP_PREFIX)]
            assert not tmp, f"temporary files left on the backing store after flush: {tmp}"
            if back != want:
                diff = {k: (want.get(k), back.get(k)) for k in set(want) | set(back) if want.get(k) != back.get(k)}
                raise AssertionError(f"backing != reference after flush: {diff}\ntrace:\n" + "\n".join(self.trace))
            stats["final_flush_compared"] += 1

    return WritePathMachine


@pytest.mark.slow
def test_model_based_write_path(tiermount, tmp_path: Path) -> None:
    m = tiermount(ram="32MiB", ssd="512MiB")
    stats = {"examples": 0, "ops": 0, "remounts": 0, "kills": 0, "final_flush_compared": 0}
    machine = make_machine(m, tmp_path / "ref", stats)
    t0 = time.monotonic()
    run_state_machine_as_test(machine, settings=settings(
        max_examples=int(os.environ.get("TIERFS_MODEL_EXAMPLES", "20")), stateful_step_count=40,
        deadline=None, database=None, derandomize="TIERFS_MODEL_RANDOM" not in os.environ,
        suppress_health_check=list(HealthCheck), print_blob=False))
    print(f"model-based: {stats} in {time.monotonic() - t0:.0f}s")
    assert stats["final_flush_compared"] >= 10


# -- races with a running write-back (found by the model; targeted here) ------------------------
def wait_writing(m, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        wb = m.stats()["writeback"]
        if wb["writing"] > 0:
            return True
        if wb["dirty_files"] == 0:
            return False
        time.sleep(0.001)
    return False


def test_readdir_racing_writeback_end(tiermount) -> None:
    """``os.listdir`` while a just-written file is being written back must always work."""
    m = tiermount(ram="32MiB", ssd="512MiB")
    data = os.urandom(8 * MiB)
    for i in range(60):
        d = m.mnt / f"d{i}"
        d.mkdir()
        (d / "x").write_bytes(data)
        while True:
            assert os.listdir(d) == ["x"]
            if not m.stats()["writeback"]["dirty_files"]:
                break


def wait_clean(m, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    """Until no file is dirty (polls the daemon's stats)."""
    deadline = time.monotonic() + timeout
    while m.stats()["writeback"]["dirty_files"]:
        assert time.monotonic() < deadline, "dirty files not written back"
        time.sleep(0.001)


def test_replace_racing_writeback(tiermount) -> None:
    """The checkpoint pattern: write ``x.tmp``, close, ``os.replace(x.tmp, x)`` (and write,
    close, unlink), with the write-back of the closed file running: the mount and, after flush,
    the backing store must show the renamed file (and no unlinked one)."""
    m = tiermount(ram="32MiB", ssd="512MiB")
    rnd = random.Random(5)
    data = {n: os.urandom(n) for n in (4096, 1 * MiB, 4 * MiB)}
    for i in range(400):
        blob = data[rnd.choice(list(data))]
        tmp, final = m.mnt / f"f{i}.tmp", m.mnt / f"f{i}"
        with open(tmp, "wb") as f:
            f.write(blob)
        # three windows, each reached by waiting for it (no sleeps): before the write-back of
        # tmp starts, while a write-back runs, after the dirty files are written back
        if i % 3 == 1:
            wait_writing(m)
        elif i % 3 == 2:
            wait_clean(m)
        os.replace(tmp, final)
        with open(final, "rb") as f:
            assert f.read() == blob, f"round {i}: the renamed file reads wrong"
        assert not tmp.exists(), f"round {i}: the old name is still there after os.replace"
        u = m.mnt / f"u{i}"
        u.write_bytes(blob[:4096])
        if i % 2:
            wait_writing(m)
        os.unlink(u)
        assert not u.exists(), f"round {i}: the unlinked file came back"
    tierfs_cmd("flush", str(m.mnt))
    names = set(os.listdir(m.backing))
    assert names == {f"f{i}" for i in range(400)}, sorted(names ^ {f"f{i}" for i in range(400)})[:10]


def test_dir_rename_during_writeback(tiermount) -> None:
    """``mv run.tmp run`` (a directory) while a file in it is being written back: ``tierfs
    flush`` then succeeds, promptly, and the backing store has the file under the new name."""
    m = tiermount(ram="32MiB", ssd="1GiB")
    data = os.urandom(64 * MiB)
    for i in range(3):
        d = m.mnt / f"run{i}.tmp"
        d.mkdir()
        (d / "ckpt").write_bytes(data)
        failures = m.stats()["writeback"]["failures"]
        fl = subprocess.Popen([sys.executable, "-m", "tierfs", "flush", str(m.mnt)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert wait_writing(m)  # the rename lands while the write-back runs
        os.rename(d, m.mnt / f"run{i}")
        _, err = fl.communicate(timeout=60)
        assert fl.returncode == 0, f"round {i}: flush failed: {err.strip()}"
        # a rename is a restart of the write-back, never a failure (that would wait RETRY_S)
        assert m.stats()["writeback"]["failures"] == failures, "the rename failed a write-back"
        assert (m.backing / f"run{i}" / "ckpt").read_bytes() == data
        assert os.listdir(m.backing / f"run{i}") == ["ckpt"]
        shutil.rmtree(m.mnt / f"run{i}")


def test_rename_dir_over_dir_with_dirty_child(tiermount) -> None:
    m = tiermount(ram="32MiB", ssd="512MiB")
    os.mkdir(m.mnt / "src")
    (m.mnt / "src" / "s").write_bytes(b"s")
    os.mkdir(m.mnt / "dst")
    fd = os.open(m.mnt / "dst" / "f", os.O_WRONLY | os.O_CREAT, 0o644)  # open: stays dirty
    try:
        os.write(fd, b"x" * 100)
        with pytest.raises(OSError) as e:
            os.rename(m.mnt / "src", m.mnt / "dst")
        assert e.value.errno in (errno.ENOTEMPTY, errno.EEXIST)
    finally:
        os.close(fd)
    assert sorted(os.listdir(m.mnt)) == ["dst", "src"]
