"""The native transport's wire format (tierfs.transport.codec): pure, no mount."""

from __future__ import annotations

import errno
import os
import socket
import struct
import time
import types

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.fs.api import Attr, FuseError, OpenReply
from tierfs.transport import codec as c
from tierfs.transport import native
from tierfs_hints import wire


def req(opcode: int, body: bytes = b"", *, unique: int = 7, nodeid: int = 1, extlen: int = 0) -> bytes:
    n = c.IN_HEADER.size + len(body)
    return c.IN_HEADER.pack(n, opcode, unique, nodeid, 1000, 100, 42, extlen, 0) + body


def test_header_fields():
    r = c.decode(req(c.GETATTR, struct.pack("<IIQ", 1, 0, 99), unique=5, nodeid=3))
    assert (r.opcode, r.unique, r.nodeid, r.h.uid, r.h.gid, r.h.pid) == (c.GETATTR, 5, 3, 1000, 100, 42)
    assert r.args == {"getattr_flags": 1, "fh": 99}


def test_init_with_flags2():
    body = struct.pack("<IIIII", 7, 44, 131072, c.INIT_EXT | c.ASYNC_READ, 1 << 5) + bytes(44)
    r = c.decode(req(c.INIT, body))
    assert r.args["minor"] == 44 and r.args["flags"] & c.PASSTHROUGH and r.args["flags"] & c.ASYNC_READ


def test_init_before_flags2():
    r = c.decode(req(c.INIT, struct.pack("<IIII", 7, 31, 4096, c.ASYNC_READ)))
    assert r.args["flags"] == c.ASYNC_READ


def test_names_and_write_data():
    r = c.decode(req(c.RENAME2, struct.pack("<QII", 9, 1, 0) + b"a\0bb\0"))
    assert r.args == {"newdir": 9, "flags": 1, "name": b"a", "newname": b"bb"}
    r = c.decode(req(c.SYMLINK, b"link\0/target\0"))
    assert (r.args["name"], r.args["target"]) == (b"link", b"/target")
    w = c.decode(req(c.WRITE, struct.pack("<QQIIQII", 3, 4096, 5, 0, 0, 0o2, 0) + b"hello"))
    assert (w.args["fh"], w.args["offset"], bytes(w.args["data"])) == (3, 4096, b"hello")
    x = c.decode(req(c.SETXATTR, struct.pack("<II", 3, 0) + b"user.a\0xyz"))
    assert (x.args["name"], x.args["value"]) == (b"user.a", b"xyz")


def test_setattr_times():
    body = c._SETATTR_IN.pack(c.FATTR_MTIME | c.FATTR_SIZE, 0, 0, 123, 0, 0, 5, 0, 0, 7, 0, 0, 0, 0, 0)
    r = c.decode(req(c.SETATTR, body))
    assert r.args["size"] == 123 and r.args["mtime_ns"] == 5 * 10**9 + 7


def test_batch_forget():
    body = struct.pack("<II", 2, 0) + struct.pack("<QQQQ", 5, 1, 6, 3)
    assert c.decode(req(c.BATCH_FORGET, body)).args["items"] == [(5, 1), (6, 3)]


def test_extensions_are_cut_off():
    r = c.decode(req(c.LOOKUP, b"name\0" + bytes(3) + bytes(8), extlen=1))
    assert r.args["name"] == b"name"


@pytest.mark.parametrize("raw,why", [
    (b"", "shorter than the header"),
    (b"\0" * 39, "shorter than the header"),
    (req(c.LOOKUP, b"noterminator"), "NUL"),
    (req(c.READ, b"\0" * 10), "shorter than its"),
    (req(c.WRITE, struct.pack("<QQIIQII", 3, 0, 100, 0, 0, 0, 0) + b"short"), "bytes of data"),
    (req(c.BATCH_FORGET, struct.pack("<II", 10**6, 0)), "beyond the body"),
    (req(c.LOOKUP, b"x\0", extlen=100), "extensions"),
])
def test_malformed_is_a_typed_error(raw, why):
    with pytest.raises(c.MalformedRequest, match=why) as ei:
        c.decode(raw)
    if len(raw) >= c.IN_HEADER.size:
        assert ei.value.unique == 7  # the transport can still answer it


