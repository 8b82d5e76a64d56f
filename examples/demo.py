"""The tierfs demo: train a real model on real data read through a tierfs mount.

Run from the repository root (``make demo`` does, after installing everything)::

    python examples/demo.py               # the full demo through a tierfs mount
    python examples/demo.py --no-mount    # the same training straight from the backing directory

Steps, each printed with the exact command it runs so you can repeat them by hand:

1. ``examples/make_shards.py`` builds WebDataset-style tar shards of Python standard-library
   source in ``demo-data/backing`` (reused when already there).
2. The shards are evicted from the page cache (``posix_fadvise(DONTNEED)``) and the SSD tier
   directory is emptied, so the first epoch really reads the backing store.
3. ``python -m tierfs mount demo-data/backing demo-data/mnt --ram ... --ssd demo-data/ssd:...``
   starts the daemon: a RAM tier in /dev/shm and an SSD tier in ``demo-data/ssd``. The demo
   sizes them below the dataset so that both tiers fill.
4. ``examples/train.py --data demo-data/mnt`` trains a byte-level GRU language model for two
   epochs with 2 DataLoader workers: epoch 1 is cold, epoch 2 re-reads the same shards (warm).
5. ``python -m tierfs stats demo-data/mnt`` shows what the tiers and the scheduler did.
6. ``python -m tierfs umount demo-data/mnt``, always (also after an error or Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
DATA = Path("demo-data")
BACKING = DATA / "backing"
SSD = DATA / "ssd"
MNT = DATA / "mnt"


def header(title: str) -> None:
    """Print a section header."""
    print(f"\n=== {title} " + "=" * max(0, 76 - len(title)), flush=True)


def child_env() -> dict[str, str]:
    """Environment of the child processes: unbuffered output, and the repository on the import
    path so ``tierfs`` and ``tierfs_hints`` import even without ``pip install``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not sys.stdout.isatty():  # a log file: let tables (rich) use a readable width
        env.setdefault("COLUMNS", "150")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def show(cmd: list[str]) -> None:
    """Print a command the way you would type it (``python`` for this interpreter)."""
    shown = ["python" if c == sys.executable else c for c in cmd]
    print("$ " + shlex.join(shown), flush=True)


def run(cmd: list[str], *, check: bool = True, timeout: float | None = None) -> int:
    """Print and run a command, its output going straight to ours; return its exit status."""
    show(cmd)
    rc = subprocess.run(cmd, env=child_env(), timeout=timeout).returncode
    if check and rc != 0:
        raise RuntimeError(f"command failed with exit status {rc}: {shlex.join(cmd)}")
    return rc


def run_training(cmd: list[str]) -> dict[str, Any]:
    """Run ``train.py --json``: stream its output and return the JSON summary (its last line).

    The child runs in its own process group, so that on any exception here (Ctrl-C included)
    :func:`stop` can end it together with its DataLoader workers before the mount is unmounted.
    """
    show(cmd)
    summary: dict[str, Any] = {}
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE, text=True,
                            process_group=0)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                summary = json.loads(line)
            else:
                print(line, end="", flush=True)
        rc = proc.wait()
    except BaseException:
        stop(proc)
        raise
    if rc != 0 or not summary:
        raise RuntimeError(f"training failed with exit status {rc}")
    return summary


