"""The miss path of a parallel backing store: chunks copied from the backing file into a tier
file in the kernel (tierfs.io.copy_range), real files and real device threads, no mount."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import trio

from tierfs import io
from tierfs.cache.manager import AccessState, Cache
from tierfs.cache.policy import Policy
from tierfs.cache.tier import Tier
from tierfs.sched.backing import BackingFile, Identity
from tierfs.sched.scheduler import Klass, TransactionScheduler

CS = 256 * 1024


def write_file(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("method", io.COPY_METHODS)
def test_copy_range_every_method_copies_at_the_offsets_without_moving_positions(tmp_path: Path, method: str) -> None:
    data = write_file(tmp_path / "src", 3 * CS + 123)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        n = io.copy_range(src, dst, 2 * CS, CS, 5 * CS, methods=(method,), route=("test", method))
        assert n == 2 * CS
        assert os.pread(dst, 2 * CS, 5 * CS) == data[CS : 3 * CS]
        assert os.lseek(src, 0, os.SEEK_CUR) == 0 and os.lseek(dst, 0, os.SEEK_CUR) == 0
        tail = io.copy_range(src, dst, CS, 3 * CS, 0, methods=(method,), route=("test", method))
        assert tail == 123  # short only at the end of the source
    finally:
        os.close(src)
        os.close(dst)


def test_copy_range_falls_back_when_the_kernel_refuses(tmp_path: Path) -> None:
    """Both kernel copies refuse a destination opened O_APPEND (EBADF, EINVAL): each refusing
    method is remembered for its route and not tried there again; the next method is."""
    data = write_file(tmp_path / "src", CS)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)  # refused by both kernel copies
    route = ("test", "append")
    try:
        before = io.copy_stats.calls["pread"]
        with pytest.raises(OSError):
            io.copy_range(src, dst, CS, 0, 0, methods=("copy_file_range", "splice"), route=route)
        assert ("copy_file_range", route) in io.copy_stats.broken
        assert ("splice", route) in io.copy_stats.broken
        assert io.copy_stats.calls["pread"] == before
    finally:
        os.close(src)
        os.close(dst)
    dst = os.open(tmp_path / "dst2", os.O_RDWR | os.O_CREAT, 0o600)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    try:
        assert io.copy_range(src, dst, CS, 0, 0, route=route) == CS  # the route's next method
        assert os.pread(dst, CS, 0) == data
    finally:
        os.close(src)
        os.close(dst)


def _read_backing(f: BackingFile, offset: int, length: int) -> bytes:
    return io.pread_exact(f.fd, length, offset)


def open_backing(path: Path) -> BackingFile:
    fd = os.open(path, os.O_RDONLY)
    st = os.fstat(fd)
    f = BackingFile(Identity(str(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns), fd)
    f.acquire()  # the handle's reference
    return f


async def read_all(cache: Cache, f: BackingFile, piece: int = 64 * 1024) -> bytes:
    access = AccessState()
    out = bytearray()
    for off in range(0, f.size, piece):
        out += await cache.read(f, off, piece, access)
    cache.forget_access(access)
    return bytes(out)


async def run_cache(tmp_path: Path, *, ram: int, elevator: bool, size: int, readahead: bool = False):  # type: ignore[no-untyped-def]
    data = write_file(tmp_path / "big", size)
    dev = io.Device("backing", 4)

    async def read(f: BackingFile, offset: int, length: int) -> bytes:
        return await dev.run(_read_backing, f, offset, length)

    async def run_io(fn):  # type: ignore[no-untyped-def]
        return await dev.run(fn)

    sched = TransactionScheduler(read, chunk_size=CS, slice_size=CS if not elevator else 4 * CS,
                                 depth=4 if not elevator else 1, run_io=run_io, elevator=elevator)
    tier = Tier("ram", str(tmp_path / "ram"), ram, inline=True)
    cache = Cache([tier], [io.Device("ram", 2)], Policy("nothrash", window=1024), sched,
                  chunk_size=CS, staging_bytes=64 * CS)
    f = open_backing(tmp_path / "big")
    try:
        async with trio.open_nursery() as n:
            cache.attach(n)
            await n.start(sched.run)
            if readahead:
                cache.prefetch(f, list(range(-(-size // CS))), Klass.SPECULATIVE)
            got = await read_all(cache, f)
            while cache.background or sched.statistics().in_flight or any(sched.queue_lengths().values()):  # noqa: ASYNC110 - real threads
                await trio.sleep(0.001)
            n.cancel_scope.cancel()
        assert got == data
        assert cache.check() == []
        return cache, sched
    finally:
        f.release()
        cache.close()


async def test_parallel_misses_are_copied_into_the_tier_in_the_kernel(tmp_path: Path) -> None:
    size = 10 * CS + 4096
    calls = sum(io.copy_stats.calls[m] for m in ("copy_file_range", "splice"))
    cache, sched = await run_cache(tmp_path, ram=64 * CS, elevator=False, size=size, readahead=True)
    s = cache.statistics()
    assert s.direct_fetches == 11 and s.staging_hits == 0 and cache.staging_used == 0
    assert sum(io.copy_stats.calls[m] for m in ("copy_file_range", "splice")) == calls + 11
    assert cache.tiers[0].chunks == 11 and sched.statistics().backing_bytes_read == size
    # the reader's bytes count as served from the backing store (a miss), as before
    assert s.backing_bytes_served > 0 and s.prefetch_used_bytes > 0


async def test_a_tier_without_room_falls_back_to_reading_into_staging(tmp_path: Path) -> None:
    cache, _ = await run_cache(tmp_path, ram=4 * CS, elevator=False, size=10 * CS)
    s = cache.statistics()
    assert 0 < s.direct_fetches <= 4  # what fit went straight in; the rest came through memory
    assert s.backing_hits >= 10 - s.direct_fetches


async def test_hdd_profile_keeps_reading_runs_into_memory(tmp_path: Path) -> None:
    cache, sched = await run_cache(tmp_path, ram=64 * CS, elevator=True, size=10 * CS)
    assert sched.transfer is None and cache.statistics().direct_fetches == 0


def test_mount_with_parallel_profile_copies_misses_in_the_kernel(tiermount, tmp_path: Path) -> None:
    from tests.conftest import write_random

    write_random(tmp_path / "back" / "f", 21 * 1024 * 1024 + 17)
    m = tiermount(ram="64MiB", extra=["--backing", "parallel"])
    assert (m.mnt / "f").read_bytes() == (tmp_path / "back" / "f").read_bytes()
    import json

    doc = json.loads((m.mnt / ".tierfs" / "stats.json").read_text())
    assert doc["scheduler"]["profile"]["name"] == "parallel"
    assert doc["cache"]["direct_fetches"] >= 1
    assert sum(doc["cache"]["kernel_copies"].values()) >= 1


def test_small_file_read_in_name_order_opens_each_backing_file_once(tiermount, tmp_path: Path) -> None:
    """A small file costs one backing open, also when next-file prediction prefetched it: the
    reader's open shares the descriptor the prefetch opened (before: two opens per file)."""
    import json

    n = 30
    d = tmp_path / "back" / "cls"
    d.mkdir()
    for i in range(n):
        (d / f"img{i:03d}.jpg").write_bytes(os.urandom(100_000 + i))
    m = tiermount(ram="64MiB")

    def stats() -> dict:
        return json.loads((m.mnt / ".tierfs" / "stats.json").read_text())["scheduler"]

    names = sorted(os.listdir(m.mnt / "cls"))
    before = stats()["backing_opens"]
    for name in names:
        assert (m.mnt / "cls" / name).read_bytes() == (d / name).read_bytes()
    s = stats()
    # before: 2 per file (58 for 30: the prefetch's open, then the reader's). A reader that
    # opens a file while the prefetcher is opening it too still costs two: a few at most
    assert s["backing_opens"] - before <= n + n // 5, s
    assert s["shared_opens"] > 0


