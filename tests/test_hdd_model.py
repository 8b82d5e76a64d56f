"""Unit tests of the emulated-HDD service-time model (bench/emuhdd/hdd_model.py): pure Python,
no mounts, no nbdkit."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "bench" / "emuhdd" / "hdd_model.py"
_spec = importlib.util.spec_from_file_location("hdd_model", _PATH)
assert _spec is not None and _spec.loader is not None
hdd_model = importlib.util.module_from_spec(_spec)
sys.modules["hdd_model"] = hdd_model
_spec.loader.exec_module(hdd_model)
HDDModel = hdd_model.HDDModel

GiB = 1 << 30
MiB = 1 << 20


def test_seek_curve_matches_datasheet() -> None:
    m = HDDModel(4 * GiB)
    assert m.seek_time(0) == 0.0
    assert m.seek_time(1) == pytest.approx(1.0e-3, rel=1e-6)  # track to track
    assert m.seek_time(m.ncyl - 1) == pytest.approx(16.0e-3, rel=1e-6)  # full stroke
    # mean over two uniformly random cylinders ~= average seek (Monte Carlo)
    rng = random.Random(7)
    n = 100_000
    mean = sum(m.seek_time(rng.randrange(m.ncyl) - rng.randrange(m.ncyl)) for _ in range(n)) / n
    assert mean == pytest.approx(8.5e-3, rel=0.02)
    # the two Ruemmler-Wilkes pieces meet continuously at the boundary
    b = m.boundary
    assert m.a + m.b * b**0.5 == pytest.approx(m.c + m.e * b, rel=1e-9)


def test_seek_monotone_in_distance() -> None:
    m = HDDModel(4 * GiB)
    prev = 0.0
    for d in range(0, m.ncyl):
        t = m.seek_time(d)
        assert t >= prev
        prev = t
    assert m.seek_time(-500) == m.seek_time(500)


@pytest.mark.parametrize("rotation", ["position", "uniform", "half"])
def test_sequential_continuation_has_no_positioning(rotation: str) -> None:
    m = HDDModel(4 * GiB, rotation=rotation, prefetch_bytes=0)
    m.service_time(123 * MiB + 4096, 1 * MiB)  # put the head somewhere, not at 0
    for i in range(1, 50):
        t = m.service_time(123 * MiB + 4096 + i * MiB, MiB)
        assert t == pytest.approx(MiB / 180e6, rel=1e-9)


def test_non_continuation_pays_seek_and_rotation() -> None:
    m = HDDModel(4 * GiB, rotation="half")
    m.service_time(0, 4096)
    t = m.service_time(2 * GiB, 4096)
    assert t == pytest.approx(m.seek_time(m.cylinder(2 * GiB)) + m.rev_time / 2 + 4096 / 180e6)
    # re-reading the same block: a hit in the drive's read-ahead segment (interface transfer)
    t2 = m.service_time(2 * GiB, 4096)
    assert t2 == pytest.approx(4096 / 600e6)
    # a write elsewhere abandons the segment: reading it again needs a full positioning
    m.service_time(GiB, 4096, write=True)
    t3 = m.service_time(2 * GiB, 4096)
    assert t3 == pytest.approx(m.seek_time(m.cylinder(2 * GiB) - m.cylinder(GiB)) + m.rev_time / 2 + 4096 / 180e6)


@pytest.mark.parametrize("rotation", ["position", "uniform"])
def test_sequential_rate_is_media_rate(rotation: str) -> None:
    m = HDDModel(4 * GiB, rotation=rotation)
    total = sum(m.service_time(GiB + i * MiB, MiB) for i in range(256))
    rate = 256 * MiB / total
    assert rate == pytest.approx(180e6, rel=0.03)  # one initial seek + rotation amortized


def test_readahead_credits_idle_time_only_for_continued_reads() -> None:
    m = HDDModel(4 * GiB, rotation="half", prefetch_bytes=2 * MiB)
    t = m.service_time(0, MiB, now=0.0)
    xfer = MiB / 180e6
    # the host comes back 2 ms after completion: 2 ms of the next MiB is already buffered
    t2 = m.service_time(MiB, MiB, now=t + 2e-3)
    assert t2 == pytest.approx(xfer - 2e-3)
    # idle longer than the transfer: already buffered, only the interface transfer is left
    t3 = m.service_time(2 * MiB, MiB, now=m.free_at + 1.0)
    assert t3 == pytest.approx(MiB / 600e6)
    # a write that continues gets no credit
    t4 = m.service_time(3 * MiB, MiB, now=m.free_at + 1e-3, write=True)
    assert t4 == pytest.approx(xfer)
    # with prefetch disabled, no credit
    m0 = HDDModel(4 * GiB, rotation="half", prefetch_bytes=0)
    t = m0.service_time(0, MiB, now=0.0)
    assert m0.service_time(MiB, MiB, now=t + 2e-3) == pytest.approx(xfer)


def test_swapped_pair_costs_one_bus_transfer_not_two_positionings() -> None:
    m = HDDModel(4 * GiB, rotation="half")
    m.service_time(GiB, MiB)
    xfer = MiB / 180e6
    # X+1 MiB arrives before X (host reordering): the drive streams through X on the way
    t1 = m.service_time(GiB + 2 * MiB, MiB)
    assert t1 == pytest.approx(2 * xfer)
    t2 = m.service_time(GiB + MiB, MiB)  # now in the read-ahead segment
    assert t2 == pytest.approx(MiB / 600e6)
    t3 = m.service_time(GiB + 3 * MiB, MiB)  # the stream goes on
    assert t3 == pytest.approx(xfer)
    # far beyond the read-ahead window: a real seek
    t4 = m.service_time(GiB + 64 * MiB, MiB)
    assert t4 > xfer + 1e-3


def test_interleaved_streams_get_no_prefetch() -> None:
    m = HDDModel(4 * GiB, rotation="half")
    streams = [0, GiB, 2 * GiB, 3 * GiB]
    t = 0.0
    for i in range(8):
        for s in streams:  # queue never empty: each request arrives as the previous completes
            t += m.service_time(s + i * MiB, MiB)
    per = t / 32
    assert per > MiB / 180e6 + m.rev_time / 2  # every switch pays seek + rotation


@pytest.mark.parametrize("rotation", ["position", "uniform", "half"])
def test_random_4k_service_time_in_datasheet_range(rotation: str) -> None:
    # random 4 KiB reads over the whole disk: avg seek 8.5 ms + half a revolution 4.17 ms
    # + 0.02 ms transfer ~= 12.7 ms, i.e. ~79 IOPS (7200 rpm datasheets: 75-100 IOPS)
    cap = 4 * GiB
    m = HDDModel(cap, rotation=rotation)
    rng = random.Random(3)
    n = 20_000
    t = 0.0
    for _ in range(n):
        t += m.service_time(rng.randrange(cap // 4096) * 4096, 4096, now=t + rng.random() * 1e-3)
    mean = t / n - 0.5e-3  # remove the random think time added to the clock
    assert 11.5e-3 < mean < 14e-3
    assert 70 < 1 / mean < 90


def test_rotation_position_average_is_half_a_revolution() -> None:
    m = HDDModel(4 * GiB, rotation="position")
    rng = random.Random(11)
    rots = []
    for _ in range(20_000):
        off = rng.randrange(GiB // 4096) * 4096
        m.cyl = m.cylinder(off)  # no seek: isolate the rotational part
        m.last_end = m.buf_lo = m.buf_hi = None
        rots.append(m.service_time(off, 0, now=rng.random() * 100))
    assert sum(rots) / len(rots) == pytest.approx(m.rev_time / 2, rel=0.03)
    assert min(rots) >= 0 and max(rots) < m.rev_time


def test_short_stroke_geometry_is_faster() -> None:
    full = HDDModel(4 * GiB)
    short = HDDModel(4 * GiB, stroke_bytes=4 * 10**12, ncyl=500_000)
    rng = random.Random(5)
    offs = [rng.randrange(GiB // 4096) * 4096 for _ in range(5000)]
    tf = sum(full.service_time(o, 4096) for o in offs)
    ts = sum(short.service_time(o, 4096) for o in offs)
    assert ts < tf
    assert short.seek_time(1) == pytest.approx(1e-3)


def test_bad_parameters_rejected() -> None:
    with pytest.raises(ValueError):
        HDDModel(0)
    with pytest.raises(ValueError):
        HDDModel(GiB, avg_seek=20e-3)
    with pytest.raises(ValueError):
        HDDModel(GiB, rotation="spin")
    with pytest.raises(ValueError):
        HDDModel(GiB, stroke_bytes=GiB // 2)


def test_module_imports_without_nbdkit() -> None:
    assert hdd_model.nbdkit is None or hasattr(hdd_model.nbdkit, "debug")
    assert hdd_model.API_VERSION == 2


@pytest.mark.parametrize("policy", ["fifo", "seqfirst"])
def test_actuator_serves_one_at_a_time_in_order(policy: str) -> None:
    import threading

    act = hdd_model._Actuator(policy)
    order: list[int] = []
    act.acquire(0)  # a request in service, ending at 4096
    started = []

    def req(off: int) -> None:
        started.append(off)
        act.acquire(off)
        order.append(off)
        act.release(off + 4096)

    threads = []
    for off in (10 * MiB, 4096, 20 * MiB):  # arrival order; 4096 continues the one in service
        t = threading.Thread(target=req, args=(off,))
        t.start()
        threads.append(t)
        while len(act.waiting) < len(threads):  # make the arrival order deterministic
            pass
    act.release(4096)
    for t in threads:
        t.join(timeout=10)
    if policy == "fifo":
        assert order == [10 * MiB, 4096, 20 * MiB]
    else:
        assert order == [4096, 10 * MiB, 20 * MiB]
