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