@pytest.mark.parametrize("profile", ["parallel", "hdd"])
def test_backing_data_calls_run_inline_only_on_a_local_parallel_store(tiermount, tmp_path: Path, profile: str) -> None:
    """On a local parallel store the backing device's data calls (small files' copies into a
    tier, reads into memory) run on the event loop while each is measured cheap (io.Device): a
    hand-off to a thread cost more than the call. The hdd profile keeps every one in its device
    thread (one request in flight)."""
    import json

    from tierfs.sched import profile as backing_profile

    d = tmp_path / "back" / "cls"
    d.mkdir(parents=True)
    for i in range(20):
        (d / f"img{i:03d}.jpg").write_bytes(os.urandom(100_000 + i))
    m = tiermount(ram="64MiB", extra=["--backing", profile])
    for i in range(20):
        assert (m.mnt / "cls" / f"img{i:03d}.jpg").read_bytes() == (d / f"img{i:03d}.jpg").read_bytes()

    def devices() -> dict:
        return json.loads((m.mnt / ".tierfs" / "stats.json").read_text())["devices"]

    def calls() -> int:
        return sum(d["inline_calls"] + d["thread_calls"] for n, d in devices().items() if n.startswith("backing-r")
                   or n == "backing")

    end = time.monotonic() + 30
    while calls() == 0:
        assert time.monotonic() < end, "no backing data call"
        time.sleep(0.05)
    devs = devices()
    assert devs["backing"]["inline_calls"] == 0, devs  # write-back's fsyncs and renames: threads
    if profile == "hdd" or not backing_profile.local(str(tmp_path / "back")):
        assert "backing-reads" not in devs and devs["backing"]["thread_calls"] > 0, devs
    else:
        assert devs["backing-reads"]["inline_calls"] > 0, devs
