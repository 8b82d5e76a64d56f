#!/usr/bin/env python3
"""How long the first write to an existing file waits for its copy into the write tier (a
checkpoint resumed with ``r+b``, a numpy ``memmap`` opened ``r+``): a file of ``--mib`` MiB on
a tmpfs backing store, one fresh mount (``--ram 2GiB``) per try, the time of ``open(O_RDWR)``
plus a one-byte ``pwrite`` through the mount. "cold": no tier holds the file (the copy reads
the backing file); "warm": ``tierfs warmup`` put it in the RAM tier first (the copy reads the
tier). Prints a Markdown table. Needs root (mounts). From the repository root:

    sudo .venv/bin/python bench/bench_copy_up.py [--mib 512] [--tries 3]

The machine's first writes into fresh memory dominate these figures on a VM
(``bench/bench_fresh_pages.py``): compare two commits alternated, from one worktree each.
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
from profile_tarx import _wait_mounted, stop  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def one(mib: int, warm: bool) -> tuple[float, int]:
    """Seconds the first write waited, and the bytes copied in the kernel."""
    work = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="bench-copyup-"))
    back, mnt = work / "back", Path(tempfile.mkdtemp(prefix="bench-copyup-mnt-"))
    back.mkdir()
    block = os.urandom(MiB)
    with open(back / "big", "wb") as f:
        for _ in range(mib):
            f.write(block)
    proc = subprocess.Popen([sys.executable, "-m", "tierfs", "mount", str(back), str(mnt), "--foreground",
                             "--ram", "2GiB"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_mounted(mnt, proc)
        if warm:
            subprocess.run([sys.executable, "-m", "tierfs", "warmup", str(mnt / "big")], cwd=REPO,
                           check=True, capture_output=True, timeout=600)
        t = time.perf_counter()
        fd = os.open(mnt / "big", os.O_RDWR)
        os.pwrite(fd, b"X", 0)
        took = time.perf_counter() - t
        os.close(fd)
        stats = json.loads((mnt / ".tierfs" / "stats.json").read_bytes())
        return took, stats["writeback"].get("copied_up_in_kernel", 0)
    finally:
        stop(proc, mnt, work)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--tries", type=int, default=3)
    args = ap.parse_args()
    print(f"| {args.mib} MiB file | first write waits, s | MB/s | copied in the kernel, MiB |")
    print("|---|---:|---:|---:|")
    for _ in range(args.tries):
        for warm in (False, True):
            s, kernel = one(args.mib, warm)
            print(f"| {'warm' if warm else 'cold'} | {s:.2f} | {args.mib * MiB / s / 1e6:.0f} | {kernel / MiB:.0f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
