"""File formats that ML code opens through ``mmap``, read through a real (read-only) mount.

Each format is written into the backing directory with its own library, then opened through
the mount the way training code does: numpy ``mmap_mode='r'``, ``torch.load(mmap=True)``,
safetensors ``safe_open`` and read-only lmdb. All of these map the file MAP_SHARED or
MAP_PRIVATE, so they fail with ENODEV if tierfs ever sets ``direct_io`` on a data file. The
mounts use 1 MiB chunks and a RAM tier smaller than the data where it matters, so mappings
span chunks and tier evictions happen under them; every format is read twice, the second
time with the mount's page cache dropped (cold: every page faults into the daemon).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.conftest import drop_page_cache, needs_fuse

pytestmark = [needs_fuse, pytest.mark.fuse]
MiB = 1 << 20


def _served(m) -> int:  # type: ignore[no-untyped-def]
    """Bytes the daemon has served so far (tiers + fetched from the backing store)."""
    s = m.stats()
    return s["cache"]["bytes_served_from_tiers"] + s["scheduler"]["backing_bytes_read"]


def test_numpy_load_mmap_r(tiermount, tmp_path: Path) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    arrays = {
        "f32.npy": rng.standard_normal((1024, 1500), dtype=np.float32),  # ~5.9 MiB, spans chunks
        "i64.npy": np.arange(300_000, dtype=np.int64).reshape(600, 500),
        "fortran.npy": np.asfortranarray(rng.integers(0, 255, (700, 900), dtype=np.uint8)),
        "rec.npy": np.array([(i, i * 0.5, b"x" * (i % 7)) for i in range(5000)],
                            dtype=[("a", "<i4"), ("b", "<f8"), ("c", "S8")]),
        "empty.npy": np.zeros((0, 3), dtype=np.float16),
    }
    (tmp_path / "back" / "np").mkdir()
    for name, a in arrays.items():
        np.save(tmp_path / "back" / "np" / name, a)
    m = tiermount(ram="4MiB", extra=("--chunk-size", "1MiB"))
    for cold in (False, True):
        before = _served(m)
        for name, a in arrays.items():
            p = m.mnt / "np" / name
            if cold:
                drop_page_cache(p)
            mm = np.load(p, mmap_mode="r")
            assert mm.dtype == a.dtype and mm.shape == a.shape, name
            assert mm.flags.f_contiguous == a.flags.f_contiguous or a.ndim < 2 or a.size == 0
            assert np.array_equal(mm, a), name
            if a.size:
                idx = tuple(s // 2 for s in a.shape)
                assert mm[idx] == a[idx]
            del mm
        if cold:
            assert _served(m) > before, "the cold pass never reached the daemon"


def test_torch_load_mmap_weights_only(tiermount, tmp_path: Path) -> None:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1024),
                                torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 10))
    sd = model.state_dict()
    ckpt = {"model": sd, "step": 1234, "big": torch.randn(3 * MiB // 4 + 17),  # ~3 MiB, odd length
            "half": torch.randn(64, 64).half(), "ids": torch.arange(10_000)}
    (tmp_path / "back" / "pt").mkdir()
    torch.save(sd, tmp_path / "back" / "pt" / "sd.pt")
    torch.save(ckpt, tmp_path / "back" / "pt" / "ckpt.pt")
    m = tiermount(ram="4MiB", extra=("--chunk-size", "1MiB"))
    for cold in (False, True):
        if cold:
            for n in ("sd.pt", "ckpt.pt"):
                drop_page_cache(m.mnt / "pt" / n)
        got = torch.load(m.mnt / "pt" / "sd.pt", mmap=True, weights_only=True)
        assert list(got) == list(sd)
        assert all(torch.equal(got[k], sd[k]) for k in sd)
        fresh = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1024),
                                    torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 10))
        fresh.load_state_dict(got)
        x = torch.randn(4, 256)
        assert torch.equal(fresh(x), model(x))
        c = torch.load(m.mnt / "pt" / "ckpt.pt", mmap=True, weights_only=True, map_location="cpu")
        assert c["step"] == 1234
        assert all(torch.equal(c["model"][k], sd[k]) for k in sd)
        for k in ("big", "half", "ids"):
            assert c[k].dtype == ckpt[k].dtype and torch.equal(c[k], ckpt[k]), k
        del got, c


def test_safetensors_safe_open_pt(tiermount, tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    tensors = {
        "embed.weight": torch.randn(2048, 512, generator=g),  # 4 MiB
        "layer.0.weight": torch.randn(512, 512, generator=g).to(torch.bfloat16),
        "layer.0.bias": torch.randn(512, generator=g),
        "counts": torch.randint(0, 1 << 40, (4097,), generator=g, dtype=torch.int64),
        "mask": torch.rand(1000, generator=g) > 0.5,
    }
    (tmp_path / "back" / "st").mkdir()
    save_file(tensors, str(tmp_path / "back" / "st" / "m.safetensors"), metadata={"format": "pt", "v": "1"})
    m = tiermount(ram="4MiB", extra=("--chunk-size", "1MiB"))
    p = m.mnt / "st" / "m.safetensors"
    for cold in (False, True):
        if cold:
            drop_page_cache(p)
        with safe_open(str(p), framework="pt") as f:
            assert f.metadata() == {"format": "pt", "v": "1"}
            assert sorted(f.keys()) == sorted(tensors)
            for k, t in tensors.items():
                got = f.get_tensor(k)
                assert got.dtype == t.dtype and torch.equal(got, t), k
            sl = f.get_slice("embed.weight")
            assert sl.get_shape() == [2048, 512]
            assert torch.equal(sl[1000:1100, 7:9], tensors["embed.weight"][1000:1100, 7:9])


def test_lmdb_readonly_all_keys(tiermount, tmp_path: Path) -> None:
    import lmdb

    rnd = random.Random(5)
    db = tmp_path / "back" / "db"
    env = lmdb.open(str(db), map_size=64 * MiB, subdir=True)
    want: dict[bytes, bytes] = {}
    with env.begin(write=True) as txn:
        for i in range(3000):
            k = f"key-{i:06d}".encode()
            v = rnd.randbytes(rnd.choice([10, 500, 2000, 4096, 9000]))  # some overflow pages
            txn.put(k, v)
            want[k] = v
    env.sync(True)
    env.close()
    m = tiermount(ram="4MiB", extra=("--chunk-size", "1MiB"))
    p = m.mnt / "db"
    for cold in (False, True):
        if cold:
            drop_page_cache(p / "data.mdb")
        env = lmdb.open(str(p), readonly=True, lock=False, subdir=True)
        try:
            assert env.stat()["entries"] == len(want)
            with env.begin() as txn:
                got = dict(txn.cursor().iternext())
                assert got.keys() == want.keys()
                bad = [k for k in want if got[k] != want[k]]
                assert not bad, bad[:5]
                for k in rnd.sample(sorted(want), 200):
                    assert txn.get(k) == want[k]
                assert txn.get(b"missing") is None
        finally:
            env.close()
    assert os.path.getsize(p / "data.mdb") == os.path.getsize(db / "data.mdb")
