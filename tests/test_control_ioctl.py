"""Control requests sent as ioctls of the command file (a read-only mount, where the file cannot
be opened for writing): the sessions of :meth:`tierfs.fs.control.ControlPlane.ioctl` in-process,
then through a real read-only mount, as root and as another user."""

from __future__ import annotations

import errno
import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from tests.conftest import run_as
from tierfs.access import Caller
from tierfs.fs import control
from tierfs.fs.api import FuseError
from tierfs_hints import wire

NOBODY = 65534


@dataclass
class Ctx:
    uid: int
    gid: int
    pid: int = 0


def _piece(op: int, token: bytes, payload: bytes = b"", offset: int = 0, *, magic: bytes = wire.CTL_IOC_MAGIC) -> bytes:
    return wire.CTL_IOC_IN.pack(magic, op, token, offset, len(payload)) + payload


def _plane() -> tuple[control.ControlPlane, list[tuple[bytes, Caller]]]:
    seen: list[tuple[bytes, Caller]] = []

    async def echo(request: bytes, caller: Caller) -> bytes:
        seen.append((bytes(request), caller))
        return json.dumps({"ok": True, "uid": caller.uid, "n": len(request)}).encode() + b"\n"

    return control.ControlPlane({"stats.json": lambda uid: b"{}"}, {wire.CTL_FILE: echo}), seen


async def _ask(plane: control.ControlPlane, ctx: Ctx, token: bytes, request: bytes) -> dict:
    ctl = plane.by_name[wire.CTL_FILE.encode()].inode
    room = wire.CTL_IOC_SIZE - wire.CTL_IOC_IN.size
    for at in range(0, len(request), room):
        await plane.ioctl(ctl, _piece(wire.CTL_OP_WRITE, token, request[at:at + room], at), ctx, None)
    out, pos = b"", 0
    while True:
        got = await plane.ioctl(ctl, _piece(wire.CTL_OP_READ, token, offset=pos), ctx, None)
        total, n = wire.CTL_IOC_OUT.unpack_from(got, 0)
        out += got[wire.CTL_IOC_OUT.size:]
        pos += n
        if pos >= total:
            return json.loads(out)


async def test_a_session_is_one_request_of_one_user() -> None:
    plane, seen = _plane()
    ctl = plane.by_name[wire.CTL_FILE.encode()].inode
    user, other = Ctx(1000, 1000), Ctx(1001, 1001)
    token = os.urandom(16)
    # a request longer than one ioctl's buffer, in pieces
    request = json.dumps({"op": "where", "paths": ["x" * 100] * 400}).encode() + b"\n"
    assert len(request) > 2 * wire.CTL_IOC_SIZE
    reply = await _ask(plane, user, token, request)
    assert reply == {"ok": True, "uid": 1000, "n": len(request)}
    assert seen[0][0] == request and seen[0][1].uid == 1000
    # the same token from another user names nothing of the first one's
    with pytest.raises(FuseError) as e:
        await plane.ioctl(ctl, _piece(wire.CTL_OP_READ, token), other, None)
    assert e.value.errno == errno.ENOENT
    # the reply is held (counted against the user's budget) until the session is closed
    assert plane.pending_by_uid.get(1000, 0) > 0
    await plane.ioctl(ctl, _piece(wire.CTL_OP_CLOSE, token), user, None)
    assert plane.sessions == {} and plane.pending_bytes == 0 and plane.pending_by_uid == {}
    with pytest.raises(FuseError) as e:
        await plane.ioctl(ctl, _piece(wire.CTL_OP_READ, token), user, None)
    assert e.value.errno == errno.ENOENT


