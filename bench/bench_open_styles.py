#!/usr/bin/env python3
"""What a Dataset's way of opening a small file costs the daemon: 4-process shuffled epochs
over resident small files, read with ``os.open`` + ``readv``, with Python's ``open(path, "rb")``
(torchvision's and PIL's loaders) and with ``open(path, "rb", buffering=0)``; on tierfs (its
requests per file from ``stats.json``) and on bindfs over the same directory.

One tmpfs directory of ``--files`` files of 80-140 KiB in 100 directories; each mount reads every
file once (tierfs then waits for the RAM tier's fills), then runs each way twice. Needs root
(mounts) and bindfs. From the repository root::

    sudo .venv/bin/python bench/bench_open_styles.py
    sudo .venv/bin/python bench/bench_open_styles.py --files 2000 --kinds tierfs
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WAYS = ("os", "python", "raw")


def make(root: str, n: int) -> None:
    r = random.Random(1)
    for i in range(n):
        d = f"{root}/ds/d{i % 100:03d}"
        os.makedirs(d, exist_ok=True)
        with open(f"{d}/f{i:05d}", "wb") as f:
            f.write(os.urandom(r.randint(80 * 1024, 140 * 1024)))


def reader(paths: list[str], way: str, barrier) -> None:  # type: ignore[no-untyped-def]
    buf = bytearray(256 * 1024)
    barrier.wait()
    for p in paths:
        if way == "os":
            fd = os.open(p, os.O_RDONLY)
            while os.readv(fd, [buf]) > 0:
                pass
            os.close(fd)
        elif way == "raw":
            with open(p, "rb", buffering=0) as f:
                f.read()
        else:
            with open(p, "rb") as f:
                f.read()


def epoch(paths: list[str], way: str, procs: int, seed: int) -> float:
    order = paths[:]
    random.Random(seed).shuffle(order)
    b = mp.Barrier(procs + 1)
    ps = [mp.Process(target=reader, args=(order[i::procs], way, b)) for i in range(procs)]
    for p in ps:
        p.start()
    b.wait()
    t = time.monotonic()
    for p in ps:
        p.join()
    return len(paths) / (time.monotonic() - t)


def requests(mnt: str) -> dict[str, int]:
    try:
        with open(mnt + "/.tierfs/stats.json") as f:
            return json.load(f)["transport"]["requests_by_opcode"]  # type: ignore[no-any-return]
    except OSError:
        return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=8000)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--kinds", default="tierfs,bindfs")
    args = ap.parse_args()
    w = tempfile.mkdtemp(dir="/dev/shm", prefix="open-styles.")
    back, mnt = w + "/back", w + "/mnt"
    os.makedirs(back)
    os.makedirs(mnt)
    try:
        make(back, args.files)
        for kind in args.kinds.split(","):
            if kind == "bindfs":
                subprocess.run(["bindfs", back, mnt], check=True)
            else:
                subprocess.run([sys.executable, "-m", "tierfs", "mount", back, mnt, "--ram", "2GiB"],
                               cwd=REPO, check=True, stdout=subprocess.DEVNULL)
            try:
                paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(mnt + "/ds") for f in fs)
                for p in paths:
                    with open(p, "rb") as f:
                        f.read()
                while kind == "tierfs":
                    with open(mnt + "/.tierfs/stats.json") as f:
                        s = json.load(f)["scheduler"]
                    if not s["queued"]["speculative"] and not s["in_flight"]:
                        break
                    time.sleep(0.2)
                for way in WAYS + WAYS:
                    r0 = requests(mnt)
                    rate = epoch(paths, way, args.procs, 7)
                    r1 = requests(mnt)
                    per = {k: round((v - r0.get(k, 0)) / len(paths), 2) for k, v in r1.items()
                           if v - r0.get(k, 0) > len(paths) // 10}
                    print(f"{kind:7s} {way:7s} {rate:7.0f} files/s  requests per file: {per}", flush=True)
            finally:
                if kind == "bindfs":
                    subprocess.run(["fusermount3", "-u", mnt], check=False)
                else:
                    subprocess.run([sys.executable, "-m", "tierfs", "umount", mnt], cwd=REPO, check=False,
                                   stdout=subprocess.DEVNULL)
    finally:
        shutil.rmtree(w, ignore_errors=True)


if __name__ == "__main__":
    main()
