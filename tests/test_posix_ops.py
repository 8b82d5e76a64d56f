"""POSIX operations a local disk has and tierfs must have too: special files (fifos, sockets,
devices), a refused rename that leaves its target usable, an open file replaced behind the
mount's back, paths longer than PATH_MAX, and inode identity (stable numbers, link counts).

One mount serves the module; ``attr_timeout=0`` makes the kernel ask the daemon for every
attribute, so what the daemon answers is what the tests see.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Mount, force_unmount, needs_fuse

pytestmark = [needs_fuse, pytest.mark.fuse]


@pytest.fixture(scope="module")
def m(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    base = tmp_path_factory.mktemp("posix_ops")
    (base / "back").mkdir()
    (base / "mnt").mkdir()
    mount = Mount(base / "back", base / "mnt", None, ["--ram", "64MiB", "-o", "attr_timeout=0"])
    try:
        mount.start()
        yield mount
    finally:
        force_unmount(mount)


@pytest.fixture
def d(m: Mount, request: pytest.FixtureRequest) -> Path:
    """A fresh directory of the mount for one test."""
    p = m.mnt / request.node.name.replace("[", "_").replace("]", "")
    p.mkdir()
    return p


def test_mkfifo_mknod_and_socket(m: Mount, d: Path) -> None:
    os.umask(0o022)
    os.mkfifo(d / "fifo", 0o640)
    st = os.lstat(d / "fifo")
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
    assert stat.S_ISFIFO(os.lstat(m.backing / d.name / "fifo").st_mode)
    os.mknod(d / "reg", stat.S_IFREG | 0o600)
    assert stat.S_ISREG(os.lstat(d / "reg").st_mode) and os.lstat(d / "reg").st_size == 0
    os.mknod(d / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))  # the test runs as root
    st = os.lstat(d / "null")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    # a Unix socket bound on the mount, and a client connecting to it by path
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cli = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(str(d / "sock"))
        srv.listen(1)
        assert stat.S_ISSOCK(os.lstat(d / "sock").st_mode)
        cli.connect(str(d / "sock"))
        conn, _ = srv.accept()
        cli.sendall(b"ping")
        assert conn.recv(4) == b"ping"
        conn.close()
    finally:
        cli.close()
        srv.close()
    # a fifo on the mount works as a fifo
    r = os.open(d / "fifo", os.O_RDONLY | os.O_NONBLOCK)
    w = os.open(d / "fifo", os.O_WRONLY)
    os.write(w, b"through the fifo")
    assert os.read(r, 100) == b"through the fifo"
    os.close(w)
    os.close(r)


def test_multiprocessing_with_tmpdir_on_the_mount(m: Mount, d: Path) -> None:
    """multiprocessing (and PyTorch's DataLoader through it) binds Unix sockets in TMPDIR."""
    code = ("import multiprocessing as mp\n"
            "if __name__ == '__main__':\n"
            "    with mp.Manager() as man:\n"
            "        d = man.dict(); d['x'] = 42; print(d['x'])\n"
            "    with mp.get_context('forkserver').Pool(2) as p:\n"
            "        print(sum(p.map(abs, [-1, -2, 3])))\n")
    # a Unix socket address holds 107 bytes: reach the directory through a short symlink
    short = Path(tempfile.mkdtemp(prefix="tfmp-")) / "t"
    short.symlink_to(d)
    try:
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(short)},
                           capture_output=True, timeout=120)
    finally:
        short.unlink()
        short.parent.rmdir()
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert r.stdout.split() == [b"42", b"6"]


def test_rename_onto_non_empty_dir_leaves_target_usable(d: Path) -> None:
    (d / "a").mkdir()
    (d / "b" / "c").mkdir(parents=True)
    fd = os.open(d / "b", os.O_RDONLY | os.O_DIRECTORY)  # a process that has it open
    try:
        with pytest.raises(OSError) as ei:
            os.rename(d / "a", d / "b")
        assert ei.value.errno in (errno.ENOTEMPTY, errno.EEXIST)
        assert os.listdir(d / "b") == ["c"]
        assert os.listdir(fd) == ["c"]
        assert stat.S_ISDIR(os.stat("c", dir_fd=fd).st_mode)
        assert os.listdir(d / "a") == []
    finally:
        os.close(fd)


def test_open_file_replaced_in_backing_dir_keeps_its_content(m: Mount, d: Path) -> None:
    """ext4 keeps serving the old inode to an open descriptor; so must the mount."""
    old = bytes(range(256)) * 64  # 16 KiB
    (m.backing / d.name / "f").write_bytes(old)
    with open(d / "f", "rb", buffering=0) as f:
        assert f.read(100) == old[:100]
        tmp = m.backing / d.name / "f.new"
        tmp.write_bytes(b"short")
        os.replace(tmp, m.backing / d.name / "f")
        assert os.fstat(f.fileno()).st_size == len(old)
        assert f.read() == old[100:]
    assert (d / "f").read_bytes() == b"short"  # a new open sees the new file


