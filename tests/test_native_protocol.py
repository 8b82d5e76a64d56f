"""The native transport's wire format (tierfs.transport.codec): pure, no mount."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.fs.api import Attr
from tierfs.transport import codec as c


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
