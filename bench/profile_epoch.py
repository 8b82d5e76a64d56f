#!/usr/bin/env python3
"""What an epoch over resident small files costs the daemon: its CPU time per file, the
requests each file costs and the daemon's mean time inside each kind of handler, and
(``--profile``) a cProfile of the daemon's whole run.

One fresh tmpfs backing directory of ``--files`` files of 80-140 KiB in 40 directories, one
mount (``--ram 2GiB`` plus ``--tierfs-arg``\\ s), one epoch that fills the RAM tier, then
``--epochs`` shuffled epochs of ``--procs`` processes each reading whole files with
``open().read()`` (what an image ``Dataset`` does); ``--drop`` drops the mount's page cache
before each (``posix_fadvise(DONTNEED)`` of every file, as ``bench_smallfiles.py`` does). The daemon's CPU time comes from
``/proc/PID/stat`` (user + system, all its threads). Needs root (mounts). From the repository
root:

    sudo .venv/bin/python bench/profile_epoch.py
    sudo .venv/bin/python bench/profile_epoch.py --profile /tmp/epoch.pstats

To compare two commits, run each one's own copy of this script from a worktree (the daemon is
started from the repository the script lies in). The machine's speed varies between minutes on
shared VMs: alternate the two, and compare CPU per file before files/s. cProfile slows the
daemon about twofold: read its figures as shares, not times.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_smallfiles import REPO, KiB, drop_page_cache, log  # noqa: E402
from profile_tarx import _stats, _wait_mounted, per_request, stop  # noqa: E402


def _read_all(paths: list[str]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            f.read()


def _epoch(mnt: Path, names: list[str], procs: int) -> float:
    """One shuffled pass over ``names`` by ``procs`` processes; files per second."""
    random.shuffle(names)
    parts = [[str(mnt / n) for n in names[i::procs]] for i in range(procs)]
    t = time.perf_counter()
    with Pool(procs) as pool:
        pool.map(_read_all, parts)
    return len(names) / (time.perf_counter() - t)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="profile-epoch-", dir="/dev/shm"))
    back, mnt = work / "back", Path(tempfile.mkdtemp(prefix="profile-epoch-mnt-"))
    back.mkdir()
    rng = random.Random(1)
    names = []
    for d in range(40):
        (back / f"d{d}").mkdir()
    for i in range(args.files):
        n = f"d{i % 40}/f{i}.jpg"
        names.append(n)
        (back / n).write_bytes(rng.randbytes(rng.randint(80, 140) * KiB))
    out: dict = {"loadavg_start": open("/proc/loadavg").read().strip(), "files": args.files}
    proc = None
    try:
        prof = ["-m", "cProfile", "-o", args.profile] if args.profile else []
        cmd = [sys.executable, *prof, "-m", "tierfs", "mount", str(back), str(mnt), "--foreground",
               "--ram", args.ram, *args.extra]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _wait_mounted(mnt, proc)
        log("filling epoch")
        cpu0 = _cpu_s(proc.pid)
        out["fill_files_per_s"] = round(_epoch(mnt, names, args.procs))
        out["fill_daemon_cpu_us_per_file"] = round((_cpu_s(proc.pid) - cpu0) / args.files * 1e6)
        time.sleep(3)  # the fills of the last files
        whole = _stats(mnt)
        before, tr0, cpu = whole["fuse"], whole.get("transport", {}), _cpu_s(proc.pid)
        log(f"{args.epochs} epochs")
        rates = []
        for _ in range(args.epochs):
            if args.drop:
                cpu_drop = _cpu_s(proc.pid)
                drop_page_cache(mnt, names, args.procs)
                cpu += _cpu_s(proc.pid) - cpu_drop  # (the drop's own requests are not the epoch's)
            rates.append(round(_epoch(mnt, names, args.procs)))
        out["files_per_s"] = rates
        after = _stats(mnt)["fuse"]
        n = args.epochs * args.files
        out["daemon_cpu_us_per_file"] = round((_cpu_s(proc.pid) - cpu) / n * 1e6)
        out["requests"] = {op: {k: round(v, 3) for k, v in d.items()}
                           for op, d in sorted(per_request(before, after, n).items())}
        out["getattrs_from_open"] = after.get("getattrs_from_open", 0) - before.get("getattrs_from_open", 0)
        whole = _stats(mnt)
        tr = whole.get("transport", {})  # (the drops' requests included)
        # metadata calls sent to threads: an open answered at once needs them inline
        out["devices"] = {k: v for k, v in whole.get("devices", {}).items() if v.get("thread_calls")}
        out["answered_at_once"] = {k: v - tr0.get(k, 0) for k, v in tr.items() if k.endswith("_answered_at_once")}
    finally:
        stop(proc, mnt, work)
    out["loadavg_end"] = open("/proc/loadavg").read().strip()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=8000)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--ram", default="2GiB")
    p.add_argument("--profile", default="", help="write the daemon's cProfile here and print its top")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--drop", action="store_true",
                   help="drop the mount's page cache before each epoch (reads come to the daemon or pass through)")
    p.add_argument("--tierfs-arg", dest="extra", action="append", default=[],
                   help="extra argument for tierfs mount (repeatable)")
    args = p.parse_args(argv)
    out = run(args)
    print(json.dumps(out, indent=1))
    if args.profile and os.path.exists(args.profile):
        st = pstats.Stats(args.profile)
        st.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
