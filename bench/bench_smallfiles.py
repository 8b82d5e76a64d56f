#!/usr/bin/env python3
"""Small files and metadata: direct (tmpfs) vs bindfs vs tierfs over the same tmpfs directory,
in one run, kernel readahead 1 MiB on both FUSE mounts.

Phases (figures in files/s or seconds; each FUSE phase runs on a fresh mount):

  epoch     a shuffled epoch over --files files of ~110 KiB (80-140 KiB, ImageNet-like, in 100
            class directories) read whole by --procs worker processes (open, read to EOF,
            close), three times per mount: ``first`` (fresh mount: for tierfs every file is a
            miss, backing -> RAM tier), ``dropped`` (the mount's page cache dropped with
            POSIX_FADV_DONTNEED on every file, not timed: for tierfs, RAM tier hits) and
            ``warm`` (right after: the page cache holds the files).
  walk      ``os.walk`` + ``lstat`` of every file of the epoch's tree on a fresh mount.
  rm        ``rm -rf`` of a tree of --rm-files empty files (40 directories) on a fresh mount.
  tar       ``tar -xf`` of a --tar-files-file tar (1-16 KiB files, 100 directories) into the
            mount; for tierfs also the ``tierfs flush`` after it (write-back), reported apart.
  cp        ``cp -a`` of a tree of --cp-files files (1-64 KiB, 20 directories) into the mount.
  latency   where a small-file read's time goes: after one epoch (tierfs: into the RAM tier) and
            a page-cache drop, one process reads the epoch's files in turn, timing each
            ``open``, the reads and ``close``; for tierfs also the requests the daemon answered
            and the mean time inside each kind of handler (``stats.json`` ``fuse.requests`` and
            ``fuse.request_seconds``). Run it alone: ``--phases latency``.

Needs root (mounts, /sys/class/bdi/*/read_ahead_kb) and bindfs. Run from the repository root:

    sudo .venv/bin/python bench/bench_smallfiles.py            # full sizes (minutes)
    sudo .venv/bin/python bench/bench_smallfiles.py --quick    # small sizes, ~1 minute
    sudo .venv/bin/python bench/bench_smallfiles.py --phases epoch,walk --json

Ratios compare figures of one run; the load average is printed beside them (a shared machine
makes every figure noisy).
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
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KiB = 1024
PHASES = ("epoch", "walk", "rm", "tar", "cp")  # and "latency", on request
TARGETS = {  # (figure, baseline, minimum ratio) from the small-file goals in docs/benchmarks.md
    "epoch first": ("bindfs", 0.7),
    "epoch dropped": ("bindfs", 1.2),
    "epoch warm": ("direct", 0.5),
    "walk": ("bindfs", 1.0),
    "rm": ("bindfs", 1.0),
    "tar": ("bindfs", 1.0),
    "cp": ("bindfs", 1.0),
}


def log(msg: str) -> None:
    print(f"[bench_smallfiles {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def is_mounted(path: Path) -> bool:
    with open("/proc/mounts") as f:
        return any(len(line.split()) > 1 and line.split()[1] == str(path) for line in f)


def set_readahead(mnt: Path, kb: int = 1024) -> None:
    st = os.stat(mnt)
    try:
        Path(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb").write_text(str(kb))
    except OSError as e:
        log(f"cannot set read_ahead_kb on {mnt}: {e}")


def unmount(mnt: Path) -> None:
    for cmd in (["fusermount3", "-u", str(mnt)], ["umount", "-l", str(mnt)]):
        if not is_mounted(mnt):
            return
        subprocess.run(cmd, capture_output=True)


@contextmanager
def mounted(kind: str, back: Path, tierfs_args: list[str]) -> Iterator[Path]:
    """A fresh mount of ``back`` (``direct`` yields ``back`` itself); always unmounted."""
    if kind == "direct":
        yield back
        return
    mnt = Path(tempfile.mkdtemp(prefix=f"bench-{kind}-"))
    try:
        if kind == "bindfs":
            subprocess.run(["bindfs", str(back), str(mnt)], check=True)
        else:
            r = subprocess.run([sys.executable, "-m", "tierfs", "mount", str(back), str(mnt), *tierfs_args],
                               cwd=REPO, capture_output=True, text=True, timeout=120)
            if r.returncode != 0 or not is_mounted(mnt):
                raise RuntimeError(f"tierfs mount failed: {(r.stdout + r.stderr)[-1500:]}")
        set_readahead(mnt)
        yield mnt
    finally:
        if kind == "tierfs" and is_mounted(mnt):
            # --flush: nothing the run wrote is left in a RAM tier under /dev/shm
            subprocess.run([sys.executable, "-m", "tierfs", "umount", "--flush", str(mnt)], cwd=REPO,
                           capture_output=True, timeout=600)
        unmount(mnt)
        try:
            mnt.rmdir()
        except OSError:
            pass


def tierfs_flush(mnt: Path) -> float:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "tierfs", "flush", str(mnt), "--timeout", "900"], cwd=REPO,
                       capture_output=True, text=True, timeout=1000)
    if r.returncode:
        raise RuntimeError(f"tierfs flush {mnt} exited {r.returncode}: {r.stdout}{r.stderr}")
    return time.perf_counter() - t


# -- data ---------------------------------------------------------------------------------------
def make_tree(root: Path, n: int, dirs: int, lo: int, hi: int, seed: int) -> list[str]:
    """``n`` files of ``lo``..``hi`` bytes in ``dirs`` directories; their relative paths."""
    rnd = random.Random(seed)
    blob = os.urandom(hi + 4096)
    names = []
    for d in range(dirs):
        (root / f"c{d:04d}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        rel = f"c{i % dirs:04d}/f{i:07d}.bin"
        k = rnd.randrange(4096)
        (root / rel).write_bytes(blob[k:k + rnd.randint(lo, hi)])
        names.append(rel)
    return names


# -- epoch --------------------------------------------------------------------------------------
def _reader(paths: list[str], barrier, out) -> None:  # type: ignore[no-untyped-def]
    buf = bytearray(256 * KiB)
    view = memoryview(buf)
    barrier.wait()
    t0 = time.perf_counter()
    nbytes = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while (k := os.readv(fd, [view])) > 0:
                nbytes += k
        finally:
            os.close(fd)
    out.put((t0, time.perf_counter(), nbytes))


def epoch(root: Path, names: list[str], procs: int, seed: int) -> float:
    """files/s of one shuffled epoch read by ``procs`` processes."""
    order = [str(root / n) for n in names]
    random.Random(seed).shuffle(order)
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_reader, args=(order[i::procs], barrier, out)) for i in range(procs)]
    for p in ps:
        p.start()
    res = [out.get(timeout=1800) for _ in ps]
    for p in ps:
        p.join()
    return len(order) / (max(r[1] for r in res) - min(r[0] for r in res))


def _drop_some(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_page_cache(root: Path, names: list[str], procs: int) -> None:
    paths = [str(root / n) for n in names]
    ctx = mp.get_context("fork")
    ps = [ctx.Process(target=_drop_some, args=(paths[i::procs],)) for i in range(procs)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()


# -- metadata -----------------------------------------------------------------------------------
def walk_lstat(root: Path) -> tuple[float, int]:
    t = time.perf_counter()
    n = 0
    for d, _, files in os.walk(root):
        for f in files:
            os.lstat(os.path.join(d, f))
            n += 1
    return time.perf_counter() - t, n


def latency(root: Path, names: list[str], mnt: Path | None) -> dict:
    """Median microseconds of open, read-to-EOF and close of each file, one process; for a
    tierfs mount ``mnt``, requests and mean microseconds inside each handler meanwhile."""
    import statistics

    def stats() -> dict:
        return json.loads((mnt / ".tierfs" / "stats.json").read_text())["fuse"] if mnt else {}

    before = stats()
    buf = bytearray(256 * KiB)
    view = memoryview(buf)
    lo, lr, lc = [], [], []
    t_all = time.perf_counter()
    for n in names:
        t0 = time.perf_counter()
        fd = os.open(root / n, os.O_RDONLY)
        t1 = time.perf_counter()
        while os.readv(fd, [view]) > 0:
            pass
        t2 = time.perf_counter()
        os.close(fd)
        lc.append(time.perf_counter() - t2)
        lo.append(t1 - t0)
        lr.append(t2 - t1)
    t_all = time.perf_counter() - t_all
    out: dict = {"files_per_s": len(names) / t_all, "open_us": statistics.median(lo) * 1e6,
                 "read_us": statistics.median(lr) * 1e6, "close_us": statistics.median(lc) * 1e6}
    if mnt:
        after = stats()
        for op, k in after["requests"].items():
            dn = k - before["requests"].get(op, 0)
            if dn and op != "flush":
                dt = after.get("request_seconds", {}).get(op, 0.0) - before.get("request_seconds", {}).get(op, 0.0)
                out[f"{op} requests"] = dn
                out[f"{op} handler_us"] = dt / dn * 1e6
    return out


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-smallfiles-", dir="/dev/shm"))
    back = work / "back"
    src = work / "src"
    back.mkdir()
    src.mkdir()
    res: dict = {"loadavg_start": open("/proc/loadavg").read().strip(), "args": vars(args)}
    kinds = [k for k in ("direct", "bindfs", "tierfs") if k in args.kinds.split(",")]
    phases = args.phases.split(",")
    fig: dict[str, dict[str, float]] = {}
    try:
        if "latency" in phases:
            log(f"making {args.files} files of 80-140 KiB")
            names = make_tree(back / "lat", args.files, 100, 80 * KiB, 140 * KiB, 1)
            for k in kinds:
                with mounted(k, back, args.tierfs_args) as m:
                    root = m / "lat"
                    epoch(root, names, args.procs, 2)
                    if k != "direct":
                        drop_page_cache(root, names, args.procs)
                    log(f"latency {k}")
                    res.setdefault("latency", {})[k] = latency(root, names, m if k == "tierfs" else None)
            shutil.rmtree(back / "lat")
        if "epoch" in phases or "walk" in phases:
            log(f"making {args.files} files of 80-140 KiB")
            names = make_tree(back / "ds", args.files, 100, 80 * KiB, 140 * KiB, 1)
        if "epoch" in phases:
            for k in kinds:
                with mounted(k, back, args.tierfs_args) as m:
                    root = m / "ds"
                    log(f"epoch {k}")
                    fig.setdefault("epoch first", {})[k] = epoch(root, names, args.procs, 2)
                    if k != "direct":
                        drop_page_cache(root, names, args.procs)
                    fig.setdefault("epoch dropped", {})[k] = epoch(root, names, args.procs, 3)
                    fig.setdefault("epoch warm", {})[k] = epoch(root, names, args.procs, 4)
                    if k == "tierfs":
                        res["tierfs_stats_after_epochs"] = json.loads((m / ".tierfs" / "stats.json").read_text())
        if "walk" in phases:
            for k in kinds:
                with mounted(k, back, args.tierfs_args) as m:
                    log(f"walk {k}")
                    dt, n = walk_lstat(m / "ds")
                    assert n == args.files, (k, n)
                    fig.setdefault("walk", {})[k] = dt
        if "epoch" in phases or "walk" in phases:
            shutil.rmtree(back / "ds")
        if "rm" in phases:
            for k in kinds:
                log(f"making {args.rm_files} empty files for rm -rf ({k})")
                make_tree(back / "rmtree", args.rm_files, 40, 0, 0, 5)
                with mounted(k, back, args.tierfs_args) as m:
                    log(f"rm -rf {k}")
                    fig.setdefault("rm", {})[k] = timed(
                        lambda m=m: subprocess.run(["rm", "-rf", str(m / "rmtree")], check=True))
                assert not (back / "rmtree").exists()
        if "tar" in phases:
            log(f"making a tar of {args.tar_files} files")
            tdir = src / "tar"
            make_tree(tdir, args.tar_files, 100, 1 * KiB, 16 * KiB, 6)
            tarpath = work / "shard.tar"
            with tarfile.open(tarpath, "w") as tf:
                tf.add(tdir, arcname="shard")
            for k in kinds:
                with mounted(k, back, args.tierfs_args) as m:
                    (m / "tarx").mkdir()
                    log(f"tar -x {k}")
                    fig.setdefault("tar", {})[k] = timed(lambda m=m: subprocess.run(
                        ["tar", "-xf", str(tarpath), "-C", str(m / "tarx")], check=True))
                    if k == "tierfs":
                        fig.setdefault("tar + flush", {})[k] = fig["tar"][k] + tierfs_flush(m)
                shutil.rmtree(back / "tarx")
        if "cp" in phases:
            log(f"making a tree of {args.cp_files} files for cp -a")
            cdir = src / "cp"
            make_tree(cdir, args.cp_files, 20, 1 * KiB, 64 * KiB, 7)
            for k in kinds:
                with mounted(k, back, args.tierfs_args) as m:
                    log(f"cp -a {k}")
                    fig.setdefault("cp", {})[k] = timed(lambda m=m: subprocess.run(
                        ["cp", "-a", str(cdir), str(m / "cpdst")], check=True))
                    if k == "tierfs":
                        fig.setdefault("cp + flush", {})[k] = fig["cp"][k] + tierfs_flush(m)
                shutil.rmtree(back / "cpdst")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["figures"] = fig
    res["loadavg_end"] = open("/proc/loadavg").read().strip()
    return res


def table(res: dict, args: argparse.Namespace) -> str:
    rows = ["| workload | unit | direct | bindfs | tierfs | tierfs / baseline (target) |",
            "|---|---|---:|---:|---:|---|"]
    labels = {
        "epoch first": f"epoch, {args.files} files ~110 KiB, {args.procs} procs, first (misses)",
        "epoch dropped": "same, page cache dropped (tierfs: RAM tier hits)",
        "epoch warm": "same, warm page cache",
        "walk": f"os.walk + lstat of {args.files} files",
        "rm": f"rm -rf of {args.rm_files} files",
        "tar": f"tar -x of {args.tar_files} files into the mount",
        "tar + flush": "same + tierfs flush (write-back)",
        "cp": f"cp -a of {args.cp_files} files into the mount",
        "cp + flush": "same + tierfs flush (write-back)",
    }
    for key, row in res["figures"].items():
        secs = not key.startswith("epoch")
        unit = "s" if secs else "files/s"

        def cell(k: str, row: dict = row, secs: bool = secs) -> str:
            v = row.get(k)
            return "" if v is None else (f"{v:.2f}" if secs else f"{v:,.0f}")

        ratio = ""
        if key in TARGETS and "tierfs" in row:
            base, target = TARGETS[key]
            if base in row:
                r = row[base] / row["tierfs"] if secs else row["tierfs"] / row[base]
                ratio = f"{r:.2f}x {base} ({'>=' if r >= target else 'BELOW'} {target})"
        rows.append(f"| {labels.get(key, key)} | {unit} | {cell('direct')} | {cell('bindfs')} | {cell('tierfs')} | {ratio} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (2000 files; seconds to a minute)")
    p.add_argument("--files", type=int, default=8000)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--rm-files", type=int, default=40000)
    p.add_argument("--tar-files", type=int, default=10000)
    p.add_argument("--cp-files", type=int, default=4000)
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--kinds", default="direct,bindfs,tierfs")
    p.add_argument("--ram", default="2GiB", help="tierfs RAM tier (holds the epoch's files)")
    p.add_argument("--tierfs-arg", action="append", default=[], dest="extra",
                   help="extra argument for tierfs mount (repeatable), e.g. --tierfs-arg=-o --tierfs-arg=attr_timeout=0")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.files, args.rm_files, args.tar_files, args.cp_files = 2000, 8000, 2500, 1000
    args.tierfs_args = ["--ram", args.ram, *args.extra]
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=1, default=str))
    else:
        print(f"load average {res['loadavg_start']} -> {res['loadavg_end']}; "
              f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
        print(table(res, args))
        for k, lat in res.get("latency", {}).items():
            print(f"latency {k}: " + ", ".join(f"{n} {v:,.1f}" if isinstance(v, float) else f"{n} {v}"
                                             for n, v in lat.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
