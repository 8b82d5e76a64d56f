"""``tierfs where``, ``tierfs warmup`` and ``tierfs evict`` through a real mount, and the hint
plan in ``tierfs stats``."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import needs_fuse, tierfs_cmd, write_random

pytestmark = needs_fuse

MiB = 1 << 20


def resident(m, path: Path) -> int:  # type: ignore[no-untyped-def]
    out = tierfs_cmd("where", "--json", str(path)).stdout
    (f,) = json.loads(out)
    return sum(f["resident_bytes"].values())


def test_warmup_where_evict(tiermount, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    for i in range(4):
        write_random(tmp_path / "back" / "shards" / f"{i}.tar", 3 * MiB, seed=i)
    m = tiermount(ram="64MiB", ssd=None, extra=("--chunk-size", "1MiB"))
    shard = m.mnt / "shards" / "0.tar"
    assert resident(m, shard) == 0
    out = tierfs_cmd("warmup", str(m.mnt / "shards"), "--by", "30").stdout
    assert "warming 4 files" in out and "done" in out
    for i in range(4):
        assert resident(m, m.mnt / "shards" / f"{i}.tar") == 3 * MiB
    table = tierfs_cmd("where", str(m.mnt / "shards")).stdout
    assert "4 files, 12.0 MiB of 12.0 MiB resident (100%)" in table
    before = m.stats()["cache"]["bytes_served_from_backing"]
    assert shard.read_bytes() == (tmp_path / "back" / "shards" / "0.tar").read_bytes()
    assert m.stats()["cache"]["bytes_served_from_backing"] == before  # served from the tiers
    hp = m.stats()["hints"]
    assert hp["declared_bytes"] == 12 * MiB and hp["to_fetch_bytes"] == 0 and hp["deadline_misses"] == 0
    assert "hint plan" in tierfs_cmd("stats", str(m.mnt)).stdout
    out = tierfs_cmd("evict", str(shard)).stdout
    assert "evicted 3 chunks" in out
    assert resident(m, shard) == 0 and resident(m, m.mnt / "shards" / "1.tar") == 3 * MiB


def test_hint_commands_refuse_paths_off_the_mount(tiermount, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    m = tiermount(ram="16MiB", ssd=None)
    (tmp_path / "elsewhere").write_bytes(b"x")
    for cmd in ("where", "warmup", "evict"):
        r = tierfs_cmd(cmd, str(tmp_path / "elsewhere"), check=False)
        assert r.returncode == 1 and "not on a tierfs mount" in r.stderr, (cmd, r.stderr)
    r = tierfs_cmd("where", str(m.mnt / "missing.bin"), check=False)
    assert r.returncode == 0 and "not a file on the backing store" in r.stdout


def test_warmup_that_cannot_fit_says_so(tiermount, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    for i in range(6):
        write_random(tmp_path / "back" / f"{i}.bin", 4 * MiB, seed=i)
    m = tiermount(ram="8MiB", ssd=None, extra=("--chunk-size", "1MiB", "-o", "staging=4MiB"))
    r = tierfs_cmd("warmup", str(m.mnt), "--timeout", "60", check=False)
    assert r.returncode == 1 and "NOT done" in r.stdout and "hold no more" in r.stdout, r.stdout


def test_shards_read_in_name_order_are_prefetched_across_files(tiermount, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """No hints: a reader streaming shards in name order finds the next shard's first chunks
    already fetched when it opens it (next-file prediction)."""
    n = 8
    for i in range(n):
        write_random(tmp_path / "back" / "shards" / f"{i:03d}.tar", 2 * MiB, seed=i)
    m = tiermount(ram="64MiB", ssd=None, extra=("--chunk-size", "1MiB"))
    found_ahead = 0
    for i in range(n):
        p = m.mnt / "shards" / f"{i:03d}.tar"
        if i >= 3:
            found_ahead += resident(m, p) > 0
        with open(p, "rb") as f:
            while f.read(256 * 1024):
                pass
    # a resident shard's open passes through (native transport): the daemon sees no read
    # reach its end, and predicts the next shard at that open instead
    pred = m.stats()["hints"]["next_file_predictions"]
    assert pred["right"] >= 4 and pred["wrong"] == 0, (pred, found_ahead)
    assert found_ahead >= 4
