"""Small pieces of the tierfs command."""

from __future__ import annotations

import pytest

from tests.conftest import needs_fuse


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


def test_flush_reports_every_file_its_requests_waited_for(monkeypatch, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A flush longer than one request (the daemon answers within ~10 s, ``timed_out``) is
    asked again; what it reports is every file any of its requests waited for, not only the
    last request's (a 10,000-file flush of 29 s said "3143 file(s) durable")."""
    import argparse

    from tierfs import cli

    replies = iter([
        {"ok": True, "waited": ["a", "b"], "timed_out": True},
        {"ok": True, "waited": ["b", "c"], "timed_out": True},
        {"ok": True, "waited": ["d"]},
    ])
    asked = []

    def command(mnt, req):  # type: ignore[no-untyped-def]
        asked.append(req)
        return next(replies)

    monkeypatch.setattr(cli, "_command", command)
    assert cli._flush(str(tmp_path), [], 1e9)["waited"] == ["a", "b", "c", "d"]
    assert len(asked) == 3 and all(r["op"] == "flush" for r in asked)

    # a timed-out flush is a failure, never reported as durable
    monkeypatch.setattr(cli, "_command", lambda mnt, req: {"ok": False, "error": "timed out", "kind": "timeout"})
    args = argparse.Namespace(mountpoint=str(tmp_path), paths=[], timeout=5.0)
    assert cli.cmd_flush(args) == 1
    assert "timed out" in capsys.readouterr().err


def test_the_daemon_takes_its_descriptor_table_whole_at_start() -> None:
    """Growing the descriptor table of a process with threads waits for an RCU grace period
    (7-16 ms a doubling on a 2-vCPU VM, the event loop stopped): the daemon grows it once at
    start, before its threads. Run in a child: the table never shrinks."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, resource, threading
        from tierfs.cli import _presize_fd_table
        def fdsize():
            for line in open("/proc/self/status"):
                if line.startswith("FDSize:"):
                    return int(line.split()[1])
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        slots = min(soft, 8192)
        before = fdsize()
        held = os.open("/dev/null", os.O_RDONLY)
        os.dup2(held, 1500)  # a descriptor in use where a smaller table ends: kept as it is
        assert not _presize_fd_table(1501)
        assert os.fstat(1500) and os.fstat(held)
        assert _presize_fd_table(slots)
        after = fdsize()
        assert before < slots <= after, (before, slots, after)
        fds = set(os.listdir("/proc/self/fd"))
        assert str(slots - 1) not in fds and "1500" in fds  # the probe left nothing open
        assert not _presize_fd_table(100)  # too small to matter
        print("ok", before, after)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr


@needs_fuse
@pytest.mark.fuse
def test_a_mounted_daemon_holds_a_presized_descriptor_table(tiermount) -> None:  # type: ignore[no-untyped-def]
    import resource

    m = tiermount(ram="16MiB")
    with open(f"/proc/{m.pid}/status") as f:
        size = next(int(line.split()[1]) for line in f if line.startswith("FDSize:"))
    with open(f"/proc/{m.pid}/limits") as f:
        soft = next(int(line.split()[3]) for line in f if line.startswith("Max open files"))
    assert size >= min(soft, 65536), (size, soft, resource.getrlimit(resource.RLIMIT_NOFILE))
