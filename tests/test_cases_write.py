"""Failure recipes from real users (``shared/cases/README.md``), the WRITE parts, through a
writable tierfs mount, scaled down to run in seconds: C05 (lmdb), C07 (temp file + chmod +
rename), C08 (overwrite), C09 (O_TRUNC), C10 (O_APPEND), C11 (size right after write/fsync).
C12 (crash during write-back) is tested in ``test_crash.py``.

"Passes" is the recipes' definition: no exception or signal, bytes equal to the ones on local
disk, done within a timeout; and for writes, the same bytes in the backing directory after
``tierfs flush`` (or unmount), with no temporary file left behind.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import random
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import Mount, drop_page_cache, join_all, needs_fuse, tierfs_cmd

pytestmark = [needs_fuse, pytest.mark.fuse]
KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
CTX = mp.get_context("fork")


def flush(m: Mount) -> None:
    tierfs_cmd("flush", str(m.mnt), timeout=120)


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def leftovers(root: Path) -> list[str]:
    """Write-back temporary files (``.tierfs-wb.*``) under ``root``."""
    return [os.path.join(d, n) for d, ds, fs in os.walk(root) for n in ds + fs if n.startswith(".tierfs-wb.")]


def py(code: str, *args: str, timeout: float = 60) -> str:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stderr}"
    return r.stdout.strip()


def sh(cmd: str) -> str:
    return subprocess.run(["bash", "-c", cmd], check=True, capture_output=True, text=True).stdout


# -- C05 -----------------------------------------------------------------------------------------
C05_KEYS = 2000


def _c05_value(i: int) -> bytes:
    return i.to_bytes(4, "little") * (4 * KiB // 4)  # 4 KiB


C05_READER = """
import lmdb, sys
env = lmdb.open(sys.argv[1], readonly=True, lock=True)
with env.begin() as txn:
    print(sum(1 for k, v in txn.cursor() if v == int(k).to_bytes(4, "little") * 1024))
"""

C05_LOADER = """
import lmdb, os, random, sys, time
db, workers, seconds, keys = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
pids = []
for w in range(workers):  # DataLoader workers: fork first, then open the env in the worker
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            env = lmdb.open(db, readonly=True, lock=False)
            rnd = random.Random(w)
            n = bad = 0
            end = time.monotonic() + seconds
            with env.begin() as txn:
                while time.monotonic() < end:
                    i = rnd.randrange(keys)
                    bad += txn.get(b"%08d" % i) != i.to_bytes(4, "little") * 1024
                    n += 1
            code = 0 if n and not bad else 2
        finally:
            os._exit(code)
    pids.append(pid)
