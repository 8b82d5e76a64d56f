"""The control plane (``<mnt>/.tierfs/ctl``) as a hostile local user uses it.

Every request acts with the credentials of the process that opened ``ctl``: paths are checked
as the kernel would check a read by that user, eviction needs ownership or write permission,
``flush`` waits only for the caller's own files, reservations and prefetch volume are bounded
per user, and requests are capped in size and items. The attacker's code is stdlib only: it
writes raw JSON lines (the format of ``tierfs_hints/wire.py``) and reads the reply back from
the same descriptor.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from pathlib import Path

import pytest

from tests.security.conftest import SYSTEM_PYTHON, User
from tierfs_hints import wire

MiB = 1 << 20

# Attacker side: argv[1] = the ctl file; stdin = the request bytes (sent as they are: no
# newline is added). Prints the reply, or {"write_errno": N, "reply": ...} if a write failed.
SEND = r"""
import json, os, sys
data = sys.stdin.buffer.read()
fd = os.open(sys.argv[1], os.O_RDWR)
out = {}
view = memoryview(data)
try:
    while view:
        view = view[os.write(fd, view[:1 << 20]):]
except OSError as e:
    out["write_errno"] = e.errno
parts, pos = [], 0
while True:
    try:
        chunk = os.pread(fd, 1 << 20, pos)
    except OSError as e:
        out["read_errno"] = e.errno
        break
    if not chunk:
        break
    parts.append(chunk)
    pos += len(chunk)
raw = b"".join(parts)
if out:
    out["reply"] = json.loads(raw) if raw.strip() else None
    print(json.dumps(out))
else:
    sys.stdout.write(raw.decode())
