"""Emulated 7200 rpm hard disk: a service-time model plus an nbdkit python plugin.

Model
-----
The service time of one request follows the classic decomposition of

    C. Ruemmler and J. Wilkes, "An introduction to disk drive modeling",
    IEEE Computer 27(3):17-28, March 1994.

    service = seek(d) + rotational latency + length / media_rate

* **Seek** over a distance of ``d`` cylinders (``d >= 1``) uses their two-piece curve:
  ``a + b*sqrt(d)`` for short seeks (``d < boundary``: the arm accelerates, then
  decelerates) and ``c + e*d`` for long ones (the arm coasts at full speed).  ``d == 0`` costs
  nothing.  The five constants are not free: they are fitted at construction from three
  datasheet figures so that

  - ``seek(1)`` = track-to-track time (default 1.0 ms),
  - ``seek(ncyl - 1)`` = full-stroke time (default 16.0 ms),
  - the mean of ``seek`` over two uniformly random positions = average seek (default 8.5 ms),

  with the two pieces meeting continuously *and* with equal slope at ``boundary``.
  (Defaults, ncyl=10000: a = 0.858 ms, b = 0.1425 ms, boundary = 4938 cyl, c = 5.863 ms,
  e = 1.014e-3 ms/cyl; e.g. seek(10) = 1.31 ms, seek(100) = 2.28 ms, seek(1000) = 5.36 ms.)
* **Rotational latency**: a request that does not start exactly where the previous one
  ended waits for its sector to come under the head.  ``rotation="position"`` (default) keeps
  the platter angle as a function of time (angle = t / T_rev mod 1, sector angle =
  (offset mod track_bytes) / track_bytes), so the wait is deterministic given the clock and is
  half a revolution (4.17 ms at 7200 rpm) on average for random requests.  ``"uniform"`` draws
  it uniformly in [0, T_rev) from a seeded RNG; ``"half"`` always charges T_rev / 2.
* **Transfer**: ``length / media_rate`` (default 180 MB/s = 180e6 bytes/s, a mid-zone figure
  of a 7200 rpm drive; zoned recording is not modelled).
* **Sequential continuation**: a request whose offset equals the end of the previous request
  pays neither seek nor rotation, whatever the idle gap between them.
* **Drive read-ahead buffer** (R&W section "Caching"): after a read the drive keeps one
  read-ahead segment ``[buf_lo, buf_hi)`` of data that passed under the head, at most
  ``segment_bytes`` (default 4 MiB) long, and while it is idle it keeps reading ahead, at the
  media rate, up to ``prefetch_bytes`` (default 2 MiB; 0 disables it) beyond the end of the last
  request.  A read that starts inside the segment, or at most ``prefetch_bytes`` beyond its end,
  needs no positioning: it costs ``max((end - buf_hi) / media_rate, length / bus_rate)``
  (the part not yet read, streamed; or the interface transfer, ``bus_rate`` default 600 MB/s
  for a fully buffered hit).  Any other request (or any write) abandons the segment.
  Consequences: (1) a single sequential reader whose host takes ``g`` ms between requests gets
  ``g`` ms of the next transfer done during the gap, so it sees the media rate, not less; (2) two
  consecutive reads that reach the drive in swapped order (X+1 MiB, then X) cost what the
  stream costs plus one bus transfer, not two positionings; (3) with several interleaved
  streams the queue is never empty, nothing is prefetched, and every switch pays a full
  seek + rotation.
* ``overhead_s`` (default 0) is added to every non-continuation request (controller overhead).

Geometry: the byte range [0, stroke_bytes) is mapped linearly onto ``ncyl`` cylinders (default
10 000).  By default ``stroke_bytes`` = capacity: the emulated disk is a *whole* drive scaled
down, so that random requests over it see the full-stroke seek distribution (-> 8.5 ms average
seek -> ~12.7 ms per random 4 KiB read -> ~79 IOPS), and data that fills half of the emulated
disk behaves like a data set filling half of a real drive.  To emulate instead a small region at
the start of a big drive, set ``stroke_bytes`` to the big drive's size (and ``ncyl`` to a
realistic cylinder count, e.g. 4 TB -> ncyl=500000, ~8 MB per cylinder).  ``track_bytes``
defaults to ``media_rate * T_rev`` (1.5 MB) and only sets the angular position of a sector.
Writes are modelled like reads (no write-back cache).

Usage as a library: ``HDDModel(capacity).service_time(offset, length, now=None)``; it updates
the head state (position, end of the last request, and the time at which the disk becomes free).

nbdkit plugin
-------------
    nbdkit -U SOCK python hdd_model.py size=4G [file=PATH] [log=PATH] [ctl=DIR] \
        [rpm=7200] [media_mbps=180] [avg_seek_ms=8.5] [t2t_ms=1.0] [full_ms=16] [ncyl=10000] \
        [stroke=SIZE] [rotation=position|uniform|half] [prefetch=2M] [segment=4M] [bus_mbps=600] \
        [overhead_ms=0] [max_request=1M] \
        [serialize=plugin|nbdkit] [queue=seqfirst|fifo]

Requests are served one at a time, like one actuator, in arrival order (``queue=fifo``) or in
arrival order except that a queued exact continuation of the last request goes first
(``queue=seqfirst``, default; see ``_Actuator``).  With the default ``serialize=plugin`` nbdkit
runs its PARALLEL thread model and the plugin queues the requests itself, so receiving the next request and sending the previous
reply overlap the "disk" time.  ``serialize=nbdkit`` uses nbdkit's SERIALIZE_ALL_REQUESTS
instead: simpler, but the host turnaround of every request (~0.5-1 ms here) becomes dead time
between requests.  Each request does the real I/O first (an anonymous, lazily allocated mmap
by default, or a sparse ``file=``), then sleeps the remainder of the modelled service time, so
the real I/O cost is part of the service time, not added to it.  ``log=`` appends one line per
request: ``wall_time op offset length model_s actual_s queued_ahead [nodelay]`` (``op``: R, W,
Z = write zeroes, F = flush; ``queued_ahead``: requests already waiting or in service when it
arrived).  If ``ctl=DIR`` is given and ``DIR/nodelay`` exists, no sleep is done (the head state
is still updated): used while filling the disk.  ``block_size`` advertises 1 MiB as the
maximum request (nbdfuse/libnbd 1.14 do not split by it; the loop device's max_sectors_kb does).
"""

