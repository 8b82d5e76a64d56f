"""The hints client against a real mount: need/progress/wait/cancel, release, epoch from a
DataLoader, checkpoint, wait_durable, refusals, and 100 000 paths.

What these tests expect of the daemon (beyond ``tierfs_hints/wire.py``) is written in each
test's docstring and collected in docs/hints.md ("What the client relies on").
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
import warnings
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, get_worker_info

import tierfs_hints
from tests.conftest import drop_page_cache, needs_fuse, write_random
from tierfs_hints import Client, TierfsHintWarning, wire
from tierfs_hints.torch import HintedSampler, hinted_shards

pytestmark = [needs_fuse, pytest.mark.fuse]
MiB = 1 << 20


def _eventually(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        time.sleep(0.05)


def _where(mnt: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """``{name: where-record}`` from the daemon's ``where`` op (the wire, not the client)."""
    reply = wire.request(str(mnt), {"op": "where", "paths": names})
    return {f["path"]: f for f in reply["files"]}


def _ram(mnt: Path, names: list[str]) -> dict[str, int]:
    return {n: int(f["resident_bytes"]["ram"]) for n, f in _where(mnt, names).items()}


def _counters(m: Any) -> tuple[int, int, int]:
    """(bytes served from the tiers: through the daemon, or handed to the kernel by passthrough
    opens of resident files; bytes served from the backing store; bytes read from it)."""
    s = m.stats()
    passed = sum(t.get("passthrough_bytes", 0) for t in s["tiers"])
    return (s["cache"]["bytes_served_from_tiers"] + passed, s["cache"]["bytes_served_from_backing"],
            s["scheduler"]["backing_bytes_read"])


def _files(back: Path, n: int, size: int, prefix: str = "d/f", seed: int = 0) -> dict[str, bytes]:
    return {f"{prefix}{i}.bin": write_random(back / f"{prefix}{i}.bin", size, seed=seed + i)
            for i in range(n)}


# ------------------------------------------------------------------------------------------
# need, progress, wait, cancel
# ------------------------------------------------------------------------------------------


def test_need_wait_then_reads_come_from_the_tiers(tiermount, tmp_path: Path) -> None:
    """After need() + wait(), progress() shows every byte resident in a tier (RAM here: the
    only tier, with room), and reading the files is served by the tiers: the backing store is
    not read again. ``total_bytes`` / ``bytes`` count the files' sizes."""
    datas = {f"d/f{i}.bin": write_random(tmp_path / "back" / "d" / f"f{i}.bin", 3 * MiB + 17 * i, seed=i)
             for i in range(4)}
    total = sum(map(len, datas.values()))
    m = tiermount(ram="64MiB")
    h = tierfs_hints.need([m.mnt / n for n in datas], label="warm")
    assert (h.files, h.nbytes, h.missing) == (4, total, [])
    assert h.wait(timeout=60) is True
    p = h.progress()
    assert p.done and not p.missed and not p.cancelled
    assert (p.total_bytes, p.remaining_bytes, p.fraction) == (total, 0, 1.0)
    assert p.resident_bytes["ram"] + p.resident_bytes["ssd"] == total, p
    before = _counters(m)
    for n, data in datas.items():
        drop_page_cache(m.mnt / n)
        assert (m.mnt / n).read_bytes() == data
    after = _counters(m)
    assert after[0] - before[0] >= total, (before, after)  # served from the tiers
    assert after[1:] == before[1:], (before, after)  # and not from the backing store


def test_need_byte_range(tiermount, tmp_path: Path) -> None:
    """A ``(path, offset, length)`` item covers those bytes: with 1 MiB chunks, the second MiB
    of a 4 MiB file is 1 MiB of ``total_bytes`` and is then read from the tier."""
    data = write_random(tmp_path / "back" / "big.bin", 4 * MiB, seed=9)
    m = tiermount(ram="64MiB", extra=("--chunk-size", "1MiB"))
    h = tierfs_hints.need([(m.mnt / "big.bin", MiB, MiB)])
    assert h.wait(60)
    assert h.progress().total_bytes == MiB
    before = _counters(m)
    with open(m.mnt / "big.bin", "rb", buffering=0) as f:
        f.seek(MiB)
        assert f.read(MiB) == data[MiB:2 * MiB]
    after = _counters(m)
    # (kernel and daemon readahead may go on past the range: only the tier side is exact)
    assert after[0] - before[0] >= MiB, (before, after)


