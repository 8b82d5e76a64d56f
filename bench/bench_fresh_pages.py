#!/usr/bin/env python3
"""What writing into memory no one has written yet costs on this machine, against writing into
memory already written: anonymous memory (a fresh ``mmap``, then the same mapping again) and a
tmpfs file (a new file, then the same file rewritten in place). Every byte of a miss lands in
fresh pages twice in tierfs (the tier's copy, and the kernel's page cache of the mount that the
READ reply fills) and once through bindfs (its page cache); on a VM whose host backs guest
memory lazily, those first touches cost far more than the copies themselves. No root needed:

    .venv/bin/python bench/bench_fresh_pages.py [--mib 256]
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time

MiB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--dir", default="/dev/shm", help="a tmpfs directory for the file case")
    args = ap.parse_args()
    n, block = args.mib * MiB, b"x" * MiB
    print("| memory | first write GB/s | rewrite GB/s |")
    print("|---|---:|---:|")
    for trial in range(2):
        m = mmap.mmap(-1, n)
        times = []
        for _ in range(2):
            t = time.perf_counter()
            for off in range(0, n, MiB):
                m[off:off + MiB] = block
            times.append(time.perf_counter() - t)
        m.close()
        print(f"| anonymous mmap, try {trial + 1} | {n / times[0] / 1e9:.2f} | {n / times[1] / 1e9:.2f} |")
    fd, path = tempfile.mkstemp(dir=args.dir)
    try:
        times = []
        for _ in range(2):
            t = time.perf_counter()
            for off in range(0, n, MiB):
                os.pwrite(fd, block, off)
            times.append(time.perf_counter() - t)
        print(f"| tmpfs file ({args.dir}) | {n / times[0] / 1e9:.2f} | {n / times[1] / 1e9:.2f} |")
    finally:
        os.close(fd)
        os.unlink(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
