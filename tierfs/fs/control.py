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
    """``render`` makes a read-only file's content at open. A *command* file instead takes a
    request (one JSON line, written) and answers it (read back from the same descriptor); the
    ``write`` returns only when the command has finished, so a command can wait (``flush``)."""

    inode: int
    name: bytes
    render: Callable[[], bytes]
    command: Command | None = None


# Bytes of requests held at once over every open command file (collected, or being answered):
# four maximal requests. Beyond it a write fails (EFBIG) and the reply says so.
MAX_PENDING_BYTES = 4 * wire.MAX_REQUEST_BYTES


class ControlPlane:
    def __init__(self, files: dict[str, Callable[[], bytes]],
                 commands: dict[str, Command] | None = None) -> None:
        self.pending_bytes = 0  # see MAX_PENDING_BYTES
        self.by_name: dict[bytes, ControlFile] = {}
        self.by_inode: dict[int, ControlFile] = {}
        items: list[tuple[str, Callable[[], bytes], Command | None]] = [
            (n, r, None) for n, r in files.items()]
        items += [(n, lambda: b"", c) for n, c in (commands or {}).items()]
        for i, (name, render, command) in enumerate(sorted(items, key=lambda t: t[0])):
            cf = ControlFile(FIRST_CONTROL_FILE + i, name.encode(), render, command)
            self.by_name[cf.name] = cf
            self.by_inode[cf.inode] = cf
