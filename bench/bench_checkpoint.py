#!/usr/bin/env python3
"""Checkpoint benchmark: torch.save through a writable tierfs mount, and its write-back.

Measures, in one run:

  (1) local   `torch.save` of a state dict (default 8 x 128 MiB float32 = 1 GiB) into a tierfs
              mount whose write tier is an SSD tier in a directory on the local disk (RAM tier
              small), versus directly into a directory of the same file system.  For each run:
              the time until `torch.save(sd, f)` returns (plus `f.flush()`: every byte handed to
              the kernel), and the time until `fsync` + `close` return.  Best of `--runs`; runs
              alternate direct / mount, and between runs the write tier is emptied (`tierfs
              flush`, then the file is deleted) and `sync` is run.
  (2) hdd     on the emulated 7200 rpm disk (bench/emuhdd.sh, backing store = its ext4): N
              processes streaming different shards (1 MiB reads) through a fresh tierfs mount
                (a) alone,
                (b) while one more process `torch.save`s a 1 GiB checkpoint into the same mount
                    (started at the same moment as the readers, after a common barrier) and
                    tierfs writes it back (`-o writeback_deadline=--deadline`).
              Reports the readers' aggregate throughput (b)/(a), when the write-back finished
              (close -> `written_files` in the stats, polled every 0.2 s) against its deadline,
              the write-back throughput, how much of it overlapped the readers, the requests
              the disk saw, and the `scheduler` / `writeback` stats of each mount.
              Fresh mount, fresh SSD tier directory and `emuhdd.sh dropcache` before (a) and (b).

Reuses bench/bench_hdd.py (the emulated disk, the readers, tierfs mount/umount, request stats).
Needs root and torch.  Tears everything down in a `finally`.  Run e.g.

    sudo /tmp/venv-probe/bin/python bench/bench_checkpoint.py            # ~3-4 minutes
    sudo /tmp/venv-probe/bin/python bench/bench_checkpoint.py --tensor-mib 16 --shard-mib 32 --runs 2
    sudo /tmp/venv-probe/bin/python bench/bench_checkpoint.py --skip-hdd --json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import bench_hdd  # noqa: E402
from bench_hdd import MB, MiB, Rig, TierfsMount, request_stats, tierfs_cmd  # noqa: E402

try:
    from tierfs_hints import wire  # the control-file names behind `tierfs stats --json`
except ImportError:  # pragma: no cover
    wire = None

GiB = 1 << 30


def log(msg: str) -> None:
    print(f"[bench_checkpoint {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return open("/proc/loadavg").read().strip()


# ---------------------------------------------------------------------------------------------
# tierfs helpers
# ---------------------------------------------------------------------------------------------


def read_stats(mnt: Path) -> dict:
    """The document `tierfs stats MNT --json` prints, read from the control file directly
    (cheap enough to poll); falls back to the CLI."""
    if wire is not None:
        with open(mnt / wire.CONTROL_DIR / wire.STATS_FILE, "rb") as f:
            return json.loads(f.read())
    r = tierfs_cmd("stats", str(mnt), "--json", timeout=60)
    return json.loads(r.stdout)


def flush(mnt: Path, timeout: float = 300) -> float:
    t0 = time.monotonic()
    r = tierfs_cmd("flush", str(mnt), "--timeout", str(int(timeout)), timeout=timeout + 30)
    if r.returncode != 0:
        raise RuntimeError(
            f"tierfs flush failed (rc={r.returncode}): {(r.stdout + r.stderr).strip()[-800:]}"
        )
    return time.monotonic() - t0


# ---------------------------------------------------------------------------------------------
# the state dict and one save
# ---------------------------------------------------------------------------------------------
def make_state_dict(n: int, mib: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    numel = mib * MiB // 4
    return {
        f"layer{i:02d}.weight": torch.rand(numel, generator=g, dtype=torch.float32)
        for i in range(n)
    }


def timed_save(sd: dict, path: Path) -> dict:
    """torch.save into an open file; times relative to the open (monotonic, system-wide)."""
    import torch

    t0 = time.monotonic()
    f = open(path, "wb")
    torch.save(sd, f)
    f.flush()  # torch.save returned and every byte is in the kernel's hands
    t_save = time.monotonic()
    os.fsync(f.fileno())
    t_fsync = time.monotonic()
    f.close()
    t_close = time.monotonic()
    return {
        "t_open": t0,
        "t_close": t_close,
        "save_s": t_save - t0,
        "fsync_s": t_fsync - t_save,
        "close_s": t_close - t_fsync,
        "save_fsync_close_s": t_close - t0,
        "bytes": os.stat(path).st_size,
    }


# ---------------------------------------------------------------------------------------------
# (1) local: mount vs direct
# ---------------------------------------------------------------------------------------------
def local_part(args, sd: dict, work: Path, res: dict) -> None:
    p1 = work / "local"
    back, ssd, mnt, direct = p1 / "back", p1 / "ssd", p1 / "mnt", p1 / "direct"
    for d in (back, ssd, direct):
        d.mkdir(parents=True, exist_ok=True)
    ssd.chmod(0o700)  # tierfs refuses a tier directory other users can reach
    out: dict = {"direct": [], "tierfs": [], "flush_s": [], "writeback": [], "fs": ""}
    try:
        out["fs"] = (
            subprocess.run(
                ["df", "--output=source,fstype", str(p1)], capture_output=True, text=True
            )
            .stdout.split("\n")[1]
            .strip()
        )
    except (OSError, IndexError):
        pass
    res["local"] = out
    extra = ["--ssd", f"{ssd}:{args.ssd_size}", "--write-tier", "ssd"]
    with TierfsMount(back, mnt, args.ram, extra) as m:
        for i in range(args.runs):
            for kind in ("direct", "tierfs"):
                target = (direct if kind == "direct" else mnt) / "ckpt.pt"
                os.sync()
                log(f"local run {i + 1}/{args.runs}: {kind} ...")
                r = timed_save(sd, target)
                r.pop("t_open"), r.pop("t_close")
                out[kind].append(r)
                log(
                    f"  {kind}: save {r['save_s']:.2f} s ({r['bytes'] / r['save_s'] / MB:.0f} MB/s), "
                    f"+fsync+close {r['save_fsync_close_s']:.2f} s"
                )
                if kind == "tierfs":
                    out["flush_s"].append(flush(mnt))
                    wb = read_stats(mnt)["writeback"]
                    out["writeback"].append(wb)
                    target.unlink()
                    wb2 = read_stats(mnt)["writeback"]
                    if wb2["dirty_files"] or wb2["dirty_bytes"]:
                        res["notes"].append(
                            f"local run {i + 1}: write tier not empty after flush+delete: {wb2}"
                        )
                else:
                    target.unlink()
        m.collect_stats()
        out["tierfs_stats"] = m.stats
    left = (
        sorted(str(p.relative_to(ssd)) for p in (ssd / "dirty").glob("*"))
        if (ssd / "dirty").exists()
        else []
    )
    if left:
        res["notes"].append(
            f"local: files left in the write tier's dirty/ after umount: {left[:5]}"
        )

    def best(kind: str, key: str) -> float:
        return min(r[key] for r in out[kind])

    nbytes = out["tierfs"][0]["bytes"]
    out["best"] = {
        k: {"save_s": best(k, "save_s"), "save_fsync_close_s": best(k, "save_fsync_close_s")}
        for k in ("direct", "tierfs")
    }
    for k in ("direct", "tierfs"):
        b = out["best"][k]
        b["save_mbps"] = nbytes / b["save_s"] / MB
        b["save_fsync_close_mbps"] = nbytes / b["save_fsync_close_s"] / MB
    res["ratios"]["local save throughput tierfs / direct"] = (
        out["best"]["direct"]["save_s"] / out["best"]["tierfs"]["save_s"]
    )
    res["ratios"]["local save+fsync+close throughput tierfs / direct"] = (
        out["best"]["direct"]["save_fsync_close_s"] / out["best"]["tierfs"]["save_fsync_close_s"]
    )


# ---------------------------------------------------------------------------------------------
# (2) hdd: readers alone, then readers + checkpoint save and write-back
# ---------------------------------------------------------------------------------------------
# Globals set in the parent before run_readers forks the workers (inherited through fork).
_CTX: dict = {}


def _worker(kind: str, arg, barrier, q) -> None:
    """One of: a reader (bench_hdd._seq_reader), the saver, or the stats poller."""
    c = _CTX
    if kind == "read":
        try:
            bench_hdd._seq_reader(arg, c["block"], barrier, q)
        finally:
            with c["readers_done"].get_lock():
                c["readers_done"].value += 1
        return
    if kind == "save":
        try:
            barrier.wait()
            r = timed_save(c["sd"], Path(arg))
            c["saver_done"].value = 1
            q.put(("ok", "save", r, r["t_open"], r["t_close"]))
        except BaseException as e:
            c["saver_done"].value = 1
            q.put(("err", "save", repr(e), 0.0, 0.0))
        return
    # kind == "poll": sample the stats until the readers are done and, if a checkpoint is being
    # written, until it is written back (or the hard limit passes)
    try:
        mnt, backing_file, limit_s = arg
        barrier.wait()
        t0 = time.monotonic()
        samples = []
        while True:
            t = time.monotonic()
            try:
                doc = read_stats(Path(mnt))
                wb, sc = doc.get("writeback", {}), doc.get("scheduler", {})
            except (OSError, ValueError) as e:
                wb, sc = {"error": repr(e)}, {}
            samples.append(
                {
                    "t": t,
                    "dirty_files": wb.get("dirty_files"),
                    "dirty_bytes": wb.get("dirty_bytes"),
                    "writing": wb.get("writing"),
                    "written_files": wb.get("written_files"),
                    "written_bytes": wb.get("written_bytes"),
                    "next_deadline_s": wb.get("next_deadline_s"),
                    "throughput_bytes_per_s": wb.get("throughput_bytes_per_s"),
                    "deadline_escalations": sc.get("deadline_escalations"),
                    "backing_bytes_read": sc.get("backing_bytes_read"),
                    "backing_bytes_written": sc.get("backing_bytes_written"),
                    "backing_file": bool(backing_file) and os.path.exists(backing_file),
                }
            )
            readers = c["readers_done"].value >= c["nreaders"]
            ckpt = (not backing_file) or (
                c["saver_done"].value
                and (wb.get("written_files") or 0) >= 1
                and not wb.get("dirty_files")
            )
            if (readers and ckpt) or t - t0 > limit_s:
                break
            time.sleep(0.2)
        q.put(("ok", "poll", samples, t0, time.monotonic()))
    except BaseException as e:
        q.put(("err", "poll", repr(e), 0.0, 0.0))


def disk_window(reqs: list, rel, a: float, b: float) -> dict:
    """What the disk model served between a and b seconds (rel() maps the log's wall times)."""
    win = [r for r in reqs if a <= rel(r[0]) <= b]
    w = [r for r in win if r[1] in ("W", "Z")]
    return {
        "seconds": b - a,
        "read_bytes": sum(r[3] for r in win if r[1] == "R"),
        "write_bytes": sum(r[3] for r in w),
        "writes": len(w),
        "mean_write_kib": sum(r[3] for r in w) / len(w) / 1024 if w else 0.0,
        "busy_frac": sum(max(r[4], r[5]) for r in win if r[1] != "F") / (b - a) if b > a else 0.0,
    }


def hdd_phase(
    key: str, rig: Rig, args, disk: Path, work: Path, shards: list[str], sd, res: dict
) -> None:
    ckpt = key == "with_ckpt"
    ssd = work / f"ssd-{key}"
    if ssd.exists():
        shutil.rmtree(ssd)
    ssd.mkdir(mode=0o700)
    tmnt = work / "tierfs"
    extra = [
        "--ssd",
        f"{ssd}:{args.ssd_size}",
        "--write-tier",
        "ssd",
        "-o",
        f"writeback_deadline={args.deadline:g}",
    ]
    (disk / "ckpt" / "ckpt.pt").unlink(missing_ok=True)
    rig.dropcache()
    ph: dict = {"key": key, "load_before": loadavg()}
    res["hdd"][key] = ph
    with TierfsMount(disk, tmnt, args.ram, extra) as m:
        nreaders = len(shards)
        ctx = mp.get_context("fork")
        _CTX.clear()
        _CTX.update(
            block=args.block_kib * 1024,
            sd=sd,
            nreaders=nreaders,
            readers_done=ctx.Value("i", 0),
            saver_done=ctx.Value("i", 0),
        )
        argsets = [("read", str(tmnt / "shards" / s)) for s in shards]
        limit = args.deadline + 120 if ckpt else 600
        argsets.append(("poll", (str(tmnt), str(disk / "ckpt" / "ckpt.pt") if ckpt else "", limit)))
        if ckpt:
            argsets.append(("save", str(tmnt / "ckpt" / "ckpt.pt")))
        mark = rig.log_mark()
        wall0, mono0 = time.time(), time.monotonic()
        log(
            f"hdd phase {key}: {nreaders} readers{' + torch.save of the checkpoint' if ckpt else ''} ..."
        )
        timeout = 120 + 4 * nreaders * args.shard_mib * MiB / (5 * MB) + (limit if ckpt else 0)
        results = bench_hdd.run_readers(_worker, argsets, timeout)
        m.collect_stats()
        ph["tierfs_stats"] = m.stats
    reads = [r for r in results if r[1] not in ("save", "poll")]
    poll = next(r for r in results if r[1] == "poll")
    samples = poll[2]
    t0 = min(r[3] for r in reads)
    t1 = max(r[4] for r in reads)
    total = sum(r[2] for r in reads)
    per = [r[2] / (r[4] - r[3]) / MB for r in reads]
    ph.update(
        readers=nreaders,
        read_bytes=total,
        read_seconds=t1 - t0,
        read_mbps=total / (t1 - t0) / MB,
        per_reader_mbps_min=min(per),
        per_reader_mbps_max=max(per),
    )
    end = samples[-1]["t"] if samples else t1
    reqs = rig.requests_since(mark)
    ph["requests"] = request_stats(reqs, end - t0)

    # disk requests inside the readers' window (requests.log has wall-clock times)
    def rel(wall: float) -> float:  # wall-clock time of the log -> seconds after the readers' start
        return wall - wall0 + mono0 - t0

    ph["disk_in_reader_window"] = disk_window(reqs, rel, 0.0, t1 - t0)
    wr = [r for r in reqs if r[1] in ("W", "Z")]
    big = [r for r in wr if r[3] >= 256 * 1024]
    ph["disk_writes"] = {
        "bytes": sum(r[3] for r in wr),
        "first_s": rel(wr[0][0]) if wr else None,
        "first_256k_s": rel(big[0][0]) if big else None,
        "last_s": rel(wr[-1][0]) if wr else None,
    }
    ph["samples"] = [{**s, "t": round(s["t"] - t0, 3)} for s in samples]
    if ckpt:
        sv = next(r for r in results if r[1] == "save")[2]
        close = sv["t_close"]
        first_wb = next((s["t"] for s in samples if (s["backing_bytes_written"] or 0) > 0), None)
        written = next((s["t"] for s in samples if (s["written_files"] or 0) >= 1), None)
        visible = next((s["t"] for s in samples if s["backing_file"]), None)
        at_end = min(samples, key=lambda s: abs(s["t"] - t1)) if samples else {}
        nb = sv["bytes"]
        ck = {
            "bytes": nb,
            "save_started_s": sv["t_open"] - t0,
            "save_s": sv["save_s"],
            "save_fsync_close_s": sv["save_fsync_close_s"],
            "save_mbps": nb / sv["save_s"] / MB,
            "closed_at_s": close - t0,
            "deadline_s": args.deadline,
            "first_backing_write_after_close_s": (first_wb - close)
            if first_wb is not None
            else None,
            "written_after_close_s": (written - close) if written is not None else None,
            "backing_file_visible_after_close_s": (visible - close)
            if visible is not None
            else None,
            "readers_done_after_close_s": t1 - close,
            "writeback_bytes_written_when_readers_done": at_end.get("backing_bytes_written"),
            "stats_throughput_bytes_per_s": samples[-1].get("throughput_bytes_per_s")
            if samples
            else None,
            "deadline_escalations": samples[-1].get("deadline_escalations") if samples else None,
        }
        ck["met_deadline"] = written is not None and (written - close) <= args.deadline
        if written is not None:
            ck["writeback_mbps_close_to_written"] = nb / (written - close) / MB
            if first_wb is not None and written > first_wb:
                ck["writeback_mbps_first_write_to_written"] = nb / (written - first_wb) / MB
        if written is not None:
            ck["disk_close_to_written"] = disk_window(reqs, rel, close - t0, written - t0)
        ph["checkpoint"] = ck
        msg = (
            f"written {ck['written_after_close_s']:.1f} s after close"
            if written is not None
            else "NOT written back when polling stopped"
        )
        log(
            f"hdd phase {key}: readers {ph['read_mbps']:.1f} MB/s; checkpoint saved in {sv['save_s']:.1f} s, {msg}"
        )
    else:
        log(f"hdd phase {key}: readers {ph['read_mbps']:.1f} MB/s")


def hdd_part(args, sd, work: Path, res: dict) -> None:
    data_bytes = args.shards * args.shard_mib * MiB
    # as bench_hdd.py by default (4 GiB for 8 x 256 MiB): shards + checkpoint fill at most 3/4 of it
    disk_gib = args.disk_gib or max(
        4, -(-4 * (data_bytes + args.tensors * args.tensor_mib * MiB) // (3 * GiB))
    )
    res["hdd"] = {"disk_gib": disk_gib}
    rig = Rig(work / "emuhdd", disk_gib, args.plugin_args, args.nice)
    (work / "emuhdd").mkdir(exist_ok=True)
    try:
        disk = rig.up()
        with open(rig.reqlog) as f:
            head = f.readline()
        res["hdd"]["model"] = head.split(" start ", 1)[-1].strip() if " start " in head else "?"
        (disk / "shards").mkdir()
        (disk / "ckpt").mkdir()
        paths = [disk / "shards" / f"shard{i:02d}.bin" for i in range(args.shards)]
        log(f"emulated disk up at {disk}; writing {args.shards} x {args.shard_mib} MiB (no delay)")
        rig.nodelay(True)
        res["hdd"]["fill_seconds"] = bench_hdd.fill(paths, args.shard_mib * MiB)
        rig.nodelay(False)
        names = [p.name for p in paths]
        for key in ("no_ckpt", "with_ckpt"):
            try:
                hdd_phase(key, rig, args, disk, work, names, sd, res)
            except Exception as e:
                res["errors"].append(f"hdd {key}: {e!r}")
                log(f"hdd {key} failed: {e!r}")
    finally:
        try:
            rig.down()
        except Exception as e:
            res["errors"].append(f"emuhdd teardown: {e}")
    h = res["hdd"]
    if (
        "no_ckpt" in h
        and "with_ckpt" in h
        and "read_mbps" in h["no_ckpt"]
        and "read_mbps" in h["with_ckpt"]
    ):
        res["ratios"]["hdd readers during write-back / without"] = (
            h["with_ckpt"]["read_mbps"] / h["no_ckpt"]["read_mbps"]
        )


# ---------------------------------------------------------------------------------------------
def f1(x, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if x is None else fmt.format(x)


def markdown(res: dict) -> str:
    cfg = res["config"]
    L = [
        f"Checkpoint {cfg['tensors']} x {cfg['tensor_mib']} MiB float32 "
        f"({cfg['tensors'] * cfg['tensor_mib']} MiB), tierfs --ram {cfg['ram']} --ssd DIR:{cfg['ssd_size']} "
        f"--write-tier ssd; load: {res['load_start']}",
        "",
    ]
    lo = res.get("local")
    if lo and "best" in lo:
        L += [
            f"(1) local disk ({lo.get('fs', '?')}), best of {cfg['runs']}; save = `torch.save(sd, f)` + `f.flush()`",
            "",
            "| target | save s (runs) | best save MB/s | save+fsync+close s (runs) | best save+fsync+close MB/s |",
            "|---|---|---|---|---|",
        ]
        for k, name in (
            ("direct", "direct, same file system"),
            ("tierfs", "tierfs mount (SSD write tier)"),
        ):
            runs = lo[k]
            b = lo["best"][k]
            saves = " / ".join(f"{r['save_s']:.2f}" for r in runs)
            fulls = " / ".join(f"{r['save_fsync_close_s']:.2f}" for r in runs)
            L.append(
                f"| {name} | {saves} | {b['save_mbps']:.0f} | {fulls} | {b['save_fsync_close_mbps']:.0f} |"
            )
        wbt = [w.get("throughput_bytes_per_s", 0) / MB for w in lo.get("writeback", [])]
        L.append("")
        L.append(
            f"write-back to the local backing dir after each mount run: `tierfs flush` "
            f"{' / '.join(f'{x:.1f}' for x in lo['flush_s'])} s, stats throughput "
            f"{' / '.join(f'{x:.0f}' for x in wbt)} MB/s"
        )
        L.append("")
    h = res.get("hdd")
    if h and ("no_ckpt" in h or "with_ckpt" in h):
        L += [
            f"(2) emulated 7200 rpm disk ({h['disk_gib']} GiB; {h.get('model', '?')}), {cfg['shards']} readers x "
            f"{cfg['shard_mib']} MiB shards, {cfg['block_kib']} KiB reads, through tierfs; "
            f"writeback_deadline={cfg['deadline']:g}",
            "",
            "| phase | readers aggregate MB/s | per reader MB/s | reader window s | disk busy (window) | disk MB read / written in window | backing MB read / written (scheduler) | demand waits (mean / p99 ms) | deadline escalations |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        ck_mib = cfg["tensors"] * cfg["tensor_mib"]
        for k, name in (
            ("no_ckpt", "(a) readers alone"),
            ("with_ckpt", f"(b) readers + {ck_mib} MiB torch.save + write-back"),
        ):
            p = h.get(k)
            if not p or "read_mbps" not in p:
                L.append(f"| {name} | failed | | | | | | | |")
                continue
            st = p.get("tierfs_stats")
            sc = st.get("scheduler", {}) if isinstance(st, dict) else {}
            dw = p["disk_in_reader_window"]
            L.append(
                f"| {name} | {p['read_mbps']:.1f} | {p['per_reader_mbps_min']:.1f}-{p['per_reader_mbps_max']:.1f} | "
                f"{p['read_seconds']:.1f} | {dw['busy_frac']:.0%} | {dw['read_bytes'] / MB:.0f} / {dw['write_bytes'] / MB:.0f} | "
                f"{sc.get('backing_bytes_read', 0) / MB:.0f} / {sc.get('backing_bytes_written', 0) / MB:.0f} | "
                f"{sc.get('demand_waits', '-')} ({sc.get('demand_wait_mean_s', 0) * 1e3:.1f} / "
                f"{sc.get('demand_wait_p99_s', 0) * 1e3:.1f}) | {sc.get('deadline_escalations', '-')} |"
            )
        ck = h.get("with_ckpt", {}).get("checkpoint")
        if ck:
            x = ck["writeback_bytes_written_when_readers_done"]
            wbr = "-" if x is None else f"{x / MB:.0f} MB"
            dwr = h["with_ckpt"]["disk_writes"]
            dcw = ck.get("disk_close_to_written")
            dcw_s = (
                f"{dcw['read_bytes'] / MB:.0f} MB read, {dcw['write_bytes'] / MB:.0f} MB written "
                f"({dcw['writes']} writes, mean {dcw['mean_write_kib']:.0f} KiB), disk busy {dcw['busy_frac']:.0%}"
                if dcw
                else "-"
            )
            L += [
                "",
                "| checkpoint in (b) | value |",
                "|---|---|",
                f"| torch.save (+flush) / +fsync+close | {ck['save_s']:.2f} s ({ck['save_mbps']:.0f} MB/s) / {ck['save_fsync_close_s']:.2f} s |",
                f"| closed at (from readers' start) | {ck['closed_at_s']:.1f} s |",
                f"| readers done after close | {ck['readers_done_after_close_s']:.1f} s |",
                f"| first backing write after close | {f1(ck['first_backing_write_after_close_s'], '{:.1f} s')} |",
                f"| written back (stats `written_files`) after close | {f1(ck['written_after_close_s'], '{:.1f} s')} (deadline {ck['deadline_s']:g} s: {'met' if ck['met_deadline'] else 'MISSED'}) |",
                f"| written back to the backing store when the readers finished (scheduler) | {wbr} of {ck['bytes'] / MB:.0f} MB |",
                f"| writes the disk saw in (b) | {dwr['bytes'] / MB:.0f} MB; first {f1(dwr['first_s'])} s, first >= 256 KiB {f1(dwr['first_256k_s'])} s, last {f1(dwr['last_s'])} s after the readers' start |",
                f"| disk between close and written | {dcw_s} |",
                f"| write-back MB/s: close -> written / first backing write -> written / stats `throughput_bytes_per_s` | {f1(ck.get('writeback_mbps_close_to_written'))} / {f1(ck.get('writeback_mbps_first_write_to_written'))} / {f1((ck['stats_throughput_bytes_per_s'] or 0) / MB)} |",
            ]
        L.append("")
    L += ["| ratio | value | target |", "|---|---|---|"]
    targets = {
        "local save throughput tierfs / direct": ">= 0.70",
        "hdd readers during write-back / without": ">= 0.85",
    }
    for k, v in res["ratios"].items():
        L.append(f"| {k} | {v:.2f} | {targets.get(k, '')} |")
    L.append("")
    L.append(
        f"total {res.get('total_seconds', 0):.0f} s; load at the end: {res.get('load_end', '?')}"
    )
    for n in res.get("notes", []):
        L.append(f"- note: {n}")
    for e in res.get("errors", []):
        L.append(f"- error: {e}")
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--tensor-mib", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="runs of part (1), best of")
    ap.add_argument("--ram", default="64MiB", help="tierfs RAM tier")
    ap.add_argument("--ssd-size", default="4GiB", help="size of the SSD tier (the write tier)")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--shard-mib", type=int, default=256)
    ap.add_argument("--block-kib", type=int, default=1024)
    ap.add_argument(
        "--disk-gib",
        type=int,
        default=0,
        help="emulated disk (default: 4/3 x (shards + checkpoint), >= 4)",
    )
    ap.add_argument(
        "--deadline", type=float, default=60.0, help="-o writeback_deadline in part (2)"
    )
    ap.add_argument("--plugin-args", default="")
    ap.add_argument(
        "--nice", type=int, default=-10, help="niceness of everything (as bench_hdd.py)"
    )
    ap.add_argument("--skip-local", action="store_true")
    ap.add_argument("--skip-hdd", action="store_true")
    ap.add_argument(
        "--workdir", type=Path, default=None, help="default: a new dir under /tmp (local disk)"
    )
    ap.add_argument("--json", action="store_true", help="JSON on stdout (table to stderr)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("needs root (mounts, loop devices)")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-ckpt."))
    work.mkdir(parents=True, exist_ok=True)
    work = work.resolve()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.nice(args.nice - os.nice(0))
    res: dict = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "load_start": loadavg(),
        "ratios": {},
        "errors": [],
        "notes": [],
    }
    res["config"]["workdir"] = str(work)
    t_start = time.monotonic()
    try:
        ok, msg = bench_hdd.tierfs_available()
        if not ok:
            raise RuntimeError(f"python -m tierfs --help failed: {msg[-300:]}")
        import torch

        torch.set_num_threads(1)  # no OpenMP pool in the parent: the save runs in a forked child
        t = time.monotonic()
        sd = make_state_dict(args.tensors, args.tensor_mib)
        log(
            f"state dict: {args.tensors} x {args.tensor_mib} MiB in {time.monotonic() - t:.1f} s; {res['load_start']}"
        )
        if not args.skip_local:
            try:
                local_part(args, sd, work, res)
            except Exception as e:
                res["errors"].append(f"local: {e!r}")
                log(f"local part failed: {e!r}")
        if not args.skip_hdd:
            hdd_part(args, sd, work, res)
    except BaseException as e:
        res["errors"].append(f"aborted: {e!r}")
        log(f"aborted: {e!r}")
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        with open("/proc/mounts") as f:
            busy = any(str(work) in line for line in f)
        if busy:
            log(f"something is still mounted under {work}; left it in place")
        elif args.workdir is None and not res["errors"]:
            shutil.rmtree(work, ignore_errors=True)
        else:  # keep the logs, drop the bulky data
            for d in ("local", "ssd-no_ckpt", "ssd-with_ckpt"):
                shutil.rmtree(work / d, ignore_errors=True)
    res["total_seconds"] = time.monotonic() - t_start
    res["load_end"] = loadavg()
    table = markdown(res)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps(res, indent=1, default=str))
    else:
        print(table)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