async def test_malformed_pieces_and_other_files_are_refused() -> None:
    plane, seen = _plane()
    ctl = plane.by_name[wire.CTL_FILE.encode()].inode
    stats = plane.by_name[b"stats.json"].inode
    ctx, token = Ctx(1000, 1000), os.urandom(16)
    cases = [
        (ctl, b"short", errno.EINVAL),
        (ctl, _piece(wire.CTL_OP_WRITE, token, b"{}\n", magic=b"NOPE"), errno.EINVAL),
        (ctl, _piece(wire.CTL_OP_WRITE, token, b"{}\n")[:-2], errno.EINVAL),  # payload shorter than said
        (ctl, _piece(99, token), errno.EINVAL),
        (stats, _piece(wire.CTL_OP_WRITE, token, b"{}\n"), errno.ENOTTY),
        (12345, _piece(wire.CTL_OP_WRITE, token, b"{}\n"), errno.ENOTTY),
    ]
    for inode, data, err in cases:
        with pytest.raises(FuseError) as e:
            await plane.ioctl(inode, data, ctx, None)
        assert e.value.errno == err, (inode, data[:8], e.value.errno)
    assert seen == [] and plane.pending_bytes == 0


async def test_over_its_cap_a_request_is_cut_off_and_the_reply_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "MAX_REQUEST_BYTES", 50_000)
    plane, seen = _plane()
    ctl = plane.by_name[wire.CTL_FILE.encode()].inode
    ctx, token = Ctx(1000, 1000), os.urandom(16)
    request = b'{"op":"where","paths":["' + b"y" * 60_000 + b'"]}\n'
    room = wire.CTL_IOC_SIZE - wire.CTL_IOC_IN.size
    with pytest.raises(FuseError) as e:
        for at in range(0, len(request), room):
            await plane.ioctl(ctl, _piece(wire.CTL_OP_WRITE, token, request[at:at + room], at), ctx, None)
    assert e.value.errno == errno.EFBIG
    got = await plane.ioctl(ctl, _piece(wire.CTL_OP_READ, token), ctx, None)
    reply = json.loads(got[wire.CTL_IOC_OUT.size:])
    assert not reply["ok"] and "MAX_REQUEST_BYTES" in reply["error"]
    assert seen == []
    await plane.ioctl(ctl, _piece(wire.CTL_OP_CLOSE, token), ctx, None)
    assert plane.pending_bytes == 0


async def test_sessions_are_bounded_per_user_and_idle_ones_go(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "MAX_USER_SESSIONS", 8)
    monkeypatch.setattr(control, "MAX_SESSIONS", 12)
    plane, _ = _plane()
    ctl = plane.by_name[wire.CTL_FILE.encode()].inode
    user = Ctx(1000, 1000)
    # unfinished requests of a client tierfs cannot see end (pid 0): one user cannot pile them up
    for _ in range(control.MAX_USER_SESSIONS):
        await plane.ioctl(ctl, _piece(wire.CTL_OP_WRITE, os.urandom(16), b'{"op":'), user, None)
    with pytest.raises(FuseError) as e:
        await plane.ioctl(ctl, _piece(wire.CTL_OP_WRITE, os.urandom(16), b'{"op":'), user, None)
    assert e.value.errno == errno.EMFILE
    # another user is not held up by it, up to the daemon's cap; root never is
    for _ in range(4):
        await plane.ioctl(ctl, _piece(wire.CTL_OP_WRITE, os.urandom(16), b'{"op":'), Ctx(1001, 1001), None)
    with pytest.raises(FuseError) as e:
        await plane.ioctl(ctl, _piece(wire.CTL_OP_WRITE, os.urandom(16), b'{"op":'), Ctx(1002, 1002), None)
    assert e.value.errno == errno.EMFILE
    assert (await _ask(plane, Ctx(0, 0), os.urandom(16), b'{"op":"x"}\n'))["ok"]
    # empty pieces do not keep a session alive; sessions that moved no bytes for
    # SESSION_IDLE_S go (their bytes with them) at the next new session
    monkeypatch.setattr(control, "SESSION_IDLE_S", 0.05)
    monkeypatch.setattr(control, "SWEEP_EVERY_S", 0.0)
    await trio.sleep(0.1)
    keep = os.urandom(16)
    await plane.ioctl(ctl, _piece(wire.CTL_OP_WRITE, keep, b'{"op":'), Ctx(1003, 1003), None)
    for _ in range(5):
        await trio.sleep(0.02)
        await plane.ioctl(ctl, _piece(wire.CTL_OP_WRITE, keep, b"", 6), Ctx(1003, 1003), None)
    assert (await _ask(plane, user, os.urandom(16), b'{"op":"x"}\n'))["ok"]
    assert plane.sessions_by_uid == {1000: 1}
    assert plane.pending_by_uid.keys() == {1000}  # the last reply only


