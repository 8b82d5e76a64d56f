#!/usr/bin/env python3
"""Which kernel copy moves a miss from the backing store into a RAM tier fastest?

Copies a file in 4 MiB chunks (tierfs' default chunk) into a tmpfs file at the same offsets,
with each method tierfs could use, from two sources, in one run:

* tmpfs -> tmpfs (a backing directory on tmpfs, the RAM tier on the same tmpfs);
* ext4 -> tmpfs (an ext4 image loop-mounted under a temp dir; its page cache dropped before
  each copy with POSIX_FADV_DONTNEED, so the bytes come from the image file: on this machine
  that is the host's page cache under the loop device, i.e. the copy cost, not a disk's).

Methods: ``copy_file_range`` (one syscall, in-kernel), ``splice`` (file -> pipe -> file, with
offsets), ``sendfile`` (in-kernel, but writes at the destination's file position: each thread
needs its own descriptor), ``pread`` (pread into a Python buffer + pwrite: the bytes pass
through Python). 1 thread and 4 threads (the parallel profile runs several copies at once).

    python bench/bench_copy.py [--size-mib 1024] [--repeat 3] [--quick]

Needs root (mkfs.ext4 and a loop mount). Prints a markdown table (GB/s, best of --repeat).
"""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tierfs import io  # noqa: E402

MiB = 1 << 20
CHUNK = 4 * MiB


def _sendfile(src: int, dst_path: str, length: int, off: int) -> int:
    fd = os.open(dst_path, os.O_WRONLY)  # own descriptor: sendfile writes at its position
    try:
        os.lseek(fd, off, os.SEEK_SET)
        done = 0
        while done < length:
            n = os.sendfile(fd, src, off + done, length - done)
            if n == 0:
                break
            done += n
        return done
    finally:
        os.close(fd)


def copy_file(src_path: str, dst_path: str, method: str, threads: int) -> float:
    """Seconds to copy ``src_path`` into a fresh ``dst_path`` chunk by chunk."""
    size = os.path.getsize(src_path)
    src = os.open(src_path, os.O_RDONLY)
    dst = os.open(dst_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.posix_fadvise(src, 0, 0, os.POSIX_FADV_DONTNEED)

    def one(off: int) -> int:
        n = min(CHUNK, size - off)
        if method == "sendfile":
            return _sendfile(src, dst_path, n, off)
        return io.copy_range(src, dst, n, off, off, methods=(method,), route=("bench", src_path, method, threads))

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            copied = sum(pool.map(one, range(0, size, CHUNK)))
        took = time.perf_counter() - t0
        if copied != size:
            raise OSError(errno.EIO, f"{method}: copied {copied} of {size}")
        return took
    finally:
        os.close(src)
        os.close(dst)
        os.unlink(dst_path)


def make_file(path: Path, mib: int) -> None:
    block = os.urandom(MiB)
    with open(path, "wb") as f:
        for i in range(mib):
            f.write(block[i % 13:] + block[: i % 13])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="256 MiB, 1 repeat")
    args = ap.parse_args()
    if args.quick:
        args.size_mib, args.repeat = 256, 1
    shm = Path(tempfile.mkdtemp(prefix="tierfs-copy-", dir="/dev/shm"))
    tmp = Path(tempfile.mkdtemp(prefix="tierfs-copy-"))
    img, mnt = tmp / "ext4.img", tmp / "mnt"
    mnt.mkdir()
    mounted = False
    try:
        subprocess.run(["truncate", "-s", f"{args.size_mib + 256}M", str(img)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", str(img)],
                       check=True)
        subprocess.run(["mount", "-o", "loop,noatime", str(img), str(mnt)], check=True)
        mounted = True
        sources = {"tmpfs": shm / "src.bin", "ext4": mnt / "src.bin"}
        for p in sources.values():
            make_file(p, args.size_mib)
        os.sync()
        gb = args.size_mib * MiB / 1e9
        print(f"copy of {args.size_mib} MiB in 4 MiB chunks into a tmpfs file, GB/s, best of {args.repeat}")
        print("| source -> tmpfs | threads | copy_file_range | splice | sendfile | pread+pwrite |")
        print("|---|---|---|---|---|---|")
        for name, src in sources.items():
            for threads in (1, 4):
                row = []
                for method in ("copy_file_range", "splice", "sendfile", "pread"):
                    try:
                        best = min(copy_file(str(src), str(shm / "dst.bin"), method, threads)
                                   for _ in range(args.repeat))
                        row.append(f"{gb / best:.2f}")
                    except OSError as e:
                        row.append(errno.errorcode.get(e.errno or 0, str(e)))
                print(f"| {name} | {threads} | " + " | ".join(row) + " |")
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)])
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