@pytest.mark.parametrize("by", [30, timedelta(seconds=30),
                                lambda: datetime.now() + timedelta(seconds=30)])
def test_need_with_a_deadline(tiermount, tmp_path: Path, by: Any) -> None:
    """The deadline reaches the daemon: ``deadline_in_s`` counts down from 30 s; met."""
    _files(tmp_path / "back", 3, 2 * MiB)
    m = tiermount(ram="64MiB")
    h = tierfs_hints.need([m.mnt / f"d/f{i}.bin" for i in range(3)], by=by() if callable(by) else by)
    p = h.progress()
    assert p.deadline_in_s is not None and 20 < p.deadline_in_s <= 30, p
    assert h.wait(60)
    p = h.progress()
    assert p.done and not p.missed, p


def test_phase(tiermount, tmp_path: Path) -> None:
    """phase() is a need with a deadline ``at`` seconds from now, labelled with its name."""
    datas = _files(tmp_path / "back", 2, MiB, prefix="val/v")
    m = tiermount(ram="64MiB")
    h = tierfs_hints.phase("eval", 20, [m.mnt / n for n in datas])
    assert h.label == "eval" and h.nbytes == 2 * MiB
    p = h.progress()
    assert p.deadline_in_s is not None and p.deadline_in_s <= 20
    assert h.wait(60) and h.progress().remaining_bytes == 0


def test_cancel(tiermount, tmp_path: Path) -> None:
    """After cancel() the daemon still answers progress for the need, with ``cancelled``;
    wait() is False; a second cancel is harmless; reads stay correct. As a context manager a
    handle cancels on exit."""
    datas = _files(tmp_path / "back", 8, 4 * MiB)
    m = tiermount(ram="64MiB")
    h = tierfs_hints.need([m.mnt / n for n in datas])
    h.cancel()
    h.cancel()
    assert h.progress().cancelled
    assert h.wait(1) is False
    for n, data in datas.items():
        assert (m.mnt / n).read_bytes() == data
    with tierfs_hints.need([m.mnt / "d/f0.bin"]) as h2:
        pass
    assert h2.progress().cancelled


# ------------------------------------------------------------------------------------------
# release and eviction order
# ------------------------------------------------------------------------------------------


def test_release_is_evicted_first(tiermount, tmp_path: Path) -> None:
    """A RAM tier of 8 chunks (LRU, 1 MiB chunks) filled by reading f0..f7 (1 MiB each, f0 first:
    the least recently used). release(f5), then reading f8 needs one chunk of room: f5 goes, not
    LRU's choice f0."""
    names = list(_files(tmp_path / "back", 9, MiB))
    m = tiermount(ram="9MiB", extra=("--chunk-size", "1MiB", "--eviction", "lru"))  # 8 chunks: the journal sets 576 KiB aside
    # Not in name order: a reader going through a directory in name order makes tierfs
    # prefetch the next file (next-file prediction), which would take f8's place early.
    for i in (0, 5, 2, 7, 1, 4, 3, 6):
        n = names[i]
        drop_page_cache(m.mnt / n)
        (m.mnt / n).read_bytes()
    _eventually(lambda: all(v == MiB for v in _ram(m.mnt, names[:8]).values()),
                what="f0..f7 resident in RAM")
    assert tierfs_hints.release(m.mnt / names[5]) == 1
    drop_page_cache(m.mnt / names[8])
    (m.mnt / names[8]).read_bytes()
    _eventually(lambda: _ram(m.mnt, [names[8]])[names[8]] == MiB, what="f8 resident")
    ram = _ram(m.mnt, names)
    assert ram[names[5]] == 0, ram
    assert all(ram[n] == MiB for n in names if n != names[5]), ram