"""


def send_as(user: User, mnt: Path, req: dict | bytes, timeout: float = 120) -> dict:
    """Send one request as ``user``; the reply as a dict."""
    data = req if isinstance(req, bytes) else json.dumps(req).encode() + b"\n"
    r = user.run([SYSTEM_PYTHON, "-I", "-c", SEND, str(mnt / ".tierfs" / "ctl")], input=data,
                 timeout=timeout)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return json.loads(r.stdout)


def as_root(mnt: Path, req: dict) -> dict:
    fd = os.open(mnt / ".tierfs" / "ctl", os.O_RDWR)
    try:
        os.write(fd, json.dumps(req).encode() + b"\n")
        return json.loads(os.pread(fd, 1 << 24, 0))
    finally:
        os.close(fd)


def settled(mnt: Path, rel: str) -> dict:
    """Residency of ``rel`` once no chunk of it is in staging (on its way into a tier)."""
    deadline = time.monotonic() + 30
    while True:
        res = as_root(mnt, {"op": "where", "paths": [rel]})["files"][0]["resident_bytes"]
        if res["staging"] == 0 or time.monotonic() > deadline:
            return res
        time.sleep(0.05)  # polling for a state, not waiting out a race


def refused_perm(reply: dict) -> bool:
    return reply.get("ok") is False and reply.get("kind") == "perm"


def vm_rss(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (``VmRSS`` of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def tree(shared_dir: Path) -> Path:
    """back/: ``private/`` (root 0700) holding ``secret`` (0644), ``rootfile`` (root 0600),
    ``pub`` (root 0644), ``open/`` (0777, for the attacker's own files)."""
    back = shared_dir / "back"
    back.mkdir(mode=0o755, exist_ok=True)
    (back / "private").mkdir(mode=0o700)
    os.chmod(back / "private", 0o700)
    (back / "private" / "secret").write_bytes(b"s" * 12345)
    os.chmod(back / "private" / "secret", 0o644)
    (back / "rootfile").write_bytes(os.urandom(4 * MiB))
    os.chmod(back / "rootfile", 0o600)
    (back / "pub").write_bytes(os.urandom(4 * MiB))
    os.chmod(back / "pub", 0o644)
    (back / "open").mkdir()
    os.chmod(back / "open", 0o777)
    return back


def test_where_hides_unreadable(attacker: User, secmount, tree: Path) -> None:
    """``where`` on a file in a root 0700 directory reveals nothing: refused, and the refusal
    is the same whether the file exists or not."""
    m = secmount(allow_other=True)
    assert as_root(m.mnt, {"op": "where", "paths": ["private/secret"]})["files"][0]["size"] == 12345
    r = send_as(attacker, m.mnt, {"op": "where", "paths": ["private/secret"]})
    assert "12345" not in json.dumps(r), r
    assert refused_perm(r), r
    r2 = send_as(attacker, m.mnt, {"op": "where", "paths": ["private/nothere"]})
    assert refused_perm(r2), r2
    assert r["error"].replace("secret", "X") == r2["error"].replace("nothere", "X")


def test_need_of_root_file_refused(attacker: User, secmount, tree: Path) -> None:
    """``need`` of a root 0600 file is refused with kind "perm" and nothing is registered."""
    m = secmount(allow_other=True)
    r = send_as(attacker, m.mnt, {"op": "need", "items": [["rootfile", 0, None]], "deadline_s": None,
                                  "priority": 0, "source": "atk", "label": "steal"})
    assert refused_perm(r), r
    assert "rootfile" in r["error"]
    for op in ({"op": "epoch", "paths": ["rootfile"], "source": "atk"},
               {"op": "phase", "name": "p", "at_s": 5, "paths": ["private/secret"], "source": "atk"},
               {"op": "release", "paths": ["private/secret"]}):
        assert refused_perm(send_as(attacker, m.mnt, op)), op
    hints = m.stats()["hints"]
    assert hints["needs"] == 0 and hints["declared_bytes"] == 0, hints


def test_evict_of_others_data(attacker: User, secmount, tree: Path) -> None:
    """Another user's cached file stays cached: ``evict`` needs ownership or write permission.
    The attacker's own file it may evict."""
    m = secmount(allow_other=True)
    (m.mnt / "pub").read_bytes()
    before = settled(m.mnt, "pub")
    assert before["ram"] + before["ssd"] > 0, before
    r = send_as(attacker, m.mnt, {"op": "evict", "paths": ["pub"]})
    assert refused_perm(r), r
    after = settled(m.mnt, "pub")
    assert after == before
    own = tree / "open" / "mine"
    own.write_bytes(os.urandom(MiB))
    os.chown(own, attacker.uid, attacker.gid)
    os.chmod(own, 0o600)
    r = send_as(attacker, m.mnt, {"op": "evict", "paths": ["open/mine"]})
    assert r["ok"], r


def test_checkpoint_reservation_bounded(attacker: User, secmount, tree: Path) -> None:
    """``checkpoint nbytes=10**12`` does not reserve the write tier: over the per-user bound
    it is refused, naming the bound; a checkpoint dir in a root 0700 dir is refused too."""
    m = secmount(allow_other=True)
    r = send_as(attacker, m.mnt, {"op": "checkpoint", "dir": "open/ck", "nbytes": 10**12, "every_s": 60})
    assert refused_perm(r), r
    assert "user_hint_share" in r["error"]
    assert m.stats()["hints"]["write_tier_kept_free_bytes"] == 0
    r = send_as(attacker, m.mnt, {"op": "checkpoint", "dir": "private/ck", "nbytes": 4096, "every_s": 60})
    assert refused_perm(r), r
    r = send_as(attacker, m.mnt, {"op": "checkpoint", "dir": "open/ck", "nbytes": MiB, "every_s": 60})
    assert r["ok"] and r["reserved_bytes"] >= MiB, r


def test_flush_waits_only_for_own(attacker: User, secmount, tree: Path) -> None:
    """A non-root ``flush`` of "everything" neither forces nor names root's dirty files, and a
    flush naming a file the attacker cannot read is refused."""
    m = secmount(allow_other=True, extra=("-o", "writeback_deadline=3600"))
    fd = os.open(m.mnt / "private" / "dirty", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"root's unsaved work")
        r = send_as(attacker, m.mnt, {"op": "flush", "paths": [], "timeout": 5})
        assert r.get("ok") and "private/dirty" not in json.dumps(r), r
        assert m.stats()["writeback"]["dirty_files"] == 1
        r = send_as(attacker, m.mnt, {"op": "flush", "paths": ["private/dirty"], "timeout": 5})
        assert refused_perm(r), r
        assert m.stats()["writeback"]["dirty_files"] == 1
    finally:
        os.close(fd)


def test_cancel_of_others_need(attacker: User, secmount, tree: Path) -> None:
    """Need ids are guessable: another user's need cannot be cancelled or watched."""
    m = secmount(allow_other=True)
    nid = as_root(m.mnt, {"op": "need", "items": [["pub", 0, None]], "deadline_s": None})["id"]
    assert refused_perm(send_as(attacker, m.mnt, {"op": "cancel", "id": nid}))
    assert refused_perm(send_as(attacker, m.mnt, {"op": "progress", "id": nid}))
    assert not as_root(m.mnt, {"op": "progress", "id": nid})["cancelled"]


def test_oversized_request_line(attacker: User, secmount, tree: Path) -> None:
    """A request line without a newline is cut off at the cap: the write fails (EFBIG), the
    reply names the cap, and the daemon's memory does not grow with the request."""
    m = secmount(allow_other=True)
    before = vm_rss(m.pid)
    size = 6 * wire.MAX_REQUEST_BYTES if hasattr(wire, "MAX_REQUEST_BYTES") else 512 * MiB
    r = send_as(attacker, m.mnt, b"[" * size, timeout=300)
    grown = vm_rss(m.pid) - before
    print(f"daemon RSS {before / MiB:.0f} MiB -> +{grown / MiB:.0f} MiB after a {size / MiB:.0f} MiB line")
    assert grown < size // 3, grown
    assert r.get("write_errno") == 27, r  # EFBIG
    assert "MAX_REQUEST_BYTES" in r["reply"]["error"], r
    assert os.stat(m.mnt).st_mode  # still serving


def test_million_item_need(attacker: User, secmount, tree: Path, scale_loop_bound: int) -> None:
    """A 1M-item ``need`` is answered with an error naming the item cap, and nothing is
    registered. The latency of a stat loop running meanwhile is printed (not asserted: no test
    asserts on wall-clock speed)."""
    m = secmount(allow_other=True)
    n = 1_000_000
    # built as text: a million lists alive in this process would make its own collector pause
    # the stat loop below for hundreds of ms
    req = ('{"op": "need", "deadline_s": null, "items": ['
           + ", ".join(f'["open/f{i}", 0, null]' for i in range(n)) + "]}\n").encode()
    gc.collect()
    stop = threading.Event()
    worst = [0.0]

    def stat_loop() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            os.stat(m.mnt / "pub")
            os.statvfs(m.mnt)  # always reaches the daemon (no attribute cache)
            worst[0] = max(worst[0], time.perf_counter() - t)

    th = threading.Thread(target=stat_loop)
    th.start()
    try:
        t0 = time.perf_counter()
        r = send_as(attacker, m.mnt, req, timeout=600)
        took = time.perf_counter() - t0
    finally:
        stop.set()
        th.join()
    print(f"1M-item need answered in {took:.2f} s; worst stat+statvfs latency meanwhile {worst[0] * 1000:.1f} ms")
    assert r.get("ok") is False and "MAX_ITEMS" in r.get("error", ""), str(r)[:500]
    stats = m.stats()
    assert stats["hints"]["needs"] == 0
    # the daemon worked through the request in slices, pausing for other FUSE requests
    # (parsing half a million items takes far longer than one 2 ms slice)
    assert stats["control"]["paced_pauses"] > 0 and stats["control"]["refused"]["value"] == 1


def test_newline_in_checkpoint_dir_forges_no_log_line(attacker: User, secmount, tree: Path,
                                                      shared_dir: Path) -> None:
    """User text in log lines is escaped and truncated: a newline in ``checkpoint.dir`` does
    not start a line of its own, and a huge path does not make a huge line."""
    logdir = shared_dir / "log"
    logdir.mkdir(mode=0o700)
    log = logdir / "daemon.log"
    m = secmount(allow_other=True, extra=("-o", f"log_file={log}", "--log-level", "debug"))
    forged = "2030-01-01 00:00:00,000 tierfs.mount WARNING: FORGED by the attacker"
    r = send_as(attacker, m.mnt, {"op": "checkpoint", "dir": "open/x\n" + forged, "nbytes": 4096, "every_s": 60})
    assert r.get("ok"), r
    send_as(attacker, m.mnt, {"op": "where", "paths": ["open/" + "y" * 2_000_000]})
    send_as(attacker, m.mnt, {"op": "need", "items": [["open/z\n" + forged, -1, None]]})
    m.stop()
    lines = log.read_text(errors="replace").splitlines()
    assert any("checkpoint hint" in line for line in lines), lines[-20:]
    assert not any(line.startswith("2030-01-01") or line.startswith(forged) for line in lines), lines[-20:]
    assert max(len(line) for line in lines) < 4096
