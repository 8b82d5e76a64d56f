#!/usr/bin/env python3
"""Crash loop: ``kill -9`` of the tierfs daemon at random moments, then check that nothing closed
was lost and that the backing store never showed a partial file under a final name.

Each round starts the daemon (``tierfs mount``), lets a writer process run random operations
through the mount (create, overwrite with O_TRUNC, append + fsync, write a temp file and
``os.replace`` it over a target, unlink, rename; sizes from 0 to 3x the write tier, so some files
switch to write-through), and kills the daemon at a random moment: while the writer writes, while
write-back runs, or while the next mount is still recovering (``tierfs mount`` has not returned
yet). After each kill:

* the backing store holds, under every final name, a version the mount had shown for that name
  or nothing (never a partial or mixed file), and no temporary name of the write-back is visible
  through the mount;
* after the restart every file the writer had closed (its last operation reported done) reads
  back exactly; a file whose last operation the kill cut may hold any of its versions or any
  prefix-free partial content, as on a local filesystem after a crash;
* every ``--flush-every`` rounds: ``tierfs flush`` and the backing store equals the mount and
  holds no temporary file.

Usage (root; a few minutes for 100 kills)::

    .venv/bin/python bench/crash_loop.py --kills 120 --seed 1

It prints one line per kill and a summary with the counts by moment; exit status 1 on any lost or
partial file. Not part of ``make test`` (minutes of random kills); the test suite's
``tests/test_crash.py`` and the in-process crash-injection tests run the same checks on fixed
moments.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
TMP_PREFIX = ".tierfs-wb."
ANY = "*"  # after a kill cut its last operation: any content is acceptable

WRITER = r"""
import hashlib, json, os, random, sys
mnt, seed, tier = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rnd = random.Random(seed)
def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n"); sys.stdout.flush()
def data(n):
    return rnd.randbytes(n)
