"""The control plane: read-only files in ``<mnt>/.tierfs/`` whose content is made at open.

Reads use ``direct_io`` (the content has no fixed size, and the page cache must not keep an old
snapshot); these files are never mapped, so the mmap caveat of direct_io does not apply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tierfs.fs.inodes import FIRST_CONTROL_FILE


@dataclass(frozen=True)
class ControlFile:
    inode: int
    name: bytes
    render: Callable[[], bytes]


class ControlPlane:
    def __init__(self, files: dict[str, Callable[[], bytes]]) -> None:
        self.by_name: dict[bytes, ControlFile] = {}
        self.by_inode: dict[int, ControlFile] = {}
        for i, (name, render) in enumerate(sorted(files.items())):
            cf = ControlFile(FIRST_CONTROL_FILE + i, name.encode(), render)
            self.by_name[cf.name] = cf
            self.by_inode[cf.inode] = cf
