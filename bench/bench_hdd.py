#!/usr/bin/env python3
"""Read benchmark on an emulated 7200 rpm hard disk: direct vs through tierfs.

Sets up the emulated disk (bench/emuhdd.sh: nbdkit disk model -> nbdfuse -> loop -> ext4),
writes N shards of random bytes, then, with the page cache of the disk dropped before every
phase (and a fresh tierfs mount, so its tiers are cold), measures in one run:

  (a) seq1     one reader, one shard, 1 MiB reads, directly from the ext4 on the emulated disk
  (b) seq8     N processes at once, each reading its own shard, direct: aggregate MB/s
  (c) tierfs8  the same N readers through a tierfs mount of the disk's directory
  (d) rand     N processes reading 4 KiB at random offsets of their shard for a fixed time:
               IOPS direct, then through tierfs (with a RAM tier smaller than the data)

and reports the ratios seq8/seq1, tierfs8/seq8, tierfs8/seq1 and rand tierfs/direct, plus
the histogram of request sizes the disk model saw in each phase (from the plugin's log).
Needs root.  Always tears the disk down (finally).  Run e.g.

    sudo .venv/bin/python bench/bench_hdd.py                 # 8 x 256 MiB, ~2-3 minutes
    sudo .venv/bin/python bench/bench_hdd.py --shard-mib 64 --rand-seconds 5 --json
    sudo .venv/bin/python bench/bench_hdd.py --skip-tierfs   # the rig alone
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
EMUHDD = HERE / "emuhdd.sh"
MiB = 1 << 20
MB = 1e6


def log(msg: str) -> None:
    print(f"[bench_hdd {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the emulated disk
# ---------------------------------------------------------------------------------------------
class Rig:
    def __init__(self, workdir: Path, size_gib: int, plugin_args: str = "", nice: int = -10) -> None:
        self.workdir = workdir
        self.size_gib = size_gib
        self.env = dict(os.environ)
        self.env["EMUHDD_NICE"] = str(nice)
        if plugin_args:
            self.env["EMUHDD_NBDKIT_ARGS"] = plugin_args
        self.mnt: Path | None = None
        self.reqlog = workdir / "requests.log"

    def _sh(self, *args: str, timeout: float = 300) -> str:
        r = subprocess.run(
            [str(EMUHDD), *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if r.stderr.strip():
            for line in r.stderr.strip().splitlines():
                log(line)
        if r.returncode != 0:
            raise RuntimeError(f"emuhdd.sh {' '.join(args)} failed (rc={r.returncode})")
        return r.stdout

    def up(self) -> Path:
        out = self._sh("up", str(self.workdir), str(self.size_gib))
        self.mnt = Path(out.strip().splitlines()[-1])
        return self.mnt

    def down(self) -> None:
        self._sh("down", str(self.workdir), timeout=120)

    def dropcache(self) -> None:
        self._sh("dropcache", str(self.workdir), timeout=120)

    def nodelay(self, on: bool) -> None:
        p = self.workdir / "nodelay"
        if on:
            p.touch()
        else:
            p.unlink(missing_ok=True)

    def loopdev(self) -> str:
        return (self.workdir / "loopdev").read_text().strip()

    def log_mark(self) -> int:
        return self.reqlog.stat().st_size if self.reqlog.exists() else 0

    def requests_since(self, mark: int) -> list[tuple[float, str, int, int, float, float]]:
        out = []
        with open(self.reqlog, "rb") as f:
            f.seek(mark)
            for line in f.read().decode(errors="replace").splitlines():
                p = line.split()
                if len(p) < 6 or p[0] == "#":
                    continue
                try:
                    out.append((float(p[0]), p[1], int(p[2]), int(p[3]), float(p[4]), float(p[5])))
                except ValueError:
                    continue
        return out


def request_stats(reqs: list, duration: float) -> dict:
    """Histogram of read sizes seen by the disk model, and how busy the 'disk' was."""
    reads = [r for r in reqs if r[1] == "R"]
    hist = collections.Counter(r[3] for r in reads)
    cont = 0
    prev_end = None
    for r in reqs:
        if r[1] in ("R", "W", "Z"):
            if r[1] == "R" and r[2] == prev_end:
                cont += 1
            prev_end = r[2] + r[3]
    busy = sum(max(r[4], r[5]) for r in reqs if r[1] != "F")
    return {
        "reads": len(reads),
        "writes": sum(1 for r in reqs if r[1] in ("W", "Z")),
        "read_bytes": sum(r[3] for r in reads),
        "read_size_hist": {str(k): v for k, v in sorted(hist.items())},
        "mean_read_kib": (sum(r[3] for r in reads) / len(reads) / 1024) if reads else 0.0,
        "sequential_continuations": cont,
        "mean_model_ms": (sum(r[4] for r in reads) / len(reads) * 1e3) if reads else 0.0,
        "disk_busy_frac": busy / duration if duration > 0 else 0.0,
    }


def fmt_hist(h: dict) -> str:
    def size(b: int) -> str:
        return f"{b // 1024}K" if b % 1024 == 0 else f"{b}B"

    return ", ".join(f"{size(int(k))}x{v}" for k, v in sorted(h.items(), key=lambda kv: -kv[1])[:6])


def file_layout(path: Path) -> dict:
    """Extents of a file on the disk (filefrag), as MiB offsets on the device."""
    try:
        out = subprocess.run(
            ["filefrag", "-v", "-b1048576", str(path)], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    ext = []
    for line in out.splitlines():
        p = line.replace(":", " ").replace("..", " ").split()
        if len(p) >= 6 and p[0].isdigit():
            try:
                ext.append((int(p[3]), int(p[4])))  # physical start/end in MiB units
            except ValueError:
                pass
    if not ext:
        return {}
    return {"extents": len(ext), "phys_start_mib": ext[0][0], "phys_end_mib": ext[-1][1]}


# ---------------------------------------------------------------------------------------------
# readers (forked processes; time.monotonic is system-wide, so times compare across processes)
# ---------------------------------------------------------------------------------------------
def _seq_reader(path: str, block: int, barrier, q) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        buf = bytearray(block)
        mv = memoryview(buf)
        total = 0
        barrier.wait()
        t0 = time.monotonic()
        while True:
            n = os.readv(fd, [mv])
            if n <= 0:
                break
            total += n
        t1 = time.monotonic()
        os.close(fd)
        q.put(("ok", path, total, t0, t1))
    except BaseException as e:  # report, never hang the parent
        q.put(("err", path, repr(e), 0.0, 0.0))


def _rand_reader(path: str, block: int, seconds: float, seed: int, barrier, q) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        size = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead for random reads
        rng = random.Random(seed)
        nblocks = max(size // block, 1)
        lat = []
        barrier.wait()
        t0 = time.monotonic()
        deadline = t0 + seconds
        t = t0
        while t < deadline:
            off = rng.randrange(nblocks) * block
            os.pread(fd, block, off)
            t2 = time.monotonic()
            lat.append(t2 - t)
            t = t2
        os.close(fd)
        q.put(("ok", path, lat, t0, t))
    except BaseException as e:
        q.put(("err", path, repr(e), 0.0, 0.0))


def run_readers(target, argsets: list[tuple], timeout: float) -> list[tuple]:
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(argsets))
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, barrier, q), daemon=True) for a in argsets]
    for p in procs:
        p.start()
    results = []
    try:
        deadline = time.monotonic() + timeout
        while len(results) < len(procs):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"readers did not finish in {timeout:.0f} s")
            try:
                results.append(q.get(timeout=min(remaining, 5)))
            except Exception:  # queue.Empty
                if not any(p.is_alive() for p in procs) and q.empty():
                    raise RuntimeError("reader processes died without a result") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()  # our own child
                p.join(timeout=5)
    errs = [r for r in results if r[0] != "ok"]
    if errs:
        raise RuntimeError(f"reader failed: {errs[0][1]}: {errs[0][2]}")
    return results


def seq_phase(paths: list[Path], block: int, timeout: float) -> dict:
    res = run_readers(_seq_reader, [(str(p), block) for p in paths], timeout)
    t0 = min(r[3] for r in res)
    t1 = max(r[4] for r in res)
    total = sum(r[2] for r in res)
    per = [r[2] / (r[4] - r[3]) / MB for r in res]
    return {
        "readers": len(paths),
        "bytes": total,
        "seconds": t1 - t0,
        "mbps": total / (t1 - t0) / MB,
        "per_reader_mbps_min": min(per),
        "per_reader_mbps_max": max(per),
        "t0": t0,
    }


def rand_phase(paths: list[Path], block: int, seconds: float, timeout: float) -> dict:
    res = run_readers(
        _rand_reader, [(str(p), block, seconds, 1000 + i) for i, p in enumerate(paths)], timeout
    )
    t0 = min(r[3] for r in res)
    t1 = max(r[4] for r in res)
    lat = sorted(x for r in res for x in r[2])
    n = len(lat)
    return {
        "readers": len(paths),
        "ios": n,
        "seconds": t1 - t0,
        "iops": n / (t1 - t0),
        "lat_mean_ms": sum(lat) / n * 1e3 if n else 0.0,
        "lat_p50_ms": lat[n // 2] * 1e3 if n else 0.0,
        "lat_p99_ms": lat[min(n - 1, int(n * 0.99))] * 1e3 if n else 0.0,
        "t0": t0,
    }


# ---------------------------------------------------------------------------------------------
# tierfs (CLI contract: mount BACKING MOUNTPOINT --ram SIZE; umount MOUNTPOINT; stats --json)
# ---------------------------------------------------------------------------------------------
def tierfs_cmd(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tierfs", *args],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tierfs_available() -> tuple[bool, str]:
    try:
        r = tierfs_cmd("--help", timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, repr(e)
    return r.returncode == 0, (r.stdout + r.stderr).strip()[-500:]


def is_mounted(path: Path) -> bool:
    p = str(path)
    with open("/proc/mounts") as f:
        return any(line.split()[1] == p for line in f if len(line.split()) > 1)


class TierfsMount:
    """A fresh tierfs mount of BACKING for one phase (context manager); ``extra``: more
    ``tierfs mount`` arguments (--ssd, --write-tier, -o ...)."""

    def __init__(self, backing: Path, mountpoint: Path, ram: str, extra: Sequence[str] = ()) -> None:
        self.backing, self.mountpoint, self.ram = backing, mountpoint, ram
        self.extra = list(extra)
        self.stats: dict | str | None = None

    def __enter__(self) -> TierfsMount:
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        r = tierfs_cmd("mount", str(self.backing), str(self.mountpoint), "--ram", self.ram, *self.extra,
                       timeout=120)
        if r.returncode != 0 or not is_mounted(self.mountpoint):
            self._force_umount()
            raise RuntimeError(
                f"tierfs mount failed (rc={r.returncode}): {(r.stdout + r.stderr).strip()[-1500:]}"
            )
        return self

    def collect_stats(self) -> None:
        try:
            r = tierfs_cmd("stats", str(self.mountpoint), "--json", timeout=60)
            self.stats = json.loads(r.stdout) if r.returncode == 0 else (r.stdout + r.stderr)[-1000:]
        except (subprocess.TimeoutExpired, json.JSONDecodeError, OSError) as e:
            self.stats = f"stats failed: {e!r}"

    def __exit__(self, *exc) -> None:
        try:
            r = tierfs_cmd("umount", str(self.mountpoint), timeout=120)
            if r.returncode != 0:
                log(f"tierfs umount rc={r.returncode}: {(r.stdout + r.stderr).strip()[-500:]}")
        except subprocess.TimeoutExpired:
            log("tierfs umount timed out")
        self._force_umount()

    def _force_umount(self) -> None:
        for _ in range(20):
            if not is_mounted(self.mountpoint):
                return
            time.sleep(0.25)
        log(f"{self.mountpoint} still mounted after tierfs umount: fusermount3 -u")
        subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True)
        if is_mounted(self.mountpoint):
            subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True)


# ---------------------------------------------------------------------------------------------
def fill(paths: list[Path], shard_bytes: int) -> float:
    t0 = time.monotonic()
    for p in paths:
        with open(p, "wb", buffering=0) as f:
            left = shard_bytes
            while left > 0:
                n = min(left, 4 * MiB)
                f.write(os.urandom(n))
                left -= n
            os.fsync(f.fileno())
    os.sync()
    return time.monotonic() - t0


def markdown(res: dict) -> str:
    a = res["phases"]
    cfg = res["config"]
    L = []
    L.append(
        f"Emulated 7200 rpm disk ({cfg['disk_gib']} GiB; {res['model']}), "
        f"{cfg['shards']} shards x {cfg['shard_mib']} MiB, {cfg['block_kib']} KiB reads, "
        f"tierfs --ram {cfg['ram']}"
    )
    L.append("")
    L.append("| phase | readers | result | mean req (KiB) | model ms/req | disk busy | request sizes seen by the disk |")
    L.append("|---|---|---|---|---|---|---|")

    def row(name: str, key: str, unit: str) -> None:
        if key not in a:
            L.append(f"| {name} | | skipped | | | | |")
            return
        p = a[key]
        val = f"{p['mbps']:.1f} MB/s" if unit == "mbps" else f"{p['iops']:.0f} IOPS (p50 {p['lat_p50_ms']:.1f} ms)"
        rq = p.get("requests", {})
        L.append(
            f"| {name} | {p['readers']} | {val} | {rq.get('mean_read_kib', 0):.0f} | "
            f"{rq.get('mean_model_ms', 0):.2f} | {rq.get('disk_busy_frac', 0):.0%} | "
            f"{fmt_hist(rq.get('read_size_hist', {}))} |"
        )

    row("(a) sequential, 1 reader, direct", "seq1", "mbps")
    row("(b) sequential, N readers, direct", "seq8", "mbps")
    row("(c) sequential, N readers, tierfs", "tierfs8", "mbps")
    row("(d) random 4 KiB, direct", "rand_direct", "iops")
    row("(d) random 4 KiB, tierfs", "rand_tierfs", "iops")
    L.append("")
    L.append("| ratio | value |")
    L.append("|---|---|")
    for k, v in res["ratios"].items():
        L.append(f"| {k} | {v:.2f} |" if isinstance(v, (int, float)) else f"| {k} | {v} |")
    if res.get("errors") or res.get("notes"):
        L.append("")
        for e in res.get("notes", []):
            L.append(f"- note: {e}")
        for e in res["errors"]:
            L.append(f"- error: {e}")
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--shard-mib", type=int, default=256)
    ap.add_argument("--disk-gib", type=int, default=0, help="emulated disk size (default: 2x data, >= 2)")
    ap.add_argument("--block-kib", type=int, default=1024, help="read size of the sequential phases")
    ap.add_argument("--rand-seconds", type=float, default=10.0)
    ap.add_argument("--ram", default="64MiB", help="tierfs RAM tier (keep it below the data size)")
    ap.add_argument("--skip-tierfs", action="store_true")
    ap.add_argument("--plugin-args", default="", help="extra key=value for the disk model, e.g. 'prefetch=0'")
    ap.add_argument("--workdir", type=Path, default=None, help="default: a new dir under /tmp")
    ap.add_argument(
        "--nice",
        type=int,
        default=-10,
        help="niceness of the readers, the tierfs daemon and the disk emulator (default -10: "
        "other jobs on the machine delay the emulated disk's requests less)",
    )
    ap.add_argument("--json", action="store_true", help="print JSON on stdout (table goes to stderr)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("needs root (loop devices, mounts)")

    shard_bytes = args.shard_mib * MiB
    data_gib = args.shards * shard_bytes / (1 << 30)
    disk_gib = args.disk_gib or max(2, int(2 * data_gib + 0.999))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="emuhdd-bench."))
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.nice(args.nice - os.nice(0))  # inherited by the readers, tierfs and emuhdd.sh

    res: dict = {
        "config": {
            "shards": args.shards,
            "shard_mib": args.shard_mib,
            "disk_gib": disk_gib,
            "block_kib": args.block_kib,
            "rand_seconds": args.rand_seconds,
            "ram": args.ram,
            "plugin_args": args.plugin_args,
            "nice": args.nice,
            "workdir": str(workdir),
        },
        "phases": {},
        "ratios": {},
        "errors": [],
        "notes": [],
    }
    do_tierfs = not args.skip_tierfs
    if do_tierfs:
        ok, msg = tierfs_available()
        if not ok:
            res["notes"].append(f"tierfs not available (python -m tierfs --help failed): {msg[-300:]}")
            do_tierfs = False
    rig = Rig(workdir, disk_gib, args.plugin_args, args.nice)
    t_start = time.monotonic()
    seq_timeout = 60 + 4 * args.shards * shard_bytes / (5 * MB)
    try:
        mnt = rig.up()
        res["config"]["loop"] = rig.loopdev()
        with open(rig.reqlog) as f:
            head = f.readline()
        res["model"] = head.split(" start ", 1)[-1].strip() if " start " in head else "?"
        data = mnt / "shards"
        data.mkdir()
        paths = [data / f"shard{i:02d}.bin" for i in range(args.shards)]
        log(f"disk up at {mnt} ({rig.loopdev()}); writing {args.shards} x {args.shard_mib} MiB")
        rig.nodelay(True)  # fill at RAM speed; the model still tracks the head
        res["fill_seconds"] = fill(paths, shard_bytes)
        rig.nodelay(False)
        res["layout"] = {p.name: file_layout(p) for p in paths}

        def phase(key: str, fn, *fargs) -> None:
            rig.dropcache()
            mark = rig.log_mark()
            log(f"phase {key} ...")
            r = fn(*fargs)
            r["requests"] = request_stats(rig.requests_since(mark), r["seconds"])
            r.pop("t0", None)
            res["phases"][key] = r
            unit = f"{r['mbps']:.1f} MB/s" if "mbps" in r else f"{r['iops']:.1f} IOPS"
            log(f"phase {key}: {unit}; disk saw {fmt_hist(r['requests']['read_size_hist'])}")

        block = args.block_kib * 1024
        phase("seq1", seq_phase, paths[:1], block, seq_timeout)
        phase("seq8", seq_phase, paths, block, seq_timeout)
        tmnt = workdir / "tierfs"
        if do_tierfs:
            try:
                with TierfsMount(mnt / "shards", tmnt, args.ram) as tm:
                    phase("tierfs8", seq_phase, [tmnt / p.name for p in paths], block, seq_timeout)
                    tm.collect_stats()
                    res["phases"]["tierfs8"]["tierfs_stats"] = tm.stats
            except Exception as e:  # report, keep measuring
                res["errors"].append(f"tierfs8: {e}")
                log(f"tierfs8 failed: {e}")
        rto = args.rand_seconds + 120
        phase("rand_direct", rand_phase, paths, 4096, args.rand_seconds, rto)
        if do_tierfs:
            try:
                with TierfsMount(mnt / "shards", tmnt, args.ram) as tm:
                    phase("rand_tierfs", rand_phase, [tmnt / p.name for p in paths], 4096, args.rand_seconds, rto)
                    tm.collect_stats()
                    res["phases"]["rand_tierfs"]["tierfs_stats"] = tm.stats
            except Exception as e:
                res["errors"].append(f"rand_tierfs: {e}")
                log(f"rand_tierfs failed: {e}")
    except BaseException as e:
        res["errors"].append(f"aborted: {e!r}")
        log(f"aborted: {e!r}")
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        try:
            rig.down()
        except Exception as e:
            res["errors"].append(f"teardown: {e}")
            log(f"teardown failed: {e}; run: {EMUHDD} down {workdir}")
        with open("/proc/mounts") as f:
            busy = any(str(workdir) in line for line in f)
        if args.workdir is None and not res["errors"] and not busy:
            shutil.rmtree(workdir, ignore_errors=True)
        elif busy:
            log(f"something is still mounted under {workdir}; left it in place")

    ph = res["phases"]

    def ratio(name: str, num: str, den: str, key: str) -> None:
        if num in ph and den in ph and ph[den][key] > 0:
            res["ratios"][name] = ph[num][key] / ph[den][key]

    ratio("seq8 direct / seq1", "seq8", "seq1", "mbps")
    ratio("seq8 tierfs / seq8 direct", "tierfs8", "seq8", "mbps")
    ratio("seq8 tierfs / seq1", "tierfs8", "seq1", "mbps")
    ratio("rand IOPS tierfs / direct", "rand_tierfs", "rand_direct", "iops")
    res["total_seconds"] = time.monotonic() - t_start

    table = markdown(res)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps(res, indent=2))
    else:
        print(table)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
