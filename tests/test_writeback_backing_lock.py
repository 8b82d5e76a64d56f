"""One daemon per backing directory: a second mount of it - by the same path or through a bind
mount - is refused, naming the mount that holds it (two daemons removed each other's temporary
files and lost closed files)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import is_mounted, needs_fuse

pytestmark = [needs_fuse, pytest.mark.fuse]


def test_second_mount_of_a_backing_directory_is_refused(tiermount, tmp_path: Path) -> None:
    first = tiermount(ram="16MiB")
    (first.mnt / "f").write_bytes(b"one")
    with pytest.raises(AssertionError) as e:
        tiermount(ram="16MiB", name="mnt2")
    assert "already mounted by tierfs" in str(e.value) and str(first.mnt) in str(e.value)
    assert not is_mounted(tmp_path / "mnt2")
    # the same directory under another name: refused too (the lock is on the inode)
    alias = tmp_path / "alias"
    alias.mkdir()
    subprocess.run(["mount", "--bind", str(tmp_path / "back"), str(alias)], check=True)
    try:
        with pytest.raises(AssertionError) as e:
            tiermount(ram="16MiB", name="mnt3", backing=alias)
        assert "already mounted by tierfs" in str(e.value)
    finally:
        subprocess.run(["umount", str(alias)], check=False)
    assert (first.mnt / "f").read_bytes() == b"one"  # the first mount is unharmed
    first.stop()
    second = tiermount(ram="16MiB", name="mnt4")  # free again once the first is gone
    assert (second.mnt / "f").read_bytes() == b"one"
