"""Crash safety of the write path: ``kill -9`` of the daemon at random moments.

Invariants checked after every kill and restart (same backing, SSD tier and mountpoint):

* every file that was closed before the kill is intact through the mount (sha256);
* the backing store never shows a partial file under a final name: right after a kill (before
  the restart) each final name on the backing store holds a version the mount had shown for it
  (or is absent), never a mix;
* no ``.tierfs-wb.*`` temporary name is visible in the mount; after ``tierfs flush`` none is left
  on the backing store and the backing store holds exactly the bytes the mount shows;
* a checkpoint target (C12) is always the complete old or the complete new checkpoint, and
  ``torch.load`` works.

Checkpoints are saved by a long-lived worker process (it imports torch once): a small CNN with
its Adam state, written through a file object the way Lightning/fsspec do it (directly over the
target, or to a temporary name and ``os.replace``). The worker hashes the bytes as it writes
them (``torch.save`` embeds a random serialization id, so two saves never match byte for byte).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import random
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import DAEMON_WRITES, REPO, Mount, is_mounted, needs_fuse, tierfs_cmd

pytestmark = [needs_fuse, pytest.mark.fuse]

MiB = 1 << 20
TMP_PREFIX = ".tierfs-wb."
DEAD = (errno.ENOTCONN, errno.ECONNABORTED)

# -- the checkpoint worker ---------------------------------------------------------------------
WORKER = r"""
import hashlib, json, os, sys, time
import torch

torch.set_num_threads(1)
torch.manual_seed(0)

def make(width):
    m = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(64 * 16, width),
        torch.nn.ReLU(), torch.nn.Linear(width, 10))
    return m, torch.optim.Adam(m.parameters(), lr=1e-3)

models = {}

class Hashing:
    def __init__(self, f, pause_at=None):
        self.f, self.h, self.n, self.pause_at = f, hashlib.sha256(), 0, pause_at
    def write(self, b):
        self.h.update(b)
        self.n += len(b)
        r = self.f.write(b)
        if self.pause_at is not None and self.n >= self.pause_at:
            self.f.flush()  # what was written reaches the filesystem; then wait to be killed
            say(paused=True, written=self.n)
            time.sleep(3600)
        return r
    def flush(self):
        self.f.flush()

def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()

say(ready=True)
for line in sys.stdin:
    req = json.loads(line)
    saved = None
    try:
        if req["op"] == "save":
            width = req.get("width", 512)
            if width not in models:
                models[width] = make(width)
            m, opt = models[width]
            x = torch.randn(8, 3, 16, 16)
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
            obj = {"model": m.state_dict(), "optimizer": opt.state_dict(), "note": req.get("note")}
            target = req["path"]
            dest = req["tmp"] if req["mode"] == "replace" else target
            say(started=True)
            with open(dest, "wb") as f:
                hf = Hashing(f, req.get("pause_at"))
                torch.save(obj, hf)
                if req.get("fsync"):
                    f.flush()
                    os.fsync(f.fileno())
            saved = hf.h.hexdigest()
            if req["mode"] == "replace":
                os.replace(dest, target)
            say(ok=True, sha=saved, size=hf.n)
        elif req["op"] == "load":
            obj = torch.load(req["path"], weights_only=True)
            assert set(obj) == {"model", "optimizer", "note"}, sorted(obj)
            say(ok=True, keys=len(obj["model"]))
        else:
            say(ok=False, err="unknown op")
    except Exception as e:
        say(ok=False, err=repr(e), sha=saved)
