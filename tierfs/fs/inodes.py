"""Inode table: FUSE inode numbers <-> backing paths, with kernel lookup counts.

tierfs numbers inodes itself (the backing store's numbers could collide with reserved ones)
and maps each backing (st_dev, st_ino) to one FUSE inode while the kernel knows it, so hard
links share an inode. An inode is forgotten when the kernel's lookup count drops to zero
(FUSE protocol: every positive LOOKUP/READDIRPLUS/CREATE reply adds one; FORGET subtracts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pyfuse3

ROOT = pyfuse3.ROOT_INODE
CONTROL_DIR = 2  # <mnt>/.tierfs
FIRST_CONTROL_FILE = 3
FIRST_DYNAMIC = 64


@dataclass
class InodeEntry:
    inode: int
    path: bytes  # relative to the backing root; b"" for the root
    dev_ino: tuple[int, int]
    lookups: int = 0
    last_key: str | None = None  # identity key seen at the last open (change detection)


class InodeTable:
    def __init__(self, backing_root: bytes, root_stat: os.stat_result) -> None:
        self.backing_root = backing_root
        self._next = FIRST_DYNAMIC
        root = InodeEntry(ROOT, b"", (root_stat.st_dev, root_stat.st_ino), lookups=1)
        self.by_inode: dict[int, InodeEntry] = {ROOT: root}
        self.by_dev_ino: dict[tuple[int, int], InodeEntry] = {root.dev_ino: root}

    def __len__(self) -> int:
        return len(self.by_inode)

    def get(self, inode: int) -> InodeEntry:
        """Raises KeyError for an inode the kernel should not know."""
        return self.by_inode[inode]

    def backing_path(self, entry: InodeEntry) -> bytes:
        return self.backing_root + b"/" + entry.path if entry.path else self.backing_root

    def child_path(self, parent: InodeEntry, name: bytes) -> bytes:
        return parent.path + b"/" + name if parent.path else name

    def remember(self, path: bytes, st: os.stat_result) -> InodeEntry:
        """The inode for a backing object, created if new; one lookup is added."""
        key = (st.st_dev, st.st_ino)
        entry = self.by_dev_ino.get(key)
        if entry is None:
            entry = InodeEntry(self._next, path, key)
            self._next += 1
            self.by_inode[entry.inode] = entry
            self.by_dev_ino[key] = entry
        elif entry.path != path and not os.path.lexists(self.backing_root + b"/" + entry.path):
            entry.path = path  # renamed behind our back
        entry.lookups += 1
        return entry

    def forget(self, inode: int, n: int) -> None:
        entry = self.by_inode.get(inode)
        if entry is None or inode == ROOT:
            return
        entry.lookups -= n
        if entry.lookups <= 0:
            del self.by_inode[inode]
            if self.by_dev_ino.get(entry.dev_ino) is entry:
                del self.by_dev_ino[entry.dev_ino]
