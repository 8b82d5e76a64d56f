"""POSIX write semantics through a writable tierfs mount, checked against a local directory.

Each scenario is a function ``scenario(root, rec)`` that performs operations under ``root`` and
records what it observes (return values, errnos, stats) in ``rec``. It runs once on a local
directory and once in the mount; the recordings must be equal, the resulting trees (names,
types, modes, owners, link counts, sizes, contents, symlink targets, user xattrs) must be
equal, and after ``tierfs flush`` the backing directory must equal the local one too, with no
write-back temporary files (``.tierfs-wb.*``) left behind.

One mount serves the whole module (scenarios work in their own subdirectories); tests that
need special mount options mount their own.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import random
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Mount, module_mount, needs_fuse, run_as, tierfs_cmd

pytestmark = [needs_fuse, pytest.mark.fuse]
KiB = 1 << 10
MiB = 1 << 20
NOBODY = 65534

Rec = list


# -- helpers -------------------------------------------------------------------------------------
def call(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``fn(*args)``'s value, or ``("ERR", "ENOENT")`` for an OSError."""
    try:
        return fn(*args, **kw)
    except OSError as e:
        return ("ERR", errno.errorcode.get(e.errno or 0, str(e.errno)))


def st_of(p: Path | str | int, *, follow: bool = True) -> tuple:
    """The comparable part of a stat: type, mode, owner, link count, size."""
    st = os.stat(p) if isinstance(p, int) or follow else os.lstat(p)
    size = None if stat.S_ISDIR(st.st_mode) else st.st_size
    return (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
            None if stat.S_ISDIR(st.st_mode) else st.st_nlink, size)


def xattrs(p: Path) -> dict[str, bytes]:
    try:
        names = os.listxattr(p, follow_symlinks=False)
    except OSError:
        return {}
    return {n: os.getxattr(p, n, follow_symlinks=False) for n in sorted(names) if n.startswith("user.")}


def tree(root: Path) -> dict[str, tuple]:
    """Everything comparable under ``root``."""
    out: dict[str, tuple] = {}
    def fail(e: OSError) -> None:
        raise e

    for dirpath, dirnames, filenames in os.walk(root, onerror=fail):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            item: tuple = st_of(p, follow=False)
            if stat.S_ISLNK(st.st_mode):
                item += (os.readlink(p),)
            elif stat.S_ISREG(st.st_mode):
                item += (hashlib.sha256(p.read_bytes()).hexdigest(), xattrs(p))
            else:
                item += (xattrs(p),)
            out[rel] = item
    return out


def wb_temps(root: Path) -> list[str]:
    return [os.path.join(d, n) for d, ds, fs in os.walk(root) for n in ds + fs if n.startswith(".tierfs-wb.")]


def flush(m: Mount, *paths: Path) -> None:
    tierfs_cmd("flush", str(m.mnt), *map(str, paths), timeout=60)


def py(code: str, *args: str) -> str:
    """Run ``code`` in a fresh Python process (a second observer); returns its stdout."""
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def settle(root: Path) -> None:
    """In a tierfs mount: wait until every dirty file is written back (``tierfs flush``); on a
    local directory: nothing. Scenarios use it to step around races reported separately."""
    for p in (root, *root.parents):
        if (p / ".tierfs" / "pid").exists():
            tierfs_cmd("flush", str(p), timeout=60)
            return


def ls(p: Path) -> list[str]:
    """Sorted names in ``p``, after :func:`settle` (a listing while files are written back can
    fail: test_listdir_while_written_back)."""
    settle(p)
    return sorted(os.listdir(p))


_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


def renameat2(old: Path, new: Path, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(old))


# -- the module's mount ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wm(tmp_path_factory: pytest.TempPathFactory, transport: str) -> Iterator[Mount]:
    yield from module_mount(tmp_path_factory, "posixw")


@pytest.fixture
def compare(wm: Mount, tmp_path: Path) -> Callable[..., tuple[Rec, Rec]]:
    """``compare(scenario)``: run on local and in the mount, compare everything."""
    n = [0]

    def run(scenario: Callable[[Path, Rec], None], *, check_tree: bool = True) -> tuple[Rec, Rec]:
        n[0] += 1
        name = f"{scenario.__name__}-{os.getpid()}-{n[0]}-{time.monotonic_ns()}"
        local = tmp_path / "local" / name
        local.mkdir(parents=True)
        here = wm.mnt / name
        here.mkdir()
        rl: Rec = []
        rm: Rec = []
        scenario(local, rl)
        scenario(here, rm)
        assert rm == rl, "observations differ (mount vs local)"
        if check_tree:
            flush(wm)  # (walking the tree during write-back can fail: test_listdir_while_written_back)
            assert tree(here) == tree(local), "tree in the mount differs from the local one"
            back = wm.backing / name
            assert wb_temps(back) == [], "write-back temporary files left in the backing store"
            assert tree(back) == tree(local), "backing tree after flush differs from the local one"
            assert tree(here) == tree(local), "tree in the mount changed after flush"
        return rl, rm

    return run