from __future__ import annotations

import math
import random
import time

MB = 1_000_000


class HDDModel:
    """Service-time model of one single-actuator disk (Ruemmler & Wilkes 1994)."""

    def __init__(
        self,
        capacity: int,
        *,
        rpm: float = 7200.0,
        media_rate: float = 180 * MB,
        avg_seek: float = 8.5e-3,
        track_to_track: float = 1.0e-3,
        full_stroke: float = 16.0e-3,
        ncyl: int = 10_000,
        stroke_bytes: int | None = None,
        track_bytes: int | None = None,
        rotation: str = "position",
        overhead_s: float = 0.0,
        prefetch_bytes: int = 2 << 20,
        segment_bytes: int = 4 << 20,
        bus_rate: float = 600 * MB,
        seed: int = 12345,
    ) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        if not track_to_track < avg_seek < full_stroke:
            raise ValueError("need track_to_track < avg_seek < full_stroke")
        if rotation not in ("position", "uniform", "half"):
            raise ValueError(f"unknown rotation model {rotation!r}")
        self.capacity = int(capacity)
        self.rpm = float(rpm)
        self.rev_time = 60.0 / self.rpm
        self.media_rate = float(media_rate)
        self.ncyl = int(ncyl)
        self.stroke_bytes = int(stroke_bytes or capacity)
        if self.stroke_bytes < self.capacity:
            raise ValueError("stroke_bytes must be >= capacity")
        self.track_bytes = int(track_bytes or round(self.media_rate * self.rev_time))
        self.rotation = rotation
        self.overhead_s = float(overhead_s)
        self.prefetch_bytes = max(int(prefetch_bytes), 0)
        self.segment_bytes = max(int(segment_bytes), 1)
        self.bus_rate = float(bus_rate)
        self.t2t, self.avg_seek_target, self.full_stroke = track_to_track, avg_seek, full_stroke
        self._rng = random.Random(seed)
        self._fit_seek_curve()
        # head state
        self.cyl = 0  # cylinder under the head
        self.last_end: int | None = None  # byte just after the previous request
        self.last_was_read = False
        self.buf_lo: int | None = None  # read-ahead segment [buf_lo, buf_hi); None: empty
        self.buf_hi: int | None = None
        self.free_at = 0.0  # time the previous request completes (model clock)

    # ---- seek curve ------------------------------------------------------------------------
    def _curve(self, boundary: float) -> tuple[float, float, float, float]:
        """a, b, c, e for a given boundary, meeting seek(1)=t2t, seek(ncyl-1)=full, C1 at boundary."""
        n = self.ncyl - 1
        sb = math.sqrt(boundary)
        # a + b = t2t ; e = b / (2 sb) ; c = a + b*sb/2 ; c + e*n = full
        b = (self.full_stroke - self.t2t) / (sb / 2 + n / (2 * sb) - 1)
        a = self.t2t - b
        e = b / (2 * sb)
        c = a + b * sb / 2
        return a, b, c, e

    def _mean_seek(self, boundary: float) -> float:
        """Mean seek over two uniformly random positions: P(d) = 2 (N - d) / N^2."""
        a, b, c, e = self._curve(boundary)
        n = float(self.ncyl)
        # integrate piecewise in closed form over continuous d in [0, N] (d < 1 uses the short
        # curve too; the difference is O(1/N)).
        def short(x: float) -> float:  # int (a + b sqrt d) 2 (N - d) / N^2 dd from 0..x
            return 2 / n**2 * (a * (n * x - x * x / 2) + b * (n * 2 / 3 * x**1.5 - 2 / 5 * x**2.5))

        def long(x: float) -> float:  # int (c + e d) 2 (N - d) / N^2 dd from 0..x
            return 2 / n**2 * (c * (n * x - x * x / 2) + e * (n * x * x / 2 - x**3 / 3))

        return short(boundary) + long(n) - long(boundary)

    def _fit_seek_curve(self) -> None:
        lo, hi = 1.0, float(self.ncyl - 1)
        if not self._mean_seek(lo) <= self.avg_seek_target <= self._mean_seek(hi):
            raise ValueError(
                f"average seek {self.avg_seek_target * 1e3:.2f} ms not reachable with this curve "
                f"(range {self._mean_seek(lo) * 1e3:.2f}-{self._mean_seek(hi) * 1e3:.2f} ms)"
            )
        for _ in range(200):  # mean seek grows with the boundary: bisect
            mid = (lo + hi) / 2
            if self._mean_seek(mid) < self.avg_seek_target:
                lo = mid
            else:
                hi = mid
        self.boundary = (lo + hi) / 2
        self.a, self.b, self.c, self.e = self._curve(self.boundary)

    def seek_time(self, distance: int) -> float:
        """Seconds to move the arm ``distance`` cylinders (0 -> 0)."""
        d = abs(int(distance))
        if d == 0:
            return 0.0
        if d < self.boundary:
            return self.a + self.b * math.sqrt(d)
        return self.c + self.e * d

    # ---- geometry --------------------------------------------------------------------------
    def cylinder(self, offset: int) -> int:
        offset = min(max(int(offset), 0), self.capacity - 1)
        return offset * self.ncyl // self.stroke_bytes

    def sector_angle(self, offset: int) -> float:
        return (offset % self.track_bytes) / self.track_bytes

    # ---- service time ----------------------------------------------------------------------
    def service_time(
        self, offset: int, length: int, now: float | None = None, *, write: bool = False
    ) -> float:
        """Service time in seconds of a request, updating the head state.

        ``now`` is the time the request reaches the drive on the model clock (used by the
        position-based rotation model and by the drive read-ahead, which works while the drive is
        idle); by default the request arrives just as the previous one completes.
        """
        start = self.free_at if now is None else max(float(now), self.free_at)
        idle = start - self.free_at
        length = max(int(length), 0)
        end = offset + length
        # read-ahead while the drive was idle after a read
        if self.last_was_read and self.buf_hi is not None and self.buf_lo is not None and idle > 0:
            assert self.last_end is not None
            limit = min(self.last_end + self.prefetch_bytes, self.capacity)
            self.buf_hi = max(self.buf_hi, min(limit, self.buf_hi + int(idle * self.media_rate)))
            self.buf_lo = max(self.buf_lo, self.buf_hi - self.segment_bytes)
        if (
            not write
            and self.buf_lo is not None
            and self.buf_hi is not None
            and self.buf_lo <= offset <= self.buf_hi + self.prefetch_bytes
        ):
            # served from (or by streaming on into) the read-ahead segment: no positioning
            total = max(max(end - self.buf_hi, 0) / self.media_rate, length / self.bus_rate)
            self.buf_hi = max(self.buf_hi, end)
            self.buf_lo = max(self.buf_lo, self.buf_hi - self.segment_bytes)
            head_at = self.buf_hi
        else:
            transfer = length / self.media_rate
            if self.last_end is not None and offset == self.last_end:
                position = 0.0  # the head is already there (e.g. writes in sequence)
            else:
                target = self.cylinder(offset)
                seek = self.seek_time(target - self.cyl)
                if self.rotation == "half":
                    rot = self.rev_time / 2
                elif self.rotation == "uniform":
                    rot = self._rng.random() * self.rev_time
                else:
                    platter = ((start + self.overhead_s + seek) / self.rev_time) % 1.0
                    rot = ((self.sector_angle(offset) - platter) % 1.0) * self.rev_time
                position = self.overhead_s + seek + rot
            total = position + transfer
            if write:
                self.buf_lo = self.buf_hi = None
            else:
                self.buf_lo, self.buf_hi = offset, end
            head_at = end
        self.cyl = self.cylinder(max(head_at - 1, 0))
        self.last_end = end
        self.last_was_read = not write
        self.free_at = start + total
        return total

    def describe(self) -> str:
        return (
            f"HDDModel(capacity={self.capacity}, stroke={self.stroke_bytes}, rpm={self.rpm:g}, media={self.media_rate / MB:g} MB/s, "
            f"seek: t2t={self.t2t * 1e3:g} ms avg={self.avg_seek_target * 1e3:g} ms "
            f"full={self.full_stroke * 1e3:g} ms -> a={self.a * 1e3:.3f} ms b={self.b * 1e3:.4f} ms "
            f"boundary={self.boundary:.0f}/{self.ncyl} cyl c={self.c * 1e3:.3f} ms "
            f"e={self.e * 1e3:.3e} ms/cyl, rotation={self.rotation} (T_rev={self.rev_time * 1e3:.2f} ms), "
            f"track={self.track_bytes} B, prefetch={self.prefetch_bytes} B, "
            f"segment={self.segment_bytes} B, bus={self.bus_rate / MB:g} MB/s)"
        )


