#!/usr/bin/env python3
"""Metadata and small files, native transport against pyfuse3: what a request costs when no
data moves through passthrough (the other half of the transport comparison; data-path figures
are bench_passthrough.py's).

One tmpfs backing directory; every figure is taken on a fresh mount, transports alternating
round by round (--rounds), and the median of the rounds is reported with the spread:

  ls -lR    ``ls -lR`` of a tree of --meta-files empty files in 100 directories (output
            discarded): READDIRPLUS and the attributes it carries.
  stat      ``os.stat`` of each of those files by its path, in shuffled order, one process:
            a LOOKUP per file (its directory's looked up once).
  walk      ``os.walk`` + ``lstat`` of the epoch's --files files.
  epoch     a shuffled epoch over --files files of 80-140 KiB read whole by --procs processes,
            three times: first (misses), page cache dropped (RAM tier hits), warm page cache
            (bench_smallfiles.py's epoch, same files).

Needs root (mounts). From the repository root:

    sudo .venv/bin/python bench/bench_transports.py                  # ~3 minutes
    sudo .venv/bin/python bench/bench_transports.py --rounds 5 --json

Any other --tierfs-arg goes to both mounts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_smallfiles import KiB, drop_page_cache, epoch, log, make_tree, mounted, walk_lstat  # noqa: E402

TRANSPORTS = ("pyfuse3", "native")
# (figure, unit, higher is better)
FIGURES = [("ls -lR", "s", False), ("stat", "s", False), ("walk", "s", False),
           ("epoch first", "files/s", True), ("epoch dropped", "files/s", True),
           ("epoch warm", "files/s", True)]


def one_round(back: Path, t: str, args: argparse.Namespace, names: list[str], meta: list[str]) -> dict[str, float]:
    extra = ["--transport", t, *args.extra]
    out: dict[str, float] = {}
    with mounted("tierfs", back, extra) as m:
        t0 = time.perf_counter()
        subprocess.run(["ls", "-lR", str(m / "meta")], stdout=subprocess.DEVNULL, check=True)
        out["ls -lR"] = time.perf_counter() - t0
    with mounted("tierfs", back, extra) as m:
        paths = [str(m / "meta" / n) for n in meta]
        random.Random(1).shuffle(paths)
        t0 = time.perf_counter()
        for p in paths:
            os.stat(p)
        out["stat"] = time.perf_counter() - t0
    with mounted("tierfs", back, extra) as m:
        out["walk"] = walk_lstat(m / "ds")[0]
    with mounted("tierfs", back, extra) as m:
        root = m / "ds"
        out["epoch first"] = epoch(root, names, args.procs, 2)
        drop_page_cache(root, names, args.procs)
        out["epoch dropped"] = epoch(root, names, args.procs, 3)
        out["epoch warm"] = epoch(root, names, args.procs, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--files", type=int, default=2000, help="epoch and walk files (~110 KiB)")
    p.add_argument("--meta-files", type=int, default=10000, help="ls -lR and stat files (empty)")
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--tierfs-arg", action="append", default=[], dest="extra")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-transports-", dir="/dev/shm"))
    back = work / "back"
    back.mkdir()
    res: dict = {"loadavg_start": open("/proc/loadavg").read().strip(), "args": vars(args), "rounds": []}
    try:
        log(f"making {args.meta_files} empty files and {args.files} files of 80-140 KiB")
        meta = make_tree(back / "meta", args.meta_files, 100, 0, 0, 3)
        names = make_tree(back / "ds", args.files, 100, 80 * KiB, 140 * KiB, 1)
        for r in range(args.rounds):
            for t in TRANSPORTS:
                log(f"round {r + 1}: {t}")
                res["rounds"].append({"transport": t, **one_round(back, t, args, names, meta)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["loadavg_end"] = open("/proc/loadavg").read().strip()
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"load average {res['loadavg_start']} -> {res['loadavg_end']}; command: python {' '.join(sys.argv)}")
    print("| figure | unit | pyfuse3 (median, range) | native (median, range) | native / pyfuse3 |")
    print("|---|---|---:|---:|---:|")
    for fig, unit, higher in FIGURES:
        cells, med = [], {}
        for t in TRANSPORTS:
            vals = [r[fig] for r in res["rounds"] if r["transport"] == t]
            med[t] = statistics.median(vals)
            fmt = "{:,.0f}" if unit == "files/s" else "{:.3f}"
            cells.append(f"{fmt.format(med[t])} ({fmt.format(min(vals))}-{fmt.format(max(vals))})")
        ratio = med["native"] / med["pyfuse3"] if higher else med["pyfuse3"] / med["native"]
        print(f"| {fig} | {unit} | {cells[0]} | {cells[1]} | {ratio:.2f}x{' (faster)' if ratio >= 1 else ''} |")
    print("(native / pyfuse3 is a speed ratio: above 1 the native transport is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