print([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])
"""


@pytest.mark.parametrize("writemap", [False, True], ids=["pwrite", "writemap"])
def test_c05_lmdb_shared_mmap_and_locks(tiermount, tmp_path: Path, writemap: bool) -> None:
    """C05 (lmdb needs shared writable mmap and locks; py-lmdb#100), steps 1-4 scaled down:
    2,000 keys of 4 KiB in one write transaction, commit, ``env.sync(True)``; a second process
    reads all keys with ``readonly=True, lock=True`` while the writer's env stays open; the same
    with ``writemap=True``; 4 DataLoader-like workers open the env after fork and read random
    keys for 2 s; after unmount the database in $BACK opens on local disk with every key."""
    import lmdb

    m = tiermount(ram="64MiB", ssd="256MiB")
    db = m.mnt / "c05" / "db"
    db.parent.mkdir()
    env = lmdb.open(str(db), map_size=1 << 30, writemap=writemap)
    try:
        with env.begin(write=True) as txn:
            for i in range(C05_KEYS):
                txn.put(b"%08d" % i, _c05_value(i))
        env.sync(True)
        assert py(C05_READER, str(db)) == str(C05_KEYS)  # another process, the writer's env open
        assert py(C05_LOADER, str(db), "4", "2", str(C05_KEYS)) == "[0, 0, 0, 0]"
    finally:
        env.close()
    m.stop()
    local = tmp_path / "copy"
    local.mkdir()
    # (cp keeps the holes: with writemap lmdb sizes data.mdb to map_size, 1 GiB)
    subprocess.run(["cp", "--sparse=always", str(m.backing / "c05" / "db" / "data.mdb"), str(local)], check=True)
    env = lmdb.open(str(local))
    with env.begin() as txn:
        assert txn.stat()["entries"] == C05_KEYS
        assert all(txn.get(b"%08d" % i) == _c05_value(i) for i in range(C05_KEYS))
    env.close()
    assert leftovers(m.backing) == []


def test_c05_lmdb_flush_while_env_open_then_close(tiermount) -> None:
    """C05 with the writer's env open for the whole run (a training job's lmdb cache) while
    ``tierfs flush`` runs (a checkpoint step), then the env is closed: once closed and past its
    write-back deadline nothing stays dirty (the write tier gives the space back), and a change
    made later on the backing store is what the mount shows."""
    import lmdb

    m = tiermount(ram="64MiB", ssd="256MiB", extra=("-o", "writeback_deadline=0.2"))
    db = m.mnt / "c05b"
    env = lmdb.open(str(db), map_size=256 * MiB)
    with env.begin(write=True) as txn:
        for i in range(500):
            txn.put(b"%08d" % i, _c05_value(i))
    env.sync(True)
    flush(m)  # while the env (data.mdb and lock.mdb open for writing) stays open
    env.close()
    flush(m)
    deadline = time.monotonic() + 60  # a hang guard: the default write-back deadline is 120 s
    while time.monotonic() < deadline and m.stats()["writeback"]["dirty_files"]:
        time.sleep(0.1)
    wb = m.stats()["writeback"]
    assert (wb["dirty_files"], wb["dirty_bytes"]) == (0, 0), wb
    assert os.listdir(m.ssd / "dirty") == []  # type: ignore[operator]


# -- C07 -----------------------------------------------------------------------------------------
def _c07_version(i: int, n: int) -> bytes:
    """Version ``i`` of the target: a header naming it, then ``n`` bytes of one value."""
    return b"V%08d:%012d\n" % (i, n) + bytes([i % 256]) * n


C07_READER = """
import os, sys, time
path, stop = sys.argv[1], sys.argv[2]
reads = 0
while not os.path.exists(stop):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        print("MISSING"); sys.exit(1)
    head, _, body = data.partition(b"\\n")
    i, n = (int(x) for x in head[1:].split(b":"))
    if len(body) != n or body.count(bytes([i % 256])) != n:
        print("PARTIAL", i, n, len(body)); sys.exit(1)
    reads += 1
