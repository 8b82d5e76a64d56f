#!/usr/bin/env python3
"""Writes of many write(2) calls into a fresh tierfs mount (RAM write tier, passthrough) and into
a tmpfs directory: time and the FUSE requests the daemon saw per file.

What it shows: whether a write(2) of a passthrough file costs a request to the daemon. Before
the native transport negotiated FUSE_HANDLE_KILLPRIV_V2, the kernel asked the daemon for the
``security.capability`` attribute before each write(2) (to drop file capabilities), one round
trip per call.

    sudo .venv/bin/python bench/bench_write_calls.py             # ~10 s
    sudo PYTHONPATH=/path/to/other/checkout .venv/bin/python bench/bench_write_calls.py

Each case runs 3 times per target; the best time is reported. Root, /dev/fuse, /dev/shm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

MiB = 1 << 20


def _write_file(block: int, total: int) -> Callable[[str], None]:
    buf = b"\0" * block

    def run(path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _ in range(total // block):
                os.write(fd, buf)
        finally:
            os.close(fd)
    return run


def _torch_save(n_tensors: int) -> Callable[[str], None] | None:
    try:
        import torch
    except ImportError:
        return None
    sd = {f"layer{i}.weight": torch.randn(147_456) for i in range(n_tensors)}  # 576 KiB each

    def run(path: str) -> None:
        torch.save(sd, path)
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=250, help="bytes per written file, MiB (default 250)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    total = args.mib * MiB
    cases: list[tuple[str, Callable[[str], None]]] = [
        (f"{args.mib} MiB in 64 KiB write(2)s", _write_file(64 << 10, total)),
        (f"{args.mib} MiB in 1 MiB write(2)s", _write_file(MiB, total)),
    ]
    ts = _torch_save(100)
    if ts is not None:
        cases.append(("torch.save of 100 tensors of 576 KiB", ts))
    work = tempfile.mkdtemp(dir="/dev/shm", prefix="bench-wcalls-")
    mnt = tempfile.mkdtemp(prefix="bench-wcalls-mnt-")
    back, direct = os.path.join(work, "back"), os.path.join(work, "direct")
    os.mkdir(back)
    os.mkdir(direct)
    py = [sys.executable, "-m", "tierfs"]
    subprocess.run([*py, "mount", back, mnt, "--ram", "2GiB"], check=True, capture_output=True)
    results = []
    try:
        def stats() -> dict:
            with open(os.path.join(mnt, ".tierfs", "stats.json"), "rb") as f:
                return json.load(f)["transport"]
        t = stats()
        for name, fn in cases:
            row: dict = {"case": name}
            for target, base in (("direct", direct), ("tierfs", mnt)):
                best = float("inf")
                before = sum(stats()["requests_by_opcode"].values())
                for k in range(args.runs):
                    p = os.path.join(base, f"f{k}")
                    t0 = time.perf_counter()
                    fn(p)
                    best = min(best, time.perf_counter() - t0)
                    os.unlink(p)
                row[f"{target}_s"] = best
                if target == "tierfs":
                    row["requests_per_file"] = (sum(stats()["requests_by_opcode"].values()) - before) / args.runs
            results.append(row)
    finally:
        subprocess.run([*py, "umount", mnt], capture_output=True)
        os.rmdir(mnt)
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"transport": t["name"], "negotiated": t.get("negotiated"), "results": results}, indent=1))
        return 0
    print(f"transport {t['name']}, passthrough {t['passthrough']}; negotiated: {t.get('negotiated')}")
    print("| case | direct (tmpfs) s | tierfs s | tierfs / direct speed | requests per file |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['case']} | {r['direct_s']:.3f} | {r['tierfs_s']:.3f} | "
              f"{r['direct_s'] / r['tierfs_s']:.2f}x | {r['requests_per_file']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