def stop(proc: subprocess.Popen[str], grace_s: float = 5.0) -> None:
    """End the process group of ``proc`` (the process and its DataLoader workers): SIGINT,
    then SIGTERM, then SIGKILL, each after ``grace_s`` seconds without the group exiting."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, so that a finished group is empty
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
    proc.poll()


def drop_page_cache(directory: Path) -> tuple[int, int]:
    """Evict the files in ``directory`` from the page cache (flushing them first, since only
    clean pages can be dropped). Returns (files, bytes)."""
    files = nbytes = 0
    for path in sorted(directory.iterdir()):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        files += 1
        nbytes += path.stat().st_size
    return files, nbytes


def is_mounted(path: Path) -> bool:
    """Whether ``path`` is a mount point in /proc/mounts (true for a dead FUSE mount too)."""
    target = str(path.resolve())
    with open("/proc/mounts") as f:
        return any(line.split()[1] == target for line in f)


def unmount(mountpoint: Path) -> None:
    """``tierfs umount``, retried for a few seconds while the mount is busy."""
    cmd = [sys.executable, "-m", "tierfs", "umount", str(mountpoint)]
    for attempt in range(5):
        if run(cmd, check=False, timeout=60) == 0 or not is_mounted(mountpoint):
            return
        time.sleep(1.0 + attempt)
    print(f"warning: {mountpoint} is still mounted; unmount it with: {shlex.join(cmd[1:])}")


def figures(summary: dict[str, Any], first: str, later: str) -> str:
    """Per-epoch table of a training summary; ``first``/``later`` say where epoch 1 and the
    later epochs read from."""
    width = max(len(first), len(later), len("reads from"))
    rows = [f"epoch  {'reads from':<{width}}  samples/s   data-wait   first batch   loss (bits/byte)"]
    for e in summary["epochs"]:
        kind = first if e["epoch"] == 1 else later
        rows.append(f"{e['epoch']:>5}  {kind:<{width}}  {e['samples_per_s']:>9.1f}   "
                    f"{e['data_wait_fraction']:>8.1%}   {e['first_batch_s']:>9.2f} s   "
                    f"{e['loss'] / math.log(2):>8.2f}")
    return "\n".join(rows)


def tier_summary(mountpoint: Path) -> str:
    """One line on what the tiers hold and served, from ``tierfs stats --json`` ("" if the
    document cannot be read)."""
    cmd = [sys.executable, "-m", "tierfs", "stats", str(mountpoint), "--json"]
    try:
        out = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=60)
        doc = json.loads(out.stdout)
        parts = [f"{t['name']} tier {t['used_bytes'] / 2**20:.1f}/{t['capacity_bytes'] / 2**20:.0f} "
                 f"MiB used, {t['hits']} hits, {t['bytes_served'] / 2**20:.1f} MiB served"
                 for t in doc["tiers"]]
        parts.append(f"{doc['cache']['tier_byte_ratio']:.0%} of all bytes read came from the tiers")
    except (OSError, ValueError, KeyError, TypeError, subprocess.SubprocessError):
        return ""
    return "tierfs: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-mount", action="store_true",
                   help="train straight from the backing directory (no tierfs), for comparison")
    p.add_argument("--size", default="16MiB", help="dataset size (text shards), default 16MiB")
    p.add_argument("--shard-size", default="2MiB", help="size of one shard, default 2MiB")
    p.add_argument("--ram", default="8MiB", help="RAM tier size, default 8MiB")
    p.add_argument("--ssd-size", default="256MiB", help="SSD tier size, default 256MiB")
    p.add_argument("--chunk-size", default="1MiB", help="tierfs chunk size, default 1MiB")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-steps-per-epoch", type=int, default=None,
                   help="cap each epoch (default: full passes over the dataset)")
    p.add_argument("--keep-ssd", action="store_true",
                   help="keep the SSD tier from the previous run (the first epoch is then warm)")
    args = p.parse_args(argv)

    os.chdir(REPO)
    t_start = time.perf_counter()
    py = sys.executable

    header("1. Dataset: WebDataset-style tar shards of real text (nothing downloaded)")
    run([py, str(EXAMPLES / "make_shards.py"), "--out", str(BACKING), "--size", args.size,
         "--shard-size", args.shard_size])

    header("2. Cold start: evict the shards from the page cache")
    files, nbytes = drop_page_cache(BACKING)
    print(f"posix_fadvise(POSIX_FADV_DONTNEED) on {files} files, {nbytes / 2**20:.1f} MiB")
    if not args.no_mount and not args.keep_ssd and SSD.exists():
        shutil.rmtree(SSD)
        print(f"emptied the SSD tier {SSD} (it persists across mounts; --keep-ssd keeps it)")

    # --evict-page-cache: this small dataset would otherwise stay in the kernel page cache and
    # epoch 2 would never reach the file system; on a real machine the dataset is larger than RAM.
    train = [py, str(EXAMPLES / "train.py"), "--epochs", str(args.epochs),
             "--workers", str(args.workers), "--evict-page-cache", "--json"]
    if args.max_steps_per_epoch is not None:
        train += ["--max-steps-per-epoch", str(args.max_steps_per_epoch)]

    if args.no_mount:
        header(f"3. Train straight from {BACKING} (no tierfs)")
        print("Every epoch reads the backing directory cold (train.py --evict-page-cache).")
        summary = run_training([*train[:2], "--data", str(BACKING), *train[2:]])
        header("Summary (no tierfs)")
        print(figures(summary, "backing (cold)", "backing (cold)"))
        print(f"\ntotal demo time {time.perf_counter() - t_start:.0f} s")
        return 0

    header("3. Mount tierfs: RAM tier in /dev/shm, SSD tier in demo-data/ssd")
    if is_mounted(MNT):
        print(f"{MNT} is still mounted from an earlier run; unmounting it first")
        unmount(MNT)
        if is_mounted(MNT):
            print(f"error: cannot unmount {MNT}; try: umount -l {MNT}", file=sys.stderr)
            return 1
    MNT.mkdir(parents=True, exist_ok=True)
    # a tier directory must be private: tierfs refuses one other users can reach
    SSD.mkdir(mode=0o700, parents=True, exist_ok=True)
    SSD.chmod(0o700)
    mount = [py, "-m", "tierfs", "mount", str(BACKING), str(MNT), "--ram", args.ram,
             "--ssd", f"{SSD}:{args.ssd_size}", "--chunk-size", args.chunk_size]
    mounted = False
    try:
        run(mount, timeout=120)
        mounted = True

        header(f"4. Train through the mount: {args.epochs} epochs, {args.workers} workers")
        print("Epoch 1 reads the backing store through tierfs (cold); epoch 2 re-reads the same\n"
              f"shards in a new order, served by the RAM and SSD tiers. The {args.size} dataset would\n"
              "fit in this machine's page cache, so train.py --evict-page-cache drops it before\n"
              "each epoch, as if the dataset were larger than RAM.")
        summary = run_training([*train[:2], "--data", str(MNT), *train[2:]])

        header("5. What tierfs did: python -m tierfs stats")
        run([py, "-m", "tierfs", "stats", str(MNT)], timeout=60)

        header("Summary")
        print(figures(summary, "backing (cold)", "tiers (warm)"))
        print(tier_summary(MNT))
    finally:
        if mounted or is_mounted(MNT):
            header("6. Unmount")
            unmount(MNT)
    print(f"\ntotal demo time {time.perf_counter() - t_start:.0f} s")
    return 0


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM: leave through the ``finally`` blocks (stop training, unmount) like Ctrl-C."""
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