print(reads)
"""


def _c07_save(target: Path, data: bytes) -> None:
    """What a library's atomic save does (safetensors >= 0.8 ``NamedTempFile`` + ``persist``)."""
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os.fchmod(f.fileno(), 0o644)
        tmp = f.name
    os.replace(tmp, target)
    dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def test_c07_atomic_save_temp_chmod_rename(tiermount, tmp_path: Path) -> None:
    """C07 (temp file + chmod + rename; safetensors#792), steps 1-3: a library-style atomic
    save of 100 MiB over an existing target (the mode becomes 0644), the real
    ``safetensors.torch.save_file`` over it (mode as a local save gives), ``torch.save`` over
    an existing file; no ``tmp*`` file stays in $MNT or $BACK. Step 4: the tests below."""
    import torch
    from safetensors.torch import load_file, save_file

    m = tiermount(ram="64MiB", ssd="512MiB")
    d = m.mnt / "c07"
    d.mkdir()
    target = d / "model.safetensors"
    target.write_bytes(_c07_version(0, 1000))  # 1. exists once
    big = _c07_version(1, 100 * MiB)  # 2. a 100 MiB save over it
    _c07_save(target, big)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sha(target.read_bytes()) == sha(big)
    # 3. the real calls
    tensors = {"w": torch.randn(256, 256), "b": torch.arange(10)}
    save_file(tensors, target)
    save_file(tensors, tmp_path / "local.safetensors")
    mode = stat.S_IMODE((tmp_path / "local.safetensors").stat().st_mode)
    assert stat.S_IMODE(target.stat().st_mode) == mode
    got = load_file(str(target))
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    ck = d / "last.ckpt"
    torch.save({"step": 1}, ck)
    torch.save({"step": 2, "w": tensors["w"]}, ck)
    assert torch.load(ck, weights_only=True)["step"] == 2
    flush(m)
    assert sorted(os.listdir(d)) == ["last.ckpt", "model.safetensors"]
    bd = m.backing / "c07"
    assert sorted(os.listdir(bd)) == ["last.ckpt", "model.safetensors"]
    assert load_file(str(bd / "model.safetensors")).keys() == tensors.keys()
    assert stat.S_IMODE((bd / "model.safetensors").stat().st_mode) == mode
    assert torch.load(bd / "last.ckpt", weights_only=True)["step"] == 2
    assert leftovers(m.backing) == []


REPLACED_REASON = ("BUG: a name replaced by rename (or unlinked) between a reader's lookup and its open gives "
                   "ENOENT: rename detaches the old target's inode (tierfs/fs/operations.py:504, "
                   "InodeTable.detach sets entry.path=None) and open() of that inode then needs its path "
                   "(operations.py:637 -> inodes.py:54 FileNotFoundError); on a local FS the open gets the old "
                   "file. Readers of an atomically replaced checkpoint see it missing")


def test_c07_replace_loop_with_reader(tiermount, tmp_path: Path) -> None:
    """C07 step 4: the target is replaced 100 times (temp file, fsync, fchmod, ``os.replace``,
    fsync of the directory) while another process reads it in a loop: the reader always sees a
    complete old or new version, never a partial or missing file; no ``tmp*`` file stays."""
    m = tiermount(ram="64MiB", ssd="256MiB")
    d = m.mnt / "c07"
    d.mkdir()
    target = d / "model.safetensors"
    target.write_bytes(_c07_version(2, MiB))
    stop = tmp_path / "stop"
    reader = subprocess.Popen([sys.executable, "-c", C07_READER, str(target), str(stop)], stdout=subprocess.PIPE,
                              text=True)
    try:
        for i in range(3, 103):
            _c07_save(target, _c07_version(i, MiB + i))
            if reader.poll() is not None:
                break
    finally:
        stop.touch()
        out, _ = reader.communicate(timeout=60)
    assert reader.returncode == 0, f"reader saw a bad file: {out}"
    assert int(out) > 0
    assert target.read_bytes() == _c07_version(102, MiB + 102)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    flush(m)
    assert os.listdir(d) == os.listdir(m.backing / "c07") == ["model.safetensors"]
    assert (m.backing / "c07" / "model.safetensors").read_bytes() == _c07_version(102, MiB + 102)
    assert leftovers(m.backing) == []


def test_c07_open_after_lookup_of_replaced_name(tiermount, tmp_path: Path) -> None:
    """C07, the reader's race made deterministic: the path is resolved first (``O_PATH``, the
    lookup), the name is then replaced, and the resolved file is opened (through
    ``/proc/self/fd``): as on a local FS, the open succeeds and reads the old version. (The
    old version is written back first; a still-dirty one is a race with its write-back.)"""
    m = tiermount(ram="64MiB", ssd="256MiB")
    got = []
    for root in (tmp_path / "local", m.mnt / "c07r"):
        root.mkdir()
        target, new = root / "target", root / "new"
        target.write_bytes(b"old" * 1000)
        new.write_bytes(b"new")
        if root == m.mnt / "c07r":
            flush(m)
        fdp = os.open(target, os.O_PATH)
        try:
            os.replace(new, target)
            fd = os.open(f"/proc/self/fd/{fdp}", os.O_RDONLY)
            try:
                got.append(os.pread(fd, 6, 0))
            finally:
                os.close(fd)
        finally:
            os.close(fdp)
    assert got == [b"oldold", b"oldold"]