# -- scenarios: data ------------------------------------------------------------------------------
def sc_create_write(root: Path, rec: Rec) -> None:
    p = root / "f"
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o640)
    rec.append(os.write(fd, b"hello world"))
    rec.append(os.pwrite(fd, b"HELLO", 0))
    rec.append(os.pwrite(fd, b"tail", 20))  # beyond EOF: a hole of zeros
    rec.append(os.fstat(fd).st_size)
    rec.append(os.pread(fd, 100, 0))
    os.close(fd)
    rec.append(call(os.open, p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o640))
    rec.append(st_of(p))
    # open(O_CREAT) without O_TRUNC on an existing file keeps its bytes
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"J")
    os.close(fd)
    rec.append(p.read_bytes())
    # umask applies at create time
    old = os.umask(0o027)
    try:
        fd = os.open(root / "masked", os.O_WRONLY | os.O_CREAT, 0o777)
        os.close(fd)
    finally:
        os.umask(old)
    rec.append(st_of(root / "masked"))
    (root / "empty").touch()
    (root / "big").write_bytes(random.Random(3).randbytes(3 * MiB + 1))  # several slices/chunks
    rec.append(os.stat(root / "big").st_size)


def sc_o_trunc(root: Path, rec: Rec) -> None:
    p = root / "t"
    p.write_bytes(b"x" * 1000)
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    rec.append(os.fstat(fd).st_size)  # atomic with open: 0 before any write
    rec.append(os.stat(p).st_size)
    os.write(fd, b"y")
    os.close(fd)
    rec.append(p.read_bytes())
    # read it into the page cache, then truncate with a shorter rewrite
    rec.append(p.read_bytes())
    with open(p, "wb") as f:
        f.write(b"zz")
    rec.append((p.stat().st_size, p.read_bytes()))
    # O_TRUNC with no write
    os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))
    rec.append((p.stat().st_size, p.read_bytes()))
    # O_RDONLY|O_TRUNC truncates too (Linux) on a file we may write
    p.write_bytes(b"abc")
    os.close(os.open(p, os.O_RDONLY | os.O_TRUNC))
    rec.append(p.stat().st_size)


def sc_o_append(root: Path, rec: Rec) -> None:
    p = root / "log"
    p.write_bytes(b"a\n")
    with open(p, "ab") as f:
        f.write(b"b\n")
        rec.append(f.tell())
    fd = os.open(p, os.O_RDWR | os.O_APPEND)
    os.lseek(fd, 0, os.SEEK_SET)
    rec.append(os.write(fd, b"c\n"))  # appends despite the seek
    rec.append(os.pwrite(fd, b"d\n", 0))  # Linux: pwrite on O_APPEND appends too
    rec.append(os.lseek(fd, 0, os.SEEK_CUR))
    os.close(fd)
    subprocess.run(f"echo e >> '{p}'", shell=True, check=True)
    rec.append(p.read_bytes())


def sc_truncate(root: Path, rec: Rec) -> None:
    p = root / "g"
    p.write_bytes(b"0123456789" * 100)
    os.truncate(p, 10000)  # grow: zeros
    rec.append(os.stat(p).st_size)
    os.truncate(p, 10)  # shrink
    rec.append(p.read_bytes())
    fd = os.open(p, os.O_RDWR)
    os.ftruncate(fd, MiB + 7)
    rec.append(os.fstat(fd).st_size)
    rec.append(os.pread(fd, 20, 0))
    rec.append(os.pread(fd, 100, MiB - 50) == b"\0" * 57)
    os.ftruncate(fd, 3)
    rec.append(os.pread(fd, 100, 0))
    os.write(fd, b"w")  # the file position (0) is inside the file
    os.close(fd)
    rec.append(p.read_bytes())
    # truncate of a file that was written back (clean) grows it in place
    q = root / "h"
    q.write_bytes(b"abc")
    os.truncate(q, 5)
    rec.append(q.read_bytes())


def sc_fallocate(root: Path, rec: Rec) -> None:
    p = root / "fa"
    p.write_bytes(b"keep")
    fd = os.open(p, os.O_RDWR)
    call(os.posix_fallocate, fd, 0, 100_000)  # may be emulated by glibc: the outcome counts
    rec.append(os.fstat(fd).st_size)
    rec.append(os.pread(fd, 8, 0))
    call(os.posix_fallocate, fd, 10, 20)  # inside the file: no change
    rec.append(os.fstat(fd).st_size)
    os.close(fd)
    rec.append(p.read_bytes()[:4])


def sc_fsync(root: Path, rec: Rec) -> None:
    p = root / "s"
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, b"durable")
    rec.append(os.fsync(fd))
    os.write(fd, b"+more")
    rec.append(os.fdatasync(fd))
    rec.append(os.fstat(fd).st_size)
    os.close(fd)
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    rec.append(os.fsync(dfd))
    os.close(dfd)


