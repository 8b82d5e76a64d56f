#!/usr/bin/env python3
"""The demo's training with and without hints, through tierfs on the emulated HDD.

Builds the demo's tar shards (``examples/make_shards.py``: paragraphs of the standard library),
copies them onto the emulated disk (``bench/emuhdd.sh``, via :class:`bench_hdd.Rig`), then runs
``examples/train.py`` once per variant, each through a fresh tierfs mount of the disk's
directory with the same tiers, after dropping the disk's page cache, with the same seed and
arguments:

  (a) none    no hints
  (b) loader  ``--hints``: the main process announces each epoch's read order (the workers'
              shard lists interleaved) plus the next epoch's, and each eval pass ahead of time
              (``tierfs_hints.phase("eval", at=..., needs=...)``)
  (c) workers ``--hints --hints-source workers`` (only with ``--variants``): each DataLoader
              worker announces its own list, under its own source

Reports per variant the data-wait fraction and samples/s of every epoch, the eval passes (eval
data resident when the pass started, deadline met, the pass's data wait), what the disk saw
(requests, and the bytes read of the training and of the eval shards, from the files' extents),
the tiers' and the scheduler's counters, and the ``hints`` section of ``tierfs stats`` of the
hinted runs (``samples``: the stats every ``--poll`` seconds). Prints a markdown table (stderr
with ``--json``) and one JSON line. Needs root. Tears everything down in ``finally`` (the
training process group, the tierfs mount, the emulated disk); keeps the workdir only on error
or with ``--workdir``.

The tiers are the same in every run: a RAM tier of about half the training data, no SSD tier
(it would hold everything and no epoch would read the disk twice), and ``staging=4MiB`` (the
daemon's 256 MiB default staging memory would hold the whole dataset on top of the RAM tier).
Each run gets a fresh mount and a dropped page cache of the disk; ``train.py
--evict-page-cache`` keeps the mount's page cache from serving a re-read.

Why the disk is slowed down (``--slowdown``, default 30): a 2-core CPU trains the byte GRU at
a couple of MB/s of shards, ~100x less than the emulated 7200 rpm disk delivers, so no epoch
would ever wait for it. A GPU job reads hundreds of MB/s from the same disk. To put the CPU job
in that ratio, every time constant of the disk model is multiplied by ``--slowdown`` (rpm,
media and bus rate divided; seek times multiplied): the same disk, in slow motion.

    sudo /tmp/venv-probe/bin/python bench/bench_hints_e2e.py                      # ~3 min
    sudo /tmp/venv-probe/bin/python bench/bench_hints_e2e.py --quick              # ~2 min
    sudo /tmp/venv-probe/bin/python bench/bench_hints_e2e.py --variants none,loader,workers
    sudo /tmp/venv-probe/bin/python bench/bench_hints_e2e.py --json > out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import bench_hdd  # noqa: E402  (bench/bench_hdd.py: the emulated disk, mounts, request stats)
from bench_hdd import Rig, TierfsMount, request_stats  # noqa: E402

MiB = 1 << 20
VARIANTS = {
    "none": [],
    "loader": ["--hints"],
    "workers": ["--hints", "--hints-source", "workers"],
}


def log(msg: str) -> None:
    print(f"[bench_hints {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def slowed_disk(s: float) -> str:
    """Plugin arguments of the default 7200 rpm model with every time constant times ``s``."""
    if s == 1:
        return ""
    return (f"rpm={7200 / s:g} media_mbps={180 / s:g} bus_mbps={600 / s:g} "
            f"avg_seek_ms={8.5 * s:g} t2t_ms={1.0 * s:g} full_ms={16.0 * s:g}")


class Poller(threading.Thread):
    """Samples the mount's stats document every ``every`` seconds (tiers, hints, scheduler)."""

    def __init__(self, mountpoint: Path, every: float) -> None:
        super().__init__(daemon=True)
        self.path = mountpoint / ".tierfs" / "stats.json"
        self.every = every
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.wait(self.every):
            try:
                doc = json.loads(self.path.read_bytes())
            except (OSError, ValueError):
                continue
            h = doc.get("hints") or {}
            sch = doc.get("scheduler") or {}
            self.samples.append({
                "t": round(time.monotonic() - t0, 2),
                "ram_used": doc["tiers"][0]["used_bytes"], "ram_hits": doc["tiers"][0]["hits"],
                "ram_misses": doc["tiers"][0]["misses"],
                "staging_used": (doc.get("staging") or {}).get("used_bytes"),
                "backing_read": sch.get("backing_bytes_read"), "busy_s": sch.get("busy_seconds"),
                "demand_waits": sch.get("demand_waits"),
                "hints_resident": h.get("resident_bytes"), "hints_to_fetch": h.get("to_fetch_bytes"),
                "hints_prefetched": h.get("prefetched_bytes"), "hints_queued": h.get("queued_chunks"),
                "pending": [(p["label"], round(p["deadline_in_s"], 1), round(p["slack_s"], 1),
                             p["remaining_bytes"]) for p in h.get("pending_deadlines", [])],
            })


