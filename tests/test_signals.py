"""Signals to the daemon ask for an orderly unmount, refused while files are open (as
``umount`` is); the daemon then keeps serving and says so in its log."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import Mount, is_mounted, needs_fuse, tierfs_cmd
from tierfs.cli import _alive
from tierfs.mount import state_dir_for

pytestmark = needs_fuse


def _log(m: Mount) -> str:
    return Path(state_dir_for(str(m.mnt)), "daemon.log").read_text(errors="replace")


def _wait_for(cond, what: str, timeout: float = 20) -> None:  # noqa: ANN001
    """Poll for an outcome the daemon reports only by acting (no event to wait on)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_signal_refuses_while_a_file_is_open_then_unmounts(tiermount, tmp_path: Path, sig: signal.Signals) -> None:
    (tmp_path / "back" / "f").write_bytes(b"abc" * 1000)
    m = tiermount()
    pid = m.pid
    fd = os.open(m.mnt / "f", os.O_RDONLY)
    try:
        before = _log(m).count("not unmounting")
        os.kill(pid, sig)
        _wait_for(lambda: _log(m).count("not unmounting") > before, "the refusal in the log")
        assert "busy" in _log(m)
        assert os.pread(fd, 3, 0) == b"abc"  # still served, not ENOTCONN
        assert is_mounted(m.mnt) and _alive(pid)
        assert (m.mnt / "f").read_bytes() == b"abc" * 1000
    finally:
        os.close(fd)
    os.kill(pid, sig)
    _wait_for(lambda: not _alive(pid), "the daemon to exit")
    assert not is_mounted(m.mnt)
    assert f"unmounted {m.mnt}" in _log(m) and "after an error" not in _log(m)
    m.pid = 0


def test_signal_after_a_lazy_unmount_keeps_serving_the_open_files(tiermount, tmp_path: Path) -> None:
    """``tierfs umount --lazy`` detached the mount; a signal then changes nothing: the daemon
    serves the files still open and exits when the last is closed."""
    (tmp_path / "back" / "f").write_bytes(b"xyz" * 100)
    m = tiermount()
    pid = m.pid
    fd = os.open(m.mnt / "f", os.O_RDONLY)
    try:
        tierfs_cmd("umount", "--lazy", str(m.mnt))
        assert not is_mounted(m.mnt)
        os.kill(pid, signal.SIGTERM)
        _wait_for(lambda: "is detached already" in _log(m), "the daemon's answer in the log")
        assert os.pread(fd, 3, 0) == b"xyz" and _alive(pid)
    finally:
        os.close(fd)
    _wait_for(lambda: not _alive(pid), "the daemon to exit after the last close")
    m.pid = 0
