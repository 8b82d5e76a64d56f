#!/usr/bin/env python3
"""Where ``tar -x`` of small files into a tierfs mount spends its time: the requests each file
costs, the daemon's mean time inside each kind of handler, and (``--profile``) a cProfile of the
daemon's whole run (the trio loop's thread; worker threads are not profiled).

One fresh tmpfs backing directory, one mount (``--ram 2GiB`` plus ``--tierfs-arg``s), one tar of
``--files`` files of 1-16 KiB in 100 directories (the tar phase of bench_smallfiles.py), then
``tierfs flush`` (the write-backs still due). Needs root (mounts). From the repository root:

    sudo .venv/bin/python bench/profile_tarx.py --files 2000
    sudo .venv/bin/python bench/profile_tarx.py --files 2000 --profile /tmp/tarx.pstats
    sudo .venv/bin/python bench/profile_tarx.py --files 2000 --tierfs-arg=--transport --tierfs-arg=pyfuse3

cProfile slows the daemon about twofold: read its figures as shares, not times.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_smallfiles import REPO, KiB, is_mounted, log, make_tree, unmount  # noqa: E402


def _stats(mnt: Path) -> dict:
    return json.loads((mnt / ".tierfs" / "stats.json").read_text())


def _wait_mounted(mnt: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:  # type: ignore[type-arg]
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited ({proc.returncode})")
        if is_mounted(mnt):
            try:
                _stats(mnt)
                return
            except (OSError, ValueError):
                pass
        time.sleep(0.1)
    raise RuntimeError("the mount did not come up")


def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="profile-tarx-", dir="/dev/shm"))
    back, src, mnt = work / "back", work / "src", Path(tempfile.mkdtemp(prefix="profile-tarx-mnt-"))
    back.mkdir()
    src.mkdir()
    proc = None
    out: dict = {"loadavg_start": open("/proc/loadavg").read().strip(), "files": args.files}
    try:
        log(f"making a tar of {args.files} files")
        make_tree(src / "tar", args.files, 100, 1 * KiB, 16 * KiB, 6)
        tarpath = work / "shard.tar"
        with tarfile.open(tarpath, "w") as tf:
            tf.add(src / "tar", arcname="shard")
        prof = ["-m", "cProfile", "-o", args.profile] if args.profile else []
        cmd = [sys.executable, *prof, "-m", "tierfs", "mount", str(back), str(mnt), "--foreground",
               "--ram", args.ram, *args.extra]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _wait_mounted(mnt, proc)
        (mnt / "tarx").mkdir()
        before = _stats(mnt)
        t = time.perf_counter()
        subprocess.run(["tar", "-xf", str(tarpath), "-C", str(mnt / "tarx")], check=True)
        out["tar_s"] = time.perf_counter() - t
        after = _stats(mnt)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "tierfs", "flush", str(mnt), "--timeout", "900"], cwd=REPO,
                       capture_output=True, timeout=1000, check=True)
        out["flush_s"] = time.perf_counter() - t
        tr = after.get("transport") or {}
        out["transport"] = f"{tr.get('name', 'pyfuse3')}{' + passthrough' if tr.get('passthrough') else ''}"
        out["writeback_passthrough_opens"] = after.get("writeback", {}).get("passthrough_opens")
        per = per_request(before["fuse"], after["fuse"], args.files)
        out["requests"] = per
        out["requests_per_file"] = sum(v["per_file"] for v in per.values())
        tb = before.get("transport") or {}
        # how the loop waited for the next request: a busy poll that found it, or epoll
        out["waits_per_file"] = {k: round((tr.get(k, 0) - tb.get(k, 0)) / args.files, 2)
                                 for k in ("busy_poll_hits", "busy_poll_misses", "epoll_waits")}
        # which device calls of the tar went to worker threads (each a hand-off and a wake-up)
        db = before.get("devices", {})
        calls = {k: {c: v.get(c, 0) - db.get(k, {}).get(c, 0) for c in ("inline_calls", "thread_calls")}
                 for k, v in after.get("devices", {}).items()}
        out["device_calls_per_file"] = {k: {c: round(n / args.files, 3) for c, n in d.items()}
                                        for k, d in calls.items() if any(d.values())}
        out["writeback_after_tar"] = after.get("writeback", {}).get("dirty_files")
    finally:
        stop(proc, mnt, work)
    out["loadavg_end"] = open("/proc/loadavg").read().strip()
    return out


def per_request(before: dict, after: dict, files: int) -> dict[str, dict[str, float]]:
    """Per kind of request between two ``stats.json`` ``fuse`` sections: how many per file,
    and the mean time inside its handler (us)."""
    per: dict[str, dict[str, float]] = {}
    for op, k in after["requests"].items():
        dn = k - before["requests"].get(op, 0)
        if dn:
            dt = after.get("request_seconds", {}).get(op, 0.0) - before.get("request_seconds", {}).get(op, 0.0)
            per[op] = {"per_file": dn / files, "handler_us": dt / dn * 1e6}
    return per


def stop(proc: subprocess.Popen | None, mnt: Path, work: Path) -> None:  # type: ignore[type-arg]
    """Unmount ``mnt`` once its dirty files are written back and wait for the daemon ``proc``
    (killed after 2 min); remove ``work`` and the mountpoint."""
    if proc is not None:
        if is_mounted(mnt):
            # --flush: what the run wrote goes back first; else its dirty files stay in the RAM
            # tier (under /dev/shm) for a next mount of a backing directory removed below
            subprocess.run([sys.executable, "-m", "tierfs", "umount", "--flush", str(mnt)], cwd=REPO,
                           capture_output=True, timeout=600)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    unmount(mnt)
    shutil.rmtree(work, ignore_errors=True)
    try:
        mnt.rmdir()
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--ram", default="2GiB")
    p.add_argument("--profile", default="", help="write the daemon's cProfile here and print its top")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--tierfs-arg", action="append", default=[], dest="extra",
                   help="extra argument for tierfs mount (repeatable)")
    args = p.parse_args(argv)
    res = run(args)
    print(json.dumps(res, indent=1))
    if args.profile and os.path.exists(args.profile):
        st = pstats.Stats(args.profile)
        st.sort_stats("tottime").print_stats(args.top)
        st.sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
