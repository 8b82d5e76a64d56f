"""The wire format shared by the daemon and its clients (``tierfs`` CLI, ``tierfs_hints``).

The control plane lives inside the mount, in a directory hidden from ``readdir``; clients read
and write small files there, so permissions follow the mount and no socket is needed.
Standard library only: DataLoader workers import this.
"""

from __future__ import annotations

import errno
import json
import os
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

    Raises OSError when the mount is not a live tierfs mount, ControlError when the daemon
    refuses the request (or it is over MAX_REQUEST_BYTES: then nothing is sent)."""
    data = json.dumps(req, separators=(",", ":")).encode() + b"\n"
    if len(data) > MAX_REQUEST_BYTES:
        raise ControlError(f"request of {len(data)} bytes is over MAX_REQUEST_BYTES ({MAX_REQUEST_BYTES}); "
                           "send fewer paths per request")
    fd = os.open(control_path(mountpoint, CTL_FILE), os.O_RDWR)
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
    reply = json.loads(b"".join(parts))
    if not reply.get("ok"):
        raise ControlError(str(reply.get("error", "request refused")), str(reply.get("kind", "value")))
    return reply  # type: ignore[no-any-return]
