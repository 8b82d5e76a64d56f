"""What a large hint plan costs Python's cyclic garbage collector (and memory), in-process.

A full (generation 2) collection visits every object the collector tracks; it runs on the
event loop, inside whichever task step happened to allocate, so its duration is a step the
event-loop watch sees (docs/concurrency.md, "The event-loop bound"). This registers hints the
way a client does (``need`` / ``epoch`` requests through :class:`HintService.handle`) and reports,
after each: the collections during it (full ones, the longest), the objects the collector tracks, the time of a full collection (best of 5,
milliseconds), the process's RSS and the most numerous tracked types.

Scenarios (``--scenario``):
  test100k   200 files, each named 500 times (tests/test_hints_mount.py's 100 000 paths),
             then 100 000 names that do not exist
  files100k  100 000 distinct one-chunk files (need), then the same as an epoch order
  items500k  MAX_ITEMS (500 000) items [path, offset, length], one chunk each, over 5000
             sparse files of 100 chunks

Usage: PYTHONPATH=. python bench/bench_hints_gc.py --scenario files100k [--dir /tmp] [--freeze]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import trio

from tierfs.cache.manager import Cache
from tierfs.cache.plan import HintPlan
from tierfs.cache.policy import Policy
from tierfs.cache.tier import Tier
from tierfs.io import Device
from tierfs.predict.hints import HintService
from tierfs.sched.scheduler import TransactionScheduler

CS = 1 << 20


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def full_gc_ms() -> float:
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


FREEZE = False
_worst = {"ms": 0.0, "n2": 0, "t": 0.0}


def _timed(phase: str, info: dict[str, int]) -> None:
    """gc.callbacks: the longest collection (and the count of full ones) since the last report."""
    if phase == "start":
        _worst["t"] = time.perf_counter()
        return
    _worst["ms"] = max(_worst["ms"], (time.perf_counter() - _worst["t"]) * 1e3)
    _worst["n2"] += info["generation"] == 2


def report(what: str) -> None:
    if FREEZE:
        gc.freeze()  # what gc.freeze() after a large plan would give (see --freeze)
    objs = gc.get_objects()
    top = Counter(type(o).__name__ for o in objs).most_common(5)
    n = len(objs)
    del objs
    during = f"gen2 {_worst['n2']:>2}, worst {_worst['ms']:5.1f} ms"
    print(f"{what:<30} during: {during}  after: tracked {n:>9,}  full gc {full_gc_ms():6.1f} ms  "
          f"RSS {rss_mib():6.1f} MiB  "
          f"top {', '.join(f'{k} {v:,}' for k, v in top)}", flush=True)
    _worst.update(ms=0.0, n2=0)


def make_files(root: Path, count: int, size: int) -> list[str]:
    names = []
    for i in range(count):
        d = root / f"d{i % 100}"
        d.mkdir(exist_ok=True)
        p = d / f"f{i}.bin"
        with open(p, "wb") as f:
            f.truncate(size)  # sparse: no data blocks
        names.append(f"d{i % 100}/f{i}.bin")
    return names


async def run(scenario: str, base: Path) -> None:
    root = base / "backing"
    root.mkdir()
    inline = Device("meta", 1, inline_under=math.inf)
    plan = HintPlan()
    tiers = [Tier("ram", str(base / "ram"), 1 << 40, inline=True)]

    async def read_backing(f: Any, offset: int, length: int) -> bytes:
        raise AssertionError("not fetched here")

    sched = TransactionScheduler(read_backing, chunk_size=CS, slice_size=4 * CS, depth=1)
    cache = Cache(tiers, [inline], Policy("nothrash", window=1 << 16, plan=plan), sched,
                  chunk_size=CS, staging_bytes=2 * CS)
    svc = HintService(cache=cache, scheduler=sched, backing_root=os.fsencode(root), meta=inline,
                      chunk_size=CS, write_tier=0, budget=0, pace=False)
    gc.collect()
    gc.callbacks.append(_timed)
    report("start")
    t = time.perf_counter()
    if scenario == "test100k":
        names = make_files(root, 200, 4096)
        order = [names[i % 200] for i in range(100_000)]
        r = await svc.handle({"op": "need", "items": order})
        report(f"need 100k paths ({r['files']} files)")
        await svc.handle({"op": "epoch", "paths": order})
        report("+ epoch 100k paths")
        await svc.handle({"op": "need", "items": [f"nope/x{i}.bin" for i in range(100_000)]})
        report("+ need 100k missing")
    elif scenario == "files100k":
        names = make_files(root, 100_000, 4096)
        r = await svc.handle({"op": "need", "items": names})
        report(f"need 100k files ({r['files']})")
        await svc.handle({"op": "epoch", "paths": names})
        report("+ epoch 100k files")
    elif scenario == "items500k":
        names = make_files(root, 5000, 100 * CS)
        # tuples, as the control parser makes of [path, offset, length] (tierfs.fs.ctl)
        items = [(names[i % 5000], (i // 5000) * CS, CS) for i in range(500_000)]
        r = await svc.handle({"op": "need", "items": items})
        report(f"need 500k items ({r['files']} files)")
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    print(f"({time.perf_counter() - t:.1f} s)")
    svc.close()
    cache.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="test100k")
    ap.add_argument("--dir", default=None, help="where to create the sparse backing files")
    ap.add_argument("--freeze", action="store_true", help="gc.freeze() after each request (the collector "
                    "then skips everything alive; gc.get_objects() still lists the frozen objects)")
    a = ap.parse_args()
    global FREEZE
    FREEZE = a.freeze
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        trio.run(run, a.scenario, Path(d))


if __name__ == "__main__":
    main()