# -- C08 -----------------------------------------------------------------------------------------
def test_c08_overwrite_existing_file(tiermount) -> None:
    """C08 (overwrite an existing file -> EPERM; mountpoint-s3#862): steps 1-3, each overwrite
    both while the old version is still dirty and after it was written back; reads return only
    the newest payload, in $MNT and in $BACK."""
    import torch

    m = tiermount(ram="64MiB", ssd="128MiB")
    d = m.mnt / "c08"
    d.mkdir()
    f = d / "f"
    for settle in (False, True):
        sh(f"echo one > '{f}'")
        if settle:
            flush(m)
        sh(f"echo two > '{f}'")
        assert f.read_bytes() == b"two\n"
        (d / "p").write_bytes(b"x" * 10)
        if settle:
            flush(m)
        (d / "p").write_bytes(b"yz" * 3)
        assert (d / "p").read_bytes() == b"yzyzyz"
        torch.save({"v": torch.arange(100)}, d / "o.pt")
        if settle:
            flush(m)
        torch.save({"v": torch.ones(3)}, d / "o.pt")
        assert torch.equal(torch.load(d / "o.pt", weights_only=True)["v"], torch.ones(3))
    flush(m)
    bd = m.backing / "c08"
    assert (bd / "f").read_bytes() == b"two\n"
    assert (bd / "p").read_bytes() == b"yzyzyz"
    assert torch.equal(torch.load(bd / "o.pt", weights_only=True)["v"], torch.ones(3))
    assert leftovers(m.backing) == []


# -- C09 -----------------------------------------------------------------------------------------
OLD = b"OLDTAIL!"


def _grep_tree(root: Path, needle: bytes) -> list[str]:
    hits = []
    for dirpath, _, files in os.walk(root):
        for n in files:
            p = os.path.join(dirpath, n)
            try:
                with open(p, "rb") as f:
                    if needle in f.read():
                        hits.append(p)
            except OSError:
                pass
    return hits


def test_c09_o_trunc_shorter_overwrite(tiermount, tmp_path: Path) -> None:
    """C09 (O_TRUNC ignored -> old tail kept; mirage#1032): steps 1-5. After each truncating
    open the size is what was written since; no old byte survives in $MNT, in the tiers
    ($CACHE) or in $BACK after write-back."""
    m = tiermount(ram="64MiB", ssd="128MiB")
    d = m.mnt / "c09"
    d.mkdir()
    t = d / "t"
    # 1-2. shell
    sh(f"printf 'A%.0s' {{1..21}} > '{t}'")
    assert sh(f"wc -c < '{t}'").strip() == "21"
    sh(f"echo BB > '{t}'")
    assert sh(f"stat -c %s '{t}'").strip() == "3"
    assert t.read_bytes() == b"BB\n"
    # 3. Python, while the long version is dirty and after it was written back
    p = d / "p"
    for settle in (False, True):
        with open(p, "wb") as f:
            f.write(OLD * 125)
        if settle:
            flush(m)
        with open(p, "wb") as f:
            f.write(b"y")
        assert (os.path.getsize(p), p.read_bytes()) == (1, b"y")
    # 4. cached variant: the long version written back, then read fully (tiers + page cache)
    c = d / "cached"
    c.write_bytes(OLD * 100_000)  # 800 KB
    flush(m)
    drop_page_cache(c)
    assert c.read_bytes() == OLD * 100_000
    with open(c, "wb") as f:
        f.write(b"y")
    assert (os.path.getsize(c), c.read_bytes()) == (1, b"y")
    assert py("import sys; print(open(sys.argv[1],'rb').read())", str(c)) == "b'y'"
    # 5. raw O_TRUNC, no write
    (d / "raw").write_bytes(OLD * 10)
    flush(m)
    os.close(os.open(d / "raw", os.O_WRONLY | os.O_TRUNC))
    assert os.stat(d / "raw").st_size == 0 and (d / "raw").read_bytes() == b""
    flush(m)
    bd = m.backing / "c09"
    assert {n: (bd / n).read_bytes() for n in sorted(os.listdir(bd))} == {
        "cached": b"y", "p": b"y", "raw": b"", "t": b"BB\n"}
    assert _grep_tree(m.backing, OLD) == []
    assert _grep_tree(m.mnt / "c09", OLD) == []


