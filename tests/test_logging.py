"""The daemon's log: one line per event that matters (mount, unmount, tier full, deadline
missed, backing error, recovery), none per read; to a file, stderr or syslog; and systemd's
readiness notification."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import (
    DAEMON_WRITES,
    REPO,
    is_mounted,
    needs_fuse,
    tierfs_cmd,
    tmpfs,
    write_random,
)
from tierfs import logevents

MiB = 1 << 20


# -- in-process -------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_throttle_logs_the_first_then_one_line_per_interval_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    t = logevents.Throttle(interval=60, clock=clock)
    log = logging.getLogger("tierfs.test")
    with caplog.at_level(logging.INFO):
        assert t.log(log, logging.WARNING, "k", "backing failed: %s", "EIO")
        for _ in range(41):
            clock.now += 1
            assert not t.log(log, logging.WARNING, "k", "backing failed: %s", "EIO")
        assert t.log(log, logging.WARNING, "other", "another kind")  # keys are independent
        clock.now += 30
        assert t.log(log, logging.WARNING, "k", "backing failed: %s", "EIO")
    assert [r.getMessage() for r in caplog.records] == [
        "backing failed: EIO", "another kind",
        "backing failed: EIO (and 41 more like it in the last 71s)"]


def test_late_watch_logs_start_and_end_once() -> None:
    class S:
        def __init__(self, late: int) -> None:
            self.late_files, self.dirty_files, self.dirty_bytes, self.eta_s = late, late, 1000 * late, 12.0

    w = logevents.LateWatch()
    seen = [w.update(S(n)) for n in (0, 2, 3, 1, 0, 0, 1)]
    assert [x and (x[0], x[1].split(":")[0]) for x in seen] == [
        None, (logging.WARNING, "write-back deadline missed"), None, None,
        (logging.INFO, "write-back caught up"), None, (logging.WARNING, "write-back deadline missed")]
    assert "2 file(s)" in seen[1][1] and "12s" in seen[1][1]  # type: ignore[index]


def datagram_socket(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(30)
    return s


def test_sd_notify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not logevents.sd_notify("READY=1")  # not under systemd: a no-op
    with datagram_socket(tmp_path / "notify") as s:
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
        assert logevents.sd_notify("READY=1\nSTATUS=up")
        assert s.recv(4096) == b"READY=1\nSTATUS=up"
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert not logevents.sd_notify("READY=1")  # never raises


def test_missing_syslog_socket_is_refused_at_the_door(tmp_path: Path) -> None:
    from tierfs.errors import MountError

    with pytest.raises(MountError, match=r"log_file=syslog:.*nosock.*cannot reach the syslog socket"):
        logevents.check_target(f"syslog:{tmp_path / 'nosock'}")
    logevents.check_target(str(tmp_path / "file.log"))  # files are opened by the daemon


def test_journald_stderr_gets_priority_prefixes(tmp_path: Path) -> None:
    code = ("import logging, os, sys; from tierfs import logevents; "
            "st = os.fstat(2); os.environ['JOURNAL_STREAM'] = f'{st.st_dev}:{st.st_ino}'; "
            "logevents.setup('info', None); logging.getLogger('tierfs.mount').warning('tier full'); "
            "logging.getLogger('tierfs.mount').info('mounted')")
    with open(tmp_path / "err", "w") as err:
        subprocess.run([sys.executable, "-c", code], stderr=err, check=True, cwd=REPO)
    assert (tmp_path / "err").read_text() == "<4>tierfs.mount: tier full\n<6>tierfs.mount: mounted\n"


# -- through a real mount ---------------------------------------------------------------------
def log_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if " tierfs" in line]


def count(lines: list[str], pattern: str) -> int:
    return sum(bool(re.search(pattern, line)) for line in lines)


@needs_fuse
@pytest.mark.fuse
def test_one_line_per_event_and_none_per_read(tiermount, tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    for i in range(200):
        write_random(tmp_path / "back" / "d" / f"f{i:03}", 20_000, seed=i)
    m = tiermount(ram="8MiB", extra=("-o", f"log_file={log},writeback_deadline=60", *DAEMON_WRITES))
    before = log_lines(log)
    assert count(before, r"INFO: mounted .* on .*; tiers: ram=8.0 MiB") == 1
    for _ in range(2):
        for i in range(200):
            (m.mnt / "d" / f"f{i:03}").read_bytes()
    os.listdir(m.mnt / "d")
    assert log_lines(log) == before, "reads must not log"
    for name in ("big1", "big2", "big3"):  # each larger than the RAM write tier: written through
        (m.mnt / name).write_bytes(os.urandom(12 * MiB))
    assert m.stats()["writeback"]["through_files"] >= 1
    m.stop()
    lines = log_lines(log)
    assert count(lines, r"WARNING: write tier ram full: writing big1 through to the backing store") == 1
    assert count(lines, r"write tier .* full") == 1  # big2 and big3: held back by the throttle
    assert count(lines, r"INFO: unmounted ") == 1
    assert count(lines, r"INFO: mounted ") == 1
    assert not [line for line in lines if re.search(r"/d/f\d{3}|\bf\d{3}\b", line)], "no line names a file read"
    assert len(lines) <= 8, "\n".join(lines)


@needs_fuse
@pytest.mark.fuse
def test_recovery_after_a_crash_is_logged_once(tiermount, tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    m = tiermount(ram="16MiB", extra=("-o", f"log_file={log}"))
    fd = os.open(m.mnt / "ckpt", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"c" * 5000)  # open for writing at the crash: journaled, not written back
    m.kill9()
    with pytest.raises(OSError):  # fsync fails on a dead mount; close only where FLUSH is sent
        os.fsync(fd)
    with contextlib.suppress(OSError):
        os.close(fd)
    m.start()
    lines = log_lines(log)
    assert count(lines, r"tierfs[.a-z]* [A-Z]+: recovery") == 1, "\n".join(lines)
    assert count(lines, r"WARNING: recovery after a crash: 1 dirty files will be written back") == 1
    tierfs_cmd("flush", str(m.mnt))
    assert (tmp_path / "back" / "ckpt").read_bytes() == b"c" * 5000


@pytest.fixture
def small_backing(tmp_path: Path):  # type: ignore[no-untyped-def]
    with tmpfs(tmp_path / "back", "8m") as back:
        yield back


def wait_for(path: Path, pattern: str, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = log_lines(path)
        if count(lines, pattern):
            return lines
        time.sleep(0.2)
    raise AssertionError(f"no line matching {pattern!r} in {path}:\n" + path.read_text())


@needs_fuse
@pytest.mark.fuse
def test_backing_store_full_logs_failure_and_missed_deadline_once(tiermount, small_backing: Path,
                                                                  tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    m = tiermount(ram="64MiB", backing=small_backing,
                  extra=("-o", f"log_file={log},writeback_deadline=500ms"))
    # accepted while the 8 MiB backing store has room (a writer is told ENOSPC at write when
    # it has not), held open so no write-back starts; then the backing store fills from outside
    files = [open(m.mnt / name, "wb") for name in ("a", "b", "c")]  # noqa: SIM115
    for f in files:
        f.write(os.urandom(2 * MiB))
        f.flush()
    with open(small_backing / "filler", "wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * MiB)
                filler.flush()
        except OSError:
            pass
    for f in files:
        f.close()
    wait_for(log, r"write-back deadline missed: 3 file")
    lines = wait_for(log, r"WARNING: write-back of [abc] failed \(retrying in 5s\):.*No space left")
    assert count(lines, r"write-back of .* failed") == 1  # the other files' failures: held back
    assert count(lines, r"deadline missed") == 1
    assert m.stats()["writeback"]["late_files"] == 3
    # At the unmount the daemon tries them once more (a RAM write tier is lost at a reboot):
    # the backing store is still full, so they stay journaled in the RAM tier, and both the
    # log and `tierfs umount` (exit 1) say so
    r = tierfs_cmd("umount", str(m.mnt), check=False)
    m.pid = 0
    assert r.returncode == 1 and "exited with files not written back" in r.stderr, r.stderr + r.stdout
    text = log.read_text()
    assert re.search(r"ERROR: 3 dirty files \(.*\) were not written back: they stay in the RAM tier", text), text[-2000:]


@needs_fuse
@pytest.mark.fuse
def test_syslog_target(tiermount, tmp_path: Path) -> None:
    with datagram_socket(tmp_path / "syslog") as s:
        m = tiermount(ram="16MiB", extra=("-o", f"log_file=syslog:{tmp_path / 'syslog'}"))
        got = []
        while not any(b"mounted" in g for g in got):
            got.append(s.recv(65536))
        m.stop()
        while not any(b"unmounted" in g for g in got):
            got.append(s.recv(65536))
    mounted = next(g for g in got if b"INFO: mounted" in g)
    # <30> = facility daemon (3) * 8 + info (6); ident with the daemon's pid
    assert re.match(rb"<30>tierfs\[\d+\]: tierfs.mount INFO: mounted .* on .*mnt", mounted), mounted


@needs_fuse
@pytest.mark.fuse
def test_foreground_mount_notifies_systemd_and_logs_to_stderr(tmp_path: Path) -> None:
    back, mnt = tmp_path / "back", tmp_path / "mnt"
    back.mkdir()
    mnt.mkdir()
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "notify"))
    with datagram_socket(tmp_path / "notify") as s, open(tmp_path / "stderr", "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "tierfs", "mount", "--foreground", str(back), str(mnt),
                              "--ram", "16MiB"], env=env, stderr=err, stdout=subprocess.DEVNULL, cwd=REPO)
        try:
            msg = s.recv(4096)
            assert msg.startswith(b"READY=1\nSTATUS=serving ") and is_mounted(mnt)
            # as systemd's ExecStop; the daemon is reaped meanwhile, as systemd reaps its main process
            umount = subprocess.Popen([sys.executable, "-m", "tierfs", "umount", str(mnt)], cwd=REPO)
            assert p.wait(timeout=60) == 0
            assert umount.wait(timeout=60) == 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
    text = (tmp_path / "stderr").read_text()
    assert count(text.splitlines(), "INFO: mounted") == 1 and count(text.splitlines(), "INFO: unmounted") == 1