def extents(path: Path) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` of ``path`` on its device (``filefrag -v -b4096``)."""
    out = subprocess.run(["filefrag", "-v", "-b4096", str(path)], capture_output=True, text=True,
                         timeout=30).stdout
    ranges = []
    for line in out.splitlines():
        p = line.replace(":", " ").replace("..", " ").split()
        if len(p) >= 6 and p[0].isdigit():
            try:
                ranges.append((int(p[3]) * 4096, (int(p[4]) + 1) * 4096))
            except ValueError:
                pass
    return ranges


def bytes_by_file(reqs: list[tuple[float, str, int, int, float, float]],
                  layout: dict[str, list[tuple[int, int]]]) -> dict[str, int]:
    """Bytes of the disk's read requests that fell in each file ("" for the rest: metadata)."""
    spans = sorted((a, b, name) for name, rs in layout.items() for a, b in rs)
    out: dict[str, int] = {}
    for r in reqs:
        if r[1] != "R":
            continue
        lo, hi = r[2], r[2] + r[3]
        left = r[3]
        for a, b, name in spans:  # a few hundred spans: fine
            n = min(hi, b) - max(lo, a)
            if n > 0:
                out[name] = out.get(name, 0) + n
                left -= n
        if left > 0:
            out[""] = out.get("", 0) + left
    return out


def child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def stop_group(proc: subprocess.Popen[str]) -> None:
    """End the process group of ``proc`` (train.py and its DataLoader workers)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        for _ in range(50):
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def train(cmd: list[str], logfile: Path, timeout: float) -> dict[str, Any]:
    """Run train.py (own process group), its output to ``logfile`` and stderr; return its JSON."""
    log("$ " + shlex.join(cmd))
    summary: dict[str, Any] = {}
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, process_group=0, cwd=str(REPO))
    timer = threading.Timer(timeout, lambda: stop_group(proc))
    timer.start()
    try:
        assert proc.stdout is not None
        with open(logfile, "a") as out:
            for line in proc.stdout:
                out.write(line)
                if line.startswith("{"):
                    summary = json.loads(line)
                else:
                    print("    " + line, end="", file=sys.stderr, flush=True)
        rc = proc.wait()
    except BaseException:
        stop_group(proc)
        raise
    finally:
        timer.cancel()
    if rc != 0 or not summary:
        raise RuntimeError(f"train.py failed (exit status {rc}); see {logfile}")
    return summary


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def markdown(res: dict[str, Any]) -> str:
    cfg = res["config"]
    runs = res["runs"]
    L = [f"Emulated 7200 rpm disk slowed {cfg['slowdown']:g}x ({cfg['disk_model']}); "
         f"{cfg['train_shards']} training shards + {cfg['eval_shards']} eval shards, "
         f"{cfg['data_mib']:.1f} MiB in all; tierfs --ram {cfg['ram']} -o staging={cfg['staging']} "
         f"--chunk-size {cfg['chunk_size']} (no SSD tier); train.py {' '.join(cfg['train_args'])}", ""]
    names = list(runs)
    L.append("| figure | " + " | ".join(names) + " |")
    L.append("|---|" + "---|" * len(names))

    def row(label: str, fn: Any) -> None:
        vals = []
        for n in names:
            try:
                vals.append(fn(runs[n]))
            except (KeyError, IndexError, TypeError, ZeroDivisionError):
                vals.append("-")
        L.append(f"| {label} | " + " | ".join(vals) + " |")

    n_epochs = max(len(r["train"]["epochs"]) for r in runs.values())
    for e in range(n_epochs):
        row(f"epoch {e + 1} data-wait fraction",
            lambda r, e=e: f"**{r['train']['epochs'][e]['data_wait_fraction']:.1%}**"
            if e == 1 else f"{r['train']['epochs'][e]['data_wait_fraction']:.1%}")
        row(f"epoch {e + 1} samples/s", lambda r, e=e: f"{r['train']['epochs'][e]['samples_per_s']:.0f}")
        row(f"epoch {e + 1} wall s (data wait s)",
            lambda r, e=e: f"{r['train']['epochs'][e]['wall_s']:.1f} ({r['train']['epochs'][e]['data_wait_s']:.1f})")
    n_evals = max(len(r["train"]["evals"]) for r in runs.values())
    for k in range(n_evals):
        def ev(r: dict[str, Any], k: int = k) -> str:
            x = r["train"]["evals"][k]
            met = {True: "met", False: "**missed**", None: "-"}[x["deadline_met"]]
            lead = "" if x.get("announced_lead_s") is None else f", announced {x['announced_lead_s']:.0f} s ahead"
            return (f"step {x['step']}: resident {fmt_pct(x['resident_fraction'])} at start ({met}{lead}); "
                    f"data wait {x['data_wait_s']:.2f} s of {x['wall_s']:.2f} s")
        row(f"eval {k + 1}", ev)
    row("disk: MB read (reads, mean KiB)",
        lambda r: f"{r['disk']['read_bytes'] / 1e6:.0f} ({r['disk']['reads']}, {r['disk']['mean_read_kib']:.0f})")
    row("disk: MB of training shards (passes over them)",
        lambda r: f"{r['disk']['train_read_bytes'] / 1e6:.0f} "
        f"({r['disk']['train_read_bytes'] / (cfg['train_mib'] * MiB):.2f})")
    row("disk: MB of eval shards (passes over them)",
        lambda r: f"{r['disk']['eval_read_bytes'] / 1e6:.0f} "
        f"({r['disk']['eval_read_bytes'] / (cfg['eval_mib'] * MiB):.2f})")
    row("disk busy", lambda r: f"{r['disk']['disk_busy_frac']:.0%}")
    row("RAM tier hits / misses", lambda r: f"{r['stats']['tiers'][0]['hits']} / {r['stats']['tiers'][0]['misses']}")
    row("bytes from tiers / staging / backing (MB)",
        lambda r: "{:.0f} / {:.0f} / {:.0f}".format(
            r["stats"]["cache"]["bytes_served_from_tiers"] / 1e6,
            r["stats"]["cache"]["bytes_served_from_staging"] / 1e6,
            r["stats"]["cache"]["bytes_served_from_backing"] / 1e6))
    row("demand waits (mean s)",
        lambda r: f"{r['stats']['scheduler']['demand_waits']} ({r['stats']['scheduler']['demand_wait_mean_s']:.2f})")
    row("hints: prefetched MB", lambda r: f"{r['stats']['hints']['prefetched_bytes'] / 1e6:.0f}"
        if r["variant"] != "none" else "-")
    row("hints: deadline misses / at risk", lambda r: f"{r['stats']['hints']['deadline_misses']} / "
        f"{r['stats']['hints']['at_risk']}" if r["variant"] != "none" else "-")
    row("run wall s", lambda r: f"{r['wall_s']:.0f}")
    if res.get("errors"):
        L.append("")
        L.extend(f"- error: {e}" for e in res["errors"])
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smaller run: 16 shards (32 MiB), RAM tier 15 MiB, 1 eval shard, an eval "
                         "every 80 steps")
    ap.add_argument("--size", default=None, help="shards in all, train + eval (default 63.9MiB: 32 shards of 2 MiB, the last one a bit smaller; quick 31.9MiB)")
    ap.add_argument("--shard-size", default="2MiB")
    ap.add_argument("--eval-holdout", type=int, default=None, help="eval shards (default 2; quick 1)")
    ap.add_argument("--ram", default=None, help="RAM tier (default 30MiB; quick 15MiB): about half the data")
    ap.add_argument("--staging", default="4MiB",
                    help="daemon staging memory (default 4MiB; tierfs' 256MiB default would hold "
                         "the whole dataset on top of the RAM tier)")
    ap.add_argument("--chunk-size", default="1MiB")
    ap.add_argument("--slowdown", type=float, default=30.0,
                    help="multiply every time constant of the disk model by this (default 30)")
    ap.add_argument("--variants", default="none,loader", help="comma list of: none, loader, workers")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--eval-every", type=int, default=None, help="steps (default 150; quick 80)")
    ap.add_argument("--eval-lead", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-timeout", type=float, default=900.0, help="seconds per training run")
    ap.add_argument("--poll", type=float, default=2.0, help="stats sampling period, s (0: none)")
    ap.add_argument("--nice", type=int, default=-10,
                    help="niceness of everything started here (the disk emulator, tierfs, training)")
    ap.add_argument("--workdir", type=Path, default=None, help="default: a new dir under /tmp (kept on error)")
    ap.add_argument("--json", action="store_true", help="JSON line on stdout, table on stderr")
    args = ap.parse_args()
    if os.geteuid() != 0:
        ap.error("needs root (loop devices, mounts)")
    q = args.quick
    size = args.size or ("31.9MiB" if q else "63.9MiB")
    ram = args.ram or ("15MiB" if q else "30MiB")
    holdout = args.eval_holdout if args.eval_holdout is not None else (1 if q else 2)
    eval_every = args.eval_every or (80 if q else 150)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hints-e2e."))
    workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.nice(args.nice - os.nice(0))  # inherited by emuhdd.sh, tierfs and train.py

    train_args = ["--epochs", str(args.epochs), "--workers", str(args.workers),
                  "--width", str(args.width), "--max-len", str(args.max_len),
                  "--batch-size", str(args.batch_size), "--threads", "1", "--seed", str(args.seed),
                  "--eval-every", str(eval_every), "--eval-holdout", str(holdout),
                  "--eval-lead", f"{args.eval_lead:g}", "--evict-page-cache", "--log-every", "100",
                  "--sample-bytes", "0", "--json"]
    mount_args = ["-o", f"staging={args.staging}", "--chunk-size", args.chunk_size]
    res: dict[str, Any] = {
        "config": {"size": size, "shard_size": args.shard_size, "ram": ram, "staging": args.staging,
                   "chunk_size": args.chunk_size, "slowdown": args.slowdown,
                   "disk_model": slowed_disk(args.slowdown) or "default model",
                   "train_args": train_args, "mount_args": mount_args, "variants": variants,
                   "nice": args.nice, "workdir": str(workdir), "quick": q},
        "load_start": os.getloadavg(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runs": {}, "errors": [],
    }
    t_start = time.monotonic()
    rig = Rig(workdir, 2, slowed_disk(args.slowdown), args.nice)
    try:
        src = workdir / "src"
        r = subprocess.run([sys.executable, str(REPO / "examples" / "make_shards.py"), "--out", str(src),
                            "--size", size, "--shard-size", args.shard_size],
                           capture_output=True, text=True, timeout=600, env=child_env())
        if r.returncode != 0:
            raise RuntimeError(f"make_shards failed: {r.stdout}{r.stderr}")
        log(r.stdout.strip())
        shards = sorted(src.glob("text-*.tar"))
        res["config"]["data_mib"] = sum(p.stat().st_size for p in shards) / MiB
        res["config"]["train_shards"] = len(shards) - holdout
        res["config"]["train_mib"] = sum(p.stat().st_size for p in shards[:len(shards) - holdout]) / MiB
        res["config"]["eval_mib"] = sum(p.stat().st_size for p in shards[len(shards) - holdout:]) / MiB
        res["config"]["eval_shards"] = holdout

        mnt = rig.up()
        with open(rig.reqlog) as f:
            head = f.readline()
        res["config"]["model_line"] = head.split(" start ", 1)[-1].strip() if " start " in head else "?"
        data = mnt / "data"
        data.mkdir()
        rig.nodelay(True)  # copy at RAM speed; the model still tracks the head
        for p in shards:
            shutil.copyfile(p, data / p.name)
        os.sync()
        rig.nodelay(False)
        layout = {p.name: extents(data / p.name) for p in shards}
        res["layout"] = {n: [r[0], r[-1][1]] if r else [] for n, r in layout.items()}
        eval_names = {p.name for p in shards[len(shards) - holdout:]}
        log(f"disk up at {mnt}: {len(shards)} shards, {res['config']['data_mib']:.1f} MiB, "
            f"disk model: {res['config']['disk_model']}")

        tmnt = workdir / "tierfs"
        for v in variants:
            rig.dropcache()  # the disk's page cache: cold, as the first epoch of a real job
            mark = rig.log_mark()
            run: dict[str, Any] = {"variant": v, "load_start": os.getloadavg()}
            log(f"variant {v}: fresh mount, load average {run['load_start']}")
            t0 = time.monotonic()
            try:
                with TierfsMount(data, tmnt, ram, mount_args) as m:
                    poller = Poller(tmnt, args.poll) if args.poll > 0 else None
                    if poller is not None:
                        poller.start()
                    try:
                        cmd = [sys.executable, str(REPO / "examples" / "train.py"), "--data", str(tmnt),
                               *train_args, *VARIANTS[v]]
                        run["train"] = train(cmd, workdir / f"train-{v}.log", args.train_timeout)
                    finally:
                        if poller is not None:
                            poller.stop.set()
                            poller.join(timeout=10)
                            run["samples"] = poller.samples
                    m.collect_stats()
                    run["stats"] = m.stats
            except Exception as e:  # report, go on with the next variant
                res["errors"].append(f"{v}: {e}")
                log(f"variant {v} failed: {e}")
            run["wall_s"] = time.monotonic() - t0
            reqs = rig.requests_since(mark)
            run["disk"] = request_stats(reqs, run["wall_s"])
            per_file = bytes_by_file(reqs, layout)
            run["disk"]["per_file_read_bytes"] = per_file
            run["disk"]["train_read_bytes"] = sum(b for n, b in per_file.items() if n and n not in eval_names)
            run["disk"]["eval_read_bytes"] = sum(b for n, b in per_file.items() if n in eval_names)
            run["load_end"] = os.getloadavg()
            res["runs"][v] = run
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
            log(f"teardown failed: {e}; run: {bench_hdd.EMUHDD} down {workdir}")
        with open("/proc/mounts") as f:
            busy = any(str(workdir) in line for line in f)
        if args.workdir is None and not res["errors"] and not busy:
            shutil.rmtree(workdir, ignore_errors=True)
        elif busy:
            log(f"something is still mounted under {workdir}; left it in place")
        else:
            log(f"kept {workdir} (logs: train-*.log, requests.log)")
    res["total_s"] = time.monotonic() - t_start
    res["load_end"] = os.getloadavg()
    res["ended"] = time.strftime("%Y-%m-%d %H:%M:%S")
    runs = [r for r in res["runs"].values() if "train" in r]
    if runs and all("stats" in r for r in runs):
        table = markdown(res)
        print(table, file=sys.stderr if args.json else sys.stdout)
    log(f"total {res['total_s']:.0f} s, load average {res['load_start']} -> {res['load_end']}")
    print(json.dumps(res))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