# ------------------------------------------------------------------------------------------
# epoch() from training code
# ------------------------------------------------------------------------------------------

SAMPLES_PER_FILE, SAMPLE = 4, 256 * 1024


class MountedShards(Dataset):  # type: ignore[type-arg]
    """8 files of 1 MiB on the mount, 4 samples of 256 KiB each; a sample is its sha1 prefix."""

    def __init__(self, mnt: Path, n_files: int = 8) -> None:
        self.mnt, self.n = str(mnt), n_files * SAMPLES_PER_FILE

    def __len__(self) -> int:
        return self.n

    def path_of(self, i: int) -> str:
        return f"{self.mnt}/d/f{i // SAMPLES_PER_FILE}.bin"

    def __getitem__(self, i: int) -> torch.Tensor:
        with open(self.path_of(i), "rb") as f:
            f.seek(i % SAMPLES_PER_FILE * SAMPLE)
            return torch.tensor(int(hashlib.sha1(f.read(SAMPLE)).hexdigest()[:12], 16))


def _sample_digests(datas: dict[str, bytes]) -> list[int]:
    out = []
    for i in range(len(datas) * SAMPLES_PER_FILE):
        data = datas[f"d/f{i // SAMPLES_PER_FILE}.bin"]
        off = i % SAMPLES_PER_FILE * SAMPLE
        out.append(int(hashlib.sha1(data[off:off + SAMPLE]).hexdigest()[:12], 16))
    return out


def test_epoch_from_dataloader_with_workers(tiermount, tmp_path: Path) -> None:
    """HintedSampler in a DataLoader with 2 worker processes: the epoch is announced from the
    main process, the batches are right, the announced order is prefetched (its handle
    completes with 8 MiB), and the next epoch reads nothing from the backing store."""
    datas = _files(tmp_path / "back", 8, MiB)
    m = tiermount(ram="64MiB")
    ds = MountedShards(m.mnt)
    hs = HintedSampler(RandomSampler(ds, generator=torch.Generator().manual_seed(0)), ds.path_of)
    loader = DataLoader(ds, sampler=hs, batch_size=4, num_workers=2)
    want = _sample_digests(datas)
    got = [int(x) for b in loader for x in b]
    assert sorted(got) == sorted(want)
    assert hs.handle is not None
    assert hs.handle.wait(60)
    assert hs.handle.progress().total_bytes == 8 * MiB
    for n in datas:
        drop_page_cache(m.mnt / n)
    before = _counters(m)
    assert sorted(int(x) for b in loader for x in b) == sorted(want)
    after = _counters(m)
    assert after[2] == before[2], (before, after)


class MountedShardStream(IterableDataset):  # type: ignore[type-arg]
    """Each DataLoader worker reads its split of the shards whole, announced by hinted_shards."""

    def __init__(self, shards: list[str]) -> None:
        self.shards = shards

    def __iter__(self) -> Any:
        info = get_worker_info()
        mine = self.shards if info is None else self.shards[info.id::info.num_workers]
        for shard in hinted_shards(mine):
            with open(shard, "rb") as f:
                yield torch.tensor(int(hashlib.sha1(f.read()).hexdigest()[:12], 16))


def test_hinted_shards_in_workers(tiermount, tmp_path: Path) -> None:
    """Each worker announces its own split (its own source); shards are read correctly."""
    datas = _files(tmp_path / "back", 6, MiB, prefix="shards/s")
    m = tiermount(ram="64MiB")
    shards = [str(m.mnt / n) for n in datas]
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error", TierfsHintWarning)  # the shards are on the mount
            got = sorted(int(x) for x in DataLoader(MountedShardStream(shards), num_workers=2,
                                                     batch_size=None))
        assert got == sorted(int(hashlib.sha1(d).hexdigest()[:12], 16) for d in datas.values())


