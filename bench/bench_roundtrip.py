#!/usr/bin/env python3
"""What one request costs: a FUSE round trip with no work in it, and an open + close of a small
file, direct (tmpfs) vs bindfs vs tierfs over the same tmpfs directory, one process, serially.

* ``isatty``: ``os.isatty`` on an open descriptor of the mount; the kernel sends an IOCTL,
  which neither daemon implements (answered at once, ENOSYS): the transport's own cost, the
  kernel's two context switches included. Python's ``open()`` sends one per file it opens.
* ``open+close``: ``os.open`` + ``os.close`` of the same small file, again and again; for
  tierfs the file is in its RAM tier after the first open, and its passthrough registration is
  kept between opens (the cheapest open tierfs has). The OPEN is synchronous; the RELEASE
  reaches the daemon after the close returned, and is paid in the daemon's time.

Figures are microseconds per call, the best of ``--runs`` runs of ``--seconds`` each; with the
tierfs mount's per-handler times (``stats.json`` ``fuse.request_seconds``) beside them. Needs root
(mounts) and bindfs. From the repository root:

    sudo .venv/bin/python bench/bench_roundtrip.py [--seconds 2] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_smallfiles import log, mounted  # noqa: E402


def per_call(fn, seconds: float) -> float:  # type: ignore[no-untyped-def]
    """Microseconds per ``fn()`` call, over ``seconds``."""
    n = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        for _ in range(100):
            fn()
        n += 100
        if time.perf_counter() >= end:
            break
    return (time.perf_counter() - t0) / n * 1e6


def measure(root: Path, seconds: float, runs: int) -> dict[str, float]:
    path = str(root / "f")
    fd = os.open(path, os.O_RDONLY)
    try:
        tty = min(per_call(lambda: os.isatty(fd), seconds) for _ in range(runs))
    finally:
        os.close(fd)
    oc = min(per_call(lambda: os.close(os.open(path, os.O_RDONLY)), seconds) for _ in range(runs))
    return {"isatty": tty, "open+close": oc}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kinds", default="direct,bindfs,tierfs")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-roundtrip-", dir="/dev/shm"))
    res: dict[str, dict[str, float]] = {}
    handlers: dict[str, float] = {}
    try:
        back = work / "back"
        back.mkdir()
        (back / "f").write_bytes(b"x" * 4096)
        for kind in args.kinds.split(","):
            log(kind)
            with mounted(kind, back, ["--ram", "64MiB"]) as m:
                res[kind] = measure(m, args.seconds, args.runs)
                if kind == "tierfs":
                    fuse = json.loads((m / ".tierfs" / "stats.json").read_text())["fuse"]
                    handlers = {k: fuse["request_seconds"][k] / fuse["requests"][k] * 1e6
                                for k in ("open", "release") if fuse["request_seconds"].get(k)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"us_per_call": res, "tierfs_handler_us": handlers, "loadavg": os.getloadavg()}))
        return 0
    kinds = list(res)
    print(f"load average {os.getloadavg()}; command: {' '.join(sys.argv)}")
    print("| call | " + " | ".join(kinds) + " |")
    print("|---|" + "---:|" * len(kinds))
    for call in ("isatty", "open+close"):
        print(f"| {call} (us) | " + " | ".join(f"{res[k][call]:.1f}" for k in kinds) + " |")
    if handlers:
        print("tierfs, mean time inside the handler (us): "
              + ", ".join(f"{k} {v:.1f}" for k, v in handlers.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
