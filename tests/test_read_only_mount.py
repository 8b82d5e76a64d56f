"""Read-only mounts (``-o ro``): every read works, every change is refused with EROFS and
never reaches the backing store; on the native transport the kernel answers opens itself
(``kernel_opens``), so reads come to the daemon by inode, control files are rendered per
GETATTR, and a change made behind tierfs' back is seen within ``attr_timeout``."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import time
import warnings
from pathlib import Path

import pytest

from tests.conftest import tierfs_cmd

KiB, MiB = 1 << 10, 1 << 20


def _tree(back: Path) -> dict[str, str]:
    """Files of the backing tree -> sha256 (symlinks: their target)."""
    out = {}
    for d, _, files in os.walk(back):
        for f in files:
            p = Path(d) / f
            rel = str(p.relative_to(back))
            out[rel] = os.readlink(p) if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _fill(back: Path) -> None:
    (back / "d" / "e").mkdir(parents=True)
    for i in range(20):
        (back / "d" / f"small{i}.bin").write_bytes(os.urandom(1000 + 997 * i))
    (back / "big.bin").write_bytes(os.urandom(12 * MiB + 12345))  # three chunks and a bit
    (back / "d" / "e" / "empty").write_bytes(b"")
    (back / "link").symlink_to("d/small3.bin")


def _refused(fn, *args) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(OSError) as e:
        fn(*args)
    assert e.value.errno == errno.EROFS, (fn, args, e.value)


def test_a_read_only_mount_reads_everything_and_refuses_every_change(tiermount, transport: str,
                                                                     tmp_path: Path) -> None:
    back = tmp_path / "back"
    _fill(back)
    before = _tree(back)
    m = tiermount(ram="64MiB", extra=("-o", "ro"))
    mnt = m.mnt

    # reads: every file, twice (the second from the tier or the page cache), mmap, readlink
    for _ in range(2):
        for rel, digest in before.items():
            if rel != "link":
                assert hashlib.sha256((mnt / rel).read_bytes()).hexdigest() == digest, rel
    for rel in before:  # out of the page cache: read again from the RAM tier, through the daemon
        fd = os.open(mnt / rel, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    for rel, digest in before.items():
        if rel != "link":
            assert hashlib.sha256((mnt / rel).read_bytes()).hexdigest() == digest, rel
    with open(mnt / "big.bin", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert mm[5 * MiB : 5 * MiB + 4096] == (back / "big.bin").read_bytes()[5 * MiB : 5 * MiB + 4096]
    with open(mnt / "big.bin", "rb") as f:  # random reads across chunk boundaries
        data = (back / "big.bin").read_bytes()
        for off in (4 * MiB - 100, 8 * MiB - 1, 12 * MiB, 12 * MiB + 12340):
            assert os.pread(f.fileno(), 4096, off) == data[off : off + 4096]
    assert os.readlink(mnt / "link") == "d/small3.bin"
    assert sorted(os.listdir(mnt / "d")) == sorted(p.name for p in (back / "d").iterdir())

    # changes: refused, by the kernel (MS_RDONLY) and by the daemon behind it
    _refused(os.open, str(mnt / "new"), os.O_CREAT | os.O_WRONLY, 0o644)
    _refused(os.open, str(mnt / "d" / "small1.bin"), os.O_WRONLY)
    _refused(os.open, str(mnt / "d" / "small1.bin"), os.O_RDWR)
    _refused(os.open, str(mnt / "d" / "small1.bin"), os.O_RDONLY | os.O_TRUNC)
    _refused(os.truncate, mnt / "big.bin", 0)
    _refused(os.mkdir, mnt / "newdir")
    _refused(os.unlink, mnt / "d" / "small2.bin")
    _refused(os.rmdir, mnt / "d" / "e")
    _refused(os.rename, mnt / "d" / "small4.bin", mnt / "d" / "moved")
    _refused(os.chmod, mnt / "big.bin", 0o600)
    _refused(os.chown, mnt / "big.bin", 1, 1)
    _refused(os.utime, mnt / "big.bin", (1, 1))
    _refused(os.symlink, "x", mnt / "sym")
    _refused(os.link, mnt / "big.bin", mnt / "hard")
    _refused(os.setxattr, mnt / "big.bin", "user.x", b"1")
    assert _tree(back) == before

    # the control files read whole and parse, again and again (rendered per GETATTR on the
    # native transport: a reader must never get the end of a newer rendering)
    for _ in range(50):
        doc = json.loads((mnt / ".tierfs" / "stats.json").read_bytes())
    assert doc["fuse"]["read_only"] is True
    assert int((mnt / ".tierfs" / "pid").read_text()) == m.pid
    r = tierfs_cmd("stats", str(mnt))
    assert "tiers" in r.stdout
    if transport == "native":
        assert doc["fuse"]["kernel_opens"] is True
        assert doc["transport"]["kernel_opens"] is True and not doc["transport"]["passthrough"]
        # one OPEN reached the daemon (answered ENOSYS), however many files were opened
        assert doc["transport"]["requests_by_opcode"].get("open", 0) <= 1
        assert doc["fuse"]["inode_readers"] > 0
        # the RAM tier's reads after the page cache was dropped were answered with no task
        assert doc["transport"]["reads_answered_at_once"] > 0
    else:
        assert doc["fuse"]["kernel_opens"] is False

    from tierfs_hints.client import Client, TierfsHintWarning

    if transport == "native":
        # requests as ioctls of the control file (it cannot be opened for writing): hints,
        # where, evict and flush work as on a read-write mount
        r = tierfs_cmd("evict", str(mnt / "big.bin"))
        assert "evicted" in r.stdout, r.stdout
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "skipped" warning
            h = Client().need([str(mnt / "big.bin")])
        assert h.wait(30) and h.progress().resident_bytes["ram"] == (back / "big.bin").stat().st_size
        r = tierfs_cmd("where", str(mnt / "big.bin"))
        assert "(100%)" in r.stdout, r.stdout
        r = tierfs_cmd("warmup", str(mnt / "d"))  # a need hint, as on a read-write mount
        assert "hint" in r.stdout and "0 B left" in r.stdout, r.stdout
        r = tierfs_cmd("flush", str(mnt))
        assert r.returncode == 0
    else:
        # no requests on a read-only mount of libfuse: hints are skipped with a warning, never
        # an error in the trainer
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            Client().need([str(mnt / "big.bin")])
        assert any(issubclass(w.category, TierfsHintWarning) and "read-only" in str(w.message) for w in got)
        r = tierfs_cmd("warmup", str(mnt / "d"))  # no hint: it reads the files through the mount
        assert "read 21 files" in r.stdout, r.stdout
        for cmd in (("flush", str(mnt)), ("where", str(mnt / "big.bin")), ("evict", str(mnt / "big.bin"))):
            r = tierfs_cmd(*cmd, check=False)
            assert r.returncode != 0 and "read-only tierfs mount" in r.stderr, (cmd, r.stderr)

    r = tierfs_cmd("umount", "--flush", str(mnt))
    assert "read-only" in r.stdout
    assert _tree(back) == before


@pytest.mark.native_only
def test_kernel_opens_see_a_change_behind_tierfs_back_within_attr_timeout(tiermount, tmp_path: Path) -> None:
    back = tmp_path / "back"
    (back / "f").write_bytes(b"old content\n")
    (back / "g").write_bytes(b"g1\n")
    m = tiermount(ram="64MiB", extra=("-o", "ro,attr_timeout=1"))
    assert (m.mnt / "f").read_bytes() == b"old content\n"
    assert (m.mnt / "g").read_bytes() == b"g1\n"
    time.sleep(0.05)
    # changed in place (a new size and mtime), and replaced by a rename (a new inode)
    with open(back / "f", "r+b") as f:
        f.write(b"NEW content, longer\n")
    (back / "g.tmp").write_bytes(b"g2 replaced\n")
    os.rename(back / "g.tmp", back / "g")
    time.sleep(1.6)  # attr_timeout and then some
    assert (m.mnt / "f").read_bytes() == b"NEW content, longer\n"
    assert (m.mnt / "g").read_bytes() == b"g2 replaced\n"
    assert m.stats()["fuse"]["inode_reader_opens"] >= 3


@pytest.mark.native_only
def test_kernel_opens_false_asks_the_daemon_at_every_open(tiermount, tmp_path: Path) -> None:
    back = tmp_path / "back"
    (back / "f").write_bytes(b"v1\n")
    m = tiermount(ram="64MiB", extra=("-o", "ro,kernel_opens=false"))
    assert (m.mnt / "f").read_bytes() == b"v1\n"
    (back / "f").write_bytes(b"v2, at once\n")
    assert (m.mnt / "f").read_bytes() == b"v2, at once\n"  # the next open sees it
    doc = m.stats()
    assert doc["fuse"]["kernel_opens"] is False and doc["transport"]["requests_by_opcode"]["open"] >= 2
    _refused(os.open, str(m.mnt / "f"), os.O_WRONLY)


@pytest.mark.native_only
def test_kernel_opens_a_reader_of_a_file_replaced_behind_tierfs_back_reads_the_old_one_to_its_end(
        tiermount, tmp_path: Path) -> None:
    """The kernel's inode is the object it opened: after a replace by rename (the safe-update
    pattern of checkpoints and shards), an open descriptor reads the old file to its end, as on
    a local filesystem, and a new open gets the new file (its own inode)."""
    back = tmp_path / "back"
    (back / "f").write_bytes(b"A" * (2 * MiB))
    m = tiermount(ram="64MiB", extra=("-o", "ro,attr_timeout=1"))
    with open(m.mnt / "f", "rb", buffering=0) as f:
        assert f.read(512 * KiB) == b"A" * (512 * KiB)
        (back / "f.tmp").write_bytes(b"B" * (2 * MiB))
        os.rename(back / "f.tmp", back / "f")
        time.sleep(1.6)  # past attr_timeout: the daemon checks its read handle again
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the rest comes as READs
        rest = f.read()
    assert rest == b"A" * (2 * MiB - 512 * KiB)
    assert (m.mnt / "f").read_bytes() == b"B" * (2 * MiB)

    # a reader that pauses for several attr_timeouts (the idle handles are swept each one)
    # after its file was replaced, or deleted: still the old file, never the new one's bytes
    for how in ("replaced", "deleted"):
        (back / how).write_bytes(b"O" * (2 * MiB))
        time.sleep(1.2)  # (a new name: the parent's listing is cached for attr_timeout)
        with open(m.mnt / how, "rb", buffering=0) as f:
            assert f.read(MiB) == b"O" * MiB
            if how == "replaced":
                (back / "n.tmp").write_bytes(b"N" * (2 * MiB))
                os.rename(back / "n.tmp", back / how)
            else:
                os.unlink(back / how)
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            time.sleep(3.5)
            assert f.read() == b"O" * MiB, how


@pytest.mark.native_only
def test_kernel_opens_see_an_in_place_change_that_keeps_size_and_mtime(tiermount, tmp_path: Path) -> None:
    """``rsync --inplace -a`` or ``cp -p`` over a file: same size, same mtime, new content. The
    kernel drops cached pages only on a size or mtime change; the daemon sees the new ctime at
    the GETATTR after attr_timeout and has the kernel drop them."""
    back = tmp_path / "back"
    (back / "f").write_bytes(b"OLD-" * 4096)
    m = tiermount(ram="64MiB", extra=("-o", "ro,attr_timeout=1"))
    assert (m.mnt / "f").read_bytes() == b"OLD-" * 4096  # in the page cache now
    st = os.stat(back / "f")
    time.sleep(0.05)
    with open(back / "f", "r+b") as f:
        f.write(b"NEW-" * 4096)
    os.utime(back / "f", ns=(st.st_atime_ns, st.st_mtime_ns))
    time.sleep(1.6)
    os.stat(m.mnt / "f")  # the GETATTR that finds the new ctime
    for _ in range(50):  # the kernel drops the pages from a thread of the daemon: moments
        if (m.mnt / "f").read_bytes() == b"NEW-" * 4096:
            break
        time.sleep(0.1)
    assert (m.mnt / "f").read_bytes() == b"NEW-" * 4096
    assert m.stats()["fuse"]["inode_invalidations"] >= 1


def test_umount_flush_of_a_read_only_mount_waits_for_what_a_crash_left(tiermount, tmp_path: Path) -> None:
    m = tiermount(ram="64MiB", extra=("-o", "writeback_hold=600,writeback_deadline=3600"))
    # killed while its writer has it open: never written back (a file closed alone is written
    # back at once, and a kill after its close raced that write-back)
    fd = os.open(m.mnt / "ck.bin", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"checkpoint" * 1000)  # (no fsync: on a RAM write tier it waits for the backing store)
    m.kill9()
    with contextlib.suppress(OSError):  # its FLUSH finds no daemon
        os.close(fd)
    assert not (tmp_path / "back" / "ck.bin").exists()  # dirty in the RAM write tier
    m.args += ["-o", "ro"]
    m.start()  # recovery: written back at once on a read-only mount
    assert (m.mnt / "ck.bin").read_bytes() == b"checkpoint" * 1000
    r = tierfs_cmd("umount", "--flush", str(m.mnt))
    assert "read-only" in r.stdout
    assert (tmp_path / "back" / "ck.bin").read_bytes() == b"checkpoint" * 1000
