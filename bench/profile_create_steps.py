#!/usr/bin/env python3
"""What each system call of a ``tar -x``-like file creation costs: direct vs bindfs vs tierfs.

One process creates ``--files`` files of 5,000 bytes in one new directory, the calls GNU tar
makes for each (``open(O_CREAT|O_EXCL)``, ``write``, ``fchown``, ``fchmod``, ``futimens``,
``close``), and reports the mean time of each call (microseconds). Each kind gets a fresh tmpfs
backing directory and a fresh mount (bench_smallfiles.mounted). A serial client like this one
waits for every request it makes, so each call costs the requests it sends (a negative LOOKUP,
a GETATTR of the directory and the CREATE for the open; the GETXATTR of ``security.capability``
for the write and the chown; a SETATTR each; the FLUSH for the close) times one round trip plus
the daemon's time in each.

It also measures what a round trip costs on this machine before any filesystem: two processes
passing a byte back and forth through pipes, pinned to two CPUs and to one (the wake-up of a
process on an idle CPU of a VM costs an interrupt through the hypervisor), and with the server
polling instead of sleeping (as the tierfs daemon does between requests).

Needs root (mounts). From the repository root:

    sudo .venv/bin/python bench/profile_create_steps.py
    sudo .venv/bin/python bench/profile_create_steps.py --kinds tierfs --files 5000 --rounds 5
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_smallfiles import mounted  # noqa: E402

STEPS = ("open", "write", "fchown", "fchmod", "futimens", "close")


def create_steps(root: Path, n: int) -> dict[str, float]:
    """Mean microseconds of each call, over ``n`` files created in a new directory of ``root``."""
    d = root / "steps"
    d.mkdir()
    spent: collections.Counter[str] = collections.Counter()
    pc = time.perf_counter
    data = b"y" * 5000
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC
    for i in range(n):
        t0 = pc()
        fd = os.open(d / f"f{i}", flags, 0o600)
        t1 = pc()
        os.write(fd, data)
        t2 = pc()
        os.fchown(fd, os.geteuid(), os.getegid())
        t3 = pc()
        os.fchmod(fd, 0o644)
        t4 = pc()
        os.utime(fd, ns=(1_000_000_000, 1_000_000_000))
        t5 = pc()
        os.close(fd)
        t6 = pc()
        for k, a, b in zip(STEPS, (t0, t1, t2, t3, t4, t5), (t1, t2, t3, t4, t5, t6), strict=True):
            spent[k] += b - a
    out = {k: round(spent[k] / n * 1e6, 1) for k in STEPS}
    out["total"] = round(sum(spent.values()) / n * 1e6, 1)
    return out


def ping_pong(server_cpu: int, client_cpu: int, spin: bool, n: int = 5000) -> float:
    """Microseconds per round trip of one byte through two pipes between two processes pinned
    to ``client_cpu`` and ``server_cpu``; ``spin``: the server polls its pipe instead of
    sleeping in read(2)."""
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    if spin:
        os.set_blocking(a_r, False)
    pid = os.fork()
    if pid == 0:  # the server
        try:
            os.sched_setaffinity(0, {server_cpu})
            for _ in range(n):
                while True:
                    try:
                        os.read(a_r, 1)
                        break
                    except BlockingIOError:
                        pass
                os.write(b_w, b"x")
        finally:
            os._exit(0)
    old = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {client_cpu})
        t = time.perf_counter()
        for _ in range(n):
            os.write(a_w, b"x")
            os.read(b_r, 1)
        dt = time.perf_counter() - t
    finally:
        os.sched_setaffinity(0, old)
        os.waitpid(pid, 0)
        for fd in (a_r, a_w, b_r, b_w):
            os.close(fd)
    return round(dt / n * 1e6, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--kinds", default="direct,bindfs,tierfs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tierfs-arg", action="append", default=[], dest="extra")
    args = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        print("round trip through pipes, us (two wake-ups; one when the server polls):")
        print(f"  two CPUs: {ping_pong(cpus[1], cpus[0], False)}; one CPU: {ping_pong(cpus[0], cpus[0], False)}; "
              f"two CPUs, server polling: {ping_pong(cpus[1], cpus[0], True)}")
    print(f"per call of a file's creation, us (mean over {args.files} files; the median of "
          f"{args.rounds} rounds, the kinds alternated, and each round's total):")
    kinds = args.kinds.split(",")
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            work = Path(tempfile.mkdtemp(prefix="create-steps-", dir="/dev/shm"))
            try:
                with mounted(kind, work, args.extra) as mnt:
                    runs[kind].append(create_steps(mnt, args.files))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    for kind in kinds:
        med = {k: statistics.median(r[k] for r in runs[kind]) for k in (*STEPS, "total")}
        print(f"  {kind}: {med}; totals {[r['total'] for r in runs[kind]]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