def test_length_mismatch():
    raw = req(c.LOOKUP, b"x\0") + b"junk"
    with pytest.raises(c.MalformedRequest, match="header says"):
        c.decode(raw)


def test_unknown_opcode_is_not_an_error():
    r = c.decode(req(4242, b"whatever"))
    assert not r.known and r.opcode == 4242


@settings(max_examples=300, deadline=None)
@given(op=st.integers(0, 60), body=st.binary(max_size=200), extlen=st.integers(0, 3))
def test_fuzz_decode_raises_only_malformed(op, body, extlen):
    try:
        c.decode(req(op, body, extlen=extlen))
    except c.MalformedRequest:
        pass


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=120))
def test_fuzz_raw_bytes(raw):
    try:
        c.decode(raw)
    except c.MalformedRequest:
        pass


def test_attr_layout():
    a = Attr(st_ino=5, st_mode=0o100644, st_nlink=1, st_size=10, st_mtime_ns=3 * 10**9 + 4,
             attr_timeout=1.5, entry_timeout=2.0)
    e = c.entry_out(a)
    assert len(e) == 128 and len(c.attr_out(a)) == 104
    nodeid, gen, ev, av, evn, avn = c.ENTRY_HEAD.unpack_from(e)
    assert (nodeid, ev, av, evn, avn) == (5, 2, 1, 0, 500_000_000)
    fields = c.ATTR.unpack_from(e, c.ENTRY_HEAD.size)
    assert fields[0] == 5 and fields[1] == 10 and fields[4] == 3 and fields[7] == 4
    assert fields[9] == 0o100644


def test_negative_times_pack():
    a = Attr(st_ino=1, st_mtime_ns=-1)  # before the epoch: seconds -1, ns 999999999
    f = c.ATTR.unpack(c.attr(a))
    assert (f[4], f[7]) == (-1, 999_999_999)


def test_replies():
    assert c.OUT_HEADER.unpack(c.error_reply(9, 2)) == (16, -2, 9)
    r = c.reply(9, c.open_out(3, c.FOPEN_PASSTHROUGH, 11))
    assert c.OUT_HEADER.unpack_from(r) == (32, 0, 9)
    assert c.OPEN_OUT.unpack_from(r, 16) == (3, c.FOPEN_PASSTHROUGH, 11)
    init = c.init_out(minor=40, max_readahead=1 << 20, flags=c.PASSTHROUGH | c.MAX_PAGES | c.INIT_EXT,
                      max_background=64, congestion_threshold=48, max_write=1 << 20, max_pages=256,
                      max_stack_depth=1)
    f = c.INIT_OUT.unpack(init)
    assert len(init) == 64 and f[3] == c.MAX_PAGES | c.INIT_EXT and f[10] == 1 << 5 and f[11] == 1


def test_dirents_pad_and_fill():
    a = Attr(st_ino=8, st_mode=0o40755)
    d = c.dirent(b"abc", 8, 1, a.st_mode)
    assert len(d) == 32 and c.DIRENT_HEAD.unpack_from(d) == (8, 1, 3, 4)  # DT_DIR
    assert len(c.direntplus(b"abc", a, 1)) == 128 + 32
    buf = c.DirBuffer(100, plus=False)
    assert buf.add(b"a" * 10, a, 1) and buf.add(b"b" * 10, a, 2)  # 40 bytes each
    assert not buf.add(b"c", a, 3)  # 32 more would make 112 > 100
    assert buf.used == 80 and buf.taken == [8, 8] and len(buf.payload()) == 80


# -- the session's loop, in-process: a socket pair stands in for /dev/fuse ------------------------


