#!/usr/bin/env python3
"""First reads (misses) through tierfs against the same reads direct and through bindfs, in one
run, on two backing stores:

  (A) tmpfs: a 2 GiB file in a tmpfs backing directory, read once by one reader with 1 MiB
      reads: direct (from tmpfs), through a fresh bindfs mount, through a fresh tierfs mount
      (RAM tier; the backing profile detected: parallel), and through tierfs with
      ``--backing hdd`` (the serial profile, for comparison). Target: tierfs >= 0.7x bindfs.
  (B) an emulated parallel store: nbdkit's memory plugin behind its delay filter (every read
      request waits ``--delay-ms``, 0.5 ms by default, and requests are served in parallel),
      exposed by nbdfuse (``-C 4`` connections) as a file, a loop device on it (direct I/O,
      rotational=0) and ext4. 8 readers each read their own eighth of a 2 GiB file: direct
      (ext4 cache dropped), through bindfs and through tierfs (fresh mounts, cache dropped
      before each). Target: tierfs >= 0.9x direct.

    sudo .venv/bin/python bench/bench_miss.py            # 2 GiB, ~2-4 minutes
    sudo .venv/bin/python bench/bench_miss.py --quick    # 512 MiB
    sudo .venv/bin/python bench/bench_miss.py --only tmpfs --json

Kernel readahead is 1 MiB on both FUSE mounts (the daemon sets it for tierfs; this script for
bindfs). Needs root, bindfs, nbdkit (with its memory plugin and delay filter), nbdfuse,
mkfs.ext4 and losetup (``make setup`` installs them). Everything is torn down in ``finally``.
Figures vary ~10-20% between runs on a loaded machine: compare columns of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXTRA: list[str] = []  # more `tierfs mount` arguments for the tierfs column (--tierfs-arg)
MiB = 1 << 20
READ = MiB


def sh(*cmd: str, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=True, capture_output=True, text=True, **kw)


def read_range(path: Path, start: int, end: int) -> int:
    """Read ``[start, end)`` of ``path`` with 1 MiB reads; bytes read."""
    buf = bytearray(READ)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    got = 0
    try:
        pos = start
        while pos < end:
            n = os.preadv(fd, [view[: min(READ, end - pos)]], pos)
            if n <= 0:
                break
            got += n
            pos += n
    finally:
        os.close(fd)
    return got


def timed_read(path: Path, readers: int) -> float:
    """GB/s of ``readers`` threads each reading its own contiguous part of ``path`` (they
    release the GIL in the read syscall)."""
    size = path.stat().st_size
    part = -(-size // readers // READ) * READ
    out = [0] * readers

    def one(i: int) -> None:
        out[i] = read_range(path, i * part, min(size, (i + 1) * part))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(readers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    if sum(out) != size:
        raise RuntimeError(f"read {sum(out)} of {size} bytes of {path}")
    return size / took / 1e9


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def set_readahead(mnt: Path, kb: int = 1024) -> None:
    st = os.stat(mnt)
    Path(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb").write_text(str(kb))


def make_file(path: Path, mib: int) -> None:
    block = os.urandom(MiB)
    with open(path, "wb") as f:
        for i in range(mib):
            f.write(block[i % 13 :] + block[: i % 13])


@contextmanager
def bindfs(backing: Path):  # type: ignore[no-untyped-def]
    mnt = Path(tempfile.mkdtemp(prefix="bench-bindfs-"))
    sh("bindfs", str(backing), str(mnt))
    try:
        set_readahead(mnt)
        yield mnt
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
        mnt.rmdir()


@contextmanager
def tierfs(backing: Path, ram_mib: int, *extra: str):  # type: ignore[no-untyped-def]
    mnt = Path(tempfile.mkdtemp(prefix="bench-tierfs-"))
    sh(sys.executable, "-m", "tierfs", "mount", str(backing), str(mnt), "--ram", f"{ram_mib}MiB", *extra,
       cwd=REPO)
    try:
        yield mnt
    finally:
        subprocess.run([sys.executable, "-m", "tierfs", "umount", str(mnt)], cwd=REPO, capture_output=True)
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
        mnt.rmdir()


def tierfs_stats(mnt: Path) -> dict[str, Any]:
    doc = json.loads((mnt / ".tierfs" / "stats.json").read_text())
    s, c = doc["scheduler"], doc["cache"]
    return {"profile": s.get("profile", {}).get("name"), "depth": s["depth"],
            "direct_fetches": c.get("direct_fetches"), "kernel_copies": c.get("kernel_copies"),
            "demand_wait_mean_ms": 1000 * s["demand_wait_mean_s"]}


def bench_tmpfs(mib: int, res: dict[str, Any]) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-miss-", dir="/dev/shm"))
    try:
        back = work / "back"
        back.mkdir()
        f = back / "big.bin"
        make_file(f, mib)
        r: dict[str, Any] = {"size_mib": mib}
        r["direct"] = timed_read(f, 1)
        with bindfs(back) as b:
            r["bindfs"] = timed_read(b / "big.bin", 1)
        with tierfs(back, mib + 256, *EXTRA) as t:
            r["tierfs"] = timed_read(t / "big.bin", 1)
            r["tierfs_stats"] = tierfs_stats(t)
            drop(t / "big.bin")
            r["tierfs_tier_hits"] = timed_read(t / "big.bin", 1)
        with tierfs(back, mib + 256, "--backing", "hdd") as t:
            r["tierfs_hdd_profile"] = timed_read(t / "big.bin", 1)
        r["tierfs_vs_bindfs"] = r["tierfs"] / r["bindfs"]
        res["tmpfs"] = r
    finally:
        shutil.rmtree(work, ignore_errors=True)


class ParallelStore:
    """nbdkit memory + delay filter -> nbdfuse -> loop (direct I/O, rotational=0) -> ext4."""

    def __init__(self, work: Path, size_mib: int, delay_ms: float) -> None:
        self.work, self.size_mib, self.delay_ms = work, size_mib, delay_ms
        self.sock, self.fuse, self.mnt = work / "nbd.sock", work / "fuse", work / "mnt"
        self.nbdkit: subprocess.Popen | None = None
        self.loop: str | None = None

    def up(self, stack: ExitStack) -> Path:
        self.fuse.mkdir()
        self.mnt.mkdir()
        self.nbdkit = subprocess.Popen(
            ["nbdkit", "--foreground", "--exit-with-parent", "--unix", str(self.sock), "--filter=delay",
             "memory", f"size={self.size_mib}M", f"rdelay={self.delay_ms}ms"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(self._stop_nbdkit)
        for _ in range(200):
            if self.sock.exists():
                break
            time.sleep(0.05)
        pidfile = self.work / "nbdfuse.pid"
        nbdfuse = subprocess.Popen(["nbdfuse", "-C", "4", "-P", str(pidfile), str(self.fuse / "disk"),
                                    "--unix", str(self.sock)], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
        stack.callback(nbdfuse.wait, 10)
        stack.callback(lambda: subprocess.run(["fusermount3", "-u", "-z", str(self.fuse)], capture_output=True))
        for _ in range(200):  # nbdfuse stays in the foreground; its pid file says it is mounted
            if pidfile.exists() and pidfile.stat().st_size and os.path.ismount(self.fuse):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("nbdfuse did not mount")
        self.loop = sh("losetup", "--find", "--show", "--direct-io=on", str(self.fuse / "disk")).stdout.strip()
        stack.callback(lambda: subprocess.run(["losetup", "-d", str(self.loop)], capture_output=True))
        name = os.path.basename(self.loop)
        Path(f"/sys/block/{name}/queue/rotational").write_text("0")
        sh("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", self.loop)
        sh("mount", "-o", "noatime", self.loop, str(self.mnt))
        stack.callback(lambda: subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True))
        return self.mnt

    def dropcache(self) -> None:
        """Evict the ext4's page cache (remount); below the loop device nothing caches."""
        sh("umount", str(self.mnt))
        sh("mount", "-o", "noatime", str(self.loop), str(self.mnt))

    def _stop_nbdkit(self) -> None:
        if self.nbdkit is not None:
            self.nbdkit.terminate()
            self.nbdkit.wait(10)


