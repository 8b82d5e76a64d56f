"""examples/train.py: the read order it announces with --hints is the order it reads, and a
run with --hints and eval passes through a real mount reports what the benchmark needs
(bench/bench_hints_e2e.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
import make_shards  # noqa: E402
import train  # noqa: E402


def _shards(out: Path, size: str = "1MiB", shard: str = "128KiB") -> list[Path]:
    make_shards.build(out, make_shards.parse_size(size), make_shards.parse_size(shard), False, 0)
    return sorted(out.glob("text-*.tar"))


class _WhichShard(train.ShardStream):
    """Yields the shard each sample comes from, in the order the workers read them."""

    def __iter__(self):  # type: ignore[no-untyped-def,override]
        info = torch.utils.data.get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        for shard in self.shards_for_worker(w, n):
            for _ in train.iter_tar_samples(shard):
                yield shard.name


def test_read_order_is_the_order_the_dataloader_reads(tmp_path: Path) -> None:
    """Batches come from the workers in turn, and the shards hold about as many samples each,
    so the order in which shards first appear in the batches is the interleaved order."""
    shards = _shards(tmp_path / "d")
    ds = _WhichShard(shards, seed=3, buffer_size=1, max_len=64)
    for epoch in (1, 2):
        ds.set_epoch(epoch)
        seen: list[str] = []
        loader = DataLoader(ds, batch_size=32, num_workers=2, collate_fn=lambda b: b)
        for batch in loader:
            seen.extend(s for s in batch if s not in seen)
        expect = [p.name for p in ds.read_order(epoch, 2)]
        assert sorted(expect) == sorted(p.name for p in shards)
        # within a window of 2 (the two workers start their next shards at about the same time)
        assert all(abs(seen.index(name) - i) <= 1 for i, name in enumerate(expect)), (seen, expect)
    assert ds.read_order(1, 2) != ds.read_order(2, 2)  # a new order per epoch


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1])


def test_hints_and_eval_through_a_mount(tiermount, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """--hints registers the epoch orders and the eval phases with the daemon; every eval pass
    reports its resident fraction (from ``where``) and whether its data was there in time."""
    _shards(tmp_path / "back")
    m = tiermount(ram="64MiB")
    common = ["--data", str(m.mnt), "--epochs", "2", "--workers", "2", "--width", "16", "--max-len", "32",
              "--batch-size", "64", "--threads", "1", "--sample-bytes", "0", "--log-every", "0",
              "--eval-every", "5", "--eval-holdout", "1", "--eval-lead", "1000", "--json"]
    plain = _run(common, capsys)
    assert plain["hints"] is False and plain["announced"] == []
    assert len(plain["evals"]) >= 2
    for ev in plain["evals"]:
        assert 0.0 <= ev["resident_fraction"] <= 1.0
        assert ev["deadline_met"] == (ev["resident_fraction"] == 1.0)
        assert ev["hint_done"] is None
    hinted = _run([*common, "--hints"], capsys)
    assert [a["epochs"] for a in hinted["announced"]] == [[1, 2], [2]]
    assert hinted["announced"][0]["files"] == hinted["shards"]  # every training shard, on the mount
    assert len(hinted["evals"]) == len(plain["evals"])
    for ev in hinted["evals"]:
        assert ev["announced_at_s"] is not None and ev["hint_done"] is not None
        assert ev["deadline_met"] == (ev["resident_fraction"] == 1.0)
    doc = m.stats()
    assert doc["hints"]["requests"] >= 2 + len(hinted["evals"])  # epochs + phases (+ where, progress)
    # same data, same seeds: the hints change nothing the model sees
    assert [e["loss"] for e in hinted["epochs"]] == pytest.approx([e["loss"] for e in plain["epochs"]], rel=1e-5)
    assert [e["loss"] for e in hinted["evals"]] == pytest.approx([e["loss"] for e in plain["evals"]], rel=1e-5)