async def test_a_piece_sent_again_is_taken_once_and_one_out_of_order_is_refused() -> None:
    plane, seen = _plane()
    ctl = plane.by_name[wire.CTL_FILE.encode()].inode
    ctx, token = Ctx(1000, 1000), os.urandom(16)
    await plane.ioctl(ctl, _piece(wire.CTL_OP_WRITE, token, b'{"op":'), ctx, None)
    # the same piece again (its ioctl was interrupted after the daemon took it): taken once
    await plane.ioctl(ctl, _piece(wire.CTL_OP_WRITE, token, b'{"op":'), ctx, None)
    with pytest.raises(FuseError) as e:  # a gap
        await plane.ioctl(ctl, _piece(wire.CTL_OP_WRITE, token, b'"x"}\n', 9), ctx, None)
    assert e.value.errno == errno.EINVAL
    await plane.ioctl(ctl, _piece(wire.CTL_OP_WRITE, token, b'"x"}\n', 6), ctx, None)
    got = await plane.ioctl(ctl, _piece(wire.CTL_OP_READ, token), ctx, None)
    assert json.loads(got[wire.CTL_IOC_OUT.size:])["n"] == 11
    assert seen[0][0] == b'{"op":"x"}\n'
    with pytest.raises(FuseError) as e:  # a session's first piece must start it
        await plane.ioctl(ctl, _piece(wire.CTL_OP_WRITE, os.urandom(16), b"x", 5), ctx, None)
    assert e.value.errno == errno.ENOENT


async def test_a_killed_clients_bytes_come_back_before_anyone_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "MAX_USER_PENDING_BYTES", 40_000)
    plane, _ = _plane()
    ctl = plane.by_name[wire.CTL_FILE.encode()].inode
    child = await trio.lowlevel.open_process(["sleep", "60"])
    try:
        dead = Ctx(1000, 1000, child.pid)
        token = os.urandom(16)
        room = wire.CTL_IOC_SIZE - wire.CTL_IOC_IN.size
        body = b'{"op":"where","paths":["' + b"z" * 30_000
        for at in range(0, len(body), room):
            await plane.ioctl(ctl, _piece(wire.CTL_OP_WRITE, token, body[at:at + room], at), dead, None)
        assert plane.pending_by_uid[1000] >= 30_000
    finally:
        child.kill()
        await child.wait()
    # the same user's next request fits: the dead client's session went first
    reply = await _ask(plane, Ctx(1000, 1000, os.getpid()), os.urandom(16),
                       b'{"op":"where","paths":["' + b"y" * 20_000 + b'"]}\n')
    assert reply["ok"]
    assert len(plane.sessions) == 1


# -- through a read-only mount ---------------------------------------------------------------------
def _as(uid: int, cwd: Path, fn) -> str:  # type: ignore[no-untyped-def]
    """``fn``'s result as uid ``uid`` in ``cwd`` (:func:`tests.conftest.run_as`): its repr, or
    the exception's name and message."""
    kind, value = run_as(uid, cwd, fn)
    return value if kind == "ok" else f"{kind}: {value}"