def sc_two_handles(root: Path, rec: Rec) -> None:
    p = root / "shared"
    p.write_bytes(b"." * 100)
    a = os.open(p, os.O_RDWR)
    b = os.open(p, os.O_RDWR)
    r = os.open(p, os.O_RDONLY)
    rec.append(os.pread(r, 10, 0))  # into the page cache
    os.pwrite(a, b"AAAA", 0)
    rec.append(os.pread(b, 10, 0))
    rec.append(os.pread(r, 10, 0))
    os.pwrite(b, b"BBBB", 50)
    os.pwrite(b, b"END", 100)  # grows the file
    rec.append(os.pread(a, 200, 48))
    rec.append(os.fstat(a).st_size)
    rec.append(os.fstat(r).st_size)
    for fd in (a, b, r):
        os.close(fd)


# -- scenarios: namespace ------------------------------------------------------------------------
def sc_mkdir_rmdir(root: Path, rec: Rec) -> None:
    d = root / "d"
    os.mkdir(d, 0o750)
    rec.append(st_of(d))
    rec.append(call(os.mkdir, d))
    os.makedirs(root / "a" / "b" / "c")
    rec.append(call(os.rmdir, root / "a" / "b"))  # ENOTEMPTY
    (d / "new").write_bytes(b"x")  # a just-written file
    rec.append(call(os.rmdir, d))  # ENOTEMPTY
    settle(root)  # (unlinking a file while it is written back: see test_rmdir_after_unlink_of_new_file)
    (d / "new").unlink()
    with open(d / "open", "wb") as f:  # a file still open for writing
        f.write(b"y")
        rec.append(call(os.rmdir, d))  # ENOTEMPTY
        os.unlink(d / "open")
    rec.append(call(os.rmdir, d))
    rec.append(call(os.rmdir, root / "missing"))
    (root / "file").write_bytes(b"")
    rec.append(call(os.rmdir, root / "file"))  # ENOTDIR
    rec.append(call(os.mkdir, root / "file"))  # EEXIST
    rec.append(call(os.mkdir, root / "missing" / "x"))  # ENOENT
    rec.append(call(os.mkdir, root / "file" / "x"))  # ENOTDIR
    rec.append(ls(root))


def sc_unlink(root: Path, rec: Rec) -> None:
    p = root / "u"
    p.write_bytes(b"gone soon")
    os.unlink(p)
    rec.append(call(os.stat, p))
    rec.append(call(os.unlink, p))
    os.mkdir(root / "dir")
    rec.append(call(os.unlink, root / "dir"))  # EISDIR
    # unlink of open files: they stay usable through their descriptor
    (root / "clean").write_bytes(b"written and closed")
    fd = os.open(root / "clean", os.O_RDONLY)
    os.unlink(root / "clean")
    rec.append(os.pread(fd, 100, 0))
    rec.append(os.fstat(fd).st_nlink)
    os.close(fd)
    fd = os.open(root / "dirty", os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, b"still being written")
    os.unlink(root / "dirty")
    os.write(fd, b"+after unlink")
    rec.append(os.pread(fd, 100, 0))
    rec.append((os.fstat(fd).st_nlink, os.fstat(fd).st_size))
    rec.append(ls(root))
    # a new file under the same name while the old one is open
    (root / "dirty").write_bytes(b"second")
    rec.append(os.pread(fd, 100, 0))
    os.close(fd)
    rec.append((root / "dirty").read_bytes())


def sc_rename(root: Path, rec: Rec) -> None:
    (root / "a").write_bytes(b"A" * 10)
    (root / "b").write_bytes(b"B" * 20)
    settle(root)  # (the same without waiting: test_replace_just_written_file)
    os.rename(root / "a", root / "b")  # over an existing (written) file
    rec.append(((root / "b").read_bytes(), call(os.stat, root / "a")))
    # over an existing file while both are open
    fa = os.open(root / "c", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fa, b"C" * 5)
    fb = os.open(root / "b", os.O_RDONLY)
    os.rename(root / "c", root / "b")
    os.write(fa, b"+")
    rec.append(os.pread(fb, 100, 0))  # the old b, still readable
    rec.append((root / "b").read_bytes())
    os.close(fa)
    os.close(fb)
    settle(root)  # (renaming a file while it is written back: see test_rename_during_write_back)
    rec.append(ls(root))
    rec.append(call(os.rename, root / "missing", root / "x"))
    os.mkdir(root / "d")
    rec.append(call(os.rename, root / "b", root / "d"))  # EISDIR
    rec.append(call(os.rename, root / "d", root / "b"))  # ENOTDIR
    os.rename(root / "b", root / "d" / "b")  # into a subdirectory
    os.rename(root / "d" / "b", root / "d" / "b")  # to itself: no-op
    rec.append(ls(root / "d"))
    # RENAME_NOREPLACE
    (root / "n1").write_bytes(b"1")
    (root / "n2").write_bytes(b"2")
    settle(root)
    rec.append(call(renameat2, root / "n1", root / "n2", RENAME_NOREPLACE))
    rec.append(call(renameat2, root / "n1", root / "n3", RENAME_NOREPLACE))
    rec.append(ls(root))
    # the same with a file still open for writing (dirty) as the target
    with open(root / "n4", "wb") as f:
        f.write(b"4")
        f.flush()
        rec.append(call(renameat2, root / "n3", root / "n4", RENAME_NOREPLACE))
    # rename of a just-written file, then write-back must land it under the new name only
    with open(root / "w1", "wb") as f:
        f.write(b"w" * 3000)
        f.flush()
        os.rename(root / "w1", root / "w2")
    rec.append(ls(root))