# =============================================================================================
# nbdkit plugin (only meaningful when loaded by `nbdkit python hdd_model.py ...`)
# =============================================================================================
try:  # pragma: no cover - only inside nbdkit
    import nbdkit  # type: ignore[import-not-found]
except ImportError:  # plain import (tests, tools)
    nbdkit = None

API_VERSION = 2

_cfg: dict[str, str] = {}
_state: dict = {}


def _parse_size(s: str) -> int:
    if nbdkit is not None:
        return int(nbdkit.parse_size(s))
    s = s.strip()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1].upper() in mult:
        return int(float(s[:-1]) * mult[s[-1].upper()])
    return int(s)


def config(key: str, value: str) -> None:
    _cfg[key] = value


def config_complete() -> None:
    if "size" not in _cfg:
        raise RuntimeError("hdd_model: size=... is required")


def thread_model():
    # serialize=plugin (default): nbdkit runs requests in parallel threads and _Actuator
    # serializes them in arrival order; serialize=nbdkit: nbdkit serializes (one thread).
    if _cfg.get("serialize", "plugin") == "nbdkit":
        return nbdkit.THREAD_MODEL_SERIALIZE_ALL_REQUESTS
    return nbdkit.THREAD_MODEL_PARALLEL


def get_ready() -> None:
    import builtins
    import mmap
    import os

    size = _parse_size(_cfg["size"])
    model = HDDModel(
        size,
        rpm=float(_cfg.get("rpm", 7200)),
        media_rate=float(_cfg.get("media_mbps", 180)) * MB,
        avg_seek=float(_cfg.get("avg_seek_ms", 8.5)) / 1e3,
        track_to_track=float(_cfg.get("t2t_ms", 1.0)) / 1e3,
        full_stroke=float(_cfg.get("full_ms", 16.0)) / 1e3,
        ncyl=int(_cfg.get("ncyl", 10_000)),
        stroke_bytes=_parse_size(_cfg["stroke"]) if "stroke" in _cfg else None,
        rotation=_cfg.get("rotation", "position"),
        overhead_s=float(_cfg.get("overhead_ms", 0.0)) / 1e3,
        prefetch_bytes=_parse_size(_cfg.get("prefetch", "2M")),
        segment_bytes=_parse_size(_cfg.get("segment", "4M")),
        bus_rate=float(_cfg.get("bus_mbps", 600)) * MB,
    )
    if "file" in _cfg:
        fd = os.open(_cfg["file"], os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, size)  # sparse
        store = mmap.mmap(fd, size)
        os.close(fd)
    else:
        store = mmap.mmap(-1, size)  # anonymous: zero-filled, allocated on first touch
    log = builtins.open(_cfg["log"], "a", buffering=1) if "log" in _cfg else None
    ctl = _cfg.get("ctl")
    _state.update(
        size=size,
        model=model,
        store=store,
        log=log,
        nodelay=os.path.join(ctl, "nodelay") if ctl else None,
        max_request=_parse_size(_cfg.get("max_request", "1M")),
    )
    global _actuator
    _actuator = _Actuator(_cfg.get("queue", "seqfirst"))
    if log:
        log.write(
            f"# {time.time():.6f} start {model.describe()} queue={_actuator.policy} "
            f"serialize={_cfg.get('serialize', 'plugin')}\n"
        )


