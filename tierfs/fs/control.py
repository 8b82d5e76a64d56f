"""The control plane: read-only files in ``<mnt>/.tierfs/`` whose content is made at open.

Reads use ``direct_io`` (the content has no fixed size, and the page cache must not keep an old
snapshot); these files are never mapped, so the mmap caveat of direct_io does not apply.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tierfs.fs.inodes import FIRST_CONTROL_FILE

Command = Callable[[bytes], Awaitable[bytes]]


@dataclass(frozen=True)
class ControlFile:
    """``render`` makes a read-only file's content at open. A *command* file instead takes a
    request (one JSON line, written) and answers it (read back from the same descriptor); the
    ``write`` returns only when the command has finished, so a command can wait (``flush``)."""

    inode: int
    name: bytes
    render: Callable[[], bytes]
    command: Command | None = None


class ControlPlane:
    def __init__(self, files: dict[str, Callable[[], bytes]],
                 commands: dict[str, Command] | None = None) -> None:
        self.by_name: dict[bytes, ControlFile] = {}
        self.by_inode: dict[int, ControlFile] = {}
        items: list[tuple[str, Callable[[], bytes], Command | None]] = [
            (n, r, None) for n, r in files.items()]
        items += [(n, lambda: b"", c) for n, c in (commands or {}).items()]
        for i, (name, render, command) in enumerate(sorted(items, key=lambda t: t[0])):
            cf = ControlFile(FIRST_CONTROL_FILE + i, name.encode(), render, command)
            self.by_name[cf.name] = cf
            self.by_inode[cf.inode] = cf