def test_tree_deeper_than_path_max(m: Mount, d: Path) -> None:
    """25 levels of 200-byte names (5 KB of path, over PATH_MAX), walked with directory fds."""
    depth, name_len = 25, 200
    fds = [os.open(d, os.O_RDONLY | os.O_DIRECTORY)]
    try:
        for level in range(depth):
            name = (f"{level:03d}" + "x" * name_len)[:name_len]
            os.mkdir(name, 0o755, dir_fd=fds[-1])
            fds.append(os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
            assert stat.S_ISDIR(os.fstat(fds[-1]).st_mode)
        os.mkfifo("bottom", 0o600, dir_fd=fds[-1])
        assert os.listdir(fds[-1]) == ["bottom"]
        assert stat.S_ISFIFO(os.stat("bottom", dir_fd=fds[-1], follow_symlinks=False).st_mode)
        os.unlink("bottom", dir_fd=fds[-1])
        for level in reversed(range(depth)):
            os.close(fds.pop())
            os.rmdir((f"{level:03d}" + "x" * name_len)[:name_len], dir_fd=fds[-1])
        assert os.listdir(fds[-1]) == []
    finally:
        for fd in fds:
            os.close(fd)


def _drop_caches() -> None:
    """Evict unused dentries and inodes: the kernel sends FORGET for the mount's inodes."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2\n")


def test_inode_numbers_stable_after_forget(m: Mount, d: Path) -> None:
    for i in range(20):
        (m.backing / d.name / f"f{i}").write_bytes(b"x")
    (m.backing / d.name / "sub").mkdir()
    names = [f"f{i}" for i in range(20)] + ["sub"]
    before = {n: os.lstat(d / n).st_ino for n in names}
    assert len(set(before.values())) == len(names)
    _drop_caches()
    after = {n: os.lstat(d / n).st_ino for n in names}
    assert after == before


def test_nlink_of_hard_linked_file_with_unwritten_changes(m: Mount, d: Path) -> None:
    (m.backing / d.name / "a").write_bytes(b"before")
    os.link(m.backing / d.name / "a", m.backing / d.name / "b")
    assert os.lstat(d / "a").st_nlink == 2
    with open(d / "a", "r+b", buffering=0) as f:
        f.write(b"AFTER!")  # dirty now; written back after close
        assert os.fstat(f.fileno()).st_nlink == 2
        assert os.lstat(d / "a").st_nlink == 2
        assert os.lstat(d / "b").st_nlink == 2
        assert os.lstat(d / "a").st_ino == os.lstat(d / "b").st_ino


def _dir_times(p: Path) -> tuple[int, int]:
    st = os.stat(p)
    return st.st_mtime_ns, st.st_ctime_ns


@pytest.mark.parametrize("change", ["create", "unlink", "rename"])
def test_directory_times_change_with_entries_in_the_write_tier(tiermount, tmp_path: Path, change: str) -> None:
    """A file created (and unlinked or renamed before its write-back) changes its directory's
    mtime and ctime at once, as on a local filesystem (pjdfstest open/00.t, unlink/00.t)."""
    m = tiermount(ram="64MiB", ssd="128MiB", extra=("-o", "writeback_deadline=3600"))
    d = m.mnt / "d"
    d.mkdir()
    fd = -1
    if change != "create":  # dirty and held open for writing: not written back meanwhile
        fd = os.open(d / "f", os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, b"x")
        assert not (tmp_path / "back" / "d" / "f").exists()
    os.utime(tmp_path / "back" / "d", ns=(1, 1))  # an old time on the backing dir: any change shows
    time_mark = _dir_times(d)
    if change == "create":
        (d / "new").write_bytes(b"y")
    elif change == "unlink":
        os.unlink(d / "f")
    else:
        os.rename(d / "f", d / "g")
    after = _dir_times(d)
    if fd >= 0:
        os.close(fd)
    assert after[0] > time_mark[0] and after[1] >= time_mark[1], (time_mark, after)


@pytest.mark.parametrize("kind", ["regular", "fifo", "socket"])
def test_names_of_a_hard_linked_object_survive_unlink_of_the_first(tiermount, kind: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """pjdfstest link/00.t: three names of one object; unlinking the name tierfs first knew it
    by leaves the other two working, each seeing the link count drop (the kernel caches names
    and attributes: a hard-linked object's must not outlive the names they came from)."""
    m = tiermount(ram="64MiB")  # the default attr_timeout: the kernel caches
    d = m.mnt / "d"
    d.mkdir()
    if kind == "socket":  # sun_path holds 108 bytes: names relative to the directory
        monkeypatch.chdir(d)
        d = Path(".")
    n0, n1, n2 = (d / f"{kind}{i}" for i in range(3))
    if kind == "regular":
        n0.write_bytes(b"x")
    elif kind == "fifo":
        os.mkfifo(n0)
    else:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(n0))
    os.link(n0, n1)
    os.link(n1, n2)
    assert [os.lstat(p).st_nlink for p in (n0, n1, n2)] == [3, 3, 3]
    os.chmod(n1, 0o640)
    os.chown(n1, 65534, 65533)
    assert [(os.lstat(p).st_uid, stat.S_IMODE(os.lstat(p).st_mode)) for p in (n0, n1, n2)] == [(65534, 0o640)] * 3
    os.unlink(n0)
    assert not os.path.lexists(n0)
    assert [(os.lstat(p).st_nlink, stat.S_IMODE(os.lstat(p).st_mode)) for p in (n1, n2)] == [(2, 0o640)] * 2
    os.unlink(n2)
    assert os.lstat(n1).st_nlink == 1 and not os.path.lexists(n2)
    os.unlink(n1)
    assert not os.path.lexists(n1)
    # pjdfstest link/02.t: link back under the first name once it is gone
    m0, m1 = d / f"{kind}-a", d / f"{kind}-b"
    m0.write_bytes(b"y")
    os.link(m0, m1)
    os.unlink(m0)
    os.link(m1, m0)
    os.unlink(m1)
    os.unlink(m0)
