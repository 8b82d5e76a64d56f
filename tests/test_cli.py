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