class StubHandlers:
    """Just enough of Handlers: a getattr that works, handlers that fail, a read that hangs."""

    def __init__(self) -> None:
        self.forgotten: list[tuple[int, int]] = []
        self.read_cancelled = False
        self.reading = trio.Event()
        self.released: list[int] = []
        self.session: native.NativeSession | None = None  # the session serving it (_with_session)

    async def getattr(self, inode, ctx=None):
        return Attr(st_ino=inode, st_mode=0o100644, st_nlink=1)

    async def lookup(self, parent, name, ctx=None):
        if name == b"bug":
            raise RuntimeError("a bug in a handler")
        if name == b"found":  # counts a lookup of inode 9
            return Attr(st_ino=9, st_mode=0o100644, st_nlink=1)
        if name == b"thread":  # served in a worker thread, as a metadata call on a slow store
            await trio.to_thread.run_sync(time.sleep, 0.001)
        raise FuseError(errno.ENOENT)

    async def forget(self, items):
        self.forgotten.extend(items)
        if any(i == 666 for i, _ in items):
            raise RuntimeError("a bug in forget")

    async def open(self, inode, flags, ctx, kill_suidgid=False):
        return OpenReply(77)

    async def release(self, fh):
        self.released.append(fh)

    def release_now(self, fh):
        return False  # every release through release(), counted there

    def forget_now(self, inode, n):
        return False  # every forget through forget(), recorded there

    def lookup_now(self, parent, name):
        return None  # every lookup through lookup()

    def setattr_now(self, inode, attr):
        return None  # every setattr through setattr()

    def getattr_now(self, inode):
        if inode == 666:
            raise RuntimeError("a bug in a request answered at once")
        return None

    async def read(self, fh, off, size):
        self.reading.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            self.read_cancelled = True
            raise
        return b""