def size():
    r = rnd.random()
    if r < 0.15: return 0
    if r < 0.55: return rnd.randrange(1, 256 << 10)
    if r < 0.85: return rnd.randrange(1 << 20, 24 << 20)
    return rnd.randrange(tier // 2, 3 * tier)  # past the write tier: write-through
names = [f"d{i % 3}/f{i}" for i in range(12)]
for d in ("d0", "d1", "d2"):
    os.makedirs(os.path.join(mnt, d), exist_ok=True)
for step in range(10**6):
    op = rnd.choice(["create", "create", "overwrite", "append", "replace", "unlink", "rename"])
    rel = rnd.choice(names)
    p = os.path.join(mnt, rel)
    say(start=op, rel=rel)
    if op in ("create", "overwrite"):
        b = data(size())
        with open(p, "wb") as f:
            for i in range(0, len(b), 1 << 20):
                f.write(b[i:i + (1 << 20)])
        say(done=op, rel=rel, sha=hashlib.sha256(b).hexdigest())
    elif op == "append":
        try:
            with open(p, "rb") as f:
                old = f.read()
        except FileNotFoundError:
            old = b""
        b = data(rnd.randrange(1, 4 << 20))
        with open(p, "ab") as f:
            f.write(b); f.flush(); os.fsync(f.fileno())
        say(done=op, rel=rel, sha=hashlib.sha256(old + b).hexdigest())
    elif op == "replace":
        b = data(size())
        tmp = p + ".tmp"
        with open(tmp, "wb") as f:
            f.write(b); f.flush(); os.fsync(f.fileno())
        os.replace(tmp, p)
        say(done=op, rel=rel, tmp=rel + ".tmp", sha=hashlib.sha256(b).hexdigest())
    elif op == "unlink":
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        say(done=op, rel=rel)
    elif op == "rename":
        dst = rnd.choice(names)
        if dst == rel:
            say(done=op, rel=rel, dst=dst, noop=True)
            continue
        say(start="rename2", rel=dst)
        try:
            os.rename(p, os.path.join(mnt, dst))
            say(done=op, rel=rel, dst=dst)
        except FileNotFoundError:
            say(done=op, rel=rel, dst=dst, noop=True)
"""


def sha(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except FileNotFoundError:
        return None


def tierfs(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "tierfs", *args], capture_output=True, text=True,
                       cwd=REPO, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"tierfs {' '.join(args)}: {r.stderr}{r.stdout}")
    return r


def daemon_pid(mnt: Path) -> int | None:
    """The daemon serving (or starting to serve) ``mnt``: found by its command line."""
    me = str(mnt)
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"tierfs" in argv and me.encode() in argv and b"--ready-fd" in argv:
            return int(d)
    return None


def kill9(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    for _ in range(500):
        try:
            st = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
        except (OSError, IndexError):
            return
        if st == "Z":
            return
        time.sleep(0.01)


def is_mounted(mnt: Path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(mnt) for line in f)


def clear_dead_mount(mnt: Path) -> None:
    if is_mounted(mnt):
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tier", default="48MiB", help="write tier (SSD) size")
    ap.add_argument("--flush-every", type=int, default=5)
    ap.add_argument("--workdir", help="default: a new directory under /tmp, removed at the end")
    args = ap.parse_args(argv)
    rnd = random.Random(args.seed)
    tier_bytes = int(args.tier.removesuffix("MiB")) * MiB
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tierfs-crash-"))
    back, mnt, ssd = work / "back", work / "mnt", work / "ssd"
    back.mkdir(parents=True, exist_ok=True)
    mnt.mkdir(exist_ok=True)
    mount_args = ["mount", str(back), str(mnt), "--ram", "32MiB", "--ssd", f"{ssd}:{args.tier}",
                  "-o", "writeback_deadline=2"]
    model: dict[str, str | None] = {}  # rel -> sha the mount must show (None: absent; ANY)
    history: dict[str, set[str]] = {}  # every version each name has shown
    counts = {"during_writes": 0, "during_writeback": 0, "during_recovery": 0, "lost": 0,
              "partial_on_backing": 0, "tmp_visible": 0, "tmp_left_after_flush": 0,
              "backing_differs_after_flush": 0, "mount_failed": 0}
    failures: list[str] = []
    t0 = time.monotonic()

    def fail(kind: str, msg: str) -> None:
        counts[kind] += 1
        failures.append(msg)
        print("  FAIL:", msg, flush=True)

    def check_backing_versions(in_flight: set[str]) -> None:
        """``in_flight``: names whose last operation the kill cut. Their backing content may be
        anything the cut operation left (an O_TRUNC rewrite of a written-through file goes to the
        backing file itself, as on a local disk), so it joins their history instead of being
        judged; every other name must hold a version the mount showed."""
        for rel in in_flight:
            got = sha(back / rel)
            if got is not None:
                history.setdefault(rel, set()).add(got)
        for rel, seen in history.items():
            got = sha(back / rel)
            if got is not None and got not in seen:
                fail("partial_on_backing", f"backing {rel} holds an unknown version "
                     f"({(back / rel).stat().st_size} bytes; mount model {model.get(rel) and str(model.get(rel))[:12]}, "
                     f"{len(seen)} known versions)")

    def check_mount() -> None:
        for dirpath, dirs, files in os.walk(mnt):
            bad = [n for n in dirs + files if n.startswith(TMP_PREFIX)]
            if bad:
                fail("tmp_visible", f"temporary names visible in the mount: {dirpath}: {bad}")
        for rel, want in list(model.items()):
            got = sha(mnt / rel)
            if want == ANY:
                model[rel] = got
            elif got != want:
                fail("lost", f"{rel}: mount shows {got and got[:12]}, closed version was {want and want[:12]}")
                model[rel] = got
            if got is not None:
                history.setdefault(rel, set()).add(got)

    try:
        tierfs(*mount_args)
        for k in range(args.kills):
            moment = rnd.choices(["during_writes", "during_writeback", "during_recovery"], [5, 3, 2])[0]
            writer = subprocess.Popen([sys.executable, "-c", WRITER, str(mnt), str(rnd.randrange(1 << 30)),
                                       str(tier_bytes)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True)
            pending: set[str] = set()
            run_for = rnd.uniform(0.2, 3.0)
            deadline = time.monotonic() + run_for
            os.set_blocking(writer.stdout.fileno(), False)  # type: ignore[union-attr]
            buf = [""]

            def drain(writer: subprocess.Popen = writer, pending: set[str] = pending,
                      buf: list[str] = buf) -> None:
                try:
                    chunk = writer.stdout.read()  # type: ignore[union-attr]
                except (TypeError, OSError):
                    chunk = None
                if chunk:
                    buf[0] += chunk
                while "\n" in buf[0]:
                    line, buf[0] = buf[0].split("\n", 1)
                    ev = json.loads(line)
                    if "start" in ev:
                        pending.add(ev["rel"])
                        continue
                    rel = ev["rel"]
                    op = ev["done"]
                    pending.discard(rel)
                    if op in ("create", "overwrite", "append"):
                        model[rel] = ev["sha"]
                        history.setdefault(rel, set()).add(ev["sha"])
                    elif op == "replace":
                        model[rel] = ev["sha"]
                        history.setdefault(rel, set()).add(ev["sha"])
                        model.pop(ev["tmp"], None)
                        pending.discard(ev["tmp"])
                    elif op == "unlink":
                        model[rel] = None
                    elif op == "rename":
                        pending.discard(ev["dst"])
                        if not ev.get("noop"):
                            model[ev["dst"]] = model.get(rel)
                            if model[ev["dst"]] not in (None, ANY):
                                history.setdefault(ev["dst"], set()).add(model[ev["dst"]])  # type: ignore[arg-type]
                            model[rel] = None

            while time.monotonic() < deadline and writer.poll() is None:
                drain()
                time.sleep(0.01)
            if moment == "during_writeback":
                writer.kill()
                writer.wait()
                drain()
                # let write-back start on what was written (deadline 2 s), then kill inside it
                end = time.monotonic() + 5
                while time.monotonic() < end:
                    try:
                        wb = json.loads((mnt / ".tierfs" / "stats.json").read_bytes())["writeback"]
                    except (OSError, ValueError):
                        break
                    if wb["writing"] > 0 or wb["dirty_files"] == 0:
                        break
                    time.sleep(0.005)
                time.sleep(rnd.uniform(0, 0.05))
            pid = daemon_pid(mnt)
            if pid is not None:
                kill9(pid)
            writer.kill()
            writer.wait()
            drain()
            in_flight = set(pending)
            for rel in pending:
                model[rel] = ANY
                if not rel.endswith(".tmp"):  # a cut "replace" may have left its temp file
                    model[rel + ".tmp"] = ANY
                    in_flight.add(rel + ".tmp")
            counts[moment] += 1
            check_backing_versions(in_flight)
            clear_dead_mount(mnt)
            if moment == "during_recovery":
                # start the daemon and kill it while it is still recovering (before it answers)
                starter = subprocess.Popen([sys.executable, "-m", "tierfs", *mount_args], cwd=REPO,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                end = time.monotonic() + 10
                pid = None
                while pid is None and time.monotonic() < end:
                    pid = daemon_pid(mnt)
                    time.sleep(0.002)
                time.sleep(rnd.uniform(0, 0.4))
                if pid is not None:
                    kill9(pid)
                starter.wait(timeout=120)
                check_backing_versions(in_flight)
                clear_dead_mount(mnt)
            r = tierfs(*mount_args, check=False)
            if r.returncode != 0:
                fail("mount_failed", f"mount after kill {k + 1} failed: {r.stderr.strip()}")
                break
            check_mount()
            if (k + 1) % args.flush_every == 0:
                tierfs("flush", str(mnt))
                for dirpath, dirs, files in os.walk(back):
                    left = [n for n in dirs + files if n.startswith(TMP_PREFIX)]
                    if left:
                        fail("tmp_left_after_flush", f"temporary files left after flush: {dirpath}: {left}")
                for rel in model:
                    if sha(back / rel) != sha(mnt / rel):
                        fail("backing_differs_after_flush", f"after flush, backing {rel} differs from the mount")
            print(f"kill {k + 1:3d} {moment:17s} files={sum(v is not None for v in model.values()):2d} "
                  f"failures={len(failures)} t={time.monotonic() - t0:.0f}s", flush=True)
    finally:
        if is_mounted(mnt):
            tierfs("umount", str(mnt), "--timeout", "60", check=False)
        pid = daemon_pid(mnt)
        if pid is not None:
            kill9(pid)
        clear_dead_mount(mnt)
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"kills": sum(counts[m] for m in ("during_writes", "during_writeback", "during_recovery")),
                      **counts, "seconds": round(time.monotonic() - t0)}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