def bench_parallel(mib: int, readers: int, delay_ms: float, res: dict[str, Any]) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-miss-par-"))
    try:
        with ExitStack() as stack:
            store = ParallelStore(work, mib + 512, delay_ms)
            mnt = store.up(stack)
            back = mnt / "data"
            back.mkdir()
            make_file(back / "big.bin", mib)
            os.sync()
            r: dict[str, Any] = {"size_mib": mib, "readers": readers, "delay_ms": delay_ms}
            store.dropcache()
            r["direct"] = timed_read(back / "big.bin", readers)
            store.dropcache()
            with bindfs(back) as b:
                r["bindfs"] = timed_read(b / "big.bin", readers)
            store.dropcache()
            with tierfs(back, mib + 256, *EXTRA) as t:
                r["tierfs"] = timed_read(t / "big.bin", readers)
                r["tierfs_stats"] = tierfs_stats(t)
            store.dropcache()
            with tierfs(back, mib + 256, "--backing", "hdd") as t:
                r["tierfs_hdd_profile"] = timed_read(t / "big.bin", readers)
            r["tierfs_vs_direct"] = r["tierfs"] / r["direct"]
            res["parallel_store"] = r
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=2048)
    ap.add_argument("--readers", type=int, default=8)
    ap.add_argument("--delay-ms", type=float, default=0.5, help="per read request of the parallel store")
    ap.add_argument("--only", choices=("tmpfs", "parallel"))
    ap.add_argument("--quick", action="store_true", help="512 MiB")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tierfs-arg", action="append", default=[],
                    help="extra tierfs mount argument for the tierfs column (repeat: --tierfs-arg=--depth --tierfs-arg=32)")
    args = ap.parse_args()
    EXTRA[:] = args.tierfs_arg
    if args.quick:
        args.size_mib = 512
    res: dict[str, Any] = {"load_average_at_start": os.getloadavg()[0]}
    if args.only in (None, "tmpfs"):
        bench_tmpfs(args.size_mib, res)
    if args.only in (None, "parallel"):
        bench_parallel(args.size_mib, args.readers, args.delay_ms, res)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"first read of a {args.size_mib} MiB file, GB/s (load average at start {res['load_average_at_start']:.1f})")
    print("| backing | readers | direct | bindfs | tierfs | tierfs --backing hdd | target |")
    print("|---|---|---|---|---|---|---|")
    if "tmpfs" in res:
        r = res["tmpfs"]
        print(f"| tmpfs | 1 | {r['direct']:.2f} | {r['bindfs']:.2f} | {r['tierfs']:.2f} | "
              f"{r['tierfs_hdd_profile']:.2f} | tierfs/bindfs = {r['tierfs_vs_bindfs']:.2f} (>= 0.7) |")
    if "parallel_store" in res:
        r = res["parallel_store"]
        print(f"| nbdkit memory, {r['delay_ms']} ms/request | {r['readers']} | {r['direct']:.2f} | "
              f"{r['bindfs']:.2f} | {r['tierfs']:.2f} | {r['tierfs_hdd_profile']:.2f} | "
              f"tierfs/direct = {r['tierfs_vs_direct']:.2f} (>= 0.9) |")
    for k in ("tmpfs", "parallel_store"):
        if k in res:
            print(f"{k}: tierfs {res[k]['tierfs_stats']}")
    if "tmpfs" in res:
        print(f"tmpfs: tierfs re-read from its RAM tier (page cache dropped): {res['tmpfs']['tierfs_tier_hits']:.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
