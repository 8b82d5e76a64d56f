"""Real file formats WRITTEN through a writable tierfs mount by their own libraries, then read
back through the mount, and (after ``tierfs flush``) from the backing directory too.

Each test drives the library the way training code does: ``torch.save`` of a model with its Adam
state to a temporary name and ``os.replace``; safetensors ``save_file`` (temp file, chmod,
rename); ``np.save`` and ``np.memmap`` ``w+``/``r+`` (shared writable mappings); lmdb with a
second process reading while the writer's env stays open, also with ``writemap=True``; h5py with
HDF5 file locking on; sqlite (rollback journal and WAL); ``tar -x``; ``cp -a`` and ``rsync -a``.

"Correct" is what the same code does on a local directory: the same bytes, the same metadata
the tool preserves (mode, mtime, symlinks, hard links, xattrs), and no temporary file
(``.tierfs-wb.*`` or the tool's own) left in the backing store after write-back.

One mount serves the module (each test works in its own directory).
"""

from __future__ import annotations

import copy
import hashlib
import os
import stat
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import (
    Mount,
    drop_page_cache,
    module_mount,
    needs_fuse,
    tierfs_cmd,
)

pytestmark = [needs_fuse, pytest.mark.fuse]
KiB = 1 << 10
MiB = 1 << 20


# -- helpers -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wm(tmp_path_factory: pytest.TempPathFactory, transport: str) -> Iterator[Mount]:
    yield from module_mount(tmp_path_factory, "formatsw")


@pytest.fixture
def wdir(wm: Mount, request: pytest.FixtureRequest) -> Path:
    """A fresh directory in the mount for this test."""
    d = wm.mnt / f"{request.node.name.replace('[', '-').replace(']', '')}-{time.monotonic_ns()}"
    d.mkdir()
    return d


def flush(m: Mount) -> None:
    tierfs_cmd("flush", str(m.mnt), timeout=90)


def back(m: Mount, p: Path) -> Path:
    """The backing-store path of mount path ``p``."""
    return m.backing / p.relative_to(m.mnt)


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def leftovers(root: Path) -> list[str]:
    """Write-back temporary files under ``root``."""
    return [os.path.join(d, n) for d, ds, fs in os.walk(root) for n in ds + fs if n.startswith(".tierfs-wb.")]


def py(code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> str:
    """Run ``code`` in a fresh Python process; returns its stdout (fails on a non-zero exit)."""
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                       env=None if env is None else {**os.environ, **env})
    assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stderr}"
    return r.stdout.strip()


