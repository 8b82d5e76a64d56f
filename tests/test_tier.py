"""Tier files (tierfs/cache/tier.py) and the private-state helpers under them (tierfs/private.py),
in-process: no mount."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tierfs import io, private
from tierfs.cache import tier as tier_mod
from tierfs.cache.tier import Tier
from tierfs.errors import MountError


def test_evicting_a_descriptor_in_use_does_not_close_it_under_its_user(tmp_path: Path, monkeypatch) -> None:
    """A device thread reading tier file A while another call opens tier file B with the fd
    cache full: B's open evicts A. The eviction must not close A's descriptor while the read
    still uses it (the number could meanwhile name another file). The interleaving is forced
    with a hook in the read itself: deterministic, no threads, no sleeps."""
    monkeypatch.setattr(tier_mod, "MAX_OPEN_FDS", 1)
    t = Tier("ssd", str(tmp_path / "t"), 1 << 20, inline=False)
    t.write("aa01", 0, b"A" * 4096)
    real_pread = io.pread_exact
    interleaved = []

    def pread_with_interleaving(fd: int, length: int, offset: int) -> bytes:
        if not interleaved:
            interleaved.append(True)
            t.write("bb02", 0, b"B" * 4096)  # evicts "aa01" from the fd cache
            # a file opened now may reuse a just-closed descriptor number
            other = os.open(tmp_path / "decoy", os.O_RDWR | os.O_CREAT, 0o600)
            os.pwrite(other, b"D" * 4096, 0)
        return real_pread(fd, length, offset)

    monkeypatch.setattr(io, "pread_exact", pread_with_interleaving)
    assert t.read("aa01", 0, 4096) == b"A" * 4096
    monkeypatch.setattr(io, "pread_exact", real_pread)
    assert t.read("aa01", 0, 4096) == b"A" * 4096  # reopened
    assert t.read("bb02", 0, 4096) == b"B" * 4096
    t.close()


def test_tier_dir_and_files_are_private_and_exact(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        t = Tier("ssd", str(tmp_path / "t"), 1 << 20, inline=False)
        t.write("cc03", 0, b"x")
    finally:
        os.umask(old)
    for p in (tmp_path / "t", tmp_path / "t" / "data", tmp_path / "t" / "data" / "cc"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p
    assert stat.S_IMODE((tmp_path / "t" / "data" / "cc" / "cc03").stat().st_mode) == 0o600
    t.close()


def test_a_symlink_planted_as_tier_file_is_replaced_not_followed(tmp_path: Path) -> None:
    t = Tier("ssd", str(tmp_path / "t"), 1 << 20, inline=False)
    victim = tmp_path / "victim"
    victim.write_bytes(b"secret")
    os.mkdir(tmp_path / "t" / "data" / "dd", 0o700)
    os.symlink(victim, tmp_path / "t" / "data" / "dd" / "dd04")
    t.write("dd04", 0, b"cached")
    assert victim.read_bytes() == b"secret"
    assert not (tmp_path / "t" / "data" / "dd" / "dd04").is_symlink()
    t.close()


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o701])
def test_an_existing_tier_dir_accessible_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    d = tmp_path / "t"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(private.PrivateStateError, match="chmod 700"):
        Tier("ssd", str(d), 1 << 20, inline=False)


def test_a_symlinked_tier_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    os.symlink(tmp_path / "real", tmp_path / "t")
    with pytest.raises(private.PrivateStateError, match="symlink"):
        Tier("ssd", str(tmp_path / "t"), 1 << 20, inline=False)


def test_remove_never_follows_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "f").write_bytes(b"x")
    fd = private.open_dir(str(tmp_path / "p"))
    try:
        os.symlink(tmp_path / "keep", "data", dir_fd=fd)
        private.remove(fd, "data")
    finally:
        os.close(fd)
    assert (tmp_path / "keep" / "f").exists()
    assert not os.path.lexists(tmp_path / "p" / "data")


def test_open_file_replaces_a_hard_link_and_a_fifo(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    fd = private.open_dir(str(tmp_path / "p"))
    try:
        os.link(outside, "linked", dst_dir_fd=fd)
        os.mkfifo("fifo", dir_fd=fd)
        for name in ("linked", "fifo"):
            f = private.open_file(fd, name, os.O_RDWR)
            try:
                os.write(f, b"new")
                st = os.fstat(f)
                assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1
                assert stat.S_IMODE(st.st_mode) == 0o600
            finally:
                os.close(f)
        with pytest.raises(FileExistsError):
            private.create_file(fd, "linked")
    finally:
        os.close(fd)
    assert outside.read_bytes() == b"keep"


def test_open_log_refuses_a_symlink_and_creates_0600(tmp_path: Path) -> None:
    (tmp_path / "target").write_bytes(b"")
    os.symlink(tmp_path / "target", tmp_path / "link.log")
    with pytest.raises(MountError, match="symlink"):
        private.open_log(str(tmp_path / "link.log"))
    os.close(private.open_log(str(tmp_path / "new.log")))
    assert stat.S_IMODE((tmp_path / "new.log").stat().st_mode) == 0o600


def test_state_parent_made_0755_by_an_older_version_is_tightened_not_refused(tmp_path: Path) -> None:
    parent = tmp_path / "run-tierfs"
    parent.mkdir(mode=0o755)
    os.chmod(parent, 0o755)
    os.close(private.open_in(str(parent), "abc"))
    assert stat.S_IMODE(parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((parent / "abc").stat().st_mode) == 0o700
    os.chmod(parent, 0o777)  # writable by others: someone may have planted something
    with pytest.raises(private.PrivateStateError, match="chmod 700"):
        private.open_in(str(parent), "abc")
