#!/usr/bin/env python3
"""The ceiling of a pyfuse3 file system for large sequential writes, next to a direct write.

Mounts a minimal pyfuse3 file system with one file whose ``write`` handler does (a) nothing but
return, (b) ``os.pwrite`` of the buffer into a file in a local directory, inline on the event
loop (what tierfs' write tier does while writes are measured cheap). A child process writes
``--mib`` MiB in 16 MiB ``write(2)`` calls into it and, alternately, directly into the local
directory; best of ``--runs``. Every FUSE write is synchronous for the writer: the kernel hands
the daemon one 1 MiB request at a time, and the writer waits for each answer. (a) is therefore
the most any pyfuse3 daemon can give on this machine, whatever it does with the data.

    sudo .venv/bin/python bench/bench_fuse_ceiling.py [--mib 1024] [--runs 5]
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import subprocess
import sys
import tempfile
import time


def serve(mountpoint: str, target: str, mode: str) -> None:
    import pyfuse3
    import trio

    class CeilingFS(pyfuse3.Operations):
        def __init__(self) -> None:
            super().__init__()
            self.size = 0
            self.fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)

        async def getattr(self, inode, ctx=None):  # type: ignore[no-untyped-def]
            a = pyfuse3.EntryAttributes()
            a.st_ino = inode
            if inode == pyfuse3.ROOT_INODE:
                a.st_mode, a.st_nlink = stat.S_IFDIR | 0o755, 2
            else:
                a.st_mode, a.st_nlink, a.st_size = stat.S_IFREG | 0o644, 1, self.size
            a.attr_timeout = a.entry_timeout = 1
            return a

        async def lookup(self, parent, name, ctx=None):  # type: ignore[no-untyped-def]
            if name == b"f":
                return await self.getattr(2)
            raise pyfuse3.FUSEError(errno.ENOENT)

        async def open(self, inode, flags, ctx):  # type: ignore[no-untyped-def]
            return pyfuse3.FileInfo(fh=2)

        async def setattr(self, inode, attr, fields, fh, ctx):  # type: ignore[no-untyped-def]
            if fields.update_size:
                self.size = attr.st_size
                os.ftruncate(self.fd, attr.st_size)
            return await self.getattr(inode)

        async def write(self, fh, off, buf):  # type: ignore[no-untyped-def]
            if mode == "pwrite":
                os.pwrite(self.fd, buf, off)
            self.size = max(self.size, off + len(buf))
            return len(buf)

    pyfuse3.init(CeilingFS(), mountpoint, {"fsname=tierfs-ceiling", "noatime"})
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close()


def timed_write(path: str, mib: int) -> float:
    block = b"\xa5" * (16 << 20)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for _ in range(mib // 16):
        os.write(fd, block)
    os.close(fd)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", default=None, help="local directory (default: a temp dir under /var/tmp)")
    ap.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(*a.serve)
        return
    base = tempfile.mkdtemp(prefix="tierfs-ceiling-", dir=a.dir or "/var/tmp")
    mnt, local = os.path.join(base, "mnt"), os.path.join(base, "local")
    os.mkdir(mnt)
    os.mkdir(local)
    results: dict[str, list[float]] = {"direct": [], "none": [], "pwrite": []}
    try:
        for mode in ("none", "pwrite"):
            daemon = subprocess.Popen([sys.executable, __file__, "--serve", mnt, os.path.join(local, "target"), mode])
            try:
                for _ in range(100):
                    if os.path.ismount(mnt):
                        break
                    time.sleep(0.05)
                for _ in range(a.runs):
                    results[mode].append(timed_write(os.path.join(mnt, "f"), a.mib))
                    results["direct"].append(timed_write(os.path.join(local, "direct"), a.mib))
                    os.unlink(os.path.join(local, "direct"))
                    subprocess.run(["sync"], check=False)
            finally:
                subprocess.run(["umount", mnt], check=False)
                daemon.wait(timeout=30)
    finally:
        subprocess.run(["rm", "-rf", base], check=False)
    best = {k: min(v) for k, v in results.items()}
    mb = a.mib * (1 << 20) / 1e6
    print(f"{a.mib} MiB in 16 MiB write(2) calls incl. close, best of {a.runs}; load {os.getloadavg()[0]:.2f}")
    print("| target | s (runs) | best MB/s | vs direct |")
    print("|---|---|---|---|")
    for k, label in (("direct", "direct into the local directory"), ("none", "pyfuse3, write handler returns at once"),
                     ("pwrite", "pyfuse3, write handler does os.pwrite inline")):
        runs = " / ".join(f"{x:.2f}" for x in results[k])
        print(f"| {label} | {runs} | {mb / best[k]:.0f} | {best['direct'] / best[k]:.2f} |")


if __name__ == "__main__":
    main()
