"""Opens of small files whose every byte is already in the RAM tier: what the daemon spends per
file once a dataset is resident (the steady state of a small-file dataset that fits the tiers).

One tierfs mount over ``--files`` files of 80-140 KiB in 100 directories of a tmpfs backing
directory. Every file is read once and the RAM tier's fills are waited for, so that all of them
are resident; then ``--rounds`` times: one pass in name order by one process (a validation loop,
``ImageFolder`` without shuffling) and one shuffled epoch by ``--procs`` processes (a training
epoch). Reported per pass: files/s, the daemon's CPU use (share of one core, from
``/proc/PID/stat``) and, for the one-process pass, the mean time inside the open handler
(``fuse.request_seconds``), with the kept registrations the passes reused.

Needs root (mount) and the native transport's passthrough (Linux 6.9+). From the repository
root::

    sudo .venv/bin/python bench/bench_resident_opens.py
    sudo .venv/bin/python bench/bench_resident_opens.py --files 2000 --rounds 1   # quick

Single figures vary with the machine's load (printed); compare runs made back to back.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_smallfiles import KiB, epoch, make_tree, mounted  # noqa: E402


def daemon_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stats(mnt: Path) -> dict:
    return json.loads((mnt / ".tierfs" / "stats.json").read_text())


def one_pass(paths: list[str]) -> None:
    buf = bytearray(256 * KiB)
    view = memoryview(buf)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while os.readv(fd, [view]) > 0:
                pass
        finally:
            os.close(fd)


def wait_filled(mnt: Path, timeout_s: float = 600) -> None:
    end = time.monotonic() + timeout_s
    while True:
        s = stats(mnt)["scheduler"]
        if not s["queued"]["speculative"] and not s["in_flight"]:
            return
        if time.monotonic() > end:
            raise RuntimeError("the RAM tier's fills did not finish")
        time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=8000)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ram", default="2GiB")
    ap.add_argument("--tierfs-arg", action="append", default=[], dest="extra")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-resident-", dir="/dev/shm"))
    try:
        back = work / "back"
        names = make_tree(back / "ds", args.files, 100, 80 * KiB, 140 * KiB, 1)
        print(f"load average {open('/proc/loadavg').read().split()[:3]}; {args.files} files")
        with mounted("tierfs", back, ["--ram", args.ram, *args.extra]) as mnt:
            pid = int((mnt / ".tierfs" / "pid").read_text())
            root = mnt / "ds"
            in_order = [str(root / n) for n in sorted(names)]
            one_pass(in_order)
            wait_filled(mnt)
            for r in range(args.rounds):
                before, c0, t0 = stats(mnt)["fuse"], daemon_cpu_s(pid), time.perf_counter()
                one_pass(in_order)
                dt, cpu = time.perf_counter() - t0, daemon_cpu_s(pid) - c0
                after = stats(mnt)["fuse"]
                opens = after["requests"]["open"] - before["requests"]["open"]
                open_s = after["request_seconds"]["open"] - before["request_seconds"]["open"]
                print(f"round {r + 1}: 1 process, name order: {len(names) / dt:,.0f} files/s, daemon CPU "
                      f"{100 * cpu / dt:.0f}%, open handler {1e6 * open_s / max(1, opens):.0f} us")
                c0 = daemon_cpu_s(pid)
                t0 = time.perf_counter()
                rate = epoch(root, names, args.procs, seed=r + 2)
                dt = time.perf_counter() - t0
                print(f"round {r + 1}: {args.procs} processes, shuffled: {rate:,.0f} files/s, daemon CPU "
                      f"{100 * (daemon_cpu_s(pid) - c0) / dt:.0f}%")
            t = stats(mnt)
            tr = t["transport"]
            print(f"passthrough opens by tier {tr.get('passthrough_opens_by_tier')}; kept registrations "
                  f"{tr.get('kept_backing_ids')}, reused {tr.get('kept_backing_reuses')}; next-file "
                  f"predictions {t['hints']['next_file_predictions']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    mp.set_start_method("fork")
    sys.exit(main())