"""


class Worker:
    """The checkpoint-saving process; replies are collected by a reader thread."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-u", "-c", WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd="/")
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.get(120).get("ready"), "checkpoint worker did not start"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.q.put(json.loads(line))
        self.q.put({"eof": True})

    def send(self, **req: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()

    def get(self, timeout: float = 60) -> dict:
        msg = self.q.get(timeout=timeout)
        assert not msg.get("eof"), "checkpoint worker died"
        return msg

    def save(self, path: Path, mode: str, timeout: float = 60, **kw: object) -> dict:
        self.send(op="save", path=str(path), tmp=str(path) + ".tmp", mode=mode, **kw)
        assert self.get(timeout).get("started")
        return self.get(timeout)

    def load(self, path: Path) -> dict:
        self.send(op="load", path=str(path))
        return self.get()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def worker():
    w = Worker()
    yield w
    w.close()


# -- helpers -----------------------------------------------------------------------------------
def sha_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(8 * MiB):
            h.update(b)
    return h.hexdigest()


def sha_or_none(path: Path) -> str | None:
    try:
        return sha_file(path)
    except FileNotFoundError:
        return None


def rand_bytes(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).bytes(size)


def write_closed(path: Path, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def tmp_names_under(root: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            if n.startswith(TMP_PREFIX):
                out.append(os.path.join(dirpath, n))
    return out


def listdir(path: Path | str) -> list[str]:
    return os.listdir(path)


def mount_listing_has_no_tmp(mnt: Path) -> None:
    """``os.listdir`` of every directory of the mount: no temp names."""
    todo = [str(mnt)]
    while todo:
        dirpath = todo.pop()
        names = listdir(dirpath)
        for n in names:
            if os.path.isdir(os.path.join(dirpath, n)):
                todo.append(os.path.join(dirpath, n))
        bad = [n for n in names if n.startswith(TMP_PREFIX)]
        assert not bad, f"temporary write-back names visible in the mount: {dirpath}: {bad}"


def journal_rows(ssd: Path) -> int:
    db = sqlite3.connect(ssd / "journal.sqlite")
    try:
        return int(db.execute("SELECT count(*) FROM dirty").fetchone()[0])
    finally:
        db.close()


def wait_writing(m: Mount, timeout: float = 10.0) -> bool:
    """Wait until a write-back is running (stats ``writing`` > 0); False if none started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            wb = m.stats()["writeback"]
        except OSError:
            return False
        if wb["writing"] > 0:
            return True
        if wb["dirty_files"] == 0:
            return False
        time.sleep(0.002)
    return False


def background_flush(m: Mount) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tierfs", "flush", str(m.mnt)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def set_deadline(m: Mount, seconds: float) -> None:
    """Change ``-o writeback_deadline=`` for the next ``m.start()``."""
    args: list[str] = []
    i = 0
    while i < len(m.args):
        if m.args[i] == "-o" and i + 1 < len(m.args) and m.args[i + 1].startswith("writeback_deadline="):
            i += 2
            continue
        args.append(m.args[i])
        i += 1
    m.args = args + ["-o", f"writeback_deadline={seconds:g}"]


def check_backing_versions(m: Mount, history: dict[str, set[str]]) -> None:
    """Right after a kill: every final name on the backing store is absent or holds a version
    the mount had shown for that path; never a partial or mixed file."""
    for rel, seen in history.items():
        got = sha_or_none(m.backing / rel)
        assert got is None or got in seen, (
            f"backing store holds a partial/unknown version of {rel} after kill -9 "
            f"(size {os.path.getsize(m.backing / rel)})")


# -- the kill loop -----------------------------------------------------------------------------
ANY = None  # after a kill: any content is acceptable (a write cut by the kill, like a local FS)


@pytest.mark.slow
def test_kill9_loop(tiermount, worker: Worker) -> None:
    """24 ``kill -9`` of the daemon: during checkpoint saves (overwrite and temp+rename) and
    during write-back of 32-64 MiB files (started by ``writeback_deadline=0`` or by a background
    ``tierfs flush``); after each, remount and check every closed file, the listing and the
    backing store (whole versions only); every third round flush and compare the backing store."""
    rnd = random.Random(int(os.environ.get("TIERFS_CRASH_SEED", "1234")))
    n_kills = 24
    # save / write-back alternate; a write-back round runs under writeback_deadline=0 or a
    # background flush (saves run under a long deadline: temp+rename racing write-back is
    # test_model_based.py::test_replace_racing_writeback)
    plan = [("save", 3600) if i % 2 == 0 else ("writeback", rnd.choice([0, 3600])) for i in range(n_kills)]
    m = tiermount(ram="64MiB", ssd="2GiB", extra=("-o", f"writeback_deadline={plan[0][1]}"))
    (m.mnt / "ckpt").mkdir()
    (m.mnt / "big").mkdir()
    model: dict[str, str | None] = {}  # path -> sha of what the mount must show (None: absent)
    history: dict[str, set[str]] = {}  # every version each path has shown
    partial: set[str] = set()  # checkpoints cut by a kill (no torch.load expected)
    kills = {"save": 0, "writeback": 0, "writing_at_kill": 0, "save_done_before_kill": 0}
    seed = 0
    t_start = time.monotonic()
    for it, (scenario, deadline_s) in enumerate(plan):
        expect: dict[str, set[str | None] | None] = {rel: {sha} for rel, sha in model.items()}
        new_ckpt = None
        if scenario == "save":
            rel = f"ckpt/model-{rnd.randrange(3)}.pt"
            mode = rnd.choice(["overwrite", "replace"])
            worker.send(op="save", path=str(m.mnt / rel), tmp=str(m.mnt / rel) + ".tmp", mode=mode,
                        note=it)
            assert worker.get().get("started")
            time.sleep(rnd.uniform(0, 0.06))
            m.kill9()
            r = worker.get()
            kills["save"] += 1
            new_ckpt = r.get("sha")
            if new_ckpt:  # its bytes were all written: the backing store may show it
                history.setdefault(rel, set()).add(new_ckpt)
            if r.get("ok"):
                kills["save_done_before_kill"] += 1
                expect[rel] = {r["sha"]}  # closed (and renamed) before the kill: must survive
                if mode == "replace":
                    expect[rel + ".tmp"] = {None}
            elif mode == "overwrite":
                expect[rel] = ANY  # cut mid-write: shows what was written, as on a local FS
            else:
                # temp+rename cut: the target is the old one, or the new one if the rename
                # reached the daemon; never anything else. The temp name: anything or absent.
                expect[rel] = {model.get(rel)} | ({r["sha"]} if r.get("sha") else set())
                expect[rel + ".tmp"] = ANY
        else:
            bg = None
            for _ in range(rnd.randint(1, 3)):
                rel = f"big/f{rnd.randrange(4)}"
                seed += 1
                data = rand_bytes(seed, rnd.choice([32, 48, 64]) * MiB)
                sha = write_closed(m.mnt / rel, data)
                del data
                expect[rel] = {sha}
                history.setdefault(rel, set()).add(sha)
            if deadline_s:
                bg = background_flush(m)
            if wait_writing(m):
                kills["writing_at_kill"] += 1
            time.sleep(rnd.uniform(0, 0.08))
            m.kill9()
            kills["writeback"] += 1
            if bg is not None:
                bg.wait(30)
        # -- right after the kill: the backing store shows whole versions only --------------
        check_backing_versions(m, history)
        # -- restart (no manual cleanup) ------------------------------------------------------
        set_deadline(m, plan[it + 1][1] if it + 1 < n_kills else 3600)
        m.start()
        mount_listing_has_no_tmp(m.mnt)
        for rel, allowed in expect.items():
            got = sha_or_none(m.mnt / rel)
            if allowed is ANY:
                partial.add(rel)
            else:
                if scenario == "save" and got is not None and got == new_ckpt:
                    partial.discard(rel)
                assert got in allowed, (f"round {it} ({scenario}): {rel} is not a version it may "
                                        f"show after kill -9 ({'absent' if got is None else 'changed'})")
            if got is None:
                model.pop(rel, None)
            else:
                model[rel] = got
                history.setdefault(rel, set()).add(got)
        listed = {f"{d}/{n}" for d in ("ckpt", "big") for n in listdir(m.mnt / d)}
        assert listed == set(model), f"round {it}: listing {sorted(listed)} != {sorted(model)}"
        if scenario == "save":
            for rel in model:
                if rel.endswith(".pt") and rel not in partial:
                    r = worker.load(m.mnt / rel)
                    assert r.get("ok"), f"torch.load({rel}) after kill -9: {r}"
        if it % 3 == 2 or it == n_kills - 1:
            tierfs_cmd("flush", str(m.mnt))
            for rel, want in model.items():
                assert sha_or_none(m.backing / rel) == want, f"round {it}: backing {rel} differs after flush"
            assert tmp_names_under(m.backing) == []
            assert m.stats()["writeback"]["dirty_files"] == 0
    elapsed = time.monotonic() - t_start
    print(f"kill loop: {kills}, {len(model)} files checked, {elapsed:.0f}s")
    assert kills["save"] + kills["writeback"] >= 20
    assert kills["writing_at_kill"] >= 5, f"too few kills landed during write-back: {kills}"


# -- C12 ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["overwrite", "replace"])
def test_c12_kill_during_writeback_keeps_old_or_new_checkpoint(tiermount, worker: Worker, mode: str) -> None:
    """C12: a good checkpoint written back; a new one saved to the same path (``mode``);
    ``kill -9`` during its write-back; after the restart ``torch.load`` works and the file
    (mount and backing) is the complete old or the complete new one; the new one, closed
    before the kill, survives."""
    rnd = random.Random(12 if mode == "overwrite" else 13)
    m = tiermount(ram="64MiB", ssd="2GiB", extra=("-o", "writeback_deadline=3600"))
    (m.mnt / "c12").mkdir()
    target = m.mnt / "c12" / "last.ckpt"
    back = m.backing / "c12" / "last.ckpt"
    width = 3072  # ~ 40 MiB with the Adam state: write-back takes a moment
    r = worker.save(target, "overwrite", width=width, note="good")
    assert r["ok"], r
    tierfs_cmd("flush", str(m.mnt))
    old = sha_file(back)
    assert old == r["sha"]
    landed = 0
    for rep in range(4):
        r = worker.save(target, mode, width=width, note=f"new-{rep}", fsync=rep % 2 == 1)
        assert r["ok"], r
        new = r["sha"]
        fl = background_flush(m)
        if wait_writing(m):
            landed += 1
        time.sleep(rnd.uniform(0, 0.05))
        m.kill9()
        fl.wait(30)
        after_kill = sha_file(back)
        assert after_kill in (old, new), "C12: the backing checkpoint is partial after kill -9"
        m.start()
        mount_listing_has_no_tmp(m.mnt)
        assert sorted(listdir(m.mnt / "c12")) == ["last.ckpt"]
        assert sha_file(target) == new, "C12: the new checkpoint (closed before the kill) was lost"
        assert worker.load(target)["ok"]
        tierfs_cmd("flush", str(m.mnt))
        assert sha_file(back) == new
        assert tmp_names_under(m.backing) == []
        old = new
    assert landed >= 2, "the kills did not land during write-back"


@pytest.mark.slow
def test_c12_writer_killed_mid_save(tiermount, tmp_path: Path) -> None:
    """C12, the other half: the *writer* is killed mid-save (the daemon lives). temp+rename
    keeps the old checkpoint; a direct overwrite shows what was written, as on a local FS;
    either way the backing store ends equal to the mount after flush, with no temp names."""
    m = tiermount(ram="64MiB", ssd="2GiB", extra=("-o", "writeback_deadline=0"))
    (m.mnt / "c12").mkdir()
    target = m.mnt / "c12" / "last.ckpt"
    w = Worker()
    try:
        r = w.save(target, "overwrite", width=3072, note="good")
        assert r["ok"], r
        tierfs_cmd("flush", str(m.mnt))
        old = sha_file(target)
        for mode in ("replace", "overwrite"):
            # killed mid-save for certain: the worker stops once 8 MiB of the ~40 MiB are written
            # (a kill after a fixed sleep missed on a fast mount: the save had finished)
            w.send(op="save", path=str(target), tmp=str(target) + ".tmp", mode=mode, width=3072,
                   pause_at=8 * MiB)
            assert w.get().get("started")
            assert w.get().get("paused")
            w.proc.kill()
            w.close()
            if mode == "replace":
                assert sha_file(target) == old
                assert (m.mnt / "c12" / "last.ckpt.tmp").stat().st_size >= 8 * MiB
            else:  # the killed overwrite leaves the name, its size that of its readable bytes
                assert len(target.read_bytes()) == target.stat().st_size
            tierfs_cmd("flush", str(m.mnt))
            for name in listdir(m.mnt / "c12"):
                assert sha_file(m.mnt / "c12" / name) == sha_file(m.backing / "c12" / name)
            assert tmp_names_under(m.backing) == []
            w = Worker()
            # whatever is left, a new save (and a load) works
            r = w.save(target, "replace", width=3072, note="again")
            assert r["ok"] and w.load(target)["ok"]
            old = r["sha"]
    finally:
        w.close()


# -- closed files survive a kill during the save of others -------------------------------------
def test_fsynced_checkpoint_survives_kill(tiermount, worker: Worker) -> None:
    """C12: "if the writer had fsynced, the new data must survive a daemon crash" (here: kill
    -9 right after the fsync+close returned, before any write-back)."""
    m = tiermount(ram="64MiB", ssd="1GiB", extra=("-o", "writeback_deadline=3600"))
    p = m.mnt / "ck.pt"
    r = worker.save(p, "overwrite", fsync=True)
    assert r["ok"]
    m.kill9()
    assert not (m.backing / "ck.pt").exists()
    m.start()
    assert sha_file(p) == r["sha"]
    assert worker.load(p)["ok"]
    tierfs_cmd("flush", str(m.mnt))
    assert sha_file(m.backing / "ck.pt") == r["sha"]


# -- umount --------------------------------------------------------------------------------------
def test_umount_does_not_wait_for_writeback(tiermount) -> None:
    """``tierfs umount`` right after a 1 GiB file is closed (its write-back needs seconds)
    returns at once, leaving it dirty and journaled in the write tier (no partial file under
    its name on the backing store); the next mount shows it and writes it back on its own
    (deadline 1 s, no flush)."""
    m = tiermount(ram="64MiB", ssd="2GiB", extra=("-o", "writeback_deadline=3600"))
    small = {f"d/s{i}": write_closed(m.mnt / "d" / f"s{i}", rand_bytes(100 + i, 1 * MiB)) for i in range(3)}
    block = rand_bytes(99, 64 * MiB)
    h = hashlib.sha256()
    with open(m.mnt / "d" / "big", "wb") as f:
        for i in range(16):
            chunk = i.to_bytes(8, "little") + block[8:]
            f.write(chunk)
            h.update(chunk)
    want = {**small, "d/big": h.hexdigest()}
    pid = m.pid
    tierfs_cmd("umount", str(m.mnt))
    assert not is_mounted(m.mnt)
    # exited (gone, or a zombie its parent has not reaped yet: umount does not wait for that)
    from tierfs.cli import _alive

    assert not _alive(pid)
    assert not (m.backing / "d" / "big").exists(), "umount waited for the write-back of d/big"
    # each file is whole on the backing store or still dirty, journaled, in the write tier
    on_backing = {rel for rel, sha in want.items() if sha_or_none(m.backing / rel) == sha}
    for rel in set(want) - on_backing:
        assert not (m.backing / rel).exists()
    assert journal_rows(m.ssd) == len(want) - len(on_backing)  # type: ignore[arg-type]
    assert len(os.listdir(m.ssd / "dirty")) == len(want) - len(on_backing)  # type: ignore[operator]
    set_deadline(m, 1)
    m.start()
    for rel, sha in want.items():
        assert sha_file(m.mnt / rel) == sha
    deadline = time.monotonic() + 60
    while m.stats()["writeback"]["dirty_files"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert m.stats()["writeback"]["dirty_files"] == 0, "dirty data not written back after remount"
    for rel, sha in want.items():
        assert sha_file(m.backing / rel) == sha
    assert tmp_names_under(m.backing) == []
    assert journal_rows(m.ssd) == 0  # type: ignore[arg-type]


def test_umount_flush_waits(tiermount) -> None:
    # daemon-served writes: a passthrough writer that outgrows the write tier is due for
    # write-back at once (docs/writes.md), and this test needs files still dirty at umount
    m = tiermount(ram="64MiB", ssd="1GiB", extra=("-o", "writeback_deadline=3600", *DAEMON_WRITES))
    want = {f"f{i}": write_closed(m.mnt / f"f{i}", rand_bytes(200 + i, 64 * MiB)) for i in range(4)}
    assert m.stats()["writeback"]["dirty_files"] > 0
    tierfs_cmd("umount", "--flush", str(m.mnt))
    assert not is_mounted(m.mnt)
    for rel, sha in want.items():
        assert sha_file(m.backing / rel) == sha
    assert tmp_names_under(m.backing) == []
    assert journal_rows(m.ssd) == 0  # type: ignore[arg-type]
    assert os.listdir(m.ssd / "dirty") == []  # type: ignore[operator]
    m.start()
    assert m.stats()["writeback"]["dirty_files"] == 0
    for rel, sha in want.items():
        assert sha_file(m.mnt / rel) == sha


@pytest.mark.parametrize("how", ["tierfs umount", "umount(8)"])
def test_an_unmount_writes_a_ram_write_tier_back_before_the_daemon_exits(tiermount, how: str) -> None:
    """A RAM write tier is lost at the next reboot: an unmount without ``--flush`` (``tierfs
    umount``, or the system's ``umount``) writes every dirty file back before the daemon exits,
    then frees the tier. (They stayed in /dev/shm, journaled for a next mount that a reboot
    never gives.) An SSD write tier keeps them for the next mount, as before
    (test_umount_does_not_wait_for_writeback)."""
    from tierfs.cli import _alive
    from tierfs.mount import ram_tier_path

    # a burst of closes (16 files or more) is held back from write-back (writeback_hold)
    m = tiermount(ram="256MiB", extra=("-o", "writeback_deadline=3600", "-o", "writeback_hold=600",
                                       *DAEMON_WRITES))
    want = {f"f{i}": write_closed(m.mnt / f"f{i}", rand_bytes(400 + i, 2 * MiB)) for i in range(24)}
    assert m.stats()["writeback"]["dirty_files"] >= 8
    ram = Path(ram_tier_path("/dev/shm", str(m.mnt)))
    assert (ram / "dirty").is_dir()
    pid = m.pid
    if how == "umount(8)":
        subprocess.run(["umount", str(m.mnt)], check=True, timeout=60)
    else:
        r = tierfs_cmd("umount", str(m.mnt))
        assert "back from its RAM tier before it exits" in r.stdout + r.stderr
    deadline = time.monotonic() + 60
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    for rel, sha in want.items():
        assert sha_or_none(m.backing / rel) == sha, rel
    assert tmp_names_under(m.backing) == []
    assert not ram.exists(), "the RAM tier was left in /dev/shm"
    m.pid = 0


# -- a dead daemon -------------------------------------------------------------------------------
def test_dead_daemon_never_leaves_enotconn(tiermount) -> None:
    """After ``kill -9`` (with dirty data and a write-back running), ``tierfs mount`` on the same
    mountpoint works without manual cleanup, and the mount answers (no ENOTCONN)."""
    m = tiermount(ram="64MiB", ssd="1GiB", extra=("-o", "writeback_deadline=0"))
    for rep in range(3):
        sha = write_closed(m.mnt / f"x{rep}", rand_bytes(300 + rep, 64 * MiB))
        wait_writing(m)
        m.kill9()
        with pytest.raises(OSError) as e:
            os.listdir(m.mnt)
        assert e.value.errno in DEAD
        old_pid = m.pid
        m.start()
        assert m.pid != old_pid
        with open("/proc/self/mounts") as f:
            assert sum(line.split()[1] == str(m.mnt) for line in f) == 1
        assert sha_file(m.mnt / f"x{rep}") == sha
        listdir(m.mnt)
    # a `tierfs umount` of a dead mount cleans it up too
    m.kill9()
    r = tierfs_cmd("umount", str(m.mnt))
    assert "dead mount" in r.stdout
    assert not is_mounted(m.mnt)
    m.start()
    tierfs_cmd("flush", str(m.mnt))
    assert tmp_names_under(m.backing) == []


def test_umount_of_a_dead_mount_frees_a_ram_tier_outside_dev_shm(tiermount, tmp_path: Path) -> None:
    """The RAM tier may live under any ``ram_dir``: `tierfs umount` of the dead mount finds it
    where the daemon wrote it down, not only under /dev/shm."""
    from tierfs.mount import mount_id

    ram_dir = tmp_path / "ramdir"
    ram_dir.mkdir()
    (tmp_path / "back" / "data.bin").write_bytes(rand_bytes(5, 3 * MiB))
    m = tiermount(ram="64MiB", extra=("-o", f"ram_dir={ram_dir}"))
    tier = ram_dir / "tierfs" / mount_id(str(m.mnt))
    assert sha_file(m.mnt / "data.bin") == hashlib.sha256((m.backing / "data.bin").read_bytes()).hexdigest()
    for _ in range(300):  # the read's chunks reach the RAM tier
        if sum(f.stat().st_blocks for f in (tier / "data").rglob("*") if f.is_file()):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("nothing of the read in the RAM tier")
    m.kill9()
    r = tierfs_cmd("umount", str(m.mnt))
    assert "dead mount" in r.stdout and "RAM tier" in r.stdout, r.stdout
    assert not is_mounted(m.mnt)
    assert sum(f.stat().st_blocks for f in (tier / "data").rglob("*") if f.is_file()) == 0


# -- bugs ----------------------------------------------------------------------------------------
def test_kill9_during_copy_up_keeps_backing_file(tiermount) -> None:
    """Opening an existing file for writing (``open(p, "r+b")``, ``np.memmap(mode="r+")``) makes
    a dirty copy of it. ``kill -9`` while that copy is made (the writer has not written a
    byte) must leave the file as it was, through the mount and on the backing store."""
    data = rand_bytes(7, 192 * MiB)
    m = tiermount(ram="64MiB", ssd="1GiB", extra=("-o", "writeback_deadline=0"))
    (m.backing / "big.bin").write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    del data
    p = subprocess.Popen([sys.executable, "-c",
                          f"import time; f = open({str(m.mnt / 'big.bin')!r}, 'r+b'); time.sleep(60)"])
    try:
        dirty = m.ssd / "dirty"  # type: ignore[operator]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            sizes = [os.path.getsize(dirty / n) for n in os.listdir(dirty)]
            if sizes and 0 < sizes[0]:
                break
            time.sleep(0.001)
        m.kill9()  # mid copy-up: open() has not returned
    finally:
        p.kill()
        p.wait()
    m.start()
    assert sha_file(m.mnt / "big.bin") == want, "kill -9 during open(r+) changed the file in the mount"
    tierfs_cmd("flush", str(m.mnt))
    assert sha_file(m.backing / "big.bin") == want, "kill -9 during open(r+) truncated the backing file"


def test_open_rdwr_of_recovered_file_during_its_writeback(tiermount) -> None:
    """After ``kill -9`` (or a clean umount with dirty data) the next mount writes the recovered
    files back; opening one of them read-write meanwhile (``open(p, "r+b")``, fio's verify pass,
    ``np.memmap(mode="r+")``) must work and read the right bytes."""
    m = tiermount(ram="64MiB", ssd="2GiB")
    data = rand_bytes(11, 192 * MiB)
    want = hashlib.sha256(data).hexdigest()
    errors = []
    for rnd in range(5):
        for i in range(2):
            write_closed(m.mnt / f"f{i}", data)
        m.kill9()
        m.start()
        for _ in range(40):
            for i in range(2):
                try:
                    with open(m.mnt / f"f{i}", "r+b") as f:
                        assert hashlib.sha256(f.read()).hexdigest() == want
                except OSError as e:
                    errors.append(f"round {rnd} f{i}: {e}")
            if errors or not m.stats()["writeback"]["dirty_files"]:
                break
        if errors:
            break
    assert not errors, errors
