#!/usr/bin/env python3
"""The write-back worker's choice of the next file, with N files dirty at once (what ``tar -x``
or ``cp -a`` of N small files leaves when write-back falls behind: a slow backing store): the
scan of every dirty file it used to make per job vs the index (tierfs/writeback/ready.py).

Each round: N dirty files, a quarter still open for writing (not ready), deadlines spread; then
every ready file is taken in turn (choose, write back = remove from the table), as the worker
does. Prints microseconds per choice. No root, no mount:

    .venv/bin/python bench/bench_next_job.py --files 1000,10000,40000
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tierfs.writeback.manager import DirtyFile  # noqa: E402
from tierfs.writeback.ready import DirtyTable, scan_choice  # noqa: E402

scan = scan_choice  # the choice as it was made before the index: a scan of every dirty file


def table(n: int, seed: int) -> DirtyTable:
    rnd = random.Random(seed)
    files = DirtyTable()
    for i in range(n):
        df = DirtyFile(i, b"d/f%d" % i, f"/nonexistent/{i}", gen=1)
        df.writers = 1 if rnd.random() < 0.25 else 0
        df.deadline = rnd.uniform(0, 120)
        files[i] = df
    return files


def drain(files: DirtyTable, choose) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    k = 0
    while (df := choose(files)) is not None:
        del files[df.id]
        k += 1
    return k, time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", default="1000,10000,40000")
    args = p.parse_args(argv)
    print("| dirty files | choices | scan, us per choice | index, us per choice |")
    print("|---:|---:|---:|---:|")
    for n in (int(x) for x in args.files.split(",")):
        k1, t_scan = drain(table(n, 1), lambda f: scan(f, 1e9))
        k2, t_ix = drain(table(n, 1), lambda f: f.ready.first(1e9))
        assert k1 == k2
        print(f"| {n:,} | {k1:,} | {t_scan / k1 * 1e6:,.1f} | {t_ix / k2 * 1e6:,.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
