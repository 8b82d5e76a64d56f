#!/usr/bin/env python3
"""What ``rm -rf`` of many empty files through a tierfs mount costs the daemon: the wall time
and the daemon's CPU time (user + system, and user alone) per file, the requests each file
costs with the daemon's mean time inside each kind of handler, and the transport's counters
(how many requests were answered as they were read, how the loop waited for the next one).

One fresh tmpfs backing directory (under /dev/shm) of ``--files`` empty files in 40
directories, one mount (``--ram 2GiB`` plus ``--tierfs-arg``\\ s), one ``rm -rf`` of the tree.
The daemon's CPU time comes from ``/proc/PID/stat`` (all its threads; its busy poll between
requests included). Needs root (mounts). From the repository root:

    sudo .venv/bin/python bench/profile_rm.py
    sudo .venv/bin/python bench/profile_rm.py --files 10000 --profile /tmp/rm.pstats

To compare two commits, run each one's own copy of this script from a worktree (the daemon is
started from the repository the script lies in), alternated: the machine's speed moves between
minutes, and the CPU per file is steadier than the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_smallfiles import REPO  # noqa: E402
from profile_tarx import _stats, _wait_mounted, per_request, stop  # noqa: E402


def _cpu_s(pid: int) -> tuple[float, float]:
    """(user + system, user) CPU seconds of process ``pid``, all its threads."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(f[11]) + int(f[12])) / tick, int(f[11]) / tick


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--profile", default="", help="write the daemon's cProfile here")
    ap.add_argument("--tierfs-arg", dest="extra", action="append", default=[],
                    help="extra argument for tierfs mount (repeatable)")
    args = ap.parse_args()
    n = args.files
    work = Path(tempfile.mkdtemp(prefix="profile-rm-", dir="/dev/shm"))
    back = work / "back"
    back.mkdir()
    mnt = Path(tempfile.mkdtemp(prefix="profile-rm-mnt-"))
    for d in range(40):
        (back / "t" / f"d{d:02d}").mkdir(parents=True)
    for i in range(n):
        (back / "t" / f"d{i % 40:02d}" / f"f{i:07d}").touch()
    prof = ["-m", "cProfile", "-o", args.profile] if args.profile else []
    out: dict = {"loadavg_start": open("/proc/loadavg").read().strip(), "files": n}
    proc = subprocess.Popen([sys.executable, *prof, "-m", "tierfs", "mount", str(back), str(mnt), "--foreground",
                             "--ram", "2GiB", *args.extra],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_mounted(mnt, proc)
        before = _stats(mnt)
        c0 = _cpu_s(proc.pid)
        t = time.perf_counter()
        subprocess.run(["rm", "-rf", str(mnt / "t")], check=True)
        dt = time.perf_counter() - t
        c1 = _cpu_s(proc.pid)
        after = _stats(mnt)
        out["us_per_file"] = round(dt / n * 1e6, 1)
        out["daemon_cpu_us_per_file"] = round((c1[0] - c0[0]) / n * 1e6, 1)
        out["daemon_user_us_per_file"] = round((c1[1] - c0[1]) / n * 1e6, 1)
        out["requests"] = per_request(before["fuse"], after["fuse"], n)
        tb, ta = before.get("transport") or {}, after.get("transport") or {}
        out["transport"] = {k: v - tb.get(k, 0) for k, v in ta.items()
                            if isinstance(v, int) and not isinstance(v, bool) and v - tb.get(k, 0)}
    finally:
        stop(proc, mnt, work)
    out["loadavg_end"] = open("/proc/loadavg").read().strip()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
