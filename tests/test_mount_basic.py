"""The read path through a real mount: bytes, metadata, errors of the CLI."""

from __future__ import annotations

import errno
import hashlib
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import (
    CURRENT,
    REPO,
    drop_page_cache,
    is_mounted,
    needs_fuse,
    tierfs_cmd,
    write_random,
)

pytestmark = [needs_fuse, pytest.mark.fuse]
MiB = 1 << 20


def test_tree_metadata_and_bytes(tiermount, tmp_path: Path) -> None:
    back = tmp_path / "back"
    sizes = [0, 1, 4095, 4096, 4 * MiB - 1, 4 * MiB, 4 * MiB + 1, 9 * MiB + 123]
    datas = {s: write_random(back / "d" / f"f{s}", s, seed=s) for s in sizes}
    (back / "d" / "link").symlink_to("f1")
    os.setxattr(back / "d" / "f1", "user.tag", b"v1")
    m = tiermount(ram="64MiB")
    mnt = m.mnt
    assert sorted(os.listdir(mnt)) == ["d"]  # .tierfs hidden from readdir
    assert (mnt / ".tierfs" / "stats.json").exists()
    assert sorted(os.listdir(mnt / "d")) == sorted([f"f{s}" for s in sizes] + ["link"])
    for s, data in datas.items():
        p = mnt / "d" / f"f{s}"
        st, bst = p.stat(), (back / "d" / f"f{s}").stat()
        assert (st.st_size, st.st_mode, st.st_mtime_ns) == (bst.st_size, bst.st_mode, bst.st_mtime_ns)
        assert p.read_bytes() == data
    assert os.readlink(mnt / "d" / "link") == "f1"
    assert (mnt / "d" / "link").read_bytes() == datas[1]
    assert os.getxattr(mnt / "d" / "f1", "user.tag") == b"v1"
    assert "user.tag" in os.listxattr(mnt / "d" / "f1")
    with pytest.raises(OSError) as e:
        os.getxattr(mnt / "d" / "f1", "user.missing")
    assert e.value.errno == errno.ENODATA
    sv, bsv = os.statvfs(mnt), os.statvfs(back)
    assert (sv.f_blocks, sv.f_bsize) == (bsv.f_blocks, bsv.f_bsize)
    with pytest.raises(OSError) as e:
        (mnt / "d" / "nope").stat()
    assert e.value.errno == errno.ENOENT


def _reader(path: str, size: int, digest_of: dict, seed: int, q) -> None:  # type: ignore[no-untyped-def]
    rnd = random.Random(seed)
    ref = digest_of
    bad = 0
    with open(path, "rb", buffering=0) as f:
        for _ in range(200):
            off = rnd.randrange(0, size)
            n = rnd.choice([1, 100, 4096, 65536, 1 << 20, 3 << 20])
            f.seek(off)
            got = f.read(n)
            if hashlib.sha256(got).hexdigest() != hashlib.sha256(ref["data"][off : off + n]).hexdigest():
                bad += 1
    q.put(bad)


def test_random_offsets_eight_processes_uncached(tiermount, tmp_path: Path) -> None:
    size = 40 * MiB + 777
    data = write_random(tmp_path / "back" / "big.bin", size, seed=7)
    m = tiermount(ram="16MiB")  # smaller than the file: fetch, evict and bypass all happen
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(str(m.mnt / "big.bin"), size, {"data": data}, i, q))
             for i in range(8)]
    for p in procs:
        p.start()
    bad = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
    assert bad == [0] * 8
    assert m.tier("ram")["used_bytes"] <= 16 * MiB


def test_offsets_past_4gib(tiermount, tmp_path: Path) -> None:
    p = tmp_path / "back" / "sparse.bin"
    size = 5 * (1 << 30) + 12345
    marks = {0: b"start", (4 << 30) - 3: b"across4G", (4 << 30) + 4096: b"past4G", size - 3: b"end"}
    with open(p, "wb") as f:
        f.truncate(size)
        for off, b in marks.items():
            f.seek(off)
            f.write(b)
    m = tiermount(ram="64MiB")
    with open(m.mnt / "sparse.bin", "rb") as f:
        assert os.fstat(f.fileno()).st_size == size
        for off, b in marks.items():
            f.seek(off)
            assert f.read(len(b)) == b
        f.seek(size - 1)
        assert f.read(10) == b"d"
        f.seek((4 << 30) + 8192)
        assert f.read(4096) == bytes(4096)


def test_backing_change_seen_at_next_open(tiermount, tmp_path: Path) -> None:
    p = tmp_path / "back" / "f.bin"
    write_random(p, 5 * MiB, seed=1)
    m = tiermount(ram="64MiB")
    assert (m.mnt / "f.bin").read_bytes() == p.read_bytes()  # now in the tier and page cache
    new = write_random(p, 3 * MiB + 5, seed=2)  # rewritten in place, shorter
    assert (m.mnt / "f.bin").read_bytes() == new
    tmp = tmp_path / "back" / "f.tmp"
    newer = write_random(tmp, 6 * MiB, seed=3)
    os.replace(tmp, p)  # replaced by rename, as tools do
    assert (m.mnt / "f.bin").read_bytes() == newer
    # same size, same mtime second but different bytes: mtime_ns still differs
    newest = bytearray(newer)
    newest[100] ^= 0xFF
    p.write_bytes(bytes(newest))
    assert (m.mnt / "f.bin").read_bytes() == bytes(newest)