def meta_tree(root: Path, *, dir_times: bool = False) -> dict[str, tuple]:
    """Everything ``cp -a``/``rsync -a``/``tar -x`` preserve, per relative path: type, mode,
    owner, size, mtime (files; directories only with ``dir_times``), content hash,
    symlink target, user xattrs, and which names are hard links of each other."""
    out: dict[str, tuple] = {}
    inodes: dict[int, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            item: tuple = (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
            if stat.S_ISLNK(st.st_mode):
                item += (os.readlink(p),)  # (its mtime: rsync does not keep it, even locally)
            elif stat.S_ISREG(st.st_mode):
                first = inodes.setdefault(st.st_ino, rel) if st.st_nlink > 1 else rel
                xa = {n: os.getxattr(p, n) for n in sorted(os.listxattr(p)) if n.startswith("user.")}
                item += (st.st_size, st.st_mtime_ns, sha(p), xa, st.st_nlink, first)
            elif dir_times:
                item += (st.st_mtime_ns,)
            out[rel] = item
    return out


# -- torch -----------------------------------------------------------------------------------------
def _train_state(seed: int) -> tuple:
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for _ in range(seed + 1):  # at least one step: Adam's exp_avg/exp_avg_sq/step exist
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt, (x, y)


def _assert_same_state(a: object, b: object) -> None:
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _assert_same_state(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same_state(x, y)
    else:
        assert a == b


def test_torch_save_model_with_adam_via_replace(wm: Mount, wdir: Path) -> None:
    """A training loop's checkpoint: ``torch.save`` to ``ckpt.pt.tmp``, ``os.replace`` onto
    ``ckpt.pt`` (twice: the second replaces a file that exists), then ``torch.load`` (plain and
    ``mmap=True``) through the mount and from the backing store; the loaded optimizer resumes
    training exactly like the original."""
    import torch

    target = wdir / "ckpt.pt"
    for seed in (0, 1):
        model, opt, _ = _train_state(seed)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": seed, "note": "ok"}
        tmp = target.with_name("ckpt.pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, target)
    assert sorted(os.listdir(wdir)) == ["ckpt.pt"]
    model, opt, (x, y) = _train_state(1)
    want = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 1, "note": "ok"})
    # one more step of the original: what a resumed run must reproduce
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    after = copy.deepcopy(model.state_dict())

    def check(path: Path) -> None:
        _assert_same_state(torch.load(path, weights_only=True), want)
        drop_page_cache(path)
        got = torch.load(path, mmap=True, weights_only=True)
        _assert_same_state(got, want)
        m2, o2, _ = _train_state(0)
        m2.load_state_dict(got["model"])
        o2.load_state_dict(copy.deepcopy(got["optimizer"]))
        o2.zero_grad()
        torch.nn.functional.cross_entropy(m2(x), y).backward()
        o2.step()
        _assert_same_state(m2.state_dict(), after)

    check(target)
    flush(wm)
    assert sorted(os.listdir(back(wm, wdir))) == ["ckpt.pt"]
    check(back(wm, target))
    assert sha(target) == sha(back(wm, target))


# -- safetensors -----------------------------------------------------------------------------------
def test_safetensors_save_file_and_safe_open(wm: Mount, wdir: Path, tmp_path: Path) -> None:
    """``save_file`` (a sibling temp file, chmod, rename: safetensors >= 0.8) creating and then
    replacing ``model.safetensors``; ``safe_open`` and ``load_file`` through the mount and from
    the backing store; the file mode is the one a local save gives."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(0)
    tensors = {"emb": torch.randn(512, 256, generator=g), "w": torch.randn(300, 7, generator=g).half(),
               "i": torch.arange(1000, dtype=torch.int64), "empty": torch.zeros(0, 4)}
    meta = {"format": "pt", "step": "7"}
    target = wdir / "model.safetensors"
    save_file({"old": torch.ones(3)}, target)
    save_file(tensors, target, metadata=meta)
    local = tmp_path / "model.safetensors"
    save_file(tensors, local, metadata=meta)
    assert sorted(os.listdir(wdir)) == ["model.safetensors"]
    assert stat.S_IMODE(target.stat().st_mode) == stat.S_IMODE(local.stat().st_mode)

    def check(path: Path) -> None:
        drop_page_cache(path)
        with safe_open(str(path), framework="pt") as f:
            assert f.metadata() == meta
            assert sorted(f.keys()) == sorted(tensors)
            for k in tensors:
                assert torch.equal(f.get_tensor(k), tensors[k]), k
            assert torch.equal(f.get_slice("emb")[10:20, :5], tensors["emb"][10:20, :5])
        got = load_file(str(path))
        assert all(torch.equal(got[k], tensors[k]) for k in tensors)

    check(target)
    flush(wm)
    assert sorted(os.listdir(back(wm, wdir))) == ["model.safetensors"]
    check(back(wm, target))
    assert sha(back(wm, target)) == sha(target)  # (not == local: the metadata's key order varies)
    assert stat.S_IMODE(back(wm, target).stat().st_mode) == stat.S_IMODE(local.stat().st_mode)


# -- numpy -----------------------------------------------------------------------------------------
def test_numpy_save_and_memmap_w_plus_r_plus(wm: Mount, wdir: Path) -> None:
    """``np.save``/``np.load`` (also ``mmap_mode='r'``), then a raw ``np.memmap`` created with
    ``'w+'`` and changed with ``'r+'`` (shared writable mappings of the mount's file): every
    write through a map shows in plain reads, in the mount and in the backing store."""
    import numpy as np

    rng = np.random.default_rng(1)
    a = rng.standard_normal((700, 900)).astype(np.float32)  # ~2.4 MiB
    np.save(wdir / "a.npy", a)
    assert np.array_equal(np.load(wdir / "a.npy"), a)
    mm = np.load(wdir / "a.npy", mmap_mode="r")
    assert np.array_equal(mm, a)
    del mm

    p = wdir / "raw.f32"
    shape = (1024, 2048)  # 8 MiB
    mm = np.memmap(p, dtype=np.float32, mode="w+", shape=shape)
    mm[::7] = np.arange(shape[1], dtype=np.float32)
    mm[-1] = -1.0
    mm.flush()
    del mm
    want = np.zeros(shape, np.float32)
    want[::7] = np.arange(shape[1], dtype=np.float32)
    want[-1] = -1.0
    assert p.stat().st_size == want.nbytes
    assert np.array_equal(np.fromfile(p, dtype=np.float32).reshape(shape), want)
    mm = np.memmap(p, dtype=np.float32, mode="r+", shape=shape)
    mm[100:200, 1000:1100] = 42.0
    mm[0, 0] = 3.5
    mm.flush()
    del mm
    want[100:200, 1000:1100] = 42.0
    want[0, 0] = 3.5
    drop_page_cache(p)
    assert np.array_equal(np.fromfile(p, dtype=np.float32).reshape(shape), want)
    # a second process sees the mapped writes too
    assert py("import numpy as np,sys; print(float(np.fromfile(sys.argv[1], np.float32)[0]))", str(p)) == "3.5"
    flush(wm)
    assert np.array_equal(np.fromfile(back(wm, p), dtype=np.float32).reshape(shape), want)
    assert np.array_equal(np.load(back(wm, wdir / "a.npy")), a)
    assert leftovers(back(wm, wdir)) == []


# -- lmdb ------------------------------------------------------------------------------------------
LMDB_READER = """
import lmdb, sys
env = lmdb.open(sys.argv[1], readonly=True, lock=True, subdir=True)
n = 0
with env.begin() as txn:
    for k, v in txn.cursor():
        i = int(k)
        assert v == bytes([i % 251]) * (1000 + i % 97), k
        n += 1
print(n, env.stat()["entries"])
"""


@pytest.mark.parametrize("writemap", [False, True], ids=["pwrite", "writemap"])
def test_lmdb_write_with_concurrent_reader(wm: Mount, wdir: Path, tmp_path: Path, writemap: bool) -> None:
    """lmdb writes (``writemap=True``: through a shared writable mapping of ``data.mdb``) while a
    second process reads with ``readonly=True, lock=True`` and the writer's env stays open (the
    lock file is a shared mapping both processes write); the database in the backing store is
    valid after the env is closed and written back."""
    import lmdb

    db = wdir / "db"
    env = lmdb.open(str(db), map_size=64 * MiB, writemap=writemap)
    try:
        with env.begin(write=True) as txn:
            for i in range(2000):
                txn.put(b"%06d" % i, bytes([i % 251]) * (1000 + i % 97))
        env.sync(True)
        assert py(LMDB_READER, str(db)) == "2000 2000"
        # a second transaction while the env is open: a new reader sees it
        with env.begin(write=True) as txn:
            for i in range(2000, 2500):
                txn.put(b"%06d" % i, bytes([i % 251]) * (1000 + i % 97))
            txn.delete(b"%06d" % 0)
        env.sync(True)
        assert py(LMDB_READER, str(db)) == "2499 2499"
    finally:
        env.close()
    assert py(LMDB_READER, str(db)) == "2499 2499"
    flush(wm)
    assert sorted(os.listdir(back(wm, db))) == ["data.mdb", "lock.mdb"]
    # the backing store's copy, opened on local disk
    local = tmp_path / "copy"
    local.mkdir()
    (local / "data.mdb").write_bytes(back(wm, db / "data.mdb").read_bytes())
    assert py(LMDB_READER, str(local)) == "2499 2499"


# -- h5py ------------------------------------------------------------------------------------------
H5_WRITE = """
import h5py, numpy as np, sys
rng = np.random.default_rng(0)
with h5py.File(sys.argv[1], "w") as f:
    f.attrs["version"] = 3
    g = f.create_group("train")
    g.create_dataset("x", data=rng.standard_normal((2000, 64)).astype("f4"), chunks=(100, 64),
                     compression="gzip")
    g.create_dataset("y", data=np.arange(2000, dtype="i8"))
    d = f.create_dataset("log", shape=(0,), maxshape=(None,), dtype="f8", chunks=(256,))
with h5py.File(sys.argv[1], "a") as f:  # reopen and grow
    d = f["log"]
    for i in range(5):
        d.resize((d.shape[0] + 300,))
        d[-300:] = np.arange(300) + i * 1000
    f["train"].attrs["rows"] = 2000
"""

H5_READ = """
import h5py, numpy as np, sys, hashlib
with h5py.File(sys.argv[1], "r") as f:
    x, y, log = f["train/x"][:], f["train/y"][:], f["log"][:]
    assert f.attrs["version"] == 3 and f["train"].attrs["rows"] == 2000
    assert np.array_equal(y, np.arange(2000)) and log.shape == (1500,)
    assert log[-1] == 4299
    print(hashlib.sha256(x.tobytes() + log.tobytes()).hexdigest())
"""

H5_LOCK_PROBE = """
import h5py, sys
try:
    h5py.File(sys.argv[1], "r").close()
    print("opened")
except OSError as e:
    print("locked" if "lock" in str(e).lower() else "error: " + str(e))
"""


def test_h5py_create_and_read_with_file_locking(wm: Mount, wdir: Path, tmp_path: Path) -> None:
    """h5py creates, reopens (``'a'``) and grows datasets with ``HDF5_USE_FILE_LOCKING=TRUE``
    (HDF5 then ``flock``s the file); the results equal a local run; while a writer holds the file
    open another process's open is refused the same way as on local disk."""
    env = {"HDF5_USE_FILE_LOCKING": "TRUE"}
    p, local = wdir / "data.h5", tmp_path / "data.h5"
    for f in (local, p):
        py(H5_WRITE, str(f), env=env)
    want = py(H5_READ, str(local), env=env)
    assert py(H5_READ, str(p), env=env) == want
    # a writer holds the file: readers are refused (as locally)
    # the holder keeps the file open until it is killed (it waits on a stdin nobody writes)
    hold = "import h5py,sys; f=h5py.File(sys.argv[1],'a'); print('ready',flush=True); sys.stdin.read()"
    probes = []
    for f in (local, p):
        holder = subprocess.Popen([sys.executable, "-c", hold, str(f)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
            probes.append(py(H5_LOCK_PROBE, str(f), env=env))
        finally:
            holder.kill()
            holder.communicate()  # reaps it and closes its pipes
    assert probes[1] == probes[0] == "locked"
    assert py(H5_READ, str(p), env=env) == want
    flush(wm)
    assert py(H5_READ, str(back(wm, p)), env=env) == want
    assert leftovers(back(wm, wdir)) == []


# -- sqlite ----------------------------------------------------------------------------------------
SQLITE_READER = """
import sqlite3, sys
con = sqlite3.connect(sys.argv[1], timeout=10)
print(*con.execute("SELECT count(*), sum(v), max(k) FROM t").fetchone())
"""


@pytest.mark.parametrize("journal_mode", ["delete", "wal"])
def test_sqlite_database(wm: Mount, wdir: Path, journal_mode: str) -> None:
    """sqlite: create a table, insert 10,000 rows in one transaction, update, close, reopen and
    query; with the rollback journal (a ``-journal`` file created, fsynced and unlinked per
    transaction) and with WAL (``-wal`` plus a shared-mmapped ``-shm``, read by a second
    process while the writer is open); ``integrity_check`` passes on the backing copy."""
    import sqlite3

    db = wdir / "t.db"
    con = sqlite3.connect(db)
    assert con.execute(f"PRAGMA journal_mode={journal_mode}").fetchone()[0] == journal_mode
    con.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v INTEGER, s TEXT)")
    with con:
        con.executemany("INSERT INTO t VALUES (?, ?, ?)", ((i, i * 3, "x" * (i % 50)) for i in range(10_000)))
    with con:
        con.execute("UPDATE t SET v = v + 1 WHERE k % 2 = 0")
        con.execute("DELETE FROM t WHERE k >= 9000")
    want = f"9000 {sum(i * 3 + (i % 2 == 0) for i in range(9000))} 8999"
    assert py(SQLITE_READER, str(db)) == want  # a second process, while this connection is open
    with con:
        con.execute("CREATE INDEX tv ON t (v)")
    con.close()
    con = sqlite3.connect(db)
    assert " ".join(map(str, con.execute("SELECT count(*), sum(v), max(k) FROM t").fetchone())) == want
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()
    assert sorted(os.listdir(wdir)) == ["t.db"]  # journal/WAL files gone after the last close
    flush(wm)
    assert sorted(os.listdir(back(wm, wdir))) == ["t.db"]
    con = sqlite3.connect(f"file:{back(wm, db)}?mode=ro", uri=True)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()
    assert py(SQLITE_READER, str(back(wm, db))) == want


# -- tar, cp -a, rsync -a -----------------------------------------------------------------------------
def _source_tree(root: Path) -> None:
    """A small data set directory: nested dirs, files of several sizes (0 B to 3 MiB), modes,
    a symlink, a hard link, a user xattr and old mtimes."""
    import random

    rnd = random.Random(5)
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty_dir").mkdir()
    sizes = {"a/zero": 0, "a/small.txt": 13, "a/b/mid.bin": 70 * KiB + 3, "big.bin": 3 * MiB + 1,
             "a/b/exec.sh": 100}
    for rel, n in sizes.items():
        (root / rel).write_bytes(rnd.randbytes(n))
    os.chmod(root / "a/b/exec.sh", 0o755)
    os.chmod(root / "a/small.txt", 0o600)
    os.symlink("b/mid.bin", root / "a" / "link")
    os.link(root / "big.bin", root / "big.hardlink")
    os.setxattr(root / "a/small.txt", "user.tag", b"label")
    t = 1_600_000_000_000_000_000
    for i, rel in enumerate(sorted(sizes)):
        os.utime(root / rel, ns=(t + i, t + i * 1_000_000_123))
    for i, rel in enumerate(["a/b", "a", "empty_dir"]):  # deepest first: setting a dir's mtime last
        os.utime(root / rel, ns=(t, t - i * 1_000_000_000))


def _diff(a: Path, b: Path) -> None:
    r = subprocess.run(["diff", "-r", "--no-dereference", str(a), str(b)], capture_output=True, text=True)
    assert r.returncode == 0, f"diff -r {a} {b}:\n{r.stdout}{r.stderr}"


def _copy_checks(wm: Mount, src: Path, dst: Path, *, dir_times: bool = False) -> None:
    want = meta_tree(src, dir_times=dir_times)
    _diff(src, dst)
    assert meta_tree(dst, dir_times=dir_times) == want, "tree in the mount differs from the source"
    flush(wm)
    _diff(src, back(wm, dst))
    assert leftovers(back(wm, dst)) == []
    assert meta_tree(back(wm, dst), dir_times=dir_times) == want, "backing tree differs from the source"
    assert meta_tree(dst, dir_times=dir_times) == want, "tree in the mount changed after write-back"


def test_cp_a_tree(wm: Mount, wdir: Path, tmp_path: Path) -> None:
    """``cp -a`` of a small tree into the mount: contents, modes, mtimes, symlink, hard link and
    xattr as in the source, in the mount and in the backing store."""
    src = tmp_path / "src"
    src.mkdir()
    _source_tree(src)
    subprocess.run(["cp", "-a", str(src), str(wdir / "cp")], check=True)
    _copy_checks(wm, src, wdir / "cp")


def test_rsync_a_tree(wm: Mount, wdir: Path, tmp_path: Path) -> None:
    """``rsync -aHX`` (temp files ``.name.XXXXXX`` renamed into place) into the mount; a second
    run finds nothing to transfer (sizes and mtimes preserved), before and after write-back."""
    src = tmp_path / "src"
    src.mkdir()
    _source_tree(src)
    dst = wdir / "rs"
    subprocess.run(["rsync", "-aHX", f"{src}/", f"{dst}/"], check=True)
    _copy_checks(wm, src, dst)
    r = subprocess.run(["rsync", "-aHX", "--itemize-changes", f"{src}/", f"{dst}/"], check=True,
                       capture_output=True, text=True)
    assert [ln for ln in r.stdout.splitlines() if not ln.startswith(".d")] == [], r.stdout


def _make_shard(tmp_path: Path) -> tuple[Path, Path]:
    """A WebDataset-style tar shard (samples of .jpg/.cls/.json) plus a subdirectory, a symlink
    and a hard link, and its extraction on local disk."""
    import json
    import random

    rnd = random.Random(9)
    src = tmp_path / "shard-src"
    (src / "meta").mkdir(parents=True)
    t = 1_650_000_000
    for i in range(40):
        key = f"{i:06d}"
        (src / f"{key}.jpg").write_bytes(b"\xff\xd8\xff" + rnd.randbytes(rnd.randint(2 * KiB, 60 * KiB)))
        (src / f"{key}.cls").write_text(str(i % 10))
        (src / f"{key}.json").write_text(json.dumps({"i": i, "caption": "x" * i}))
    (src / "meta" / "info.txt").write_text("shard 0\n")
    os.symlink("meta/info.txt", src / "README")
    os.link(src / "000000.jpg", src / "meta" / "first.jpg")
    for i, p in enumerate(sorted(src.rglob("*"))):
        os.utime(p, (t + i, t + i), follow_symlinks=False)
    shard = tmp_path / "shard-000000.tar"
    with tarfile.open(shard, "w", format=tarfile.GNU_FORMAT) as tf:
        for p in sorted(src.iterdir()):
            tf.add(p, arcname=p.name)
    local = tmp_path / "local-x"
    local.mkdir()
    subprocess.run(["tar", "-xf", str(shard), "-C", str(local)], check=True)
    return shard, local


def test_tar_extract_shard(wm: Mount, wdir: Path, tmp_path: Path) -> None:
    """``tar -xf shard.tar -C $MNT/dir``: the tree equals the same extraction on local disk
    (contents, modes, mtimes, symlink, hard link), in the mount and in the backing store."""
    shard, local = _make_shard(tmp_path)
    dst = wdir / "x"
    dst.mkdir()
    subprocess.run(["tar", "-xf", str(shard), "-C", str(dst)], check=True)
    _copy_checks(wm, local, dst)
    # the extracted files list the same as the archive's members
    with tarfile.open(shard) as tf:
        assert sorted(m.name for m in tf.getmembers()) == sorted(str(p.relative_to(dst)) for p in dst.rglob("*"))


# -- directory mtimes --------------------------------------------------------------------------------
def _dir_times_scenario(root: Path, how: str, tmp_path: Path) -> None:
    """A directory whose mtime is set (as ``tar -x``, ``cp -a`` and ``rsync -a`` do once its
    entries are in) right after a large file in it was written and closed."""
    if how == "utime":
        (root / "sub").mkdir()
        (root / "sub" / "big").write_bytes(b"b" * 8 * MiB)
        os.utime(root / "sub", ns=(1_500_000_000_000_000_000, 1_500_000_000_000_000_000))
    else:
        shard = tmp_path / "dirs.tar"
        if not shard.exists():
            src = tmp_path / "dirs-src"
            (src / "sub").mkdir(parents=True)
            (src / "sub" / "small").write_bytes(b"s")
            (src / "sub" / "big").write_bytes(b"b" * 8 * MiB)
            os.utime(src / "sub", (1_500_000_000, 1_500_000_000))
            with tarfile.open(shard, "w") as tf:
                tf.add(src / "sub", arcname="sub", recursive=False)
                tf.add(src / "sub" / "small", arcname="sub/small")
                tf.add(src / "sub" / "big", arcname="sub/big")  # the last member
        subprocess.run(["tar", "-xf", str(shard), "-C", str(root)], check=True)


@pytest.mark.parametrize("how", ["utime", "tar"])
def test_directory_mtime_survives_write_back(wm: Mount, wdir: Path, tmp_path: Path, how: str) -> None:
    """A directory mtime an application sets (``tar -x``, ``cp -a``, ``rsync -a`` restore them
    after filling the directory) stays as set, as on local disk, in the mount and in the
    backing store after the files in it are written back."""
    local = tmp_path / "local"
    local.mkdir()
    _dir_times_scenario(local, how, tmp_path)
    _dir_times_scenario(wdir, how, tmp_path)
    want = os.stat(local / "sub").st_mtime_ns
    assert want // 10**9 == 1_500_000_000
    flush(wm)
    assert (os.stat(wdir / "sub").st_mtime_ns, os.stat(back(wm, wdir / "sub")).st_mtime_ns) == (want, want)
