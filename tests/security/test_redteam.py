"""Red-team findings on the hardened code: a hostile local user against a root mount with the
documented defaults (``allow_other``), after the private-state, backing-tree and control-plane
fixes. Each test is one hole found; a hole still open is a strict xfail naming its fix.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from pathlib import Path

from tests.conftest import tierfs_cmd
from tests.security.conftest import SYSTEM_PYTHON, User
from tests.security.test_control_plane import as_root, send_as
from tierfs_hints import wire

# Attacker side: open argv[2] descriptors of the ctl file (argv[1]) and write argv[3] bytes
# without a newline into each (an unfinished request the daemon keeps), print the errno of
# each descriptor's refused write (0: all taken), then hold them until stdin closes.
HOLD = r"""
import os, sys
ctl, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
buf = b"x" * (1 << 20)
fds, errs = [], []
for _ in range(n):
    fd = os.open(ctl, os.O_RDWR)
    fds.append(fd)
    left, err = size, 0
    try:
        while left:
            left -= os.write(fd, buf[:min(left, len(buf))])
    except OSError as e:
        err = e.errno
    errs.append(err)
print(" ".join(map(str, errs)), flush=True)
sys.stdin.read()
"""


def test_redteam_ctl_pending_bytes_starve_everyone(attacker: User, victim: User, secmount) -> None:
    """One user holding unfinished request lines on several descriptors used to take the whole
    daemon-wide budget of held request bytes (four maximal requests): every other user's
    request, root's included, then failed with EFBIG ("retry later") for as long as the attacker
    kept its descriptors open. The held bytes are now bounded per user (two maximal requests),
    so root and the other users are still served."""
    m = secmount(allow_other=True)
    ctl = str(m.mnt / ".tierfs" / "ctl")
    cmd = ["setpriv", f"--reuid={attacker.uid}", f"--regid={attacker.gid}", "--clear-groups",
           "--inh-caps=-all", "--", SYSTEM_PYTHON, "-I", "-c", HOLD, ctl, "4",
           str(wire.MAX_REQUEST_BYTES - 1)]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line, p.stderr.read() if p.stderr else b""  # type: ignore[union-attr]
        errs = [int(x) for x in line.split()]
        assert len(errs) == 4
        # root and another user still get an answer while the attacker holds its descriptors
        assert as_root(m.mnt, {"op": "where", "paths": []})["ok"] is True
        r = send_as(victim, m.mnt, {"op": "where", "paths": []})
        assert r.get("ok") is True, r
        assert any(errs), "the attacker alone held four maximal requests"
    finally:
        p.kill()
        p.wait()


def test_redteam_stats_json_reveals_paths_in_private_dirs(attacker: User, secmount, shared_dir: Path) -> None:
    """``.tierfs/stats.json`` is readable by every user of the mount and listed the paths of
    quarantined journal rows (``writeback.quarantined_paths``): names of files in another user's
    0700 directory, which the attacker cannot list or even look up."""
    back = shared_dir / "back"
    (back / "private").mkdir(mode=0o700)
    os.chmod(back / "private", 0o700)
    m = secmount(allow_other=True, extra=("-o", "writeback_deadline=3600"))
    (m.mnt / "private" / "payroll-2026-layoffs.xlsx").write_bytes(b"v" * 1000)
    m.kill9()
    # a journal row recovery cannot honour (its temporary file is gone), as in
    # tests/test_writeback_recovery_mount.py: the row is quarantined under its path
    assert m.ssd is not None
    con = sqlite3.connect(m.ssd / "journal.sqlite")
    cols = [r[1] for r in con.execute("PRAGMA table_info(dirty)")]
    cur = con.execute("INSERT INTO dirty (path, tmp, through) VALUES (?, ?, 1)",
                      (b"private/acquisition-target-name", b".tierfs-wb.77.3"))
    if "state" in cols:
        con.execute("UPDATE dirty SET state='through' WHERE id=?", (cur.lastrowid,))
    con.commit()
    con.close()
    m.start()
    tierfs_cmd("flush", str(m.mnt))
    assert as_root(m.mnt, {"op": "where", "paths": []})["ok"] is True
    root_view = json.loads((m.mnt / ".tierfs" / "stats.json").read_bytes())
    assert root_view["writeback"]["quarantined"] == 1
    r = attacker.run(["cat", str(m.mnt / ".tierfs" / "stats.json")])
    assert r.returncode == 0, r.stderr
    assert b"acquisition-target-name" not in r.stdout
    r = attacker.run(["ls", str(m.mnt / "private")])
    assert r.returncode != 0  # the attacker cannot list the directory itself
