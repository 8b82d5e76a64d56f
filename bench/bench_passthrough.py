#!/usr/bin/env python3
"""Passthrough benchmark: what the daemon costs on the data path, tierfs against the tier's own
speed, in one run (one transport per run: compare runs made back to back).

Phases (each prints its figures and the commands behind them):

  ram-seq   sequential read (1 MiB reads) of a file resident in the RAM tier, the mount's page
            cache dropped before each read (POSIX_FADV_DONTNEED on the file through the mount),
            against reading a copy of the file in /dev/shm directly.
  ssd-seq   the same for a file resident in the SSD tier (no RAM tier), against a copy in the
            SSD directory; the page cache of both the tier file and the direct copy is dropped
            before each read, so both read the device.
  rand4k    4 KiB random reads (aligned, POSIX_FADV_RANDOM) of a RAM-tier-resident file by
            --procs processes for --rand-seconds, mount page cache dropped first, against the
            same on the /dev/shm copy; aggregate IOPS.
  ckpt      torch.save of a state dict (--tensors x --tensor-mib float32, >= 1 GiB by default)
            through the mount the way frameworks do (temporary name, fsync, close, os.replace),
            against the same save directly into the write tier's directory. Reports the time
            torch.save blocks the caller per GiB (what a training loop feels) and save+fsync.
            Between runs the write tier is emptied (tierfs flush, file deleted).

The mount is made with ``tierfs mount ... --transport T`` when the tierfs CLI has that option
(native|pyfuse3|auto), else with the default (pyfuse3) transport, which is what ``--transport
pyfuse3`` then measures. The stats document tells which transport ran, how many opens passed
through (``tiers[].passthrough_opens``) and how many read requests reached the daemon.

Needs root (mounts, /sys/class/bdi read_ahead_kb), and torch for the ckpt phase. Run e.g.

    sudo python bench/bench_passthrough.py --transport native            # full sizes, minutes
    sudo python bench/bench_passthrough.py --transport pyfuse3 --quick   # 128 MiB, seconds
    sudo python bench/bench_passthrough.py --phases ram-seq,rand4k --size-mib 512 --json

Measurements on a shared machine are noisy: the load average is printed with the figures, and
each ratio compares figures of one run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
GiB = 1 << 30
BLOCK = MiB
PHASES = ("ram-seq", "ssd-seq", "rand4k", "ckpt")


def log(msg: str) -> None:
    print(f"[bench_passthrough {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tierfs(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierfs", *args], cwd=str(REPO), capture_output=True,
                          text=True, timeout=timeout)


def has_transport_option() -> bool:
    r = tierfs("mount", "--help", timeout=60)
    return "--transport" in r.stdout


def is_mounted(path: Path) -> bool:
    with open("/proc/mounts") as f:
        return any(line.split()[1] == str(path) for line in f if len(line.split()) > 1)


def loadavg() -> str:
    return open("/proc/loadavg").read().strip()


class Mount:
    """``tierfs mount BACKING MNT ARGS...`` for one phase; unmounted on exit (tierfs umount,
    then fusermount3 -u, then a lazy umount)."""

    def __init__(self, backing: Path, mnt: Path, args: list[str]) -> None:
        self.backing, self.mnt, self.args = backing, mnt, args
        self.cmd = ["tierfs", "mount", str(backing), str(mnt), *args]

    def __enter__(self) -> Mount:
        self.mnt.mkdir(parents=True, exist_ok=True)
        r = tierfs("mount", str(self.backing), str(self.mnt), *self.args)
        if r.returncode != 0 or not is_mounted(self.mnt):
            self._force()
            raise RuntimeError(f"tierfs mount failed (rc={r.returncode}): {(r.stdout + r.stderr)[-1500:]}")
        st = os.stat(self.mnt)
        try:  # 1 MiB kernel readahead (what docs/benchmarks.md measures with)
            Path(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb").write_text("1024")
        except OSError as e:
            log(f"cannot set read_ahead_kb: {e}")
        return self

    def stats(self) -> dict:
        try:
            return json.loads((self.mnt / ".tierfs" / "stats.json").read_bytes())
        except (OSError, ValueError) as e:
            return {"error": repr(e)}

    def flush(self) -> None:
        r = tierfs("flush", str(self.mnt), "--timeout", "600", timeout=700)
        if r.returncode != 0:
            raise RuntimeError(f"tierfs flush failed: {(r.stdout + r.stderr)[-800:]}")

    def __exit__(self, *exc: object) -> None:
        try:
            tierfs("umount", str(self.mnt))
        except subprocess.TimeoutExpired:
            log("tierfs umount timed out")
        self._force()

    def _force(self) -> None:
        for _ in range(20):
            if not is_mounted(self.mnt):
                return
            time.sleep(0.25)
        subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True)
        if is_mounted(self.mnt):
            subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)


# -- I/O helpers --------------------------------------------------------------------------------
def make_file(path: Path, nbytes: int) -> None:
    chunk = os.urandom(BLOCK)
    with open(path, "wb") as out:
        for i in range(0, nbytes, BLOCK):
            k = (i // BLOCK) % 7
            out.write((chunk[k:] + chunk[:k])[: min(BLOCK, nbytes - i)])


def make_resident(f: Path, tier: str, size: int, notes: list[str]) -> int:
    """Read ``f`` through the mount until ``tierfs where`` shows every byte in ``tier`` (a cold
    read can leave its last chunks in staging until a second read places them; an open passes
    through only when the whole file is in one tier). Returns the reads it took."""
    for n in range(1, 11):
        read_all(f)
        time.sleep(0.5)  # placement runs in the background
        r = tierfs("where", str(f), "--json")
        try:
            resident = json.loads(r.stdout)[0]["resident_bytes"].get(tier, 0)
        except (ValueError, LookupError):
            resident = -1
        if resident == size:
            return n
    notes.append(f"{f}: not wholly resident in the {tier} tier after 10 reads ({resident} of {size} bytes)")
    return 10


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_tree(root: Path) -> None:
    """Drop the page cache of every regular file under ``root`` (an SSD tier's files)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                drop(Path(dirpath) / name)
            except OSError:
                pass


def read_all(path: Path) -> float:
    """Seconds to read the whole file with 1 MiB reads."""
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        while os.readv(fd, [view]) > 0:
            pass
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _rand_worker(path: str, seconds: float, seed: int, barrier, out) -> None:  # type: ignore[no-untyped-def]
    import random

    fd = os.open(path, os.O_RDONLY)
    blocks = os.fstat(fd).st_size // 4096
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    rnd = random.Random(seed)
    offs = [rnd.randrange(blocks) * 4096 for _ in range(1 << 16)]
    barrier.wait()
    n = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        for off in offs[(n & 0xFFFF):(n & 0xFFFF) + 256]:
            os.pread(fd, 4096, off)
        n += 256
        if time.perf_counter() >= end:
            break
    out.put((n, time.perf_counter() - t0))
    os.close(fd)


def rand_iops(path: Path, procs: int, seconds: float) -> float:
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(procs)
    q = ctx.Queue()
    ps = [ctx.Process(target=_rand_worker, args=(str(path), seconds, i, barrier, q)) for i in range(procs)]
    for p in ps:
        p.start()
    res = [q.get(timeout=seconds + 120) for _ in ps]
    for p in ps:
        p.join()
    return sum(n for n, _ in res) / max(t for _, t in res)


# -- phases -------------------------------------------------------------------------------------
def seq_phase(args, work: Path, tier: str, res: dict) -> None:  # type: ignore[no-untyped-def]
    size = args.size_mib * MiB
    back, mnt = work / f"{tier}-back", work / f"{tier}-mnt"
    back.mkdir()
    make_file(back / "big.bin", size)
    if tier == "ram":
        direct = Path(tempfile.mkdtemp(prefix="tierfs-pt-direct-", dir="/dev/shm")) / "big.bin"
        margs = ["--ram", f"{args.size_mib + 256}MiB"]
        ssd = None
    else:
        direct = Path(tempfile.mkdtemp(prefix="direct-", dir=args.ssd_dir)) / "big.bin"
        ssd = Path(tempfile.mkdtemp(prefix="ssd-tier-", dir=args.ssd_dir))
        margs = ["--ram", "0", "--ssd", f"{ssd}:{args.size_mib + 256}MiB"]
    shutil.copyfile(back / "big.bin", direct)
    margs += args.transport_args
    out: dict = {"bytes": size}
    res[f"{tier}-seq"] = out
    try:
        with Mount(back, mnt, margs) as m:
            out["mount_cmd"] = " ".join(m.cmd)
            f = mnt / "big.bin"
            out["first_read_gbps"] = size / 1e9 / read_all(f)  # backing store -> tier
            out["warm_reads"] = 1 + make_resident(f, tier, size, res["notes"])
            os.sync()  # DONTNEED drops clean pages only: the copy and the tier files were just written
            before = m.stats()

            def cold_mount() -> float:
                drop(f)
                if ssd is not None:
                    drop_tree(ssd)
                return read_all(f)

            def cold_direct() -> float:
                if tier == "ssd":
                    drop(direct)
                return read_all(direct)

            t_m, t_d = [], []
            for _ in range(args.repeat):  # alternate: both see the same load
                t_d.append(cold_direct())
                t_m.append(cold_mount())
            after = m.stats()
            out["direct_gbps"] = size / 1e9 / min(t_d)
            out["tierfs_gbps"] = size / 1e9 / min(t_m)
            out["ratio"] = out["tierfs_gbps"] / out["direct_gbps"]
            out["direct_cmd"] = f"read {direct} (1 MiB reads{', fadvise DONTNEED first' if tier == 'ssd' else ''})"
            out["tierfs_cmd"] = (f"read {f} (1 MiB reads, fadvise DONTNEED on it"
                                 f"{' and on the SSD tier files' if ssd else ''} first)")
            out.update(_pt_figures(before, after, tier))
    finally:
        shutil.rmtree(direct.parent, ignore_errors=True)
        if ssd is not None:
            shutil.rmtree(ssd, ignore_errors=True)
        shutil.rmtree(back, ignore_errors=True)


def _transport(doc: dict) -> str:
    """The transport a stats document names (``transport.name``, passthrough on or off)."""
    t = doc.get("transport")
    if isinstance(t, dict):
        return f"{t.get('name', '?')}{' +passthrough' if t.get('passthrough') else ''}"
    return str(t) if t else "pyfuse3"


def _pt_figures(before: dict, after: dict, tier: str) -> dict:
    """What the daemon saw between two stats documents: read requests, passthrough opens."""
    out: dict = {"transport": _transport(after)}
    try:
        out["daemon_read_requests"] = after["fuse"]["read_requests"] - before["fuse"]["read_requests"]
        t_after = next(t for t in after["tiers"] if t["name"] == tier)
        t_before = next(t for t in before["tiers"] if t["name"] == tier)
        out["passthrough_opens"] = t_after.get("passthrough_opens", 0) - t_before.get("passthrough_opens", 0)
        out["tier_hit_ratio"] = t_after.get("hit_ratio")
    except (KeyError, StopIteration, TypeError):
        pass
    return out


def rand_phase(args, work: Path, res: dict) -> None:  # type: ignore[no-untyped-def]
    size = args.rand_size_mib * MiB
    back, mnt = work / "rand-back", work / "rand-mnt"
    back.mkdir()
    make_file(back / "big.bin", size)
    direct = Path(tempfile.mkdtemp(prefix="tierfs-pt-direct-", dir="/dev/shm")) / "big.bin"
    shutil.copyfile(back / "big.bin", direct)
    out: dict = {"bytes": size, "procs": args.procs, "seconds": args.rand_seconds}
    res["rand4k"] = out
    try:
        with Mount(back, mnt, ["--ram", f"{args.rand_size_mib + 256}MiB", *args.transport_args]) as m:
            out["mount_cmd"] = " ".join(m.cmd)
            f = mnt / "big.bin"
            out["warm_reads"] = make_resident(f, "ram", size, res["notes"])
            before = m.stats()
            d, t = [], []
            for _ in range(args.repeat):
                d.append(rand_iops(direct, args.procs, args.rand_seconds))
                drop(f)
                t.append(rand_iops(f, args.procs, args.rand_seconds))
            after = m.stats()
            out["direct_iops"] = max(d)
            out["tierfs_iops"] = max(t)
            out["ratio"] = out["tierfs_iops"] / out["direct_iops"]
            out["direct_cmd"] = f"{args.procs} procs x pread 4 KiB random aligned of {direct}"
            out["tierfs_cmd"] = f"{args.procs} procs x pread 4 KiB random aligned of {f} (DONTNEED first)"
            out.update(_pt_figures(before, after, "ram"))
    finally:
        shutil.rmtree(direct.parent, ignore_errors=True)
        shutil.rmtree(back, ignore_errors=True)


def _save(sd: dict, dest: Path) -> dict:
    """torch.save the way frameworks do: temporary name, flush, fsync, close, os.replace."""
    import torch

    tmp = dest.with_name(dest.name + ".tmp")
    t0 = time.perf_counter()
    with open(tmp, "wb") as f:
        torch.save(sd, f)
        f.flush()
        t_save = time.perf_counter()
        os.fsync(f.fileno())
    t_fsync = time.perf_counter()
    os.replace(tmp, dest)
    t_end = time.perf_counter()
    return {"save_s": t_save - t0, "fsync_close_s": t_fsync - t_save, "replace_s": t_end - t_fsync,
            "total_s": t_end - t0, "bytes": os.stat(dest).st_size}


def ckpt_phase(args, work: Path, res: dict) -> None:  # type: ignore[no-untyped-def]
    import torch

    numel = args.tensor_mib * MiB // 4
    g = torch.Generator().manual_seed(0)
    sd = {f"layer{i:02d}.weight": torch.rand(numel, generator=g) for i in range(args.tensors)}
    back, mnt = work / "ckpt-back", work / "ckpt-mnt"
    back.mkdir()
    if args.write_tier == "ram":
        margs = ["--ram", f"{args.tensors * args.tensor_mib + 1024}MiB", "--write-tier", "ram"]
        ssd = None
        direct_dir = Path(tempfile.mkdtemp(prefix="tierfs-pt-direct-", dir="/dev/shm"))
    else:
        ssd = Path(tempfile.mkdtemp(prefix="ssd-tier-", dir=args.ssd_dir))
        margs = ["--ram", "64MiB", "--ssd", f"{ssd}:{args.tensors * args.tensor_mib + 1024}MiB",
                 "--write-tier", "ssd"]
        direct_dir = Path(tempfile.mkdtemp(prefix="direct-", dir=args.ssd_dir))
    out: dict = {"write_tier": args.write_tier, "direct": [], "tierfs": []}
    res["ckpt"] = out
    try:
        with Mount(back, mnt, [*margs, *args.transport_args]) as m:
            out["mount_cmd"] = " ".join(m.cmd)
            before = m.stats()
            for _ in range(args.repeat):
                os.sync()
                out["direct"].append(_save(sd, direct_dir / "ckpt.pt"))
                (direct_dir / "ckpt.pt").unlink()
                os.sync()
                out["tierfs"].append(_save(sd, mnt / "ckpt.pt"))
                m.flush()
                (mnt / "ckpt.pt").unlink()
            after = m.stats()
        nbytes = out["tierfs"][0]["bytes"]
        for kind in ("direct", "tierfs"):
            best = min(r["save_s"] for r in out[kind])
            out[f"{kind}_save_gbps"] = nbytes / 1e9 / best
            out[f"{kind}_blocks_s_per_gib"] = best / (nbytes / GiB)
            out[f"{kind}_total_gbps"] = nbytes / 1e9 / min(r["total_s"] for r in out[kind])
        out["ratio_save"] = out["tierfs_save_gbps"] / out["direct_save_gbps"]
        out["ratio_total"] = out["tierfs_total_gbps"] / out["direct_total_gbps"]
        out["bytes"] = nbytes
        out["direct_cmd"] = f"torch.save -> {direct_dir}/ckpt.pt.tmp, fsync, os.replace"
        out["tierfs_cmd"] = f"torch.save -> {mnt}/ckpt.pt.tmp, fsync, os.replace; tierfs flush; rm"
        out["transport"] = _transport(after)
        try:
            out["daemon_write_requests"] = after["fuse"]["write_requests"] - before["fuse"]["write_requests"]
            out["passthrough_writable_opens"] = after["writeback"].get("passthrough_writable_opens", 0)
            out["passthrough_overrun_bytes"] = after["writeback"].get("passthrough_overrun_bytes", 0)
        except (KeyError, TypeError):
            pass
    finally:
        shutil.rmtree(direct_dir, ignore_errors=True)
        if ssd is not None:
            shutil.rmtree(ssd, ignore_errors=True)
        shutil.rmtree(back, ignore_errors=True)


# -- report -------------------------------------------------------------------------------------
def report(res: dict) -> None:
    print(f"tierfs passthrough benchmark, transport asked: {res['transport']} "
          f"({res['transport_note']}); load before: {res['load_start']}, after: {res['load_end']}")
    print("\n| phase | direct | tierfs | tierfs/direct | daemon requests | passthrough opens | transport |")
    print("|---|---|---|---|---|---|---|")
    for key in ("ram-seq", "ssd-seq"):
        r = res.get(key)
        if r and "ratio" in r:
            print(f"| {key} {r['bytes'] // MiB} MiB, 1 MiB reads, cold | {r['direct_gbps']:.2f} GB/s | "
                  f"{r['tierfs_gbps']:.2f} GB/s | {r['ratio']:.2f} | {r.get('daemon_read_requests', '?')} reads | "
                  f"{r.get('passthrough_opens', '?')} | {r.get('transport')} |")
    r = res.get("rand4k")
    if r and "ratio" in r:
        print(f"| rand4k {r['bytes'] // MiB} MiB, {r['procs']} procs | {r['direct_iops']:,.0f} IOPS | "
              f"{r['tierfs_iops']:,.0f} IOPS | {r['ratio']:.2f} | {r.get('daemon_read_requests', '?')} reads | "
              f"{r.get('passthrough_opens', '?')} | {r.get('transport')} |")
    r = res.get("ckpt")
    if r and "ratio_save" in r:
        print(f"| ckpt torch.save {r['bytes'] / GiB:.2f} GiB ({r['write_tier']} write tier), until save returns | "
              f"{r['direct_save_gbps']:.2f} GB/s ({r['direct_blocks_s_per_gib']:.2f} s/GiB) | "
              f"{r['tierfs_save_gbps']:.2f} GB/s ({r['tierfs_blocks_s_per_gib']:.2f} s/GiB) | {r['ratio_save']:.2f} | "
              f"{r.get('daemon_write_requests', '?')} writes | {r.get('passthrough_writable_opens', '?')} | "
              f"{r.get('transport')} |")
        print(f"| ckpt save + fsync + close + os.replace{' (fsync: backing store)' if r['write_tier'] == 'ram' else ''} | "
              f"{r['direct_total_gbps']:.2f} GB/s | "
              f"{r['tierfs_total_gbps']:.2f} GB/s | {r['ratio_total']:.2f} | | | |")
    print("\ncommands:")
    for key in ("ram-seq", "ssd-seq", "rand4k", "ckpt"):
        r = res.get(key)
        if r:
            for c in ("mount_cmd", "direct_cmd", "tierfs_cmd"):
                if c in r:
                    print(f"  {key} {c.split('_')[0]}: {r[c]}")
    print(f"  this run: {res['argv']}")
    for note in res["notes"]:
        print(f"note: {note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transport", default="native", choices=("native", "pyfuse3", "auto"))
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {PHASES}")
    ap.add_argument("--size-mib", type=int, default=2048, help="file of the sequential phases")
    ap.add_argument("--rand-size-mib", type=int, default=2048, help="file of the rand4k phase")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--rand-seconds", type=float, default=5.0)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--tensor-mib", type=int, default=128, help="8 x 128 MiB = 1 GiB state dict")
    ap.add_argument("--write-tier", default="ssd", choices=("ram", "ssd"),
                    help="ssd (default): fsync is durable on the SSD both ways; ram: tierfs' fsync "
                         "then waits for the backing store (docs/writes.md), /dev/shm's does not")
    ap.add_argument("--ssd-dir", default="/var/tmp", help="a directory on the local SSD")
    ap.add_argument("--repeat", type=int, default=3, help="best of N")
    ap.add_argument("--quick", action="store_true", help="128 MiB files, 2 x 64 MiB state dict, 1 s, 2 runs")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mib = args.rand_size_mib = 128
        args.tensors, args.tensor_mib, args.rand_seconds, args.repeat = 2, 64, 1.0, 2
    phases = [p for p in args.phases.split(",") if p]
    bad = [p for p in phases if p not in PHASES]
    if bad:
        ap.error(f"unknown phase(s) {bad}; known: {PHASES}")
    res: dict = {"transport": args.transport, "notes": [], "load_start": loadavg(),
                 "argv": " ".join([sys.executable, *sys.argv])}
    if has_transport_option():
        args.transport_args = ["--transport", args.transport]
        res["transport_note"] = "tierfs mount --transport " + args.transport
        if args.transport != "pyfuse3":  # resident reads pass through only with passthrough = on
            args.transport_args += ["-o", "passthrough=on"]
            res["transport_note"] += " -o passthrough=on"
    elif args.transport == "pyfuse3":
        args.transport_args = []
        res["transport_note"] = "this tierfs has no --transport option: pyfuse3, the only transport"
    else:
        print(f"this tierfs has no --transport option: only pyfuse3 can be measured, not {args.transport}",
              file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="tierfs-bench-pt-", dir=args.ssd_dir))
    try:
        for phase in phases:
            log(f"{phase} ...")
            try:
                if phase in ("ram-seq", "ssd-seq"):
                    seq_phase(args, work, phase.split("-")[0], res)
                elif phase == "rand4k":
                    rand_phase(args, work, res)
                else:
                    ckpt_phase(args, work, res)
            except Exception as e:  # noqa: BLE001 - report the others
                res["notes"].append(f"{phase} failed: {e!r}")
                log(f"{phase} failed: {e!r}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["load_end"] = loadavg()
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        report(res)
    return 0 if not res["notes"] or all("failed" not in n for n in res["notes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
