#!/usr/bin/env python3
"""Sequential read of a large file: tierfs (RAM tier hit, cold and warm page cache) against the
same file read directly from tmpfs and through bindfs (a C FUSE passthrough from Debian) over
the same directory, all with 1 MiB kernel readahead, in one run.

    python bench/bench_read.py [--size-mib 2048] [--repeat 3] [--json]

Needs root (mounts, /sys/class/bdi) and bindfs (apt install bindfs). "cold" means the file is
not in the page cache of the mount being measured (dropped with POSIX_FADV_DONTNEED), so every
byte goes through the FUSE daemon; for tierfs the bytes are in its RAM tier. "warm" re-reads
through the kernel page cache (tierfs keeps it for unchanged files).
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
from pathlib import Path

BLOCK = 1 << 20
REPO = Path(__file__).resolve().parent.parent


def read_all(path: Path) -> float:
    """Seconds to read the whole file with 1 MiB reads."""
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        while os.readv(fd, [view]) > 0:
            pass
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def set_readahead(mnt: Path, kb: int = 1024) -> None:
    st = os.stat(mnt)
    Path(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb").write_text(str(kb))


def best(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    return min(fn() for _ in range(repeat))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    size = args.size_mib * BLOCK
    work = Path(tempfile.mkdtemp(prefix="tierfs-bench-", dir="/dev/shm"))
    back, bmnt, tmnt = work / "back", Path(tempfile.mkdtemp(prefix="bindfs-")), Path(tempfile.mkdtemp(prefix="tierfs-"))
    back.mkdir()
    f = back / "big.bin"
    with open(f, "wb") as out:
        chunk = os.urandom(BLOCK)
        for i in range(args.size_mib):
            out.write(chunk[i % 7 :] + chunk[: i % 7])
    gb = size / 1e9
    res: dict[str, float] = {}
    try:
        res["tmpfs_direct"] = gb / best(lambda: read_all(f), args.repeat)
        subprocess.run(["bindfs", str(back), str(bmnt)], check=True)
        set_readahead(bmnt)
        res["bindfs_cold"] = gb / best(lambda: (drop(bmnt / "big.bin"), read_all(bmnt / "big.bin"))[1], args.repeat)
        res["bindfs_warm"] = gb / best(lambda: read_all(bmnt / "big.bin"), args.repeat)
        subprocess.run([sys.executable, "-m", "tierfs", "mount", str(back), str(tmnt),
                        "--ram", f"{args.size_mib + 512}MiB"], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        tf = tmnt / "big.bin"
        res["tierfs_first_read"] = gb / read_all(tf)  # from the backing store into the RAM tier
        res["tierfs_cold"] = gb / best(lambda: (drop(tf), read_all(tf))[1], args.repeat)
        res["tierfs_warm"] = gb / best(lambda: read_all(tf), args.repeat)
        stats = json.loads((tmnt / ".tierfs" / "stats.json").read_text())
        res["tierfs_ram_hit_ratio"] = stats["tiers"][0]["hit_ratio"]
    finally:
        for m in (tmnt, bmnt):
            if os.path.ismount(m):
                if m == tmnt:
                    subprocess.run([sys.executable, "-m", "tierfs", "umount", str(m)], cwd=REPO)
                else:
                    subprocess.run(["fusermount3", "-u", str(m)])
        shutil.rmtree(work, ignore_errors=True)
        for m in (tmnt, bmnt):
            try:
                m.rmdir()
            except OSError:
                pass
    res["cold_vs_bindfs"] = res["tierfs_cold"] / res["bindfs_cold"]
    res["warm_vs_tmpfs"] = res["tierfs_warm"] / res["tmpfs_direct"]
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"sequential read of {args.size_mib} MiB, 1 MiB reads, best of {args.repeat} (GB/s)")
        print("| path | GB/s |\n|---|---|")
        for k in ("tmpfs_direct", "bindfs_cold", "bindfs_warm", "tierfs_first_read", "tierfs_cold", "tierfs_warm"):
            print(f"| {k} | {res[k]:.2f} |")
        print(f"\ntierfs cold / bindfs cold = {res['cold_vs_bindfs']:.2f} (target >= 0.7)")
        print(f"tierfs warm / tmpfs direct = {res['warm_vs_tmpfs']:.2f} (target >= 0.8)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
