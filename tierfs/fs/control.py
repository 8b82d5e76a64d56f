"""The control plane: read-only files in ``<mnt>/.tierfs/`` whose content is made at open.

Reads use ``direct_io`` (the content has no fixed size, and the page cache must not keep an old
snapshot); these files are never mapped, so the mmap caveat of direct_io does not apply.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tierfs.access import Caller
from tierfs.fs.inodes import FIRST_CONTROL_FILE
from tierfs_hints import wire

# A command gets the request line and the credentials of whoever opened the control file
# (an open descriptor is a capability, as in Unix: see tierfs.access).
Command = Callable[[bytes, Caller], Awaitable[bytes]]


@dataclass(frozen=True)
class ControlFile:
    """``render(uid)`` makes a read-only file's content at open, for the opener ``uid``. A
    *command* file instead takes a
    request (one JSON line, written) and answers it (read back from the same descriptor); the
    ``write`` returns only when the command has finished, so a command can wait (``flush``)."""

    inode: int
    name: bytes
    render: Callable[[int], bytes]
    command: Command | None = None


# Bytes of requests held at once over every open command file (collected, or being answered):
# four maximal requests. Beyond it a write fails (EFBIG) and the reply says so.
MAX_PENDING_BYTES = 4 * wire.MAX_REQUEST_BYTES
# Of those, what one user other than root may hold (two maximal requests): one user keeping
# unfinished request lines open on several descriptors used to take the whole budget and lock
# every other user, root included, out of the control plane. Root is held to no budget (its
# requests are the operator's; the bytes it may hold are bounded by its open descriptors).
MAX_USER_PENDING_BYTES = 2 * wire.MAX_REQUEST_BYTES


class ControlPlane:
    """Args:
        files: name -> render; ``render(uid)`` makes a read-only file's content at open for the
            opener ``uid`` (a file may show root more than other users).
        commands: name -> command (see :data:`Command`).
    """

    def __init__(self, files: dict[str, Callable[[int], bytes]],
                 commands: dict[str, Command] | None = None) -> None:
        self.pending_bytes = 0  # held by users other than root, see MAX_PENDING_BYTES
        self.pending_by_uid: dict[int, int] = {}  # see MAX_USER_PENDING_BYTES
        self.by_name: dict[bytes, ControlFile] = {}
        self.by_inode: dict[int, ControlFile] = {}
        items: list[tuple[str, Callable[[int], bytes], Command | None]] = [
            (n, r, None) for n, r in files.items()]
        items += [(n, lambda uid: b"", c) for n, c in (commands or {}).items()]
        for i, (name, render, command) in enumerate(sorted(items, key=lambda t: t[0])):
            cf = ControlFile(FIRST_CONTROL_FILE + i, name.encode(), render, command)
            self.by_name[cf.name] = cf
            self.by_inode[cf.inode] = cf

    def hold(self, uid: int, n: int) -> str | None:
        """Account ``n`` more request bytes held for ``uid``; None if within the budgets, else
        why not (then nothing is accounted)."""
        if uid == 0:
            return None
        mine = self.pending_by_uid.get(uid, 0)
        if mine + n > MAX_USER_PENDING_BYTES:
            return (f"uid {uid} already holds {mine} bytes of requests (MAX_USER_PENDING_BYTES "
                    f"{MAX_USER_PENDING_BYTES}); finish or close earlier requests")
        if self.pending_bytes + n > MAX_PENDING_BYTES:
            return (f"the daemon already holds {self.pending_bytes} bytes of requests "
                    f"(MAX_PENDING_BYTES {MAX_PENDING_BYTES}); retry later")
        self.pending_by_uid[uid] = mine + n
        self.pending_bytes += n
        return None

    def unhold(self, uid: int, n: int) -> None:
        """Give back ``n`` request bytes accounted by :meth:`hold` for ``uid``."""
        if uid == 0 or n == 0:
            return
        self.pending_bytes -= n
        left = self.pending_by_uid.get(uid, 0) - n
        if left > 0:
            self.pending_by_uid[uid] = left
        else:
            self.pending_by_uid.pop(uid, None)