@pytest.mark.native_only
def test_a_read_only_mount_takes_requests_with_each_callers_rights(tiermount, tmp_path: Path) -> None:
    back = tmp_path / "back"
    (back / "pub").mkdir(parents=True)
    (back / "pub" / "a.bin").write_bytes(os.urandom(300_000))
    (back / "secret.bin").write_bytes(os.urandom(300_000))
    os.chmod(back / "secret.bin", 0o600)
    m = tiermount(ram="64MiB", extra=("-o", "ro"))
    mnt = str(m.mnt)

    # another user hints what it may read, and nothing it may not
    got = _as(NOBODY, m.mnt, lambda: wire.request(".", {"op": "need", "items": [["pub/a.bin", 0, None]]})["files"])
    assert got == "1", got
    got = _as(NOBODY, m.mnt, lambda: wire.request(".", {"op": "need", "items": [["secret.bin", 0, None]]}))
    assert got.startswith("ControlError") and "permission denied" in got, got
    assert wire.request(mnt, {"op": "need", "items": [["secret.bin", 0, None]]})["files"] == 1  # root may

    # root's session, half sent, is nobody's to read or finish
    token = os.urandom(16)
    fd = os.open(os.path.join(mnt, ".tierfs", "ctl"), os.O_RDONLY)
    try:
        buf = bytearray(wire.CTL_IOC_SIZE)
        first = _piece(wire.CTL_OP_WRITE, token, b'{"op":"where","paths":["secret.bin"]')
        buf[: len(first)] = first
        fcntl.ioctl(fd, wire.CTL_IOC, buf, True)

        def hijack() -> str:
            b = bytearray(wire.CTL_IOC_SIZE)
            p = _piece(wire.CTL_OP_WRITE, token, b"}\n", 38)
            b[: len(p)] = p
            fcntl.ioctl(fd, wire.CTL_IOC, b, True)  # a new session of its own: no reply of root's
            b = bytearray(wire.CTL_IOC_SIZE)
            p = _piece(wire.CTL_OP_READ, token)
            b[: len(p)] = p
            fcntl.ioctl(fd, wire.CTL_IOC, b, True)
            return bytes(b[wire.CTL_IOC_OUT.size:]).rstrip(b"\0").decode()

        got = _as(NOBODY, m.mnt, hijack)
        assert "secret" not in got and "size" not in got, got
    finally:
        os.close(fd)
    doc = json.loads((m.mnt / ".tierfs" / "stats.json").read_bytes())
    assert doc["transport"]["unexpected_errors"] == 0


def test_the_client_sends_an_interrupted_piece_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A signal with a handler that returns (a DataLoader's SIGCHLD) interrupts the ioctl with
    EINTR, which fcntl.ioctl does not retry: the client does, and the request goes through; a
    daemon at its cap of this user's requests (EMFILE) is waited for, briefly."""
    (tmp_path / wire.CONTROL_DIR).mkdir()
    (tmp_path / wire.CONTROL_DIR / wire.CTL_FILE).write_bytes(b"")
    request, reply = bytearray(), json.dumps({"ok": True, "n": 0}).encode()
    faults = {"write": [InterruptedError(errno.EINTR, "Interrupted system call"),
                        OSError(errno.EMFILE, "Too many open files")],
              "read": [InterruptedError(errno.EINTR, "Interrupted system call")]}
    calls = []

    def ioctl(fd: int, cmd: int, buf: bytearray, mutate: bool) -> int:
        assert cmd == wire.CTL_IOC and len(buf) == wire.CTL_IOC_SIZE
        _, op, _, offset, n = wire.CTL_IOC_IN.unpack_from(buf, 0)
        kind = {wire.CTL_OP_WRITE: "write", wire.CTL_OP_READ: "read", wire.CTL_OP_CLOSE: "close"}[op]
        calls.append(kind)
        if faults.get(kind):
            raise faults[kind].pop(0)
        if kind == "write":
            assert offset == len(request)
            request.extend(buf[wire.CTL_IOC_IN.size:wire.CTL_IOC_IN.size + n])
        if kind != "read":
            wire.CTL_IOC_OUT.pack_into(buf, 0, 0, 0)
        else:
            piece = reply[offset:offset + 100]
            wire.CTL_IOC_OUT.pack_into(buf, 0, len(reply), len(piece))
            buf[wire.CTL_IOC_OUT.size:wire.CTL_IOC_OUT.size + len(piece)] = piece
        return 0

    monkeypatch.setattr(wire.fcntl, "ioctl", ioctl)
    got = wire._request_ioctl(str(tmp_path), b'{"op":"where","paths":[]}\n')
    assert json.loads(got) == {"ok": True, "n": 0}
    assert bytes(request) == b'{"op":"where","paths":[]}\n'
    assert calls == ["write", "write", "write", "read", "read", "close"]