def sc_rename_dir_with_new_files(root: Path, rec: Rec) -> None:
    src = root / "src"
    (src / "sub").mkdir(parents=True)
    (src / "closed").write_bytes(b"c" * 5000)
    (src / "sub" / "deep").write_bytes(b"d" * 7000)
    f = open(src / "open", "wb")
    f.write(b"o" * 100)
    f.flush()
    os.rename(src, root / "dst")
    f.write(b"O" * 100)  # still open: keeps writing into the moved file
    f.close()
    rec.append(ls(root))
    rec.append(ls(root / "dst"))
    rec.append([(root / "dst" / n).read_bytes()[:3] for n in ("closed", "open", "sub/deep")])
    rec.append(os.stat(root / "dst" / "open").st_size)
    rec.append(call(os.stat, src / "closed"))
    # a new file in the moved directory, then move it back
    (root / "dst" / "later").write_bytes(b"L")
    os.rename(root / "dst", src)
    rec.append(ls(src))


def sc_symlink(root: Path, rec: Rec) -> None:
    (root / "target").write_bytes(b"via link")
    os.symlink("target", root / "l1")
    os.symlink("nowhere/at/all", root / "dangling")
    os.symlink("/abs/path", root / "abs")
    rec.append(os.readlink(root / "l1"))
    rec.append((root / "l1").read_bytes())
    rec.append(call(os.stat, root / "dangling"))
    rec.append(call(os.symlink, "x", root / "target"))  # EEXIST
    with open(root / "l1", "ab") as f:  # writing through a symlink writes the target
        f.write(b"!")
    rec.append((root / "target").read_bytes())
    settle(root)  # (mkdir during that write-back: see test_mkdir_after_rmdir_of_open_dir)
    os.rename(root / "l1", root / "l2")
    rec.append(os.readlink(root / "l2"))
    os.unlink(root / "dangling")
    os.mkdir(root / "d")
    os.symlink("../target", root / "d" / "up")
    rec.append((root / "d" / "up").read_bytes())


def sc_hardlink(root: Path, rec: Rec) -> None:
    (root / "a").write_bytes(b"one")
    os.link(root / "a", root / "b")
    rec.append((os.stat(root / "a").st_nlink, os.stat(root / "b").st_nlink))
    rec.append(os.stat(root / "a").st_ino == os.stat(root / "b").st_ino)
    with open(root / "a", "ab") as f:
        f.write(b"+two")
    rec.append((root / "b").read_bytes())
    # a link to a file still open for writing
    fd = os.open(root / "c", os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, b"x")
    os.link(root / "c", root / "d")
    os.write(fd, b"y")
    os.close(fd)
    rec.append((root / "d").read_bytes())
    os.unlink(root / "a")
    rec.append((os.stat(root / "b").st_nlink, (root / "b").read_bytes()))
    rec.append(call(os.link, root / "b", root / "c"))  # EEXIST


# -- scenarios: attributes -------------------------------------------------------------------------
def sc_chmod_chown(root: Path, rec: Rec) -> None:
    (root / "clean").write_bytes(b"c")
    os.chmod(root / "clean", 0o600)
    rec.append(st_of(root / "clean"))
    fd = os.open(root / "dirty", os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, b"d")
    os.fchmod(fd, 0o640)
    rec.append(st_of(fd))
    os.fchown(fd, NOBODY, NOBODY)
    os.write(fd, b"d")  # root may still write
    rec.append(st_of(fd))
    os.close(fd)
    os.chown(root / "clean", NOBODY, -1)
    rec.append(st_of(root / "clean"))
    os.mkdir(root / "d", 0o755)
    os.chmod(root / "d", 0o1777)
    os.chown(root / "d", NOBODY, NOBODY)
    rec.append(st_of(root / "d"))
    os.symlink("clean", root / "ln")
    os.chown(root / "ln", NOBODY, NOBODY, follow_symlinks=False)
    rec.append(st_of(root / "ln", follow=False))
    os.chmod(root / "clean", 0o4755)  # setuid bit
    rec.append(st_of(root / "clean"))
    # chmod of a just-closed file, then more writes
    (root / "x").write_bytes(b"1")
    os.chmod(root / "x", 0o444)
    with open(root / "x", "ab") as f:  # root ignores the mode
        f.write(b"2")
    rec.append(st_of(root / "x"))