def test_c09_no_old_bytes_left_in_the_tiers(tiermount) -> None:
    """C09 "Expected": after a truncating overwrite of a cached file and write-back, no old
    byte survives in $CACHE (the tier directories) either."""
    from tierfs.mount import ram_tier_path

    m = tiermount(ram="64MiB", ssd="128MiB")
    c = m.mnt / "c"
    c.write_bytes(OLD * 100_000)
    flush(m)
    drop_page_cache(c)
    assert c.read_bytes() == OLD * 100_000  # into the tiers
    with open(c, "wb") as f:
        f.write(b"y")
    flush(m)
    assert c.read_bytes() == b"y"
    tiers = [m.ssd, Path(ram_tier_path("/dev/shm", str(m.mnt)))]
    assert [h for t in tiers for h in _grep_tree(t, OLD)] == []


# -- C10 -----------------------------------------------------------------------------------------
def _c10_appender(path: str, tag: str, barrier) -> None:  # type: ignore[no-untyped-def]
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    barrier.wait()
    for i in range(1000):
        line = f"{tag}:{i:06d}:".encode()
        os.write(fd, line + b"." * (63 - len(line)) + b"\n")
    os.close(fd)


def test_c10_o_append_existing_file(tiermount) -> None:
    """C10 (O_APPEND on an existing file -> EINVAL; mountpoint-s3#863): steps 1-5, on a file
    written back and on one still dirty; 4 processes append 1000 64-byte lines each; the size
    is exact, every line whole and each writer's lines in order; ``logging.FileHandler``
    (and tensorboard's event writer if installed) work on the mount."""
    m = tiermount(ram="64MiB", ssd="128MiB")
    d = m.mnt / "c10"
    d.mkdir()
    for settle in (True, False):
        log = d / f"log-{settle}.txt"
        log.write_bytes(b"a\n")
        if settle:
            flush(m)
        with open(log, "a") as f:
            f.write("b\n")
        sh(f"echo c >> '{log}'")
        assert log.read_bytes() == b"a\nb\nc\n"
        barrier = CTX.Barrier(4)
        procs = [CTX.Process(target=_c10_appender, args=(str(log), f"w{k}", barrier)) for k in range(4)]
        for p in procs:
            p.start()
        join_all(procs, 60)
        data = log.read_bytes()
        assert len(data) == 6 + 4 * 1000 * 64
        assert data[:6] == b"a\nb\nc\n"
        lines = data[6:].split(b"\n")[:-1]
        assert all(len(ln) == 63 and ln.endswith(b".") for ln in lines)
        for k in range(4):
            mine = [int(ln.split(b":")[1]) for ln in lines if ln.startswith(b"w%d:" % k)]
            assert mine == list(range(1000)), f"writer {k}"
    # 5. logging
    logger = logging.getLogger("c10-test")
    h = logging.FileHandler(d / "train.log")
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    try:
        for i in range(200):
            logger.info("step %d loss %.3f", i, 1 / (i + 1))
    finally:
        logger.removeHandler(h)
        h.close()
    h = logging.FileHandler(d / "train.log")  # reopened: mode 'a'
    logger.addHandler(h)
    try:
        logger.info("resumed")
    finally:
        logger.removeHandler(h)
        h.close()
    text = (d / "train.log").read_text().splitlines()
    assert len(text) == 201 and text[0] == "step 0 loss 1.000" and text[-1] == "resumed"
    try:
        from torch.utils.tensorboard import SummaryWriter  # optional
    except ImportError:
        pass
    else:
        w = SummaryWriter(str(d / "tb"))
        for i in range(10):
            w.add_scalar("loss", 1 / (i + 1), i)
        w.close()
        assert any(n.startswith("events.out.tfevents") for n in os.listdir(d / "tb"))
    flush(m)
    bd = m.backing / "c10"
    for settle in (True, False):
        assert (bd / f"log-{settle}.txt").read_bytes() == (d / f"log-{settle}.txt").read_bytes()
    assert (bd / "train.log").read_text().splitlines() == text


