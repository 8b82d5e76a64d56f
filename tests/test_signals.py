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


@pytest.mark.parametrize("fails", [False, True], ids=["signal", "write-back fails"])
async def test_the_write_back_before_exit_ends_at_a_signal_or_a_failure(caplog, fails: bool) -> None:
    """After an unmount, a daemon whose write tier is the RAM tier writes its dirty files back
    before exiting (test_crash.py). A second SIGTERM stops that wait, and so does a write-back
    that fails; either way the log says what stays in memory, and the daemon goes on to exit."""
    import logging
    from types import SimpleNamespace

    import trio
    import trio.testing

    from tierfs.errors import BackingIOError
    from tierfs.mount import write_back_before_exit

    class Stuck:
        def statistics(self) -> SimpleNamespace:
            return SimpleNamespace(dirty_files=3, dirty_bytes=5 << 20)

        async def wait_durable(self, files: object, timeout: float) -> list[str]:  # noqa: ASYNC109
            if fails:
                raise BackingIOError("f", OSError(28, "No space left on device"))
            await trio.sleep_forever()
            return []

    caplog.set_level(logging.INFO, logger="tierfs")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write_back_before_exit, Stuck())
            await trio.testing.wait_all_tasks_blocked()
            if not fails:
                os.kill(os.getpid(), signal.SIGTERM)
    assert "writing back 3 dirty files" in caplog.text
    assert ("No space left" if fails else "signal SIGTERM: stopped writing back") in caplog.text
    assert "3 dirty files (5.0 MiB) were not written back" in caplog.text