def sc_utimens(root: Path, rec: Rec) -> None:
    t1 = (1_500_000_000_123_456_789, 1_600_000_000_987_654_321)
    (root / "clean").write_bytes(b"c")
    os.utime(root / "clean", ns=t1)
    st = os.stat(root / "clean")
    rec.append(st.st_mtime_ns)
    fd = os.open(root / "dirty", os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, b"d")
    os.utime(fd, ns=t1)
    rec.append(os.fstat(fd).st_mtime_ns)
    rec.append(os.stat(root / "dirty").st_mtime_ns)
    os.close(fd)
    rec.append(os.stat(root / "dirty").st_mtime_ns)
    os.mkdir(root / "d")
    os.utime(root / "d", ns=t1)
    rec.append(os.stat(root / "d").st_mtime_ns)
    os.symlink("clean", root / "ln")
    os.utime(root / "ln", ns=t1, follow_symlinks=False)
    rec.append(os.lstat(root / "ln").st_mtime_ns)
    # only mtime (atime UTIME_OMIT)
    (root / "m").write_bytes(b"m")
    os.utime(root / "m", ns=t1)
    rec.append(os.stat(root / "m").st_mtime_ns)


def sc_xattrs(root: Path, rec: Rec) -> None:
    (root / "clean").write_bytes(b"c")
    fd = os.open(root / "dirty", os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, b"d")
    os.mkdir(root / "d")
    for p in (root / "clean", root / "dirty", root / "d"):
        rec.append(call(os.getxattr, p, "user.missing"))  # ENODATA
        rec.append(call(os.removexattr, p, "user.missing"))  # ENODATA
        os.setxattr(p, "user.a", b"1")
        os.setxattr(p, "user.b", b"\0binary\xff")
        os.setxattr(p, "user.a", b"22")  # replace
        rec.append(sorted(n for n in os.listxattr(p) if n.startswith("user.")))
        rec.append(os.getxattr(p, "user.a"))
        os.removexattr(p, "user.b")
        rec.append(call(os.getxattr, p, "user.b"))
        rec.append(sorted(n for n in os.listxattr(p) if n.startswith("user.")))
    os.write(fd, b"more")  # xattrs survive further writes
    os.setxattr(fd, "user.via_fd", b"fd")
    rec.append(os.getxattr(fd, "user.via_fd"))
    os.close(fd)
    rec.append(call(os.getxattr, root / "nope", "user.a"))  # ENOENT


# -- comparison tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("scenario", [
    sc_create_write, sc_o_trunc, sc_o_append, sc_truncate, sc_fallocate, sc_fsync, sc_two_handles,
    sc_mkdir_rmdir, sc_unlink, sc_rename, sc_rename_dir_with_new_files, sc_symlink,
    sc_chmod_chown, sc_utimens, sc_xattrs,
], ids=lambda f: f.__name__[3:])
def test_same_as_local(compare, scenario) -> None:  # type: ignore[no-untyped-def]
    compare(scenario)


def test_hardlink_same_as_local(compare) -> None:  # type: ignore[no-untyped-def]
    compare(sc_hardlink)


def sc_rename_dir_over_dir_with_new_file(root: Path, rec: Rec) -> None:
    os.makedirs(root / "A")
    (root / "A" / "a").write_bytes(b"a")
    os.makedirs(root / "B")
    with open(root / "B" / "f", "wb") as f:  # B holds only a file not yet written back
        f.write(b"dirty")
        f.flush()
        rec.append(call(os.rename, root / "A", root / "B"))  # ENOTEMPTY
        rec.append(sorted(os.listdir(root)))
        rec.append(sorted(os.listdir(root / "B")))


def test_rename_dir_over_dir_with_dirty_file(compare) -> None:  # type: ignore[no-untyped-def]
    compare(sc_rename_dir_over_dir_with_new_file)


def sc_mkdir_after_rmdir_of_open_dir(root: Path, rec: Rec) -> None:
    for i in range(10):
        os.mkdir(root / f"old{i}")
        fd = os.open(root / f"old{i}", os.O_RDONLY | os.O_DIRECTORY)  # like a shell whose cwd is there
        try:
            os.rmdir(root / f"old{i}")
            os.mkdir(root / f"new{i}")  # the backing store may give it the freed inode number
            rec.append(call(os.mkdir, root / f"new{i}" / "sub"))
            rec.append(call((root / f"new{i}" / "f").write_bytes, b"x"))
            # sorted: listing order is the filesystem's own (tierfs streams the backing
            # directory's order, then files not written back yet)
            rec.append(call(lambda p: sorted(os.listdir(p)), root / f"new{i}"))
        finally:
            os.close(fd)


def test_mkdir_after_rmdir_of_open_dir(compare) -> None:  # type: ignore[no-untyped-def]
    compare(sc_mkdir_after_rmdir_of_open_dir)