def open(readonly):  # noqa: A001 - nbdkit callback name
    return 1


def get_size(h) -> int:
    return _state["size"]


def block_size(h):
    # (minimum, preferred, maximum): clients should not send more than max_request at once.
    return (1, 4096, _state["max_request"])


def is_rotational(h) -> bool:
    return True


def can_multi_conn(h) -> bool:
    return False


def can_write(h) -> bool:
    return True


def can_flush(h) -> bool:
    return True


def can_trim(h) -> bool:
    return False


def can_zero(h) -> bool:
    return True


def can_fua(h):
    return nbdkit.FUA_NATIVE  # writes are "durable" on return (no write cache modelled)


class _Actuator:
    """One actuator: requests are served one at a time.

    Used with nbdkit's PARALLEL thread model, so that nbdkit's worker threads keep receiving
    the next requests and sending finished replies while the "disk" serves one request: the
    host-side cost of a request (socket I/O, nbdfuse, FUSE, loop) then overlaps the service of
    the previous one, as with a real disk's command queue, instead of adding dead time between
    requests (which is what nbdkit's SERIALIZE_ALL_REQUESTS model does: one thread per
    connection receives, serves and replies in turn).

    Order: ``policy="fifo"`` serves strictly in the order requests reached the plugin.
    ``policy="seqfirst"`` (default) does the same, except that a waiting request that starts
    exactly where the previous one ended is served next (its positioning cost is zero, so any
    drive with command queueing would pick it; it also undoes the occasional swap of two
    consecutive requests by the host stack's threads, which would otherwise cost a revolution).
    The oldest waiting request is never bypassed more than ``max_bypass`` times.
    """

    def __init__(self, policy: str = "seqfirst", max_bypass: int = 8) -> None:
        import threading

        if policy not in ("fifo", "seqfirst"):
            raise ValueError(f"unknown queue policy {policy!r}")
        self.policy = policy
        self.max_bypass = max_bypass
        self.cond = threading.Condition()
        self.next_ticket = 0
        self.waiting: dict[int, int] = {}  # ticket -> offset, in arrival order
        self.busy = False
        self.chosen: int | None = None
        self.last_end: int | None = None
        self.bypassed = 0  # times the oldest waiting request was passed over

    def _pick(self) -> int:
        oldest = next(iter(self.waiting))
        if self.policy == "seqfirst" and self.bypassed < self.max_bypass:
            for t, off in self.waiting.items():
                if off == self.last_end:
                    self.bypassed = self.bypassed + 1 if t != oldest else 0
                    return t
        self.bypassed = 0
        return oldest

    def acquire(self, offset: int) -> int:
        """Wait for our turn; returns how many requests were queued or in service at arrival."""
        with self.cond:
            ticket = self.next_ticket
            self.next_ticket += 1
            ahead = len(self.waiting) + int(self.busy)
            self.waiting[ticket] = offset
            if not self.busy and self.chosen is None:
                self.chosen = self._pick()
            while self.chosen != ticket:
                self.cond.wait()
            del self.waiting[ticket]
            self.chosen = None
            self.busy = True
            return ahead

    def release(self, last_end: int | None) -> None:
        with self.cond:
            self.busy = False
            self.last_end = last_end
            if self.waiting:
                self.chosen = self._pick()
                self.cond.notify_all()