# -- C11 -----------------------------------------------------------------------------------------
SIZE_CODE = "import os,sys; print(os.stat(sys.argv[1]).st_size)"


def _observers(p: Path) -> dict[str, int]:
    [de] = [de for de in os.scandir(p.parent) if de.name == p.name]
    return {"stat": os.stat(p).st_size, "process": int(py(SIZE_CODE, str(p))), "scandir": de.stat().st_size}


@pytest.mark.parametrize("case", ["12B", "100MiB", "ftruncate5GiB"])
def test_c11_size_right_after_write_and_fsync(tiermount, case: str) -> None:
    """C11 (stat shows size 0 after write + fsync; s3fs#320): steps 1-4: O_CREAT|O_EXCL, write
    (12 B, 100 MiB) or ``ftruncate`` to 5 GiB (sparse), fsync; ``fstat``, ``stat``, a second
    process and ``scandir`` all report the new size at once, before and after close, without
    waiting for write-back; after write-back $BACK has the same size and bytes (the 5 GiB
    file stays sparse there)."""
    m = tiermount(ram="64MiB", ssd="256MiB")
    d = m.mnt / "c11"
    d.mkdir()
    p = d / case
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        assert os.fstat(fd).st_size == 0
        if case == "12B":
            size, data = 12, b"hello world!"
            os.write(fd, data)
        elif case == "100MiB":
            size, data = 100 * MiB, random.Random(11).randbytes(MiB) * 100
            for off in range(0, size, 8 * MiB):
                os.write(fd, data[off : off + 8 * MiB])
        else:
            size, data = 5 * GiB, b"tail"
            os.ftruncate(fd, size)
            os.pwrite(fd, b"head", 0)
            os.pwrite(fd, b"tail", size - 4)
        assert os.fstat(fd).st_size == size
        assert _observers(p) == dict.fromkeys(("stat", "process", "scandir"), size)
        os.fsync(fd)
        assert os.fstat(fd).st_size == size
        assert _observers(p) == dict.fromkeys(("stat", "process", "scandir"), size)
    finally:
        os.close(fd)
    assert _observers(p) == dict.fromkeys(("stat", "process", "scandir"), size)
    for t in m.stats()["tiers"]:
        assert t["used_bytes"] + t["dirty_bytes"] <= t["capacity_bytes"], t

    def content_ok(q: Path) -> bool:
        with open(q, "rb") as f:
            if case != "ftruncate5GiB":
                return sha(f.read()) == sha(data)
            head = f.read(4)
            f.seek(GiB)
            mid = f.read(MiB)
            f.seek(size - 4)
            return head == b"head" and mid == b"\0" * MiB and f.read() == b"tail"

    assert content_ok(p)
    flush(m)
    bp = m.backing / "c11" / case
    assert bp.stat().st_size == size
    assert content_ok(bp)
    if case == "ftruncate5GiB":
        assert bp.stat().st_blocks * 512 < 64 * MiB, "the sparse file was filled in on the backing store"
    assert _observers(p) == dict.fromkeys(("stat", "process", "scandir"), size)
    assert leftovers(m.backing) == []