# -- mount-only checks ---------------------------------------------------------------------------
def test_rename_exchange(wm: Mount) -> None:
    d = wm.mnt / "exchange"
    d.mkdir()
    (d / "x").write_bytes(b"X")
    (d / "y").write_bytes(b"YY")
    try:
        renameat2(d / "x", d / "y", RENAME_EXCHANGE)
    except OSError as e:
        assert e.errno == errno.EINVAL, e  # refused cleanly, nothing changed
        assert ((d / "x").read_bytes(), (d / "y").read_bytes()) == (b"X", b"YY")
    else:
        assert ((d / "x").read_bytes(), (d / "y").read_bytes()) == (b"YY", b"X")
    flush(wm)
    assert sorted(os.listdir(wm.backing / "exchange")) == ["x", "y"]


def test_statfs(wm: Mount, tmp_path: Path) -> None:
    sv, lv = os.statvfs(wm.mnt), os.statvfs(wm.backing)
    assert (sv.f_bsize, sv.f_frsize, sv.f_blocks, sv.f_namemax) == (lv.f_bsize, lv.f_frsize, lv.f_blocks,
                                                                     lv.f_namemax)
    assert abs(sv.f_bavail - lv.f_bavail) < lv.f_blocks // 100


STAT_CODE = "import os,sys; st=os.stat(sys.argv[1]); print(st.st_size, st.st_mtime_ns)"


