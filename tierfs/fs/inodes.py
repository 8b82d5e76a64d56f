"""Inode table: FUSE inode numbers <-> backing paths, with kernel lookup counts.

Paths are relative to the backing root and only ever resolved through
:class:`~tierfs.backing_tree.BackingTree`; this table never builds an absolute path.

Inode numbers are stable for a backing object for the mount's life, also after the kernel
forgot it (git, ``rsync -H`` and ``tar --listed-incremental`` compare them): an object on the
backing root's filesystem with ``st_ino < 2**48`` gets ``2**48 + st_ino`` (a reversible map,
no memory per object); any other object (another filesystem mounted inside the backing tree, a
larger ``st_ino``, or a number still used by a live inode of an object whose backing inode was
recycled) gets a number from a counter below ``2**48``, remembered in a table for the mount's
life. Files that exist only as dirty files (created, not yet written back) take counter numbers
too; after their write-back, once the kernel forgets them, they show the number of their new
backing inode. Hard links share one backing ``(st_dev, st_ino)`` and so one inode.

An inode is forgotten when the kernel's lookup count drops to zero (FUSE protocol: every
positive LOOKUP/READDIRPLUS/CREATE reply adds one; FORGET subtracts).

The table is indexed by path as well as by inode and by backing ``(st_dev, st_ino)``: unlink,
rename and the "who holds this name" question are dict look-ups, not scans of every inode the
kernel holds. (They were scans: ``rm -rf`` of 40,000 files, each held by the kernel after
READDIRPLUS, did 40,000 x 40,000 comparisons and took 8 min 50 s.) Only a rename of a
directory walks the table, for the paths beneath it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierfs.backing_tree import BackingTree
    from tierfs.writeback.manager import DirtyFile

ROOT = 1  # FUSE_ROOT_ID
CONTROL_DIR = 2  # <mnt>/.tierfs
FIRST_CONTROL_FILE = 3
FIRST_DYNAMIC = 64
DERIVED_BASE = 1 << 48  # inode = DERIVED_BASE + st_ino for objects on the backing root's device


# eq=False: identity (the path index finds and removes entries with `is`); slots: one object
# the garbage collector walks per inode, not two (with a __dict__): a full collection over the
# 100k inodes of a listed 100k-entry directory held the event loop 90-180 ms, 8 times
@dataclass(eq=False, slots=True)
class InodeEntry:
    inode: int
    path: bytes | None  # relative to the backing root; b"" for the root; None once unlinked
    dev_ino: tuple[int, int]  # backing (st_dev, st_ino); (-1, id) for a file not yet written back
    lookups: int = 0
    last_key: str | None = None  # identity key seen at the last open (change detection)
    dirty: DirtyFile | None = None  # set while the file has changes not on the backing store
    orphan: Any = None  # BackingFile kept open: the name was unlinked or replaced while the
    #                     kernel still held this inode (it may still open it, as on a local fs)
    # told: namespace.told_key() of the backing attributes last replied for this inode (None:
    # a dirty file's, or none yet); reval_sent: an open answered ESTALE since (the kernel
    # looks the name up again and retries; see fs/namespace.py, "Kernel caching")
    told: tuple[int, int, int, int, int] | None = None
    reval_sent: bool = False
    kept: bool = False  # its dirty file is kept for it (Namespace.preserve: df.keep counted)
    # a regular file when first looked up (an object keeps its type for its (dev, ino)): only
    # those are kept open by Namespace.preserve, which need not lstat the name first
    regular: bool = True
    # unlinked through the mount while it had other names: an open racing the unlink is
    # answered ESTALE (the kernel looks the name up again), where a file of one name gets ENOENT
    linked_elsewhere: bool = False


class InodeTable:
    """Args: tree: the backing tree (its root becomes :data:`ROOT`)."""

    def __init__(self, tree: BackingTree) -> None:
        self.tree = tree
        root_stat = tree.lstat(b"")
        self.root_dev = root_stat.st_dev
        self._next = FIRST_DYNAMIC
        root = InodeEntry(ROOT, b"", (root_stat.st_dev, root_stat.st_ino), lookups=1, regular=False)
        self.by_inode: dict[int, InodeEntry] = {ROOT: root}
        self.by_dev_ino: dict[tuple[int, int], InodeEntry] = {root.dev_ino: root}
        # path -> the live entry naming it; a path named by more (a replaced name's old inode
        # still held: rare) keeps the others in _more_at_path. One dict value per path, not a
        # list each: fewer objects for the garbage collector to walk. Kept by _index/_unindex,
        # through _set_path/_add/_drop, the only writers of entry.path.
        self._by_path: dict[bytes, InodeEntry] = {b"": root}
        self._more_at_path: dict[bytes, list[InodeEntry]] = {}
        # numbers not derivable from (st_dev, st_ino), kept after forget (see module docstring)
        self._numbers: dict[tuple[int, int], int] = {}
        self.on_forget: Callable[[InodeEntry], None] | None = None

    def _at(self, path: bytes) -> list[InodeEntry]:
        """Every live entry whose path is ``path``."""
        e = self._by_path.get(path)
        if e is None:
            return []
        more = self._more_at_path.get(path)
        return [e, *more] if more else [e]

    def at_path(self, path: bytes) -> list[InodeEntry]:
        """Entries the kernel holds (lookups > 0) for ``path``."""
        return [e for e in self._at(path) if e.lookups > 0]

    def _index(self, entry: InodeEntry, path: bytes) -> None:
        if self._by_path.setdefault(path, entry) is not entry:
            self._more_at_path.setdefault(path, []).append(entry)

    def _unindex(self, entry: InodeEntry, path: bytes) -> None:
        more = self._more_at_path.get(path)
        if self._by_path.get(path) is entry:
            if more:
                self._by_path[path] = more.pop(0)
                if not more:
                    del self._more_at_path[path]
            else:
                del self._by_path[path]
        elif more:
            for k, e in enumerate(more):
                if e is entry:
                    del more[k]
                    break
            if not more:
                del self._more_at_path[path]

    def _set_path(self, entry: InodeEntry, path: bytes | None) -> None:
        """Change ``entry.path``, keeping the path index true."""
        old = entry.path
        if old == path:
            return
        live = self.by_inode.get(entry.inode) is entry
        if old is not None and live:
            self._unindex(entry, old)
        entry.path = path
        if path is not None and live:
            self._index(entry, path)

    def _add(self, entry: InodeEntry) -> None:
        self.by_inode[entry.inode] = entry
        self.by_dev_ino[entry.dev_ino] = entry
        if entry.path is not None:
            self._index(entry, entry.path)

    def _drop(self, entry: InodeEntry) -> None:
        del self.by_inode[entry.inode]
        if self.by_dev_ino.get(entry.dev_ino) is entry:
            del self.by_dev_ino[entry.dev_ino]
        if entry.path is not None:
            self._unindex(entry, entry.path)

    def paths_held(self) -> int:
        """How many distinct paths the table indexes (a statistic, and the tests' check that
        the index does not outgrow the table)."""
        return len(self._by_path)

    def __len__(self) -> int:
        return len(self.by_inode)

    def get(self, inode: int) -> InodeEntry:
        """Raises KeyError for an inode the kernel should not know."""
        return self.by_inode[inode]

    def rel(self, entry: InodeEntry) -> bytes:
        """The entry's path relative to the backing root. Raises FileNotFoundError for an
        unlinked entry."""
        if entry.path is None:
            raise FileNotFoundError(2, "unlinked")
        return entry.path

    def child_path(self, parent: InodeEntry, name: bytes) -> bytes:
        if parent.path is None:
            raise FileNotFoundError(2, "parent directory was removed")
        return parent.path + b"/" + name if parent.path else name

    def _counter(self) -> int:
        n = self._next
        self._next += 1
        return n

    def number_for(self, key: tuple[int, int]) -> int:
        """The stable inode number of backing object ``key`` = (st_dev, st_ino)."""
        n = self._numbers.get(key)
        if n is None and key[0] == self.root_dev and 0 <= key[1] < DERIVED_BASE:
            n = DERIVED_BASE + key[1]
        if n is not None and n not in self.by_inode:
            return n
        # Not derivable, or the number is held by a live inode that no longer maps to this
        # backing inode (unlinked, or rewritten, while the kernel still holds it; the
        # filesystem recycled its number): a counter number, kept for the mount's life.
        # Called only for a key no live entry maps.
        n = self._counter()
        self._numbers[key] = n
        return n

    def remember_dirty(self, path: bytes, df: DirtyFile) -> InodeEntry:
        """The inode of a dirty file (new, or a copy of a backing file); one lookup added."""
        entry = self.by_inode.get(df.inode) if df.inode else None
        if entry is None:
            key = (-1, df.id)
            entry = InodeEntry(self._counter(), path, key)
            self._add(entry)
        self.attach(entry, df)
        self._set_path(entry, path)
        entry.lookups += 1
        return entry

    def attach(self, entry: InodeEntry, df: DirtyFile) -> None:
        """The entry's content now lives in a dirty file. Its old backing (st_dev, st_ino) is
        unmapped (unless the file is hard-linked and so written back into that same inode):
        write-back will replace that backing file, and the filesystem may give the number to a
        new object, which must get a new inode, not this one."""
        entry.dirty = df
        df.inode = entry.inode
        if not df.in_place:
            self.rekey(entry, (-1, df.id))

    def rekey(self, entry: InodeEntry, dev_ino: tuple[int, int]) -> None:
        """The entry's file now lives at another backing (st_dev, st_ino) (written back)."""
        if self.by_dev_ino.get(entry.dev_ino) is entry:
            del self.by_dev_ino[entry.dev_ino]
        entry.dev_ino = dev_ino
        self.by_dev_ino[dev_ino] = entry

    def rename(self, old: bytes, new: bytes, *, subtree: bool = True) -> None:
        """``old`` is now ``new``; with ``subtree`` (a directory was renamed) the paths beneath
        it follow, found by a walk of the path index (O(paths held)); a file's rename is O(1)."""
        for entry in self._at(old):
            self._set_path(entry, new)
        if not subtree:
            return
        prefix = old + b"/"
        below = [p for p in self._by_path if p.startswith(prefix)]
        for p in below:
            for entry in self._at(p):
                self._set_path(entry, new + p[len(old):])

    def naming(self, path: bytes) -> list[InodeEntry]:
        """Every entry whose path is ``path`` (held or not)."""
        return self._at(path)

    def detach(self, path: bytes) -> None:
        """``path`` was unlinked: entries naming it keep working through open handles only, and
        its backing (st_dev, st_ino), which the filesystem may reuse, no longer maps to them."""
        for entry in self._at(path):
            self._set_path(entry, None)
            if self.by_dev_ino.get(entry.dev_ino) is entry:
                del self.by_dev_ino[entry.dev_ino]

    def reattach(self, path: bytes, entries: list[InodeEntry]) -> None:
        """Undo :meth:`detach` of ``entries`` (an operation that would have replaced ``path``
        was refused)."""
        for entry in entries:
            if entry.path is None and entry.inode in self.by_inode:
                self._set_path(entry, path)
                if entry.dev_ino[0] >= 0:
                    self.by_dev_ino.setdefault(entry.dev_ino, entry)

    def remember(self, path: bytes, st: os.stat_result) -> InodeEntry:
        """The inode for a backing object, created if new; one lookup is added."""
        key = (st.st_dev, st.st_ino)
        entry = self.by_dev_ino.get(key)
        if entry is not None and entry.path is not None and entry.path != path:
            there = self._at_path(entry.path)
            if there is None:
                self._set_path(entry, path)  # renamed behind our back (a file or a directory)
            elif there != key:
                # Its old name names another object now (replaced by a rename, or two names
                # swapped), and this object turns up under a new name: the key may be a number
                # the filesystem recycled for a new object while the kernel still holds the old
                # inode. A new inode; the old one keeps its name (an open of it finds the new
                # object there and answers ESTALE, so the kernel looks the name up again) and
                # its open handles, but no longer maps this key. Re-pathing the old inode
                # served a new file the content of another (the old name's), whatever the modes.
                del self.by_dev_ino[key]
                entry = None
            # (else a hard link: one inode, two names; it keeps its first)
        if entry is None:
            entry = InodeEntry(self.number_for(key), path, key, regular=stat.S_ISREG(st.st_mode))
            self._add(entry)
        elif entry.path is None:
            self._set_path(entry, path)
        entry.lookups += 1
        return entry

    def _at_path(self, path: bytes) -> tuple[int, int] | None:
        """The backing (st_dev, st_ino) that ``path`` names now; None if nothing."""
        try:
            st = self.tree.lstat_or_none(path)
        except OSError:  # ENOTDIR, ELOOP (a symlink swapped in on the way): not there for us
            return None
        return None if st is None else (st.st_dev, st.st_ino)

    def forget(self, inode: int, n: int) -> None:
        entry = self.by_inode.get(inode)
        if entry is None or inode == ROOT:
            return
        entry.lookups -= n
        if entry.lookups <= 0:
            self._drop(entry)
            if self.on_forget is not None:
                self.on_forget(entry)
