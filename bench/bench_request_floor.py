#!/usr/bin/env python3
"""What one FUSE round trip costs a serial client, bindfs against tierfs: the client's wall
time per call and the daemon's CPU time per call, for requests whose handlers do almost
nothing and which the kernel never answers from a cache: ``statvfs`` (STATFS: one backing
``statvfs``) and ``listxattr`` (LISTXATTR: one backing ``listxattr``). (Not ``getxattr``: a
daemon that answers it ENOSYS or EOPNOTSUPP once is never asked again.) A serial client (``rm -rf``, ``tar -x``) pays this for every request, so it
separates the per-request cost of each daemon from the work its handlers do (a ``tar -x``
CREATE, which tierfs makes a dirty file of, against bindfs' plain ``open``).

One fresh tmpfs backing directory with one file, then for each daemon a fresh mount (bindfs in
the foreground, tierfs ``--ram 256MiB`` plus ``--tierfs-arg``\\ s) and ``--calls`` calls of each
kind from this process. The daemon's CPU time is user + system of all its threads
(``/proc/PID/stat``; tierfs' includes its busy poll: ``busy_poll_us``). Needs root (mounts) and
bindfs. From the repository root:

    sudo .venv/bin/python bench/bench_request_floor.py
    sudo .venv/bin/python bench/bench_request_floor.py --tierfs-arg=-o --tierfs-arg=busy_poll_us=0
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_smallfiles import REPO, is_mounted, unmount  # noqa: E402


def _cpu_s(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _wait_mounted(mnt: Path, proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited ({proc.returncode})")
        if is_mounted(mnt) and (mnt / "f").exists():
            return
        time.sleep(0.1)
    raise RuntimeError("the mount did not come up")


def measure(kind: str, back: Path, calls: int, extra: list[str]) -> dict[str, tuple[float, float]]:
    mnt = Path(tempfile.mkdtemp(prefix=f"floor-{kind}-"))
    if kind == "bindfs":
        argv = ["bindfs", "-f", "--no-allow-other", str(back), str(mnt)]
    else:
        argv = [sys.executable, "-m", "tierfs", "mount", str(back), str(mnt), "--foreground",
                "--ram", "256MiB", *extra]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = {}
    try:
        _wait_mounted(mnt, proc)
        p = str(mnt / "f")
        for name, fn in (("statvfs", lambda: os.statvfs(p)), ("listxattr", lambda: os.listxattr(p))):
            for _ in range(200):  # warm
                try:
                    fn()
                except OSError:
                    pass
            c0, t0 = _cpu_s(proc.pid), time.perf_counter()
            for _ in range(calls):
                try:
                    fn()
                except OSError:
                    pass
            wall, cpu = time.perf_counter() - t0, _cpu_s(proc.pid) - c0
            out[name] = (wall / calls * 1e6, cpu / calls * 1e6)
    finally:
        unmount(mnt)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.rmdir(mnt)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--tierfs-arg", dest="extra", action="append", default=[])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="floor-back-", dir="/dev/shm") as d:
        back = Path(d)
        (back / "f").write_bytes(b"x")
        print(f"load average {open('/proc/loadavg').read().split()[0]}; {args.calls} calls each")
        print("| daemon | request | client wall us/call | daemon CPU us/call |")
        print("|---|---|---:|---:|")
        for kind in ("bindfs", "tierfs"):
            for name, (wall, cpu) in measure(kind, back, args.calls, args.extra).items():
                print(f"| {kind} | {name} | {wall:.1f} | {cpu:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
