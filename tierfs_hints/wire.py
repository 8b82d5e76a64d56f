"""The wire format shared by the daemon and its clients (``tierfs`` CLI, ``tierfs_hints``).

The control plane lives inside the mount, in a directory hidden from ``readdir``; clients read
and write small files there (on a read-only mount, ioctls of the command file: CTL_IOC), so
permissions follow the mount and no socket is needed.
Standard library only: DataLoader workers import this.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
import time
from typing import Any

CONTROL_DIR = ".tierfs"
STATS_FILE = "stats.json"  # read: the stats document (JSON, versioned)
PID_FILE = "pid"  # read: the daemon's pid, decimal
CONFIG_FILE = "config.json"  # read: the effective configuration
STATS_VERSION = 1
CTL_FILE = "ctl"  # read-write: one JSON request line in, one JSON reply out (see below)

# Requests to CTL_FILE: one JSON object per open, written as one line ending in "\n"; the
# write returns when the daemon has answered; the reply (one JSON object) is read back from the
# same descriptor. Paths are relative to the mount root ("a/b.tar"); absolute paths, "..",
# and paths that resolve outside the mount are refused. Replies on failure:
# {"ok": false, "error": "message", "kind": "value" | "os" | "perm" | "timeout"}.
#
# Every request acts with the credentials of the process that opened CTL_FILE (uid, gid,
# supplementary groups): a path it could not read through the mount is refused with kind
# "perm" (nothing of the request is done), as are "evict" of a file it neither owns nor may
# write, "cancel"/"progress"/"wait" of another user's need, and reservations or prefetch
# volume beyond its share (the user_hint_share option). uid 0 may do anything.
#
# Caps (a request over one is refused with kind "value" and an error naming the cap): a request
# line is at most MAX_REQUEST_BYTES (the write that crosses it fails with EFBIG and the reply,
# read back as usual, names the cap); a request carries at most MAX_ITEMS paths or items; a
# path is at most MAX_PATH_BYTES; a label, source or name at most MAX_TEXT characters.
#
#   {"op": "flush", "paths": [...] or [], "timeout": s}
#       -> {"ok": true, "waited": [paths]} once they (or all dirty files) are durable on the
#          backing store.
#   {"op": "need", "items": [[path, offset, length], ...], "deadline_s": s | null,
#    "priority": int, "source": str, "label": str}
#       Files (offset 0, length null = whole file) will be read in this order, and should be in
#       a fast tier within deadline_s seconds (null: no deadline; prefetched in order after all
#       deadline work). -> {"ok": true, "id": "n7", "bytes": B, "files": N, "missing": [paths]}
#   {"op": "progress", "id": "n7"}
#       -> {"ok": true, "id", "label", "total_bytes", "resident_bytes": {"ram": B, "ssd": B,
#          "staging": B}, "remaining_bytes", "deadline_in_s" (null), "projected_s" (null),
#          "done": bool, "missed": bool, "cancelled": bool}
#   {"op": "wait", "id": "n7", "timeout": s}  -> the progress reply plus "timed_out": bool
#   {"op": "cancel", "id": "n7"}               -> {"ok": true}
#   {"op": "release", "paths": [...]}           -> {"ok": true, "chunks": N}
#       not needed again soon: evicted first.
#   {"op": "epoch", "paths": [...], "source": str}
#       the access order of the coming epoch; replaces the previous epoch order of ``source``
#       (sources are per user). -> like "need", plus "truncated_bytes": B when the order was
#       cut to its head to fit the caller's share (user_hint_share).
#   {"op": "phase", "name": str, "at_s": s, "paths": [...], "source": str}
#       a phase starting in at_s seconds needs these files: a need with that deadline.
#   {"op": "checkpoint", "dir": path, "nbytes": B, "every_s": s}
#       keep B bytes of write-tier room for checkpoints written into dir. -> {"ok": true,
#       "reserved_bytes": B}
#   {"op": "where", "paths": [...]}
#       -> {"ok": true, "files": [{"path", "size", "resident_bytes": {"ram", "ssd", "staging"},
#          "dirty_bytes"}]}
#   {"op": "evict", "paths": [...]}             -> {"ok": true, "chunks": N, "bytes": B}
MAX_REQUEST_BYTES = 64 << 20  # one request line, newline included (500 000 items of ~100-byte paths fit)
MAX_ITEMS = 500_000  # paths or items in one request (an ImageNet-1k epoch order is 1.28 M: send a window)
MAX_PATH_BYTES = 4096  # one path, encoded (PATH_MAX)
MAX_TEXT = 1000  # characters of a label, source or phase name

HINT_OPS = ("need", "progress", "wait", "cancel", "release", "epoch", "phase", "checkpoint",
            "where", "evict", "flush")


# -- requests on a read-only mount (ioctls of CTL_FILE) -----------------------------------------
# A read-only mount (MS_RDONLY) refuses every open for writing in the VFS, before the daemon
# hears of it, so CTL_FILE cannot take a request line there. The native transport takes the
# same requests, with the same caps and the same check of the caller's rights, as ioctls of
# CTL_FILE opened for reading: one ioctl number (CTL_IOC: _IOWR('t', 1, CTL_IOC_SIZE)), whose
# buffer of CTL_IOC_SIZE bytes the kernel copies to the daemon and back (a restricted FUSE
# ioctl: its size and direction are in its number; 16383 bytes at most, _IOC_SIZEBITS 14).
# In: CTL_IOC_IN (magic CTL_IOC_MAGIC, op, a 16-byte session token the client draws at random,
# offset, payload length) then the payload. Out: CTL_IOC_OUT (the reply's whole length, the
# payload length) then the payload. A session is one request: CTL_OP_WRITE pieces of the
# request line (the session starts at its first piece, with the credentials of the process
# that sends it; its token is the session's name for that uid only), CTL_OP_READ pieces of the
# reply from an offset (waits for the reply), CTL_OP_CLOSE. Errors come back as the ioctl's
# errno, as from the file (EFBIG over a cap: the reply says which).
CTL_IOC_SIZE = (1 << 14) - 1
CTL_IOC = (3 << 30) | (CTL_IOC_SIZE << 16) | (ord("t") << 8) | 1
CTL_IOC_MAGIC = b"TFC1"
CTL_IOC_IN = struct.Struct("<4sI16sQI")  # magic, op, token, offset, payload length
CTL_IOC_OUT = struct.Struct("<QI")  # the reply's whole length, payload length
CTL_OP_WRITE, CTL_OP_READ, CTL_OP_CLOSE = 1, 2, 3


class DaemonBusy(OSError):
    """A live daemon could not take a request now (EMFILE: this user's requests in flight are
    at its cap; ENOENT: it let the request go before it was finished): not a dead mount."""


def _ioc_buffer(op: int, token: bytes, offset: int = 0, payload: bytes = b"") -> bytearray:
    """One CTL_IOC buffer: CTL_IOC_IN, then ``payload``."""
    buf = bytearray(CTL_IOC_SIZE)
    CTL_IOC_IN.pack_into(buf, 0, CTL_IOC_MAGIC, op, token, offset, len(payload))
    buf[CTL_IOC_IN.size:CTL_IOC_IN.size + len(payload)] = payload
    return buf


class ControlError(Exception):
    """The daemon refused a request; ``kind`` is "value" (bad input, over a cap), "perm" (the
    caller may not), "timeout" or "os"."""

    def __init__(self, message: str, kind: str = "value") -> None:
        super().__init__(message)
        self.kind = kind


def control_path(mountpoint: str, name: str) -> str:
    return os.path.join(mountpoint, CONTROL_DIR, name)


def request(mountpoint: str, req: dict[str, Any]) -> dict[str, Any]:
    """Send one request to the daemon of ``mountpoint`` and return its reply.

    Raises OSError when the mount is not a live tierfs mount (EROFS: a read-only mount whose
    daemon takes no requests), ControlError when the daemon refuses the request (or it is over
    MAX_REQUEST_BYTES: then nothing is sent)."""
    data = json.dumps(req, separators=(",", ":")).encode() + b"\n"
    if len(data) > MAX_REQUEST_BYTES:
        raise ControlError(f"request of {len(data)} bytes is over MAX_REQUEST_BYTES ({MAX_REQUEST_BYTES}); "
                           "send fewer paths per request")
    return _reply(send(mountpoint, data))


def send(mountpoint: str, data: bytes) -> bytes:
    """Send request line ``data`` (JSON, ending in a newline) to the daemon of ``mountpoint``
    and return its reply's bytes: written to CTL_FILE, or as ioctls of it where a read-only
    mount refuses the write (CTL_IOC). Raises OSError."""
    try:
        fd = os.open(control_path(mountpoint, CTL_FILE), os.O_RDWR)
    except OSError as e:
        if e.errno != errno.EROFS:
            raise
        return _request_ioctl(mountpoint, data)
    try:
        payload = memoryview(data)
        try:
            while payload:
                payload = payload[os.write(fd, payload):]
        except OSError as e:
            if e.errno != errno.EFBIG:
                raise
            # the daemon cut the request off at its cap; its reply says which
        parts: list[bytes] = []
        pos = 0
        while chunk := os.pread(fd, 1 << 20, pos):
            parts.append(chunk)
            pos += len(chunk)
    finally:
        os.close(fd)
    return b"".join(parts)


def takes_requests(mountpoint: str) -> bool:
    """Whether the daemon of tierfs mount ``mountpoint`` takes requests: always on a
    read-write mount; on a read-only one, if it takes them as ioctls (the native transport;
    one ioctl, which ends a session that does not exist)."""
    if not os.statvfs(mountpoint).f_flag & os.ST_RDONLY:
        return True
    fd = os.open(control_path(mountpoint, CTL_FILE), os.O_RDONLY)
    try:
        fcntl.ioctl(fd, CTL_IOC, _ioc_buffer(CTL_OP_CLOSE, os.urandom(16)), True)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _reply(data: bytes) -> dict[str, Any]:
    reply = json.loads(data)
    if not reply.get("ok"):
        raise ControlError(str(reply.get("error", "request refused")), str(reply.get("kind", "value")))
    return reply  # type: ignore[no-any-return]


def _request_ioctl(mountpoint: str, data: bytes) -> bytes:
    """Send request line ``data`` through ioctls of CTL_FILE (a read-only mount: see CTL_IOC)
    and return the reply's bytes. Raises OSError (EROFS: the mount takes none; its transport
    does not speak this protocol)."""
    room = CTL_IOC_SIZE - CTL_IOC_IN.size
    token = os.urandom(16)
    fd = os.open(control_path(mountpoint, CTL_FILE), os.O_RDONLY)

    def call(op: int, offset: int = 0, payload: bytes = b"") -> tuple[int, bytes]:
        buf = _ioc_buffer(op, token, offset, payload)
        backoff = 0.01
        while True:
            try:
                fcntl.ioctl(fd, CTL_IOC, buf, True)
                break
            except InterruptedError:
                # a signal with a handler that returned (a DataLoader's SIGCHLD): sent again,
                # as os.read would be (PEP 475); the daemon takes a WRITE piece once (its offset)
                continue
            except OSError as e:
                if e.errno in (errno.ENOTTY, errno.ENOSYS, errno.EINVAL) and op == CTL_OP_WRITE and offset == 0:
                    raise OSError(errno.EROFS, f"{mountpoint} is a read-only tierfs mount whose daemon "
                                               "takes no control requests (the pyfuse3 transport: "
                                               "mount it with the native transport, or read-write)") from e
                if e.errno == errno.EMFILE and backoff < 2.0:
                    time.sleep(backoff)  # the user's requests in flight are at the daemon's cap
                    backoff *= 2
                    continue
                if e.errno == errno.EMFILE:
                    raise DaemonBusy(errno.EMFILE, f"tierfs mount {mountpoint}: this user has too many "
                                                   "control requests in flight; retry later") from e
                if e.errno == errno.ENOENT:
                    raise DaemonBusy(errno.ENOENT, f"tierfs mount {mountpoint} let this request go "
                                                   "before it was finished (unused too long)") from e
                raise
        total, n = CTL_IOC_OUT.unpack_from(buf, 0)
        if n > CTL_IOC_SIZE - CTL_IOC_OUT.size:
            raise OSError(errno.EPROTO, f"malformed control reply from {mountpoint}")
        return total, bytes(buf[CTL_IOC_OUT.size:CTL_IOC_OUT.size + n])

    try:
        try:
            for at in range(0, len(data), room):
                call(CTL_OP_WRITE, at, data[at:at + room])
        except OSError as e:
            if e.errno != errno.EFBIG:
                raise
            # the daemon cut the request off at its cap; its reply says which
        parts: list[bytes] = []
        pos = 0
        while True:
            total, piece = call(CTL_OP_READ, pos)
            parts.append(piece)
            pos += len(piece)
            if pos >= total or not piece:
                break
        return b"".join(parts)
    finally:
        try:
            call(CTL_OP_CLOSE)
        except OSError:
            pass  # the daemon lets an abandoned session go by itself
        os.close(fd)