def test_ssd_tier_survives_remount(tiermount, tmp_path: Path) -> None:
    data = write_random(tmp_path / "back" / "w.bin", 24 * MiB, seed=5)
    m = tiermount(ram="8MiB", ssd="64MiB")
    assert (m.mnt / "w.bin").read_bytes() == data
    assert m.tier("ssd")["used_bytes"] >= 12 * MiB
    m.stop()
    m.start()
    drop_page_cache(tmp_path / "back" / "w.bin")
    assert (m.mnt / "w.bin").read_bytes() == data
    s = m.stats()
    ssd = next(t for t in s["tiers"] if t["name"] == "ssd")
    assert ssd["hits"] > 0
    # only what the SSD did not hold is fetched again
    assert s["scheduler"]["backing_bytes_read"] <= 24 * MiB - ssd["used_bytes"] + 4 * MiB


def test_ssd_corruption_is_detected(tiermount, tmp_path: Path) -> None:
    data = write_random(tmp_path / "back" / "c.bin", 8 * MiB, seed=9)
    m = tiermount(ram="0", ssd="64MiB")
    assert (m.mnt / "c.bin").read_bytes() == data
    m.stop()
    for dirpath, _, files in os.walk(m.ssd / "data"):
        for f in files:
            with open(os.path.join(dirpath, f), "r+b") as fh:
                fh.seek(1000)
                fh.write(b"CORRUPT")
    m.start()
    assert (m.mnt / "c.bin").read_bytes() == data
    assert m.stats()["cache"]["checksum_failures"] >= 1


@pytest.mark.parametrize("case", ["missing_backing", "nonempty_mnt", "mounted", "bad_size",
                                  "ram_too_big", "bad_config"])
def test_mount_errors_are_one_line(case: str, tmp_path: Path, tiermount) -> None:
    back, mnt = tmp_path / "back", tmp_path / "m2"
    mnt.mkdir()
    args = [str(back), str(mnt)]
    if case == "missing_backing":
        args[0] = str(tmp_path / "nope")
    elif case == "nonempty_mnt":
        (mnt / "x").write_text("x")
    elif case == "mounted":
        m = tiermount()
        args[1] = str(m.mnt)
    elif case == "bad_size":
        args += ["--ram", "12 bananas"]
    elif case == "ram_too_big":
        args += ["--ram", "100TiB"]
    elif case == "bad_config":
        cfg = tmp_path / "c.toml"
        cfg.write_text('chunk_sise = "4MiB"\n')
        args += ["--config", str(cfg)]
    r = tierfs_cmd("mount", *args, check=False)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierfs: "), r.stderr
    expect = {"missing_backing": "does not exist", "nonempty_mnt": "not empty",
              "mounted": "already mounted", "bad_size": "ram", "ram_too_big": "larger than its filesystem",
              "bad_config": "chunk_sise"}[case]
    assert expect in lines[0]
    assert not is_mounted(mnt)


def test_dead_daemon_mount_is_cleaned_up(tiermount, tmp_path: Path) -> None:
    write_random(tmp_path / "back" / "x", 1000)
    m = tiermount()
    m.kill9()
    with pytest.raises(OSError) as e:
        os.stat(m.mnt / "x")
    assert e.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    m.start()  # same mountpoint, no manual cleanup
    assert (m.mnt / "x").stat().st_size == 1000


def test_fixture_unmounts_even_a_dead_daemon(tmp_path: Path) -> None:
    """The fixture's failure path: a killed daemon's mount is still removed."""
    from tests.conftest import Mount, force_unmount

    (tmp_path / "back").mkdir()
    (tmp_path / "mnt").mkdir()
    m = Mount(tmp_path / "back", tmp_path / "mnt", None, ["--ram", "16MiB"])
    m.start()
    m.kill9()
    assert is_mounted(m.mnt)
    force_unmount(m)
    assert not is_mounted(m.mnt)