# ------------------------------------------------------------------------------------------
# checkpoint and wait_durable
# ------------------------------------------------------------------------------------------


def test_checkpoint_reserve_then_write(tiermount, tmp_path: Path) -> None:
    """checkpoint() on a directory that does not exist yet reserves the room asked for (the SSD
    write tier has it); the write tier then keeps that much free, even after reads filled the
    tiers; the checkpoint written there is durable after wait_durable(). A second declaration
    for the directory replaces the first."""
    back = tmp_path / "back"
    names = list(_files(back, 24, 4 * MiB, prefix="data/x"))
    m = tiermount(ram="16MiB", ssd="96MiB")
    ckpt = m.mnt / "ckpt"
    assert tierfs_hints.checkpoint(ckpt, "32MiB", every=60) == 32 * MiB
    for n in names:
        (m.mnt / n).read_bytes()

    def ssd_free() -> int:
        t = m.tier("ssd")
        return int(t["effective_capacity_bytes"]) - int(t["used_bytes"])

    _eventually(lambda: ssd_free() >= 32 * MiB, what="32 MiB of SSD room kept free")
    ckpt.mkdir()
    data = os.urandom(32 * MiB)
    with open(ckpt / "step1.pt", "wb") as f:
        f.write(data)
    assert tierfs_hints.wait_durable([ckpt / "step1.pt"], timeout=120) is True
    assert (back / "ckpt" / "step1.pt").read_bytes() == data
    assert tierfs_hints.checkpoint(ckpt, 16 * MiB, timedelta(minutes=30)) == 16 * MiB


def test_wait_durable(tiermount, tmp_path: Path) -> None:
    """Files written through the mount are on the backing store, whole, once wait_durable()
    returns True; a file that is not dirty is durable at once: the daemon answers a flush of it
    with a zero timeout, naming no file waited for, and writes nothing back for it."""
    write_random(tmp_path / "back" / "clean.bin", MiB, seed=1)
    m = tiermount(ram="64MiB", ssd="128MiB")
    datas = {f"out/w{i}.bin": os.urandom(3 * MiB + i) for i in range(3)}
    (m.mnt / "out").mkdir()
    for n, d in datas.items():
        (m.mnt / n).write_bytes(d)
    assert tierfs_hints.wait_durable([m.mnt / n for n in datas], timeout=120) is True
    for n, d in datas.items():
        assert (tmp_path / "back" / n).read_bytes() == d
    written = m.stats()["writeback"]["written_files"]
    assert written >= len(datas)
    # timeout 0: any wait at all would make the daemon answer "timed out" (a ControlError)
    reply = wire.request(str(m.mnt), {"op": "flush", "paths": ["clean.bin"], "timeout": 0})
    assert reply["ok"] is True and reply["waited"] == [] and not reply.get("timed_out")
    assert tierfs_hints.wait_durable(m.mnt / "clean.bin", timeout=30) is True
    wb = m.stats()["writeback"]
    assert (wb["written_files"], wb["dirty_files"]) == (written, 0)


# ------------------------------------------------------------------------------------------
# Refusals: off the mount, escapes, bad input, a dead daemon
# ------------------------------------------------------------------------------------------


def test_path_outside_the_mount_is_a_no_op_with_a_warning(tiermount, tmp_path: Path) -> None:
    write_random(tmp_path / "elsewhere" / "x.bin", 4096)
    write_random(tmp_path / "back" / "f.bin", 4096)
    m = tiermount(ram="64MiB")
    c = Client()  # a fresh client: its warning has not been shown yet
    with pytest.warns(TierfsHintWarning, match="not on a tierfs mount"):
        h = c.need([tmp_path / "elsewhere" / "x.bin"])
    p = h.progress()
    assert (p.total_bytes, p.done) == (0, True) and h.wait(0)
    h = c.need([tmp_path / "elsewhere" / "x.bin", m.mnt / "f.bin"])  # only f.bin is sent
    assert h.nbytes == 4096 and h.skipped == 1
    with pytest.raises(ValueError, match="root of a tierfs mount"):
        c.need([m.mnt])