class Peer:
    """The kernel's side of the pair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = trio.socket.from_stdlib_socket(sock)

    async def send(self, raw: bytes) -> None:
        await self.sock.send(raw)

    async def reply(self) -> tuple[int, int, bytes]:
        raw = await self.sock.recv(1 << 17)
        n, err, unique = c.OUT_HEADER.unpack_from(raw)
        assert n == len(raw)
        return unique, -err, raw[c.OUT_HEADER.size:]


async def _with_session(script, busy_poll_s: float = 0.0) -> tuple[native.NativeSession, StubHandlers]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    a.setblocking(False)
    stub = StubHandlers()
    s = native.NativeSession(stub, a.detach(), "/nonexistent/tierfs-test", want_passthrough=True,  # type: ignore[arg-type]
                             busy_poll_s=busy_poll_s)
    stub.session = s
    peer = Peer(b)
    await peer.send(req(c.INIT, struct.pack("<IIIII", 7, 45, 1 << 17, c.INIT_EXT | c.ASYNC_READ, 0) + bytes(44), unique=1))
    await s.init()
    async with trio.open_nursery() as n:
        n.start_soon(s.main)
        await script(peer, stub)
        peer.sock.close()  # the loop ends like an unmount
    s.close(unmount=False)
    return s, stub


def _run(script, busy_poll_s: float = 0.0):
    return trio.run(_with_session, script, busy_poll_s)


def test_init_before_main_and_normal_request():
    async def go():
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        a.setblocking(False)
        s = native.NativeSession(StubHandlers(), a.detach(), "/nonexistent/x", want_passthrough=True)  # type: ignore[arg-type]
        peer = Peer(b)
        body = struct.pack("<IIIII", 7, 45, 1 << 17, c.INIT_EXT | c.ASYNC_READ | c.MAX_PAGES, 1 << 5)
        await peer.send(req(c.INIT, body + bytes(44), unique=1))
        ir = await s.init()
        unique, err, payload = await peer.reply()
        f = c.INIT_OUT.unpack(payload)
        assert (unique, err, f[0], f[1]) == (1, 0, 7, 40)
        assert ir.passthrough and f[10] == 1 << 5 and f[11] == 1 and f[8] == native.MAX_PAGES
        assert f[3] & c.MAX_PAGES and not f[3] & c.DO_READDIRPLUS  # only what the kernel offered
        async with trio.open_nursery() as n:
            n.start_soon(s.main)
            await peer.send(req(c.GETATTR, struct.pack("<IIQ", 0, 0, 0), unique=2, nodeid=5))
            unique, err, payload = await peer.reply()
            assert (unique, err, len(payload)) == (2, 0, 104)
            peer.sock.close()
        s.close(unmount=False)

    trio.run(go)


def test_malformed_truncated_unknown_and_bugs_keep_the_loop_alive():
    async def script(peer, stub):
        await peer.reply()  # INIT's
        await peer.send(req(c.READ, b"\0" * 3, unique=10))  # truncated body
        assert await peer.reply() == (10, errno.EINVAL, b"")
        await peer.send(b"\0" * 12)  # not even a header: nothing to answer
        await peer.send(req(999, b"x", unique=11))  # unknown opcode
        assert await peer.reply() == (11, errno.ENOSYS, b"")
        await peer.send(req(c.LOOKUP, b"bug\0", unique=12))  # a handler bug
        assert await peer.reply() == (12, errno.EIO, b"")
        await peer.send(req(c.LOOKUP, b"nope\0", unique=13))
        assert await peer.reply() == (13, errno.ENOENT, b"")
        await peer.send(req(c.FORGET, struct.pack("<Q", 1), unique=14, nodeid=666))  # buggy forget: no reply
        await peer.send(req(c.GETATTR, struct.pack("<IIQ", 0, 0, 0), unique=15, nodeid=5))
        unique, err, _ = await peer.reply()
        assert (unique, err) == (15, 0)  # the next reply is this one: nothing answered the forget
        # a bug in a request the transport answers itself (no task): EIO, and the loop goes on
        await peer.send(req(c.GETATTR, struct.pack("<IIQ", 0, 0, 0), unique=16, nodeid=666))
        assert await peer.reply() == (16, errno.EIO, b"")
        await peer.send(req(c.GETATTR, struct.pack("<IIQ", 0, 0, 0), unique=17, nodeid=5))
        assert (await peer.reply())[:2] == (17, 0)

    s, _ = _run(script)
    assert (s.malformed, s.unknown, s.unexpected) == (2, 1, 3)


def test_ioctls_are_answered_enotty_without_a_handler():
    # Python's open() asks isatty() of every file it opens (a TCGETS ioctl, 0x5401)
    async def script(peer, stub):
        await peer.reply()
        await peer.send(req(c.IOCTL, struct.pack("<QIIQII", 3, 0, 0x5401, 0, 0, 60), unique=20, nodeid=5))
        assert await peer.reply() == (20, errno.ENOTTY, b"")
        # the control requests' ioctl too: a read-write mount takes them as writes of the file
        body = wire.CTL_IOC_IN.pack(wire.CTL_IOC_MAGIC, wire.CTL_OP_WRITE, bytes(16), 0, 0)
        body += bytes(wire.CTL_IOC_SIZE - len(body))
        await peer.send(req(c.IOCTL, struct.pack("<QIIQII", 0, 0, wire.CTL_IOC, 0, len(body), len(body)) + body,
                            unique=22, nodeid=5))
        assert await peer.reply() == (22, errno.ENOTTY, b"")
        await peer.send(req(c.GETATTR, struct.pack("<IIQ", 0, 0, 0), unique=21, nodeid=5))
        assert (await peer.reply())[:2] == (21, 0)

    s, _ = _run(script)
    assert (s.ioctls, s.unknown, s.unexpected) == (2, 0, 0)
    assert s.statistics()["ioctls"] == 2


def test_interrupt_cancels_and_answers_eintr():
    async def script(peer, stub):
        await peer.reply()
        await peer.send(req(c.READ, c._READ_IN.pack(1, 0, 4096, 0, 0, 0, 0), unique=20))
        await stub.reading.wait()
        await peer.send(req(c.INTERRUPT, struct.pack("<Q", 20), unique=21))
        assert await peer.reply() == (20, errno.EINTR, b"")
        assert stub.read_cancelled
        await peer.send(req(c.INTERRUPT, struct.pack("<Q", 12345), unique=22))  # long done: ignored
        await peer.send(req(c.GETATTR, struct.pack("<IIQ", 0, 0, 0), unique=23, nodeid=5))
        assert (await peer.reply())[:2] == (23, 0)

    s, _ = _run(script)
    assert s.interrupts == 2 and s.interrupted == 1


def test_workers_grow_with_blocked_requests_and_shrink_after():
    """Requests are served by a pool of workers: fifty reads blocked at once each hold one,
    and a getattr behind them is still answered (a worker is started whenever none is left
    to read); once they are done, idle workers beyond MAX_IDLE_WORKERS end."""
    async def script(peer, stub):
        await peer.reply()
        for k in range(50):
            await peer.send(req(c.READ, c._READ_IN.pack(1, 0, 4096, 0, 0, 0, 0), unique=100 + k))
        await trio.testing.wait_all_tasks_blocked()
        await peer.send(req(c.GETATTR, struct.pack("<IIQ", 0, 0, 0), unique=99, nodeid=5))
        assert (await peer.reply())[:2] == (99, 0)
        for k in range(50):
            await peer.send(req(c.INTERRUPT, struct.pack("<Q", 100 + k), unique=200 + k))
        got = sorted([(await peer.reply())[:2] for _ in range(50)])
        assert got == [(100 + k, errno.EINTR) for k in range(50)]
        await trio.testing.wait_all_tasks_blocked()
        seen.append((stub.session.peak_workers, stub.session.workers))

    seen: list[tuple[int, int]] = []
    s, _ = _run(script)
    peak, after = seen[0]
    assert peak > 50 and after <= native.MAX_IDLE_WORKERS + 1
    assert s.interrupted == 50


def test_requests_that_never_wait_are_served_by_one_worker():
    """A worker keeps the reading turn while its handler runs without waiting: a client that
    sends one request at a time (``rm -rf``, ``tar -x``) is served by one worker, with no
    other woken or started per request (each request used to start or wake a second one)."""
    async def script(peer, stub):
        await peer.reply()
        for k in range(20):
            await peer.send(req(c.GETATTR, struct.pack("<IIQ", 0, 0, 0), unique=10 + k, nodeid=5))
            assert (await peer.reply())[:2] == (10 + k, 0)
        await trio.testing.wait_all_tasks_blocked()
        seen.append((stub.session.peak_workers, stub.session.workers))
        await peer.send(req(c.READ, c._READ_IN.pack(1, 0, 4096, 0, 0, 0, 0), unique=50))
        await stub.reading.wait()  # the read waits: its worker handed the turn on
        await peer.send(req(c.GETATTR, struct.pack("<IIQ", 0, 0, 0), unique=51, nodeid=5))
        assert (await peer.reply())[:2] == (51, 0)
        seen.append((stub.session.peak_workers, stub.session.workers))

    seen: list[tuple[int, int]] = []
    _run(script)
    assert seen == [(1, 1), (2, 2)]


def _getattr(unique: int) -> bytes:
    return req(c.GETATTR, struct.pack("<IIQ", 0, 0, 0), unique=unique, nodeid=5)


def test_busy_poll_reads_the_next_request_of_a_serial_client(monkeypatch):
    """After answering, the transport polls /dev/fuse for a while before sleeping in epoll: a
    client in another thread that sends its next request shortly after its reply (a serial
    one: rm -rf, tar -x; here 2 ms later, long after the worker came back to read) has every
    request after its first read by a poll, none after a sleep in epoll."""
    monkeypatch.setattr(native.os, "sched_getaffinity", lambda pid: {0, 1})

    async def script(peer, stub):
        await peer.reply()
        sock = peer.sock._sock.dup()  # a blocking twin of the kernel's side, for the thread
        sock.setblocking(True)

        def client() -> list[tuple[int, int]]:
            got = []
            for k in range(10):
                if k:
                    time.sleep(0.002)
                sock.send(_getattr(100 + k))
                n, err, unique = c.OUT_HEADER.unpack_from(sock.recv(1 << 17))
                got.append((unique, -err))
                if k == 0:
                    before.append((stub.session.busy_poll_hits, stub.session.epoll_waits))
            sock.close()
            return got

        got = await trio.to_thread.run_sync(client)
        assert got == [(100 + k, 0) for k in range(10)]

    before: list[tuple[int, int]] = []
    s, _ = _run(script, busy_poll_s=0.5)
    hits0, waits0 = before[0]
    assert s.busy_poll_s == 0.5
    # the nine requests after the first: each found by a poll, none after a sleep in epoll (the
    # loop's last read, after the client closed, may sleep once)
    assert s.busy_poll_hits - hits0 == 9
    assert s.epoll_waits - waits0 <= 1
    st = s.statistics()
    assert st["busy_poll_us"] == 500000 and st["busy_poll_hits"] == s.busy_poll_hits


def test_busy_poll_never_while_a_handler_waits_for_a_thread(monkeypatch):
    """While a handler waits for a worker thread its client waits for that reply, and the
    thread's result comes through epoll: the reader sleeps there at once instead of polling
    (a poll would hold the reply back for the whole poll)."""
    monkeypatch.setattr(native.os, "sched_getaffinity", lambda pid: {0, 1})

    async def script(peer, stub):
        await peer.reply()
        # (a poll may have run out since the INIT's reply: this script's own task, the test's
        # and not the daemon's, waited behind it; counted from here)
        before.append(stub.session.busy_poll_misses)
        sock = peer.sock._sock.dup()
        sock.setblocking(True)

        def client() -> list[tuple[int, int]]:
            got = []
            for k in range(3):
                sock.send(req(c.LOOKUP, b"thread\0", unique=100 + k))
                n, err, unique = c.OUT_HEADER.unpack_from(sock.recv(1 << 17))
                got.append((unique, -err))
            sock.close()
            return got

        got = await trio.to_thread.run_sync(client)
        assert got == [(100 + k, errno.ENOENT) for k in range(3)]
        during.append(stub.session.busy_poll_misses)

    before: list[int] = []
    during: list[int] = []
    _run(script, busy_poll_s=0.5)
    # (each would have cost its reply 0.5 s; the one allowed: the read after the last reply,
    # whose poll finds nothing when the client is done)
    assert during[0] - before[0] <= 1


def test_busy_poll_stops_while_it_finds_nothing(monkeypatch):
    """A client that is not there when the poll ends (here: it runs in the daemon's own loop,
    so it can never send during a poll) costs BUSY_POLL_MISSES polls, then the next
    BUSY_POLL_SKIP reads sleep at once, and then one polls again."""
    monkeypatch.setattr(native.os, "sched_getaffinity", lambda pid: {0, 1})
    n = native.BUSY_POLL_MISSES + native.BUSY_POLL_SKIP + 2

    async def script(peer, stub):
        await peer.reply()
        for k in range(n):
            await peer.send(_getattr(100 + k))
            assert (await peer.reply())[:2] == (100 + k, 0)

    s, _ = _run(script, busy_poll_s=0.001)
    assert s.busy_poll_hits == 0
    # BUSY_POLL_MISSES polls, then BUSY_POLL_SKIP reads without one, then polls again (one or
    # two: whether the read before the first request polls depends on what else was runnable)
    assert native.BUSY_POLL_MISSES < s.busy_poll_misses <= native.BUSY_POLL_MISSES + 3


def test_runnable_tasks_as_trio_counts_them():
    """The poll's check for other runnable tasks reads trio's run queue directly (the public
    statistics call costs more): it must say what trio says."""
    async def go():
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s = native.NativeSession(StubHandlers(), a.detach(), "/nonexistent/x", want_passthrough=True)  # type: ignore[arg-type]
        try:
            assert s._runnable() == trio.lowlevel.current_statistics().tasks_runnable == 0
            async with trio.open_nursery() as n:
                n.start_soon(trio.sleep, 0)
                n.start_soon(trio.sleep, 0)
                assert s._runnable() == trio.lowlevel.current_statistics().tasks_runnable == 2
            assert s._runq is not None and len(s._runq) == 0  # the fast path, not the fallback
        finally:
            s.close(unmount=False)
            b.close()

    trio.run(go)


def test_busy_poll_never_with_one_cpu(monkeypatch):
    """With one CPU the client cannot run while the daemon polls: no polling at all."""
    monkeypatch.setattr(native.os, "sched_getaffinity", lambda pid: {0})

    async def script(peer, stub):
        await peer.reply()
        for k in range(3):
            await peer.send(_getattr(100 + k))
            assert (await peer.reply())[:2] == (100 + k, 0)

    s, _ = _run(script, busy_poll_s=0.001)
    assert s.busy_poll_s == 0 and s.busy_poll_hits == s.busy_poll_misses == 0


def test_inline_await_calls_on_suspend_once_and_forwards_values_and_errors():
    calls: list[str] = []

    async def no_wait() -> int:
        return 1

    async def waits() -> int:
        await trio.lowlevel.checkpoint()
        await trio.lowlevel.checkpoint()
        return 2

    async def cancelled() -> str:
        with trio.CancelScope() as cs:
            cs.cancel()
            await trio.sleep(10)  # the Cancelled trio throws in reaches the coroutine
        return "caught" if cs.cancelled_caught else "not"

    async def fails() -> None:
        await trio.lowlevel.checkpoint()
        raise KeyError("x")

    async def main() -> None:
        assert await native._Inline(no_wait(), lambda: calls.append("a")) == 1
        assert calls == []
        assert await native._Inline(waits(), lambda: calls.append("b")) == 2
        assert calls == ["b"]
        assert await native._Inline(cancelled(), lambda: calls.append("c")) == "caught"
        with pytest.raises(KeyError):
            await native._Inline(fails(), lambda: calls.append("d"))
        assert calls == ["b", "c", "d"]

    trio.run(main)


def test_forget_storm():
    items = [(i, 1) for i in range(2, 4002)]

    async def script(peer, stub):
        await peer.reply()
        for k in range(0, len(items), 500):
            chunk = items[k:k + 500]
            body = struct.pack("<II", len(chunk), 0) + b"".join(struct.pack("<QQ", i, n) for i, n in chunk)
            await peer.send(req(c.BATCH_FORGET, body, unique=0))
        for i in range(1000):
            await peer.send(req(c.FORGET, struct.pack("<Q", 2), unique=0, nodeid=10_000 + i))
        await peer.send(req(c.GETATTR, struct.pack("<IIQ", 0, 0, 0), unique=30, nodeid=5))
        assert (await peer.reply())[:2] == (30, 0)  # no reply to any forget came first
        await trio.testing.wait_all_tasks_blocked()  # every forget task ran

    _, stub = _run(script)
    assert sorted(stub.forgotten) == sorted(items + [(10_000 + i, 2) for i in range(1000)])


def test_reply_to_a_forgotten_request_does_not_end_the_loop(monkeypatch):
    real = os.writev
    calls = {"n": 0}

    def writev(fd, parts):
        calls["n"] += 1
        if calls["n"] == 2:  # the first reply after INIT's: the kernel forgot that request
            raise OSError(errno.ENOENT, "No such file or directory")
        return real(fd, parts)

    monkeypatch.setattr(native.os, "writev", writev)

    async def script(peer, stub):
        await peer.reply()
        await peer.send(req(c.GETATTR, struct.pack("<IIQ", 0, 0, 0), unique=40, nodeid=5))
        await peer.send(req(c.GETATTR, struct.pack("<IIQ", 0, 0, 0), unique=41, nodeid=5))
        assert (await peer.reply())[:2] in ((40, 0), (41, 0))

    s, _ = _run(script)
    assert s.stale_replies == 1


def _refuse_reply(monkeypatch, unique: int) -> None:
    """The kernel refuses the reply to request ``unique`` (ENOENT: its caller was interrupted
    or killed meanwhile, and nobody waits for it any more)."""
    real = os.writev

    def writev(fd, parts):
        if c.OUT_HEADER.unpack_from(parts[0])[2] == unique:
            raise OSError(errno.ENOENT, "No such file or directory")
        return real(fd, parts)

    monkeypatch.setattr(native.os, "writev", writev)


def test_an_open_whose_reply_the_kernel_did_not_take_is_released(monkeypatch):
    _refuse_reply(monkeypatch, 50)  # the open's reply: its opener is gone

    async def script(peer, stub):
        await peer.reply()
        await peer.send(req(c.OPEN, struct.pack("<II", os.O_RDONLY, 0), unique=50, nodeid=5))
        await peer.send(req(c.GETATTR, struct.pack("<IIQ", 0, 0, 0), unique=51, nodeid=5))
        assert (await peer.reply())[:2] == (51, 0)
        await trio.testing.wait_all_tasks_blocked()

    s, stub = _run(script)
    assert stub.released == [77] and s.stale_replies == 1



def test_an_open_answered_at_once_whose_reply_the_kernel_did_not_take_is_released(monkeypatch, tmp_path):
    """The OPEN of a kept tier copy is answered as it is read (Handlers.open_now). If the
    kernel does not take that reply (its opener was killed meanwhile), the handle is released
    there and then, and the inode's count of passthrough opens goes back: else the copy stayed
    pinned, and the inode in passthrough mode for good (its cached opens refused ETXTBSY)."""
    _refuse_reply(monkeypatch, 52)
    (tmp_path / "copy").write_bytes(b"x" * 10)
    fd = os.open(tmp_path / "copy", os.O_RDONLY)
    st = os.fstat(fd)
    handles = iter([78, 79])
    released: list[tuple[int, bool]] = []

    def open_now(inode, flags, ctx, register):
        bid = register(fd)  # the kept registration: no ioctl
        assert bid == 3
        return OpenReply(next(handles)), types.SimpleNamespace(fd=fd, size=10, tier="ram"), bid

    def release_now(fh, count=True):
        released.append((fh, count))
        return True

    async def script(peer, stub):
        await peer.reply()
        s = stub.session
        s.pt = native.Passthrough(s.fd, kept=lambda inode: True)  # (a kept copy outlives its opens)
        s.pt.inodes[5] = native._InodeIO(backing_id=3, ident=(st.st_dev, st.st_ino), kind="tier")
        stub.open_now, stub.release_now = open_now, release_now
        await peer.send(req(c.OPEN, struct.pack("<II", os.O_RDONLY, 0), unique=52, nodeid=5))
        await peer.send(req(c.OPEN, struct.pack("<II", os.O_RDONLY, 0), unique=53, nodeid=5))
        unique, err, payload = await peer.reply()
        assert (unique, err) == (53, 0)
        assert c.OPEN_OUT.unpack_from(payload) == (79, c.FOPEN_PASSTHROUGH | c.FOPEN_NOFLUSH, 3)
        assert released == [(78, False)]
        assert s.pt.by_fh == {79: (5, "pt", False)} and s.pt.inodes[5].pt == 1
        assert s.opens_now == 1 and s.stale_replies == 1
        s.pt.inodes.clear()  # (no BACKING_CLOSE ioctl on the socket at the end)
        s.pt.by_fh.clear()

    try:
        _run(script)
    finally:
        os.close(fd)


def test_a_lookup_whose_reply_the_kernel_did_not_take_is_forgotten(monkeypatch):
    """An entry reply counts a lookup of its inode; if the kernel does not take it (the caller
    was interrupted meanwhile), the kernel never sends the FORGET, so the daemon gives the
    lookup back itself (or the inode would stay in its table for ever)."""
    _refuse_reply(monkeypatch, 60)

    async def script(peer, stub):
        await peer.reply()
        await peer.send(req(c.LOOKUP, b"found\0", unique=60, nodeid=1))
        await peer.send(req(c.LOOKUP, b"found\0", unique=61, nodeid=1))
        assert (await peer.reply())[:2] == (61, 0)
        await trio.testing.wait_all_tasks_blocked()

    s, stub = _run(script)
    assert stub.forgotten == [(9, 1)] and s.stale_replies == 1