_actuator: _Actuator | None = None


def _request(op: str, offset: int, length: int, io) -> None:
    """Serve one request: wait for the actuator, do the real I/O, sleep the rest of the model."""
    import os

    st = _state
    model: HDDModel = st["model"]
    act = _actuator
    assert act is not None
    ahead = act.acquire(offset)
    try:
        t0 = time.monotonic()
        io()
        svc = model.service_time(offset, length, now=t0, write=op != "R")
        actual = time.monotonic() - t0
        nodelay = st["nodelay"] is not None and os.path.exists(st["nodelay"])
        if not nodelay and svc > actual:
            time.sleep(svc - actual)
        if nodelay or svc < actual:
            # the real I/O took longer (or no delay): keep the model clock on the wall clock
            model.free_at = time.monotonic()
        if st["log"] is not None:
            st["log"].write(
                f"{time.time():.6f} {op} {offset} {length} {svc:.6f} {time.monotonic() - t0:.6f}"
                f" {ahead}{' nodelay' if nodelay else ''}\n"
            )
    finally:
        act.release(model.last_end)


def pread(h, buf, offset, flags) -> None:
    def io() -> None:
        buf[:] = _state["store"][offset : offset + len(buf)]

    _request("R", offset, len(buf), io)


def pwrite(h, buf, offset, flags) -> None:
    def io() -> None:
        _state["store"][offset : offset + len(buf)] = buf

    _request("W", offset, len(buf), io)


def zero(h, count, offset, flags) -> None:
    def io() -> None:
        store = _state["store"]
        chunk = bytes(min(count, 1 << 20))
        pos = offset
        while pos < offset + count:
            k = min(len(chunk), offset + count - pos)
            store[pos : pos + k] = chunk[:k]
            pos += k

    _request("Z", offset, count, io)


def flush(h, flags) -> None:
    if _state["log"] is not None:
        _state["log"].write(f"{time.time():.6f} F 0 0 0 0 0\n")


def cleanup() -> None:
    if _state.get("log") is not None:
        _state["log"].close()
