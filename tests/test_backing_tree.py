"""BackingTree: every access stays beneath the root, never follows a symlink, and reaches paths
longer than PATH_MAX (no mount needed)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tierfs.backing_tree import BackingTree, openat2_supported


@pytest.fixture
def tree(tmp_path: Path):
    root = tmp_path / "back"
    root.mkdir()
    t = BackingTree(os.fsencode(root))
    try:
        yield t
    finally:
        t.close()


def test_openat2_available() -> None:
    assert openat2_supported()


def test_symlinked_directory_is_not_followed(tree: BackingTree, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"x")
    os.symlink(outside, tmp_path / "back" / "d")
    for call in (lambda: tree.lstat(b"d/secret"), lambda: tree.open_read(b"d/secret"),
                 lambda: tree.mkdir(b"d/new", 0o755), lambda: tree.unlink(b"d/secret"),
                 lambda: tree.create_tmp(b"d", b".t"), lambda: tree.chmod(b"d/secret", 0o777)):
        with pytest.raises(OSError) as ei:
            call()
        assert ei.value.errno == errno.ELOOP
    assert (outside / "secret").exists() and not (outside / "new").exists()
    assert oct((outside / "secret").stat().st_mode & 0o777) != "0o777"


def test_final_symlink_is_never_followed(tree: BackingTree, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's")
    os.chmod(victim, 0o600)
    os.symlink(victim, tmp_path / "back" / "l")
    with pytest.raises(OSError) as ei:
        tree.open_read(b"l")
    assert ei.value.errno == errno.ELOOP
    tree.chmod(b"l", 0o777)  # a symlink has no mode: left alone
    tree.chown(b"l", 1, 1)  # the link's own owner
    assert victim.stat().st_mode & 0o777 == 0o600 and victim.stat().st_uid == 0
    assert tree.readlink(b"l") == os.fsencode(victim)


def test_dotdot_cannot_leave_the_root(tree: BackingTree) -> None:
    with pytest.raises(OSError) as ei:
        tree.lstat(b"../outside")
    assert ei.value.errno == errno.EXDEV


def test_create_tmp_skips_a_planted_name(tree: BackingTree, tmp_path: Path, monkeypatch) -> None:
    import tierfs.backing_tree as bt

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    names = iter([b"aaaa", b"bbbb"])
    monkeypatch.setattr(bt.secrets, "token_hex", lambda n: next(names).decode())
    os.symlink(victim, tmp_path / "back" / ".tmp.aaaa")
    fd, name = tree.create_tmp(b"", b".tmp.")
    os.close(fd)
    assert name == b".tmp.bbbb" and victim.read_bytes() == b"keep"
    assert (tmp_path / "back" / ".tmp.bbbb").stat().st_mode & 0o777 == 0o600


def test_paths_longer_than_path_max(tree: BackingTree) -> None:
    rel = b""
    for i in range(25):  # 25 levels of 200-byte names: ~5 KB, past PATH_MAX
        rel = (rel + b"/" if rel else b"") + bytes([97 + i % 26]) * 200
        tree.mkdir(rel, 0o755)
    assert len(rel) > 4096
    fd, name = tree.create_tmp(rel, b"f")
    os.write(fd, b"deep")
    os.close(fd)
    tree.rename(rel + b"/" + name, rel + b"/file")
    rfd, st = tree.open_read(rel + b"/file")
    assert os.read(rfd, 10) == b"deep" and st.st_size == 4
    os.close(rfd)
    assert [n for n, _ in tree.scandir(rel)] == [b"file"]
    tree.unlink(rel + b"/file")
    tree.rmdir(rel)


def test_rename_noreplace_and_xattrs(tree: BackingTree, tmp_path: Path) -> None:
    from tierfs.backing_tree import RENAME_NOREPLACE

    (tmp_path / "back" / "a").write_bytes(b"a")
    (tmp_path / "back" / "b").write_bytes(b"b")
    with pytest.raises(FileExistsError):
        tree.rename(b"a", b"b", RENAME_NOREPLACE)
    tree.setxattr(b"a", b"user.k", b"v")
    assert tree.getxattr(b"a", b"user.k") == b"v"
    assert "user.k" in tree.listxattr(b"a")
    tree.removexattr(b"a", b"user.k")


def test_make_node_exact_mode_owner_and_setgid(tree: BackingTree, tmp_path: Path) -> None:
    import stat

    old = os.umask(0o077)
    try:
        st = tree.make_node(b"d", stat.S_IFDIR | 0o775, 1234, 5678)
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o775, 1234, 5678)
        os.chown(tmp_path / "back" / "d", 0, 4321)
        os.chmod(tmp_path / "back" / "d", 0o2775)
        sub = tree.make_node(b"d/sub", stat.S_IFDIR | 0o755, 1234, 5678)
        assert (stat.S_IMODE(sub.st_mode), sub.st_gid) == (0o2755, 4321)
        fifo = tree.make_node(b"d/fifo", stat.S_IFIFO | 0o640, 1234, 5678)
        assert stat.S_ISFIFO(fifo.st_mode) and (stat.S_IMODE(fifo.st_mode), fifo.st_gid) == (0o640, 4321)
        link = tree.make_symlink(b"target", b"d/link", 1234, 5678)
        assert stat.S_ISLNK(link.st_mode) and (link.st_uid, link.st_gid) == (1234, 4321)
    finally:
        os.umask(old)


def test_make_symlink_never_chowns_a_swapped_name(tree: BackingTree, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The name is replaced by a hard link to another's file right after the symlink is made."""
    victim = tmp_path / "back" / "victim"
    victim.write_text("root's")
    real_symlink = os.symlink

    def symlink_then_swap(target, name, *, dir_fd=None):  # type: ignore[no-untyped-def]
        real_symlink(target, name, dir_fd=dir_fd)
        os.unlink(name, dir_fd=dir_fd)
        os.link(victim, name, dst_dir_fd=dir_fd)

    monkeypatch.setattr(os, "symlink", symlink_then_swap)
    with pytest.raises(OSError) as ei:
        tree.make_symlink(b"t", b"s", 1234, 1234)
    assert ei.value.errno == errno.ELOOP
    assert (os.lstat(victim).st_uid, os.lstat(victim).st_gid) == (0, 0)
