"""Small pieces of the tierfs command."""

from __future__ import annotations


def test_a_zombie_daemon_counts_as_exited() -> None:
    import os
    import subprocess

    from tierfs.cli import _alive

    child = subprocess.Popen(["true"])
    for _ in range(200):  # exited, not reaped: a zombie
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                break
        import time

        time.sleep(0.01)
    assert not _alive(child.pid)
    assert _alive(os.getpid())
    child.wait()
    assert not _alive(child.pid)