def test_cli_entry_point_runs() -> None:
    r = subprocess.run([sys.executable, "-m", "tierfs", "--help"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "mount" in r.stdout


def test_umount_of_dead_daemon_frees_its_ram_tier(tiermount, tmp_path: Path) -> None:
    from tierfs.mount import ram_tier_path

    write_random(tmp_path / "back" / "x", 3 * MiB)
    m = tiermount(ram="32MiB")
    assert (m.mnt / "x").read_bytes()
    ram_dir = Path(ram_tier_path("/dev/shm", str(m.mnt)))
    assert ram_dir.exists()
    m.kill9()
    r = tierfs_cmd("umount", str(m.mnt))
    assert "RAM tier" in r.stdout
    # the cached data (the memory) is freed; a write tier's journal, if any, stays for recovery
    assert not (ram_dir / "data").exists()
    assert not is_mounted(m.mnt)


def test_umount_lazy_detaches_while_a_file_is_open(tiermount, tmp_path: Path) -> None:
    write_random(tmp_path / "back" / "x", 1000)
    m = tiermount()
    with open(m.mnt / "x", "rb") as f:
        r = tierfs_cmd("umount", "--lazy", str(m.mnt), timeout=30)  # returns while f is open
        assert "detached" in r.stdout
        assert not is_mounted(m.mnt)
        assert len(f.read()) == 1000  # the open file still works
    m.pid = 0


def _requests(m) -> dict:
    return json.loads((m.mnt / ".tierfs" / "stats.json").read_bytes())["fuse"]


def test_kernel_caches_names_and_answers_close_itself(tiermount, tmp_path: Path) -> None:
    """Names and attributes of files are cached by the kernel (lstat after readdir, open of a
    name just looked up: no LOOKUP each), and close(2) sends no FLUSH after the first."""
    back = tmp_path / "back" / "d"
    back.mkdir()
    for i in range(40):
        (back / f"f{i}").write_bytes(b"x" * i)
    # attr_timeout=60: the cache window certainly outlasts the test on a loaded machine
    m = tiermount(ram="16MiB", extra=("-o", "attr_timeout=60"))
    d = m.mnt / "d"
    names = os.listdir(d)  # READDIRPLUS: each entry with its attributes
    before = _requests(m)["requests"]
    for n in names:
        os.lstat(d / n)
        assert (d / n).read_bytes() == b"x" * int(n[1:])
    after = _requests(m)["requests"]
    assert after.get("lookup", 0) - before.get("lookup", 0) == 0
    assert after.get("open", 0) - before.get("open", 0) >= 40  # and the stats.json read
    if CURRENT["transport"] == "pyfuse3":  # native with passthrough writes answers FLUSH
        assert after.get("flush", 0) <= 1


def test_backing_change_seen_at_next_open_while_names_are_cached(tiermount, tmp_path: Path) -> None:
    """With names and attributes cached (attr_timeout=60), a file grown in place or replaced
    behind tierfs' back is read whole, with its new size, at the next open."""
    p = tmp_path / "back" / "f.bin"
    write_random(p, 1 * MiB, seed=1)
    m = tiermount(ram="64MiB", extra=("-o", "attr_timeout=60"))
    f = m.mnt / "f.bin"
    assert f.read_bytes() == p.read_bytes()
    assert os.stat(f).st_size == 1 * MiB
    with open(p, "ab") as out:  # grown in place: the kernel's cached size is too small now
        out.write(b"tail" * 1000)
    assert f.read_bytes() == p.read_bytes()
    assert os.stat(f).st_size == 1 * MiB + 4000
    tmp = tmp_path / "back" / "f.tmp"
    newer = write_random(tmp, 3 * MiB + 7, seed=3)
    os.replace(tmp, p)
    assert f.read_bytes() == newer
    assert os.stat(f).st_size == len(newer)
    shorter = write_random(p, 1000, seed=4)  # shrunk in place
    assert f.read_bytes() == shorter
    assert _requests(m)["stale_opens"] >= 3


def test_directory_after_removing_and_creating_names(tiermount, tmp_path: Path) -> None:
    """After each unlink and create through the mount, the directory's attributes read through
    the mount are the backing directory's: the GETATTR the kernel sends after such a change is
    answered from the change's own fstat of the directory (``fuse.dir_getattrs_from_change``),
    never with the times from before it."""
    back = tmp_path / "back"
    (back / "d").mkdir()
    for i in range(20):
        (back / "d" / f"old{i}").write_bytes(b"x")
    m = tiermount(ram="16MiB")
    d = m.mnt / "d"
    names = sorted(os.listdir(d))
    mtime = os.stat(d).st_mtime_ns
    bst = os.lstat(back / "d")
    before = m.stats()["fuse"]["dir_getattrs_from_change"]
    for i, name in enumerate(names):
        time.sleep(0.011)  # past a clock tick: times may be as coarse as a jiffy (HZ=100)
        os.unlink(d / name)
        (d / f"new{i}").write_bytes(b"y")
        st = os.stat(d)
        # the change shows at once (the backing directory itself is compared in-process, in
        # tests/test_dir_after_change.py: here write-backs of the new files run beside it)
        assert mtime < st.st_mtime_ns <= st.st_ctime_ns
        assert (st.st_nlink, st.st_mode, st.st_uid) == (2, bst.st_mode, bst.st_uid)
        mtime = st.st_mtime_ns
    assert sorted(os.listdir(d)) == sorted(f"new{i}" for i in range(20))
    assert m.stats()["fuse"]["dir_getattrs_from_change"] >= before + 20