def test_escapes_are_refused(tiermount, tmp_path: Path) -> None:
    """A path that enters the mount and leaves it, through '..' or through a symlinked
    directory of the mount (absolute or relative target), is a ValueError; nothing is sent."""
    write_random(tmp_path / "outside" / "secret.bin", 4096)
    back = tmp_path / "back"
    back.mkdir(exist_ok=True)
    (back / "abs").symlink_to(tmp_path / "outside")
    (back / "rel").symlink_to("../outside")
    m = tiermount(ram="64MiB")
    with pytest.raises(ValueError, match="through '..'"):
        tierfs_hints.need([f"{m.mnt}/../outside/secret.bin"])
    for link in ("abs", "rel"):
        with pytest.raises(ValueError, match="symlink leaving the mount"):
            tierfs_hints.need([m.mnt / link / "secret.bin"])
        with pytest.raises(ValueError, match="symlink leaving the mount"):
            tierfs_hints.checkpoint(m.mnt / link, "1MiB", 60)


def test_symlinked_file_leaving_the_mount_is_refused_by_the_daemon(tiermount, tmp_path: Path) -> None:
    """The client does not stat files (100 000 paths would cost 100 000 FUSE round trips), so
    a file that is itself a symlink pointing outside reaches the daemon, which refuses the
    request (kind "value": ValueError) and keeps serving."""
    write_random(tmp_path / "outside" / "secret.bin", 4096)
    data = write_random(tmp_path / "back" / "f.bin", 4096)
    (tmp_path / "back" / "evil.bin").symlink_to(tmp_path / "outside" / "secret.bin")
    m = tiermount(ram="64MiB")
    with pytest.raises(ValueError, match="refused the need hint"):
        tierfs_hints.need([m.mnt / "f.bin", m.mnt / "evil.bin"])
    assert (m.mnt / "f.bin").read_bytes() == data


NAN = math.nan
RAW_BAD: list[dict[str, Any]] = [  # requests the client never sends; the daemon must refuse each with kind "value"
    {"op": "need", "items": [["f.bin", -1, 10]], "deadline_s": None, "priority": 0, "source": "t", "label": ""},
    {"op": "need", "items": [["f.bin", 0, 0]], "deadline_s": None, "priority": 0, "source": "t", "label": ""},
    {"op": "need", "items": [["f.bin", 0, None]], "deadline_s": NAN, "priority": 0, "source": "t", "label": ""},
    {"op": "need", "items": [["f.bin", 0, None]], "deadline_s": -5, "priority": 0, "source": "t", "label": ""},
    {"op": "need", "items": "f.bin", "deadline_s": None, "priority": 0, "source": "t", "label": ""},
    {"op": "need", "items": [[5, 0, None]], "deadline_s": None, "priority": 0, "source": "t", "label": ""},
    {"op": "need", "items": [["../outside/secret.bin", 0, None]], "deadline_s": None, "priority": 0,
     "source": "t", "label": ""},
    {"op": "need", "items": [["/etc/passwd", 0, None]], "deadline_s": None, "priority": 0,
     "source": "t", "label": ""},
    {"op": "epoch", "paths": [["f.bin"]], "source": "t"},
    {"op": "phase", "name": "eval", "at_s": NAN, "paths": ["f.bin"], "source": "t"},
    {"op": "checkpoint", "dir": "ckpt", "nbytes": -5, "every_s": 60},
    {"op": "checkpoint", "dir": "ckpt", "nbytes": MiB, "every_s": 0},
    {"op": "checkpoint", "dir": "../outside", "nbytes": MiB, "every_s": 60},
    {"op": "progress", "id": "no-such-need"},
    {"op": "wait", "id": "no-such-need", "timeout": 1},
    {"op": "release", "paths": "f.bin"},
    {"op": "no-such-op"},
    {"paths": ["f.bin"]},
]