@pytest.mark.parametrize("size", [12, 3 * MiB + 5])
def test_size_and_mtime_right_after_write(wm: Mount, size: int) -> None:
    d = wm.mnt / f"sizes{size}"
    d.mkdir()
    p = d / "f"
    t0 = time.time_ns()
    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        assert os.fstat(fd).st_size == 0
        os.write(fd, b"z" * size)
        st = os.fstat(fd)
        assert st.st_size == size and st.st_mtime_ns >= t0 - 10_000_000
        assert os.stat(p).st_size == size
        out = py(STAT_CODE, str(p)).split()  # a second process, while the fd is open
        assert int(out[0]) == size and int(out[1]) >= t0 - 10_000_000
        [de] = [de for de in os.scandir(d) if de.name == "f"]
        assert de.stat().st_size == size
        os.fsync(fd)
        assert os.stat(p).st_size == size
        # an mtime set explicitly, then a write: mtime moves forward again
        os.utime(fd, ns=(10**18, 10**18 // 2))
        assert os.stat(p).st_mtime_ns == 10**18 // 2
        t1 = time.time_ns()
        os.pwrite(fd, b"+", size)
        assert os.stat(p).st_mtime_ns >= t1 - 10_000_000
        assert int(py(STAT_CODE, str(p)).split()[0]) == size + 1
    finally:
        os.close(fd)
    assert p.stat().st_size == size + 1
    # write-back may or may not have run (before or after the last byte): a whole version or none
    if (wm.backing / d.name / "f").exists():
        assert (wm.backing / d.name / "f").read_bytes() in (b"z" * size, b"z" * size + b"+")
    flush(wm)
    assert (wm.backing / d.name / "f").stat().st_size == size + 1


LOCK_CODE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
out = []
for kind in ("flock", "lockf"):
    try:
        if kind == "flock":
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 10, 0)
        out.append("got")
    except OSError as e:
        out.append("busy")
print(" ".join(out))
"""


def sc_locks(root: Path, rec: Rec) -> None:
    p = root / "lock"
    p.write_bytes(b"\0" * 100)
    fd = os.open(p, os.O_RDWR)
    rec.append(py(LOCK_CODE, str(p)))  # free
    fcntl.flock(fd, fcntl.LOCK_EX)
    rec.append(py(LOCK_CODE, str(p)).split()[0])  # flock busy
    fcntl.flock(fd, fcntl.LOCK_UN)
    fcntl.lockf(fd, fcntl.LOCK_EX, 10, 0)
    rec.append(py(LOCK_CODE, str(p)).split()[1])  # posix lock busy
    fcntl.lockf(fd, fcntl.LOCK_UN, 10, 0)
    fcntl.lockf(fd, fcntl.LOCK_SH, 5, 50)  # a range that does not overlap
    rec.append(py(LOCK_CODE, str(p)))
    # F_GETLK sees the holder
    import struct
    req = struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 100, 0)
    rec.append(struct.unpack("hhqqi", fcntl.fcntl(fd, fcntl.F_GETLK, req))[0])  # own lock: F_UNLCK
    os.close(fd)
    rec.append(py(LOCK_CODE, str(p)))


def test_locks(compare) -> None:  # type: ignore[no-untyped-def]
    compare(sc_locks)


# -- permissions (default_permissions) ------------------------------------------------------------
def _as_nobody(cwd: Path, fn: Callable[[], object]) -> str:
    """Run ``fn`` as uid/gid 65534 in ``cwd`` (:func:`tests.conftest.run_as`); returns
    'ok:<repr>' or the errno name."""
    kind, value = run_as(NOBODY, cwd, fn)
    return f"ok:{value}" if kind == "ok" else value


def _perm_tree(root: Path) -> None:
    (root / "public").write_bytes(b"pub")
    (root / "private").write_bytes(b"priv")
    os.chmod(root / "public", 0o644)
    os.chmod(root / "private", 0o600)
    with open(root / "private_open", "wb") as f:  # still dirty
        f.write(b"p")
        os.fchmod(f.fileno(), 0o600)


def test_permissions_without_allow_other(tiermount) -> None:  # type: ignore[no-untyped-def]
    m = tiermount(ram="32MiB", extra=("--no-allow-other",))  # root's mounts allow others by default
    _perm_tree(m.mnt)
    for fn in (lambda: open("public", "rb").read(), lambda: os.stat("public"), lambda: os.listdir("."),
               lambda: open("new", "wb")):
        assert _as_nobody(m.mnt, fn) in ("EACCES", "EPERM")
    assert not (m.mnt / "new").exists()


def test_permissions_with_allow_other(tiermount, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    m = tiermount(ram="32MiB", extra=("--allow-other",))
    local = tmp_path / "local"
    local.mkdir()
    for root in (local, m.mnt):
        _perm_tree(root)
        os.chmod(root, 0o755)
    settle(m.mnt)
    checks: list[Callable[[], object]] = [
        lambda: open("public", "rb").read(),
        lambda: open("private", "rb").read(),
        lambda: open("private_open", "rb").read(),
        lambda: open("public", "ab"),
        lambda: open("newfile", "wb"),
        lambda: os.chmod("public", 0o666),
        lambda: os.chown("public", NOBODY, NOBODY),
        lambda: os.unlink("public"),
        lambda: os.setxattr("public", "user.x", b"1"),
        lambda: sorted(os.listdir(".")),
        lambda: os.stat("private").st_size,
    ]
    got_local = [_as_nobody(local, fn) for fn in checks]
    got_mnt = [_as_nobody(m.mnt, fn) for fn in checks]
    assert got_local[0] == "ok:b'pub'" and got_local[1] == "EACCES"
    assert got_mnt == got_local
    # a directory nobody owns: they may create there, and the file is theirs
    for root in (local, m.mnt):
        os.mkdir(root / "nb")
        os.chown(root / "nb", NOBODY, NOBODY)
    mine = [_as_nobody(root, lambda: (open("nb/mine", "wb").write(b"m"), os.stat("nb/mine").st_uid))
            for root in (local, m.mnt)]
    assert mine[0] == mine[1] == f"ok:{(1, NOBODY)!r}"
    flush(m)
    assert tree(m.backing) == tree(local)


# -- races between namespace operations and write-back -----------------------------------------------
def test_rmdir_after_unlink_of_new_file(wm: Mount) -> None:
    base = wm.mnt / "rmrf"
    base.mkdir()
    got = []
    for i in range(20):
        d = base / str(i)
        d.mkdir()
        (d / "f").write_bytes(b"x" * (i * 50_000 + 10))
        os.unlink(d / "f")
        got.append(call(os.rmdir, d))
    assert got == [None] * 20
    flush(wm)
    assert os.listdir(base) == [] and os.listdir(wm.backing / "rmrf") == []


def test_rmdir_after_unlink_of_new_file_waits(wm: Mount) -> None:
    """The same with a flush in between always works (the race above needs no flush)."""
    d = wm.mnt / "rmrf2"
    d.mkdir()
    (d / "f").write_bytes(b"x" * 1000)
    flush(wm)
    os.unlink(d / "f")
    os.rmdir(d)
    assert not (wm.backing / "rmrf2").exists()


def test_replace_just_written_file(wm: Mount) -> None:
    base = wm.mnt / "replace"
    base.mkdir()
    got = []
    for i in range(20):
        d = base / str(i)
        d.mkdir()
        (d / "a").write_bytes(b"A" * 10)
        (d / "b").write_bytes(b"B" * 20)
        os.rename(d / "a", d / "b")
        got.append(call((d / "b").read_bytes))
    assert got == [b"A" * 10] * 20
    flush(wm)
    assert [(wm.backing / "replace" / str(i) / "b").exists() for i in range(20)] == [True] * 20
    assert [(base / str(i) / "b").read_bytes() for i in range(20)] == [b"A" * 10] * 20


def test_listdir_while_written_back(wm: Mount) -> None:
    base = wm.mnt / "lsrace"
    base.mkdir()
    errors = []
    for round_ in range(60):
        d = base / str(round_)
        d.mkdir()
        for k in range(20):
            (d / f"f{k}").write_bytes(b"y" * 100)
        for _ in range(10):
            r = call(lambda d=d: sorted((e.name, e.stat().st_size) for e in os.scandir(d)))
            if isinstance(r, tuple):
                errors.append(r)
        if errors:
            break
    assert errors == []


def test_setuid_bit_survives_write_back(wm: Mount) -> None:
    """chown then chmod 4755 through the mount: the backing file ends with the same mode and
    owner after write-back (a chown applied after the chmod would clear the setuid bit)."""
    p = wm.mnt / "suid"
    p.write_bytes(b"x")
    os.chown(p, NOBODY, NOBODY)
    os.chmod(p, 0o4755)
    flush(wm)
    st = os.stat(wm.backing / "suid")
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (0o4755, NOBODY, NOBODY)
    assert os.stat(p).st_mode & 0o7777 == 0o4755


CAPS_VALUE = struct.pack("<IIIII", 0x02000000, 1 << 10, 0, 0, 0)  # cap_net_bind_service, permitted


def test_capabilities_and_trusted_xattrs_survive_write_back(wm: Mount) -> None:
    """`setcap` on a file written through the mount, and trusted.* xattrs (root's), reach the
    backing store with the file (only user.* did: the capability was gone once the file was
    written back); on a hard-linked file, written back in place, too, and an xattr removed
    through the mount is removed there."""
    p = wm.mnt / "tool"
    with open(p, "wb") as f:
        f.write(b"\x7fELF" + b"\0" * 100)
    os.setxattr(p, "security.capability", CAPS_VALUE)
    os.setxattr(p, "trusted.t", b"t1")
    os.setxattr(p, "user.k", b"k1")
    flush(wm)
    b = wm.backing / "tool"
    assert os.getxattr(b, "security.capability") == CAPS_VALUE
    assert (os.getxattr(b, "trusted.t"), os.getxattr(b, "user.k")) == (b"t1", b"k1")

    # hard-linked: written back into the backing inode itself
    os.link(p, wm.mnt / "tool2")
    with open(p, "r+b") as f:
        f.write(b"\x7fELF2")  # the write drops the capability, as on a local filesystem
    with pytest.raises(OSError):
        os.getxattr(p, "security.capability")
    os.setxattr(wm.mnt / "tool2", "security.capability", CAPS_VALUE)
    os.removexattr(p, "trusted.t")
    flush(wm)
    for name in ("tool", "tool2"):
        b = wm.backing / name
        assert b.read_bytes()[:5] == b"\x7fELF2"
        assert os.getxattr(b, "security.capability") == CAPS_VALUE, name
        assert os.getxattr(b, "user.k") == b"k1"
        assert "trusted.t" not in os.listxattr(b), name
    assert os.stat(wm.backing / "tool").st_ino == os.stat(wm.backing / "tool2").st_ino


@pytest.mark.parametrize("kind", ["small", "sliced", "hardlinked"])
def test_times_set_through_the_mount_reach_the_backing_file(wm: Mount, kind: str) -> None:
    """An atime and mtime set through the mount on a file being written (``tar -x``, ``cp -a``,
    ``touch -a`` do it) are the backing file's after the write-back. The write-back's read of
    the data file used to renew its atime (relatime renews an atime older than the ctime, which
    the utime itself moved), and that renewed atime was what the backing file got. ``small``:
    one transaction; ``sliced``: several slices; ``hardlinked``: written back in place."""
    d = wm.mnt / f"times-{kind}"
    d.mkdir()
    p = d / "f"
    size = 33 * MiB + 7 if kind == "sliced" else 5000  # (more than the mount's 32 MiB slice)
    if kind == "hardlinked":
        (wm.backing / d.name / "f").write_bytes(b"o" * 10)
        os.link(wm.backing / d.name / "f", wm.backing / d.name / "g")
    times = (1_000_000_000_123_456_789, 1_100_000_000_987_654_321)  # atime older than mtime
    with open(p, "r+b" if kind == "hardlinked" else "wb") as f:
        f.write(b"t" * size)
        f.flush()
        os.utime(f.fileno(), ns=times)
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == times
    flush(wm)
    b = os.stat(wm.backing / d.name / "f")
    assert b.st_size == size
    assert (b.st_atime_ns, b.st_mtime_ns) == times
    if kind == "hardlinked":  # written back into the same inode, which both names share
        assert os.stat(wm.backing / d.name / "g").st_ino == b.st_ino and b.st_nlink == 2
    subprocess.run(["sh", "-c", "echo 2 > /proc/sys/vm/drop_caches"], check=True)
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == times


def test_a_write_back_while_open_leaves_the_atime_set_through_the_mount(wm: Mount) -> None:
    """A file written back while still open for writing (``tierfs flush``, an ``fsync``) keeps
    the atime set on it through the mount, as the mount shows it and, after it is written
    again and closed, on the backing file: the write-back reads the data file through a
    descriptor of its own opened ``O_NOATIME``. (Its read through the shared descriptor renewed
    the atime, and the next write-back carried the renewed one.)"""
    p = wm.mnt / "open-times"
    times = (1_000_000_000_123_456_789, 1_100_000_000_987_654_321)  # atime older than mtime
    with open(p, "wb") as f:
        f.write(b"a" * 5000)
        f.flush()
        os.utime(f.fileno(), ns=times)
        flush(wm)  # written back while open: the write-back read the data file
        assert os.stat(wm.backing / "open-times").st_atime_ns == times[0]
        assert os.fstat(f.fileno()).st_atime_ns == times[0]
        f.write(b"b" * 3000)  # (a write moves the mtime, never the atime)
    flush(wm)
    b = os.stat(wm.backing / "open-times")
    assert b.st_size == 8000 and b.st_mtime_ns > times[1]
    assert b.st_atime_ns == times[0]
    assert os.stat(p).st_atime_ns == times[0]