def test_bad_input_never_harms_the_daemon(tiermount, tmp_path: Path) -> None:
    """Bad input is refused in the caller (ValueError, nothing sent); requests the client
    would never send are refused by the daemon (ControlError kind "value"), and so is a line
    that is not JSON; afterwards the daemon still serves stats, reads and hints."""
    write_random(tmp_path / "outside" / "secret.bin", 4096)
    data = write_random(tmp_path / "back" / "f.bin", 2 * MiB)
    m = tiermount(ram="64MiB")
    p = m.mnt / "f.bin"
    for call in (lambda: tierfs_hints.need([p], by=NAN), lambda: tierfs_hints.need([(p, 0, -1)]),
                 lambda: tierfs_hints.need([(p, -4096, 10)]), lambda: tierfs_hints.phase("", 5, [p]),
                 lambda: tierfs_hints.checkpoint(m.mnt / "ckpt", 0, 60)):
        with pytest.raises(ValueError):
            call()
    for req in RAW_BAD:
        with pytest.raises(wire.ControlError) as e:
            wire.request(str(m.mnt), req)
        assert e.value.kind == "value", (req, e.value)
    fd = os.open(m.mnt / ".tierfs" / "ctl", os.O_RDWR)
    try:
        os.write(fd, b"{not json\n")
        assert json.loads(os.pread(fd, 1 << 16, 0))["ok"] is False
    finally:
        os.close(fd)
    os.stat(m.mnt)
    assert m.stats()["version"] == wire.STATS_VERSION
    drop_page_cache(p)
    assert p.read_bytes() == data
    assert tierfs_hints.need([p]).wait(60)


def test_dead_daemon_is_an_oserror(tiermount, tmp_path: Path) -> None:
    """A mount whose daemon died: the next hint raises OSError naming the mount."""
    write_random(tmp_path / "back" / "f.bin", 4096)
    m = tiermount(ram="64MiB")
    c = Client()
    assert c.need([m.mnt / "f.bin"]).wait(30)
    m.kill9()
    with pytest.raises(OSError, match=re.escape(f"tierfs mount {m.mnt} did not answer")):
        c.need([m.mnt / "f.bin"])


# ------------------------------------------------------------------------------------------
# Scale
# ------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_hundred_thousand_paths(tiermount, tmp_path: Path, scale_loop_bound: int) -> None:
    """need() and epoch() of 100 000 paths (200 real files, each named 500 times) work: one
    request each (the daemon's count of control requests); ``bytes`` counts each file once.
    100 000 names that do not exist raise FileNotFoundError listing them all in ``.missing``
    (missing_ok=True: in handle.missing), again in one request each. The daemon's event loop
    stays within its bound throughout (checked by the fixture when it unmounts)."""
    back = tmp_path / "back"
    for i in range(200):
        write_random(back / f"d{i % 10}" / f"f{i}.bin", 4096, seed=i)
    m = tiermount(ram="64MiB")
    order = [f"{m.mnt}/d{i % 10}/f{i % 200}.bin" for i in range(100_000)]

    def requests() -> int:
        return int(m.stats()["control"]["requests"])

    n = requests()
    h = tierfs_hints.need(order)
    assert requests() == n + 1
    assert h.nbytes == 200 * 4096 and h.missing == []
    assert h.wait(60)
    n = requests()
    e = tierfs_hints.epoch(order)
    assert requests() == n + 1
    assert e.nbytes == 200 * 4096
    missing = [f"{m.mnt}/nope/x{i}.bin" for i in range(100_000)]
    n = requests()
    with pytest.raises(FileNotFoundError) as err:
        tierfs_hints.need(missing)
    assert requests() == n + 1
    assert len(err.value.missing) == 100_000  # type: ignore[attr-defined]
    err.value.handle.cancel()  # type: ignore[attr-defined]
    n = requests()
    h2 = tierfs_hints.need(missing, missing_ok=True)
    assert requests() == n + 1
    assert len(h2.missing) == 100_000 and h2.nbytes == 0
    assert (m.mnt / "d3" / "f3.bin").read_bytes() == (back / "d3" / "f3.bin").read_bytes()
