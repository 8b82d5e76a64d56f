"""The namespace overlay: the backing tree with the dirty files of
:class:`~tierfs.writeback.manager.WriteBack` laid over it.

A path with a dirty file shows the dirty file. Namespace operations on clean objects (mkdir,
rename, unlink, chmod, ...) are applied to the backing store at once (they are metadata; no
partial file can appear); file *data* is written to the write tier and written back later.
This module resolves names (lookup, readdir listings), answers attributes (of backing objects,
dirty files, and unlinked-but-open files), carries out unlink/rename/link semantics (an inode
the kernel still holds keeps its old content, as on a local filesystem), copies files up into
the write tier (:meth:`Namespace.make_dirty`) and keeps the table of open backing files.

It knows no transport: it raises :class:`~tierfs.fs.api.FuseError` where POSIX names an errno,
typed tierfs errors or OSError otherwise (mapped at the boundary, :mod:`tierfs.fs.handlers`).

Kernel caching: names and attributes of every object are cached by the kernel for the
configured ``attr_timeout`` (entry and attribute timeouts alike), and a change made behind
tierfs' back is still seen by the next ``open``: an open always reaches the daemon, which opens
the backing file and compares it with the attributes it last told the kernel about this inode
(:attr:`InodeEntry.told`). If they differ (replaced, or changed in place), the open answers
``ESTALE`` once; the kernel's VFS then repeats the path walk with ``LOOKUP_REVAL``, which sends
a fresh LOOKUP for the cached name (fs/namei.c, ``do_filp_open``), so the kernel learns the new
size and times (or the new inode) before the open that follows. Until that open, ``stat`` of a
changed file may show the old attributes for up to ``attr_timeout`` (60 s by default, as NFS's
``acregmax``; ``attr_timeout=0`` asks the daemon every time). Measured: with ``entry_timeout=0`` every open of a cached file cost one
more round trip (a LOOKUP), and ``lstat`` after ``readdir`` one more per file.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections import OrderedDict, deque
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from tierfs import tasks
from tierfs.backing_tree import BackingTree, DirScan, proc_path, read_batch, split
from tierfs.cache.manager import AccessState, Cache
from tierfs.fs.api import RENAME_EXCHANGE, RENAME_NOREPLACE, Attr, FuseError, RequestCtx, SetAttr
from tierfs.fs.handles import HandleTable
from tierfs.fs.inodes import CONTROL_DIR, ROOT, InodeEntry, InodeTable
from tierfs.io import Device, open_backing
from tierfs.sched.backing import BackingFile, Identity, Openings, key_path
from tierfs.writeback.backing_ops import data_segments
from tierfs.writeback.manager import DirtyFile, KernelSource, WriteBack, is_tmp_name
from tierfs_hints import wire

log = logging.getLogger("tierfs.fs")
CONTROL_NAME = wire.CONTROL_DIR.encode()
# The last lookup of a regular file stands for the open that follows it for this long (the
# kernel sends them back to back), and at most this many are remembered.
LOOKED_UP_S = 0.2
LOOKED_UP_MAX = 1024
# readdir: entries read from a backing directory per step (one metadata call, lstat of each
# included: 1.4-2.2 us per entry on tmpfs, a batch 0.35-1 ms, well under the loop's 50 ms
# bound when run inline; a cold HDD directory is slower and the meta device then runs it in a
# thread). A READDIRPLUS reply takes ~25 entries (4 KiB).
READDIR_BATCH = 128
# entries already sent that a listing keeps: the kernel asks again from the last entry its
# caller took, which can lie inside the last reply (a getdents buffer smaller than a reply)
READDIR_KEEP = 256


def told_key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What identifies the attributes the kernel holds of a backing object: (st_dev, st_ino,
    st_size, st_mtime_ns, st_ctime_ns)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError as e:
            log.warning("close of a backing descriptor: %s", e)


def lstat_or_none(tree: BackingTree, rel: bytes) -> os.stat_result | None:
    try:
        return tree.lstat(rel)
    except FileNotFoundError:
        return None


def _rmdir_with_orphans(tree: BackingTree, rel: bytes) -> None:
    """rmdir; if only write-back temporary files keep the backing dir from being empty, they
    are orphans (no dirty file lives in this dir: the caller checked) and go first."""
    try:
        tree.rmdir(rel)
    except OSError as e:
        if e.errno != errno.ENOTEMPTY:
            raise
        names = tree.listdir(rel)
        if not names or not all(is_tmp_name(n) for n in names):
            raise
        for n in names:
            tree.unlink_quiet(rel + b"/" + n if rel else n)
        tree.rmdir(rel)


def _times(attr: SetAttr, cur: Attr | os.stat_result) -> tuple[int, int]:
    """(atime_ns, mtime_ns) a SETATTR that sets one or both times leaves: the one it does not
    set is ``cur``'s (the file's attributes now)."""
    return (cur.st_atime_ns if attr.atime_ns is None else attr.atime_ns,
            cur.st_mtime_ns if attr.mtime_ns is None else attr.mtime_ns)


def _setattr_backing(tree: BackingTree, rel: bytes, mode: int | None, uid: int | None,
                     gid: int | None, times: tuple[int, int] | None) -> None:
    """chmod / chown / utime of a clean backing object, each on the object itself (never
    through a symlink; a symlink's mode is left alone)."""
    if mode is not None:
        tree.chmod(rel, mode & 0o7777)
    if uid is not None or gid is not None:
        tree.chown(rel, -1 if uid is None else uid, -1 if gid is None else gid)
    if times is not None:
        tree.utime(rel, times)


def _truncate_backing(tree: BackingTree, rel: bytes, size: int) -> None:
    """Truncate a clean backing file in place (a file whose opens the kernel passes through to
    it: see Namespace.backing_in_place)."""
    fd = tree.open(rel, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


class Namespace:
    """Args:
        tree: the backing tree; every backing-store access goes through it (never a path
        string). inodes: the inode table. cache: reads of clean files (copy-up, drops of stale
        chunks). writeback: dirty files. meta: device for backing-store metadata calls (stat,
        readdir, open, rename, ...), separate from the scheduler's data I/O. handles: the open
        handles (an unlinked open file answers from what its handles read). attr_timeout:
        seconds.
    """

    def __init__(self, *, tree: BackingTree, inodes: InodeTable, cache: Cache, writeback: WriteBack,
                 meta: Device, handles: HandleTable, attr_timeout: float) -> None:
        self.tree = tree
        self.inodes = inodes
        self.cache = cache
        self.wb = writeback
        self.meta = meta
        self.handles = handles
        self.attr_timeout = attr_timeout
        # inode -> (descriptor, (size, mtime_ns, ctime_ns) when leased) of the tier file its
        # writers write in place through passthrough (kept by the handler layer: Handlers.lease);
        # once that file changed, attributes come from it
        self.written_in_place: dict[int, tuple[int, tuple[int, int, int]]] = {}
        # inodes whose opens the kernel passes through to their backing file (a miss on a
        # parallel store, ``passthrough_misses``): their writers write the backing file in
        # place, so a truncate goes there too, never to a dirty copy
        self.backing_in_place: set[int] = set()
        self.nursery: trio.Nursery | None = None
        self._to_close: list[int] = []  # backing fds of unlinked files, closed in a thread
        self._closing = False
        self.open_files: dict[str, BackingFile] = {}
        # Backing files the daemon holds open for other reasons (hinted or predicted prefetch),
        # by identity key; an open of that very file shares it (see backing_file).
        self.find_open: Callable[[str], BackingFile | None] | None = None
        # ... and by path: the file a prefetch holds open at a path relative to the root
        self.find_held: Callable[[bytes], BackingFile | None] | None = None
        # a backing object whose attributes the kernel was told changed in place (same device and
        # inode number) behind tierfs' back: set on a mount whose opens the kernel answers
        self.on_changed_in_place: Callable[[InodeEntry], None] | None = None
        self.openings = Openings()  # shared with the prefetcher by the mount
        # path -> (trio time, lstat) of the last lookup, for the open that follows it
        self._looked_up: OrderedDict[bytes, tuple[float, os.stat_result]] = OrderedDict()
        # path -> (trio time, fstat) of the last open of a clean file's backing file, for the
        # GETATTR that follows it (see :meth:`lstat`); emptied by every request that may change
        # a file (:meth:`begin_change`)
        self._opened: OrderedDict[bytes, tuple[float, os.stat_result]] = OrderedDict()
        self.opened_stats = 0  # GETATTRs answered from the fstat of the open just before
        # (directory path, trio time, fstat, dir_token() before it) right after the last change
        # of names made through tierfs (a create, an unlink), for the GETATTR of that directory
        # the kernel sends next (:meth:`saw_dir`); requests that may create, remove or rename a
        # name, in flight, and their count (bumped at each one's start and end)
        self._dir_seen: tuple[bytes, float, os.stat_result, tuple[int, int]] | None = None
        self._ns_changing = 0
        self._ns_gen = 0
        # ... and changes of a directory's own attributes (SETATTR, xattrs of anything not a
        # regular file), likewise (:meth:`begin_attrs_change`)
        self._attrs_changing = 0
        self._attrs_gen = 0
        self.dir_stats = 0  # GETATTRs of a directory answered from the fstat of a change just before
        # requests that may change a file, in flight; bumped at each one's start and end: an
        # open whose fstat may have raced one keeps nothing (backing_file)
        self._changing = 0
        self._change_gen = 0
        self.shared_opens = 0  # opens served by a backing file already open (no open(2))
        self._dirty_locks: dict[int, trio.Lock] = {}
        writeback.on_clean = self.on_clean
        inodes.on_forget = self.on_forget

    # -- attributes ------------------------------------------------------------------------
    def attrs(self, inode: int, st: os.stat_result, *, nlink: int | None = None) -> Attr:
        """The reply for ``st``, cached by the kernel for ``attr_timeout`` seconds, except an
        object with more than one name (a hard link, not a directory): the daemon knows such
        an inode by one of its names, so once that name is unlinked, the kernel's cached other
        names would reach an inode the daemon can no longer resolve (pjdfstest link/00.t,
        link/02.t: ENOENT for the surviving names). Uncached, each use of another name is
        looked up again and finds the object under that name."""
        timeout = self.attr_timeout
        if (st.st_nlink if nlink is None else nlink) > 1 and not stat.S_ISDIR(st.st_mode):
            timeout = 0.0
        if inode not in self.written_in_place:
            return Attr.of(inode, st, nlink=nlink, entry_timeout=timeout, attr_timeout=timeout)
        return self.in_place_attrs(Attr.of(inode, st, nlink=nlink))

    def in_place_attrs(self, a: Attr) -> Attr:
        """``a`` for an inode opened for writing in place through passthrough: the kernel's
        writes go to its tier file, whose size and times are the file's once they changed,
        until it is taken in (an answer with the older size would cut the kernel's own size of
        the inode); not cached by the kernel meanwhile."""
        in_place = self.written_in_place.get(a.st_ino)
        if in_place is None:
            return a
        a.entry_timeout = a.attr_timeout = 0.0
        fd, seen = in_place
        t = os.fstat(fd)  # an open descriptor: no I/O
        if (t.st_size, t.st_mtime_ns, t.st_ctime_ns) != seen:
            a.st_size, a.st_blocks, a.st_mtime_ns, a.st_ctime_ns = t.st_size, t.st_blocks, t.st_mtime_ns, t.st_ctime_ns
        return a

    def clean_attrs(self, entry: InodeEntry, st: os.stat_result, *, nlink: int | None = None) -> Attr:
        """The reply for a backing object's attributes ``st``; remembered as what the kernel
        was told (an open compares the backing file with it: module docstring)."""
        old, entry.told = entry.told, told_key(st)
        if self.on_changed_in_place is not None and old is not None and old != entry.told \
                and old[:2] == entry.told[:2]:
            self.on_changed_in_place(entry)
        return self.attrs(entry.inode, st, nlink=nlink)

    async def dirty_attrs(self, entry: InodeEntry, df: DirtyFile) -> Attr:
        nlink = 1 if df.path is not None else 0
        if df.in_place and df.path is not None:
            # hard-linked: the names are links of the backing inode it is written back into
            try:
                st = await self.meta.run(lstat_or_none, self.tree, df.path)
            except OSError:
                st = None
            if st is not None and stat.S_ISREG(st.st_mode):
                nlink = st.st_nlink
        entry.told = None  # a data file's attributes: nothing to compare a backing file with
        return self.attrs(entry.inode, await self.wb.stat(df), nlink=nlink)

    def held_fd(self, entry: InodeEntry) -> int | None:
        """A descriptor of what the entry's open handles read, if one is open: its attributes are
        that file's, whatever the name now names. First a dirty file's descriptor a handle
        reads (a file opened while dirty keeps reading its data file after its write-back, until
        closed: with the name unlinked, nothing else answers for it), then the copy of the
        backing file kept for an unlinked name, then a handle's backing file."""
        backing = None
        for h in self.handles.of_inode(entry.inode):
            if h.dirty is not None and h.dirty.fd >= 0:
                return int(h.dirty.fd)
            if backing is None and h.file is not None and h.file.fd >= 0:
                backing = int(h.file.fd)
        if entry.orphan is not None and entry.orphan.fd >= 0:
            return int(entry.orphan.fd)
        return backing

    def begin_change(self) -> None:
        """A request that may change a file's attributes (through tierfs) starts: the fstats of
        opens before it no longer stand for their files (:meth:`lstat`), nor those of opens
        until it ends. Pair with :meth:`end_change`."""
        self._changing += 1
        self._change_gen += 1
        if self._opened:
            self._opened.clear()

    def end_change(self) -> None:
        self._changing -= 1
        self._change_gen += 1
        if self._opened:
            self._opened.clear()

    def opened_stat(self, entry: InodeEntry) -> os.stat_result | None:
        """The ``fstat`` a reader's open of ``entry`` took of its backing file moments ago
        (within ``LOOKED_UP_S``), given once, or None.

        A program's open(2) is followed at once by an fstat (Python's open() does one, as does
        stdio's buffering), and the kernel sends that fstat as a GETATTR whenever a read passed
        through to the tier file marked the atime stale (every file of an epoch after the
        first: fs/fuse/passthrough.c invalidates atime on each read). The open fstat-ed the
        backing file microseconds ago: as fresh as an lstat now, at no metadata call (a third
        of that GETATTR's time in the daemon)."""
        path = entry.path
        if path is None or not self._opened:
            return None
        seen = self._opened.pop(path, None)
        if (seen is not None and trio.current_time() - seen[0] <= LOOKED_UP_S
                and (seen[1].st_dev, seen[1].st_ino) == entry.dev_ino):
            self.opened_stats += 1
            return seen[1]
        return None

    def seen_dir_stat(self, entry: InodeEntry) -> os.stat_result | None:
        """The ``fstat`` of directory ``entry`` that a change of its names took moments ago
        (:meth:`saw_dir`), given once and only while it still stands, or None."""
        seen_dir = self._dir_seen
        if seen_dir is None or seen_dir[0] != entry.path:
            return None
        self._dir_seen = None
        ns_gen, attrs_gen = seen_dir[3]
        if (self._ns_changing == 0 and self._attrs_changing == 0
                and self._ns_gen == ns_gen + 1 and self._attrs_gen == attrs_gen
                and trio.current_time() - seen_dir[1] <= LOOKED_UP_S
                and (seen_dir[2].st_dev, seen_dir[2].st_ino) == entry.dev_ino):
            self.dir_stats += 1
            return seen_dir[2]
        return None

    async def lstat(self, entry: InodeEntry) -> os.stat_result:
        if entry.path is None:  # unlinked but open: its descriptor knows
            fd = self.held_fd(entry)
            if fd is None:
                raise FileNotFoundError(2, "unlinked")
            return os.fstat(fd)
        if self._dir_seen is not None:
            st = self.seen_dir_stat(entry)
            if st is not None:
                return st
        if self._opened:
            st = self.opened_stat(entry)
            if st is not None:
                return st
        try:
            st = await self.meta.run(lstat_or_none, self.tree, entry.path)
        except OSError as e:
            if e.errno not in (errno.ENOTDIR, errno.ELOOP, errno.EXDEV):
                raise
            st = None  # a directory on the way was swapped for a file or a symlink
        if st is not None and (st.st_dev, st.st_ino) == entry.dev_ino:
            return st
        # The name no longer names this entry's object (replaced or removed behind tierfs'
        # back): an open descriptor still serves the old file, as ext4 does.
        fd = self.held_fd(entry)
        if fd is not None:
            return os.fstat(fd)
        if st is None or (stat.S_ISLNK(st.st_mode) and entry.dev_ino[0] >= 0):
            # gone, or a symlink now where another object was: never show the link's
            # attributes for the held inode (the kernel would take it for a type change)
            raise FileNotFoundError(errno.ENOENT, "gone from the backing store")
        return st

    def dir_token(self) -> tuple[int, int]:
        """What :meth:`saw_dir` compares: take it before the call that stats the directory."""
        return (self._ns_gen, self._attrs_gen)

    def saw_dir(self, path: bytes, st: os.stat_result, token: tuple[int, int]) -> None:
        """Directory ``path`` was just changed through tierfs (a name created or removed in
        it) and ``st`` is its ``fstat`` right after, taken after :meth:`dir_token` gave
        ``token``. The kernel drops a directory's attributes after each such change
        (``fuse_dir_changed``), and with ``default_permissions`` the permission check of the
        next change in it asks for them again: ``rm -rf`` and ``tar -x`` cost a GETATTR of the
        directory per file. That GETATTR is answered from ``st`` (:meth:`lstat`) if it comes
        within ``LOOKED_UP_S`` and, from ``token`` on, no other request that may create,
        remove or rename a name started (this one's own end is the one counted) nor one that
        may change a directory's own attributes: as fresh as an ``lstat`` taken when the
        change was made. (The kernel also holds the directory's lock across a change of its
        names and a SETATTR of it, so that these never overlap through the mount.) Call it
        inside a request counted by :meth:`begin_ns_change`, after its last await."""
        self._dir_seen = (path, trio.current_time(), st, token)

    def begin_attrs_change(self) -> None:
        """A request that may change the attributes of a directory itself starts (a SETATTR
        or an xattr change of anything not known to be a regular file): a directory's
        attributes seen after a change of its names no longer stand (:meth:`saw_dir`)."""
        self._attrs_changing += 1
        self._attrs_gen += 1
        self._dir_seen = None

    def end_attrs_change(self) -> None:
        self._attrs_changing -= 1
        self._attrs_gen += 1

    def begin_ns_change(self) -> None:
        """A request that may create, remove or rename a name starts (:meth:`saw_dir`)."""
        self._ns_changing += 1
        self._ns_gen += 1

    def end_ns_change(self) -> None:
        self._ns_changing -= 1
        self._ns_gen += 1

    async def entry_attrs(self, entry: InodeEntry) -> Attr:
        if entry.dirty is not None:
            return await self.dirty_attrs(entry, entry.dirty)
        st = await self.lstat(entry)
        held_dirty = entry.path is None and any(h.dirty is not None for h in self.handles.of_inode(entry.inode))
        # unlinked but open, answered by a data file: its link is the tier's, no name links it
        return self.clean_attrs(entry, st, nlink=0 if held_dirty else None)

    # -- names -----------------------------------------------------------------------------
    async def lookup_path(self, path: bytes, st: os.stat_result | None = None) -> Attr:
        """Resolve a path of the merged view; one lookup is added to the inode returned.
        ``st``: the backing object's ``lstat`` if the caller has just taken it (it made it)."""
        df = self.wb.get(path)
        if df is not None:
            entry = self.inodes.remember_dirty(path, df)
            # counted: an interrupt must not cancel the reply that tells the kernel so (the
            # lookup would never be forgotten); a data file's fstat is short
            with trio.CancelScope(shield=True):
                return await self.dirty_attrs(entry, df)
        if st is None:
            st = await self.meta.run(self.tree.lstat, path)
        entry = self.inodes.remember(path, st)
        self._saw_looked_up(path, st)
        if entry.dirty is not None and entry.dirty.state.value == "clean":
            entry.dirty = None
        if entry.dirty is not None:  # another hard link of a file being written
            with trio.CancelScope(shield=True):  # counted (above)
                return await self.dirty_attrs(entry, entry.dirty)
        return self.clean_attrs(entry, st)

    def lookup_now(self, parent_inode: int, name: bytes) -> Attr | int | None:
        """:meth:`lookup` with no await: the attributes of a clean object (one lookup added, as
        :meth:`lookup_path` adds it), ``errno.ENOENT`` for a name the backing store does not
        have, or None (nothing done: call :meth:`lookup`). Taken for a name of a directory with
        a path that no dirty file holds, while backing-store metadata calls run inline (the
        metadata device's own judgement), on a mount whose opens reach the daemon (with
        ``kernel_opens``, an attribute reply may first have to drop the kernel's pages:
        :meth:`clean_attrs`). ``.`` and ``..``, an error of the ``lstat`` other than a missing
        name, and another hard link of a file being written go to :meth:`lookup`."""
        if is_tmp_name(name):
            return errno.ENOENT
        parent = self.inodes.by_inode.get(parent_inode)
        if (parent is None or parent.path is None or name == b"." or name == b".."
                or self.on_changed_in_place is not None or not self.meta.inline_now()):
            return None
        path = self.inodes.child_path(parent, name)
        if self.wb.get(path) is not None:
            return None
        try:
            st = self.meta.run_now(lstat_or_none, self.tree, path)
        except OSError:  # ENOTDIR, ELOOP, EXDEV (a directory on the way swapped): lookup maps it
            return None
        if st is None:
            return errno.ENOENT
        known = self.inodes.by_dev_ino.get((st.st_dev, st.st_ino))
        if known is not None and known.dirty is not None and known.dirty.state.value != "clean":
            return None  # another hard link of a file being written: its data file's attributes
        entry = self.inodes.remember(path, st)
        if entry.dirty is not None and entry.dirty.state.value == "clean":
            entry.dirty = None
        if entry.dirty is not None:  # (cannot be: checked above) undone, for lookup to redo
            entry.lookups -= 1
            return None
        self._saw_looked_up(path, st)
        return self.clean_attrs(entry, st)

    def _saw_looked_up(self, path: bytes, st: os.stat_result) -> None:
        """A lookup's ``lstat`` of ``path``: kept a moment for an open that follows (a regular
        file's)."""
        if stat.S_ISREG(st.st_mode):
            self._looked_up[path] = (trio.current_time(), st)
            self._looked_up.move_to_end(path)
            if len(self._looked_up) > LOOKED_UP_MAX:
                self._looked_up.popitem(last=False)

    async def lookup(self, parent_inode: int, name: bytes) -> Attr:
        """``name`` in a directory of the backing tree (not the control directory)."""
        if is_tmp_name(name):
            raise FuseError(errno.ENOENT)
        parent = self.inodes.get(parent_inode)
        if name == b".":
            entry = parent
            st = await self.lstat(entry)
            entry.lookups += 1
            return self.clean_attrs(entry, st)
        if name == b"..":
            assert parent.path is not None
            rel = os.path.dirname(parent.path)
            st = await self.meta.run(self.tree.lstat, rel)
            entry = self.inodes.remember(rel, st) if rel else self.inodes.get(ROOT)
            if not rel:
                entry.lookups += 1
            return self.clean_attrs(entry, st)
        return await self.lookup_path(self.inodes.child_path(parent, name))

    async def exists(self, path: bytes) -> os.stat_result | DirtyFile | None:
        df = self.wb.get(path)
        if df is not None:
            return df
        return await self.meta.run(lstat_or_none, self.tree, path)

    def new_child(self, parent_inode: int, name: bytes) -> bytes:
        if parent_inode == CONTROL_DIR or (parent_inode == ROOT and name == CONTROL_NAME):
            raise FuseError(errno.EPERM)
        if is_tmp_name(name):
            raise FuseError(errno.EINVAL)  # names tierfs reserves for write-back
        return self.inodes.child_path(self.inodes.get(parent_inode), name)

    # -- directories -----------------------------------------------------------------------
    def listing(self, entry: InodeEntry) -> DirListing:
        """A new streamed listing of a directory (see :class:`DirListing`)."""
        return DirListing(self, self.inodes.rel(entry))

    def listed_backing(self, parent: InodeEntry, name: bytes, st: os.stat_result) -> tuple[InodeEntry, Attr]:
        """:meth:`listed_attrs` of a backing entry (no await: most entries of a listing)."""
        entry = self.inodes.remember(self.inodes.child_path(parent, name), st)
        return entry, self.clean_attrs(entry, st)

    async def listed_attrs(self, parent: InodeEntry, name: bytes, obj: Any) -> tuple[InodeEntry, Attr] | None:
        """The entry and attributes of one listed name (one lookup added), or None if it is
        gone since it was listed."""
        path = self.inodes.child_path(parent, name)
        if isinstance(obj, DirtyFile) and obj.path != path:
            return None  # renamed or unlinked since opendir
        if isinstance(obj, DirtyFile) and obj.state.value == "clean":
            # written back since opendir: the backing file is the entry now
            obj = await self.meta.run(lstat_or_none, self.tree, path)
            if obj is None:
                return None
        if isinstance(obj, DirtyFile):
            entry = self.inodes.remember_dirty(path, obj)
            return entry, await self.dirty_attrs(entry, obj)
        entry = self.inodes.remember(path, obj)
        return entry, self.clean_attrs(entry, obj)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: RequestCtx) -> Attr:
        path = self.new_child(parent_inode, name)
        if self.wb.get(path) is not None:
            raise FuseError(errno.EEXIST)
        token = self.dir_token()
        st, dst = await self.meta.run(self.tree.make_node_in, path, stat.S_IFDIR | (mode & 0o7777), ctx.uid, ctx.gid)
        a = await self.lookup_path(path, st)
        self.saw_dir(split(path)[0], dst, token)
        return a

    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: RequestCtx) -> Attr:
        """A fifo, socket (``bind()`` of a Unix socket), empty regular file or, for root,
        a character or block device; owned by the caller, setgid directories honoured."""
        path = self.new_child(parent_inode, name)
        kind = stat.S_IFMT(mode)
        if kind not in (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFREG, stat.S_IFCHR, stat.S_IFBLK):
            raise FuseError(errno.EINVAL)
        if kind in (stat.S_IFCHR, stat.S_IFBLK) and ctx.uid != 0:
            raise FuseError(errno.EPERM)  # the kernel checks CAP_MKNOD too
        if await self.exists(path) is not None:
            raise FuseError(errno.EEXIST)
        token = self.dir_token()
        st, dst = await self.meta.run(self.tree.make_node_in, path, kind | (mode & 0o7777), ctx.uid, ctx.gid, rdev)
        a = await self.lookup_path(path, st)
        self.saw_dir(split(path)[0], dst, token)
        return a

    async def rmdir(self, parent_inode: int, name: bytes) -> None:
        path = self.new_child(parent_inode, name)
        if self.wb.get(path) is not None:
            raise FuseError(errno.ENOTDIR)
        if self.wb.has_children(path):
            raise FuseError(errno.ENOTEMPTY)
        await self.wb.settle_dir(path)
        # In a thread, never inline: an rmdir takes the parent directory's lock, which the
        # write-back's threads hold while they create and rename files beside it, and the
        # kernel may spin for it on CPU; measured right after a write-back into the directory
        # with two CPU-bound processes beside the daemon: 13-17 ms on CPU each time (70 ms on a
        # slower CI machine), under 0.5 ms when idle. Directories are removed rarely enough
        # that a thread hand-off (~0.1 ms) costs nothing measurable (rm -rf: one per directory).
        await self.meta.in_thread(_rmdir_with_orphans, self.tree, path)
        self.inodes.detach(path)

    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: RequestCtx) -> Attr:
        path = self.new_child(parent_inode, name)
        if self.wb.get(path) is not None:
            raise FuseError(errno.EEXIST)
        token = self.dir_token()
        st, dst = await self.meta.run(self.tree.make_symlink_in, target, path, ctx.uid, ctx.gid)
        a = await self.lookup_path(path, st)
        self.saw_dir(split(path)[0], dst, token)
        return a

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: RequestCtx) -> tuple[InodeEntry, DirtyFile]:
        """A new (or truncated-over) regular file: a dirty file in the write tier, counted as
        opened for writing (the creator's handle: the caller gives it back with
        ``WriteBack.closed(df, True)``)."""
        path = self.new_child(parent_inode, name)
        existing: os.stat_result | DirtyFile | None = self.wb.get(path)
        if existing is not None and flags & os.O_EXCL:
            raise FuseError(errno.EEXIST)
        # the parent is resolved beneath the backing root first (a directory swapped for a
        # symlink is refused here) and gives the group of the new file if it is setgid; the
        # name's lstat comes with it (one walk for both)
        pst, st = await self.meta.run(self.tree.probe_create, path, existing is None)
        if existing is None:
            existing = st
            if existing is not None and flags & os.O_EXCL:
                raise FuseError(errno.EEXIST)
        gid = pst.st_gid if pst.st_mode & stat.S_ISGID else ctx.gid
        df = await self.wb.create(path, stat.S_IFREG | (mode & 0o7777), ctx.uid, gid)
        # opened at once, before the next await: a dirty file with no writer is the write-back's
        # to take, and it took new files here, wrote them back empty and closed their data
        # file before the create answered (EBADF for 3 of 10,000 files of a tar -x)
        self.wb.opened(df, True)
        try:
            if isinstance(existing, os.stat_result):
                self.inodes.detach(path)
            elif existing is None:
                # a new name: the directory changed now, not at write-back (POSIX; pjdfstest
                # open/00.t), and write-back keeps the directory's times as they are then
                token = self.dir_token()
                self.saw_dir(split(path)[0], await self.meta.run(self.tree.touch, split(path)[0]), token)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.wb.closed(df, True)
            raise
        return self.inodes.remember_dirty(path, df), df

    # -- links, unlink, rename -------------------------------------------------------------
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes) -> Attr:
        entry = self.inodes.get(inode)
        new_path = self.new_child(new_parent_inode, new_name)
        if await self.exists(new_path) is not None:
            raise FuseError(errno.EEXIST)
        if entry.dirty is not None:
            # A hard link shares one inode: put the file on the backing store first.
            await self.wb.wait_durable([entry.dirty], timeout=float("inf"))
        src = self.inodes.rel(entry)
        await self.meta.run(self.tree.link, src, new_path)
        if entry.dirty is not None and entry.dirty.state.value != "clean":
            # still open for writing: its later write-back must keep the link, and both
            # names are one inode
            st = await self.meta.run(self.tree.lstat, src)
            st2 = await self.meta.run(self.tree.lstat, new_path)
            # both names must be the inode just linked; if a user swapped one meanwhile,
            # the write-back knows no inode and checks the owner instead
            same = (st.st_dev, st.st_ino) == (st2.st_dev, st2.st_ino)
            self.wb.set_in_place(entry.dirty, st if same else None)
            self.inodes.rekey(entry, (st.st_dev, st.st_ino))
        return await self.lookup_path(new_path)

    async def preserve(self, path: bytes, *, opened_only: bool = False) -> None:
        """Before ``path`` is unlinked or renamed over: an inode the kernel still holds for it
        (a process looked the name up and may open it next, e.g. a reader racing ``os.replace``)
        stays openable with its old content until the kernel forgets it, as on a local fs: a
        clean file through a held backing fd, a dirty one by keeping its data file.

        ``opened_only`` (an unlink): a clean file is kept only while a handle has it open (an
        open of ``/proc/PID/fd/N`` reaches the inode with no name; one in flight at the unlink
        finds the file its handle holds: Handlers._held_file). An open that resolved the
        name from the kernel's cache and reaches the daemon after the unlink gets ``ENOENT``,
        as if the unlink had come first. Keeping every file the kernel knows was an ``open`` of
        its backing file per unlink and a ``close`` in a thread when the kernel forgets it:
        ``rm -rf`` of 10,000 files took 220-240 us per file that way, 162-168 us without. The
        price: an ``open`` racing a name that another process makes and unlinks again
        thousands of times a second fails ``ESTALE`` a few times in 10,000 (it never did)."""
        for entry in self.inodes.at_path(path):
            df = entry.dirty
            if df is not None and df.state.value != "clean":
                if not entry.kept:
                    df.keep += 1
                    entry.kept = True
            elif opened_only and not self.handles.of_inode(entry.inode):
                continue
            elif entry.orphan is None and entry.regular:
                # Opened at once, with no lstat first (a third of an unlink's time in the
                # daemon for rm -rf, cProfile): the open refuses what is no longer a regular
                # file (O_NOFOLLOW, O_NONBLOCK, then fstat), as any open of a name does.
                try:
                    bf = await self.backing_file(path)
                except OSError:
                    continue  # gone, or not a regular file any more: nothing to keep
                if (bf.identity.dev, bf.identity.ino) == entry.dev_ino:
                    entry.orphan = bf
                else:  # replaced behind tierfs' back, or by a write-back's commit
                    self.release_backing(bf)

    async def unlink(self, parent_inode: int, name: bytes) -> None:
        path = self.new_child(parent_inode, name)
        await self.preserve(path, opened_only=True)
        df = self.wb.get(path)
        if df is None:
            # a clean object: unlinkat(2) answers as POSIX does (ENOENT; EISDIR for a directory)
            # without an lstat first (one metadata call per file less for rm -rf)
            token = self.dir_token()
            nlink, dst = await self.meta.run(self.tree.unlink_stat_dir, path)
        else:
            await self.wb.unlink(df)
            # stat the backing store only now: a write-back may have just put the file there
            st = await self.meta.run(lstat_or_none, self.tree, path)
            token = self.dir_token()
            if st is not None and not stat.S_ISDIR(st.st_mode):
                nlink, dst = await self.meta.run(self.tree.unlink_stat_dir, path)
            else:  # only the write tier had it: the directory changed all the same
                nlink, dst = 1, await self.meta.run(self.tree.touch, split(path)[0])
        self._unlinked(path, nlink, dst, token)

    def unlink_now_path(self, parent_inode: int, name: bytes) -> bytes | None:
        """The path :meth:`unlink_now` may remove now, with no await, or None (then call
        :meth:`unlink`): a name the write tier does not hold, no inode of which is kept
        dirty or open by a handle (:meth:`preserve` has nothing to keep), while metadata
        calls run inline (:meth:`Device.inline_now`). Errors in the name (EPERM, EINVAL,
        an unknown directory) are left to :meth:`unlink`."""
        if not self.meta.inline_now():
            return None
        try:
            path = self.new_child(parent_inode, name)
        except (FuseError, KeyError, OSError):  # (OSError: a directory no longer named)
            return None
        if self.wb.get(path) is not None:
            return None
        for entry in self.inodes.at_path(path):
            df = entry.dirty
            if (df is not None and df.state.value != "clean") or self.handles.of_inode(entry.inode):
                return None
        return path

    def unlink_now(self, path: bytes) -> None:
        """:meth:`unlink` of a path :meth:`unlink_now_path` gave, done now (inline, as its
        metadata call would run): ``rm -rf`` sends one UNLINK per file, and the handler's
        task and awaits cost ~5 us of the daemon's CPU each (bench/profile_rm.py, four
        alternated pairs; docs/benchmarks.md). Raises what :meth:`unlink` raises."""
        token = self.dir_token()
        nlink, dst = self.meta.run_now(self.tree.unlink_stat_dir, path)
        self._unlinked(path, nlink, dst, token)

    def _unlinked(self, path: bytes, nlink: int, dst: os.stat_result, token: tuple[int, int]) -> None:
        if nlink > 1:
            # still linked under another name: an open of the inode that the unlink raced is
            # answered ESTALE (the kernel looks its name up again), not ENOENT
            for entry in self.inodes.at_path(path):
                entry.linked_elsewhere = True
        self.inodes.detach(path)
        self.saw_dir(split(path)[0], dst, token)

    async def _rename_checks(self, old: bytes, new: bytes, flags: int) -> tuple[os.stat_result | DirtyFile, bool]:
        """The source, and whether it is a directory; the errno POSIX gives if the rename
        cannot be done."""
        src = await self.exists(old)
        if src is None:
            raise FuseError(errno.ENOENT)
        target = await self.exists(new)
        if target is not None and flags & RENAME_NOREPLACE:
            raise FuseError(errno.EEXIST)
        src_is_dir = isinstance(src, os.stat_result) and stat.S_ISDIR(src.st_mode)
        if isinstance(target, os.stat_result) and stat.S_ISDIR(target.st_mode) and not src_is_dir:
            raise FuseError(errno.EISDIR)
        if isinstance(target, DirtyFile) and src_is_dir:
            raise FuseError(errno.ENOTDIR)
        if src_is_dir and self.wb.has_children(new):
            raise FuseError(errno.ENOTEMPTY)  # the target dir holds unwritten files
        return src, src_is_dir

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int) -> None:
        if flags & RENAME_EXCHANGE:
            raise FuseError(errno.EINVAL)
        old = self.new_child(parent_inode_old, name_old)
        new = self.new_child(parent_inode_new, name_new)
        if old == new:
            return
        src, src_is_dir = await self._rename_checks(old, new, flags)
        await self.preserve(new)
        # The target's inodes are detached before the rename (a lookup during its await
        # must not hand out the old target) and reattached if the backing store refuses
        # it (ENOTEMPTY, EISDIR, ...): the target stays as it was, usable.
        replaced = self.inodes.naming(new)
        self.inodes.detach(new)
        moved = False
        if isinstance(src, DirtyFile):
            moved = await self._rename_dirty(src, old, new)
        if not moved:  # a clean object (or one written back just now): rename it on the backing store
            tdf = self.wb.get(new)
            if tdf is not None:
                await self.wb.unlink(tdf)
            try:
                await self.meta.run(self.tree.rename, old, new)
            except BaseException:
                self.inodes.reattach(new, replaced)
                raise
            if src_is_dir:
                self.wb.rename_dir(old, new)
        self.inodes.rename(old, new, subtree=src_is_dir)

    async def _rename_dirty(self, src: DirtyFile, old: bytes, new: bytes) -> bool:
        """Rename a dirty file in the write tier; False if it was written back meanwhile (the
        caller renames the backing file then)."""
        moved = await self.wb.rename(src, new)
        if moved:
            # an older version under the old name must not reappear there (stat only
            # now: the dirty file itself is no longer at `old`)
            shadowed = await self.meta.run(lstat_or_none, self.tree, old)
            if shadowed is not None and not stat.S_ISDIR(shadowed.st_mode):
                await self.meta.run(self.tree.unlink, old)
            for d in {split(old)[0], split(new)[0]}:  # both directories changed now
                await self.meta.run(self.tree.touch, d)
        return moved

    # -- attributes (setattr) ----------------------------------------------------------------
    async def setattr(self, inode: int, attr: SetAttr) -> Attr:
        entry = self.inodes.get(inode)
        if attr.size is not None and inode in self.backing_in_place and entry.dirty is None:
            await self.truncate_backing(entry, attr.size)
        elif attr.size is not None:
            df = await self.make_dirty(entry, truncate=attr.size == 0)
            await self.wb.truncate(df, attr.size)
        times = None
        if attr.atime_ns is not None or attr.mtime_ns is not None:
            times = _times(attr, await self.entry_attrs(entry))
        mode, uid, gid = attr.mode, attr.uid, attr.gid
        if mode is not None or uid is not None or gid is not None or times is not None:
            if entry.dirty is None and entry.path is None and entry.regular:
                # unlinked while open: its attributes change on its anonymous copy, as its
                # data does (_make_dirty_unlinked); the backing file has no name to set them on
                await self.make_dirty(entry, truncate=False)
            if entry.dirty is not None:
                await self.wb.set_attrs(entry.dirty, mode=mode, uid=uid, gid=gid, times=times)
            else:
                if times is not None:
                    # A directory's times set while a write-back commits a file into it: the
                    # commit gives the directory back the times it read before its rename (in
                    # another thread), which would undo these (tar -x sets them right after
                    # closing the last file). Set them once those commits are done.
                    await self.wb.settle_dir(self.inodes.rel(entry))
                await self.meta.run(_setattr_backing, self.tree, self.inodes.rel(entry),
                                    mode, uid, gid, times)
        return await self.entry_attrs(entry)

    def setattr_now(self, entry: InodeEntry, attr: SetAttr) -> Attr | None:
        """:meth:`setattr` of a file being written in the write tier, with no await: its
        attributes after, or None (nothing done; then await :meth:`setattr`). Only a change of
        mode, owner or times (no size), of a dirty file not written back in place and with no
        set-ID bit to drop (``kill_suidgid``), that the write-back layer makes now
        (:meth:`WriteBack.set_attrs_now`). ``tar -x`` and ``cp -a`` send three per file they
        make (a chown, a chmod, the times), each ~25 us of the daemon's time through a handler.
        Raises OSError as the calls do."""
        df = entry.dirty
        if df is None or attr.size is not None or df.in_place or df.fd < 0:
            return None
        if attr.mode is None and attr.uid is None and attr.gid is None and attr.atime_ns is None \
                and attr.mtime_ns is None:
            return None  # (nothing to set: the handler's path starts no new generation for it)
        cur = None
        if attr.kill_suidgid:
            # (the kernel asks it with every chown: FUSE_HANDLE_KILLPRIV_V2) nothing to drop
            # from a file with no set-ID bit; one with them goes to the handler's rule
            cur = self.wb.stat_now(df)
            if cur.st_mode & (stat.S_ISUID | stat.S_ISGID):
                return None
        times = None
        if attr.atime_ns is not None and attr.mtime_ns is not None:  # (futimens: no fstat)
            times = (attr.atime_ns, attr.mtime_ns)
        elif attr.atime_ns is not None or attr.mtime_ns is not None:
            times = _times(attr, cur or self.wb.stat_now(df))
        if not self.wb.set_attrs_now(df, mode=attr.mode, uid=attr.uid, gid=attr.gid, times=times):
            return None
        entry.told = None  # (as dirty_attrs: a data file's attributes)
        return self.attrs(entry.inode, self.wb.stat_now(df), nlink=1 if df.path is not None else 0)

    async def truncate_backing(self, entry: InodeEntry, size: int) -> None:
        """Truncate the backing file of ``entry`` itself (see :attr:`backing_in_place`)."""
        await self.meta.run(_truncate_backing, self.tree, self.inodes.rel(entry), size)
        entry.told = None  # the kernel keeps its own size of a file passed through

    # -- dirty files (copy-up) -----------------------------------------------------------------
    async def make_dirty(self, entry: InodeEntry, *, truncate: bool) -> DirtyFile:
        """The inode's dirty file, made from the backing file if it has none yet (a copy-up,
        or an empty file when it is about to be truncated to zero). One at a time per inode:
        two writers opening a clean file at once must share one dirty copy."""
        lock = self._dirty_locks.setdefault(entry.inode, trio.Lock())
        try:
            async with lock:
                return await self._make_dirty_locked(entry, truncate=truncate)
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._dirty_locks.pop(entry.inode, None)

    async def _make_dirty_locked(self, entry: InodeEntry, *, truncate: bool) -> DirtyFile:
        if entry.dirty is not None and entry.dirty.state.value != "clean":
            return entry.dirty
        path = entry.path
        if path is None:
            return await self._make_dirty_unlinked(entry, truncate=truncate)
        st = await self.meta.run(self.tree.lstat, path)
        if not stat.S_ISREG(st.st_mode):
            raise FuseError(errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL)
        held = self.clean_but_open(entry, path)
        if held is not None and self.wb.redirty(held, st):
            self.inodes.attach(entry, held)
            return held
        if truncate or st.st_size == 0:
            df = await self.wb.create(path, st.st_mode, st.st_uid, st.st_gid)
        else:
            bf = await self.backing_file(path)
            access = AccessState()
            try:
                # the file opened, not the one the lstat named a moment before: one renamed
                # over the name in between is copied whole, with its own mode, owner and times
                # (it was copied to the old file's size under the old file's attributes)
                st = await self.meta.run(os.fstat, bf.fd)
                segments = await self.meta.run(data_segments, bf.fd, st.st_size)
                # xattrs are read through the open descriptor (/proc/self/fd/N), not a path
                df = await self.wb.copy_up(
                    path, st, lambda off, n: self.cache.read(bf, off, n, access), proc_path(bf.fd),
                    segments, self._kernel_source(bf))
            finally:
                self.cache.forget_access(access)
                self.release_backing(bf)
        if st.st_nlink > 1:
            self.wb.set_in_place(df, st)
        self.inodes.attach(entry, df)
        return df

    def _kernel_source(self, bf: BackingFile) -> KernelSource:
        """What a copy-up of ``bf`` may copy in the kernel: the bytes the cache holds none of,
        one chunk at a time."""
        return KernelSource(bf.fd, partial(self.cache.holds_any, bf), self.cache.chunk_size,
                            ("copy-up", bf.identity.dev))

    async def _make_dirty_unlinked(self, entry: InodeEntry, *, truncate: bool) -> DirtyFile:
        """The first write (or truncate) through a descriptor of a clean file whose name was
        unlinked, or replaced, after it was opened: a local filesystem lets it write, and
        every descriptor of the file sees the change. The copy is anonymous: its journal row
        names no path (a crash discards it), it is never written back, and it goes once the
        kernel has forgotten the inode and the last handle closed (:meth:`WriteBack.unkeep`).
        Its source is what the open handles read (the entry's orphan, else a handle's backing
        file). Raises FuseError(ENOENT) when none is left, or when the backing inode still has
        a name (a copy would split from it); OSError (ENOSPC) when the write tier cannot hold
        it."""
        src = entry.orphan if entry.orphan is not None and entry.orphan.fd >= 0 else None
        if src is None:
            src = next((h.file for h in self.handles.of_inode(entry.inode)
                        if h.file is not None and h.file.fd >= 0), None)
        if src is None or entry.linked_elsewhere:
            raise FuseError(errno.ENOENT)
        src.acquire()  # open across the copy, whatever the handles do meanwhile
        try:
            st = await self.meta.run(os.fstat, src.fd)
            if st.st_nlink > 0:
                # the backing inode still has a name (a hard link the rename over this one
                # left, or one made behind tierfs' back): a copy would split from it
                raise FuseError(errno.ENOENT)
            if truncate or st.st_size == 0:
                df = await self.wb.create(None, st.st_mode, st.st_uid, st.st_gid, journal=False)
            else:
                access = AccessState()
                try:
                    segments = await self.meta.run(data_segments, src.fd, st.st_size)
                    df = await self.wb.copy_up(None, st, lambda off, n: self.cache.read(src, off, n, access),
                                               proc_path(src.fd), segments, self._kernel_source(src))
                finally:
                    self.cache.forget_access(access)
        finally:
            src.release(self._close_backing)
        self.inodes.attach(entry, df)
        # kept while the kernel holds the inode, as an unlinked dirty file is (preserve): a
        # reader opened before the copy reads it after the writer's close, and so does a
        # reopen through /proc/PID/fd/N (on_forget gives it up)
        df.keep += 1
        entry.kept = True
        return df

    async def take_in_place(self, entry: InodeEntry, src_fd: int) -> DirtyFile:
        """The inode's dirty file, made to hold the bytes of ``src_fd``: its tier file, which
        the kernel wrote in place (:meth:`tierfs.writeback.manager.WriteBack.take_in_place`).
        One at a time per inode, as :meth:`make_dirty`. Raises FuseError(ENOENT) for an
        unlinked file (nothing to take in), OSError (ENOSPC, EIO)."""
        lock = self._dirty_locks.setdefault(entry.inode, trio.Lock())
        try:
            async with lock:
                path = entry.path
                if path is None:
                    raise FuseError(errno.ENOENT)
                df = entry.dirty
                if df is not None and df.state.value != "clean" and not df.through:
                    return await self.wb.take_in_place(path, df, src_fd, os.fstat(df.fd), None)
                st = await self.meta.run(self.tree.lstat, path)
                bf = await self.backing_file(path)
                try:
                    df = await self.wb.take_in_place(path, None, src_fd, st, proc_path(bf.fd))
                finally:
                    self.release_backing(bf)
                if st.st_nlink > 1:
                    self.wb.set_in_place(df, st)
                self.inodes.attach(entry, df)
                return df
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._dirty_locks.pop(entry.inode, None)

    def clean_but_open(self, entry: InodeEntry, path: bytes) -> DirtyFile | None:
        """The written-back (clean) dirty file of ``entry`` that open handles still read, if
        any (:meth:`tierfs.writeback.manager.WriteBack.redirty`)."""
        for h in self.handles.of_inode(entry.inode):
            if h.dirty is not None and h.dirty.state.value == "clean" and h.dirty.path == path:
                return h.dirty
        return None

    # -- open backing files ----------------------------------------------------------------
    async def backing_file(self, rel: bytes, *, reader: bool = False) -> BackingFile:
        """The open backing file at ``rel`` (shared by every open of one identity), with one
        more open counted; give it back with :meth:`release_backing`. ``reader``: for an open
        that cannot write, whose fstat then answers the GETATTR right after it (:meth:`lstat`)."""
        await self.openings.wait(rel)  # a prefetch opening it: share what it opens
        shared = await self._shared_open(rel)
        if shared is not None:
            return self._acquire_shared(shared)
        opening = self.openings.begin(rel)
        gen = self._change_gen
        try:
            fd, st = await self.meta.run(open_backing, self.tree, rel)
        finally:
            self.openings.end(rel, opening)
        if reader and self._changing == 0 and self._change_gen == gen:  # raced no change
            self._record_opened(rel, st)
        return self._share_open(rel, st, fd)

    def backing_file_now(self, rel: bytes) -> BackingFile | None:
        """:meth:`backing_file` for a reader, with no await, or None (nothing done: call
        :meth:`backing_file`): while no prefetch is opening ``rel``, backing-store metadata
        calls run inline (:meth:`tierfs.io.Device.inline_now`), and sharing a descriptor a
        prefetch holds would not take an ``lstat`` first. Raises OSError as the open does."""
        if self.openings.busy(rel) or not self.meta.inline_now():
            return None
        seen = self._looked_up.get(rel)
        if seen is not None and trio.current_time() - seen[0] <= LOOKED_UP_S:
            del self._looked_up[rel]
            shared = self._looked_up_open(rel, seen[1])
        else:
            held = self.find_held(rel) if self.find_held is not None else None
            if held is not None and held.fd >= 0:
                return None  # _shared_open compares it with an lstat first
            self._looked_up.pop(rel, None)  # (too old to trust, as _shared_open drops it)
            shared = None
        if shared is not None:
            return self._acquire_shared(shared)
        fd, st = self.meta.run_now(open_backing, self.tree, rel)
        if self._changing == 0:  # (nothing can change while this runs: no await)
            self._record_opened(rel, st)
        return self._share_open(rel, st, fd)

    def _acquire_shared(self, shared: BackingFile) -> BackingFile:
        """``shared`` (from :meth:`_shared_open`), with one more open counted."""
        held = self.open_files.get(shared.key)
        if held is None or held.fd < 0:
            self.open_files[shared.key] = shared
        shared.acquire()
        shared.opens += 1
        self.shared_opens += 1
        return shared

    def _record_opened(self, rel: bytes, st: os.stat_result) -> None:
        """A reader's open fstat-ed ``rel`` just now (:meth:`opened_stat`)."""
        self._opened[rel] = (trio.current_time(), st)
        self._opened.move_to_end(rel)
        if len(self._opened) > LOOKED_UP_MAX:
            self._opened.popitem(last=False)

    def _share_open(self, rel: bytes, st: os.stat_result, fd: int) -> BackingFile:
        """The open backing file of ``rel`` with identity ``st``: the one already in the table
        (``fd`` closed), else a new one holding ``fd``; one open counted."""
        identity = Identity.of(key_path(self.tree.root, rel), st)
        bf = self.open_files.get(identity.key)
        if bf is None or bf.fd < 0:
            bf = BackingFile(identity, fd)
            self.open_files[identity.key] = bf
        else:
            os.close(fd)
        bf.acquire()
        bf.opens += 1
        return bf

    async def _shared_open(self, rel: bytes) -> BackingFile | None:
        """An open backing file this open can share instead of opening ``rel`` again: one the
        daemon holds open already (for another open, or for a hinted or predicted prefetch)
        whose identity (inode, size, mtime, ctime) is what ``rel`` names *now*. Now is the
        lookup the kernel sent just before this open, if there was one within
        ``LOOKED_UP_S``; else, when a prefetch holds a file at ``rel``, one ``lstat`` (instead
        of an open). A change made behind tierfs' back is seen as before: a different
        identity opens the file. Saves the second open(2) of a small file a prefetch opened
        (measured: 2 opens per file read in name order before, 1 after; tests/test_miss_path.py).
        Costs nothing when neither holds: no extra call."""
        seen = self._looked_up.pop(rel, None)
        if seen is not None and trio.current_time() - seen[0] <= LOOKED_UP_S:
            return self._looked_up_open(rel, seen[1])
        else:
            bf = self.find_held(rel) if self.find_held is not None else None
            if bf is None or bf.fd < 0:
                return None
            try:
                st = await self.meta.run(self.tree.lstat, rel)
            except OSError:
                return None  # the open says why
            if Identity.of(key_path(self.tree.root, rel), st).key != bf.key:
                return None
        if bf is None or bf.fd < 0 or bf.stale:
            return None
        return bf

    def _looked_up_open(self, rel: bytes, st: os.stat_result) -> BackingFile | None:
        """An open backing file whose identity is ``st``, what the lookup just before this
        open found at ``rel`` (:meth:`_shared_open`), if the daemon holds one."""
        key = Identity.of(key_path(self.tree.root, rel), st).key
        bf = self.open_files.get(key)
        if (bf is None or bf.fd < 0) and self.find_open is not None:
            bf = self.find_open(key)
        if bf is None or bf.fd < 0 or bf.stale:
            return None
        return bf

    def release_backing(self, f: BackingFile) -> None:
        f.opens -= 1
        if f.opens == 0:
            # Nobody reads on: queued readahead of this file is waste (not a fill: Cache.fill)
            if f.key not in self.cache.filling:
                self.cache.scheduler.cancel_speculative(f.key)
            if self.open_files.get(f.key) is f:
                del self.open_files[f.key]
        f.release(self._close_backing)

    def _close_backing(self, fd: int) -> None:
        """Close a backing descriptor nothing uses any more. The last close of a file unlinked
        meanwhile frees its blocks in the closing thread: a thread's job (measured: a FORGET
        closing an unlinked file held for its reader blocked the event loop 43-47 ms, 3 ms of
        it on CPU); any other close is cheap and stays inline (an fstat tells them apart)."""
        try:
            st = os.fstat(fd)
            frees_blocks = st.st_nlink == 0 and st.st_blocks > 0
        except OSError:
            frees_blocks = False
        if not frees_blocks or self.nursery is None:
            os.close(fd)  # (an unlinked empty file, as `rm -rf` of a tree of them leaves: ~1 us)
            return
        # Batched: one thread hop for all the closes queued meanwhile. A hop per close (a task,
        # a worker thread, the wake-up back) was 11% of the loop's busy samples in `rm -rf`.
        self._to_close.append(fd)
        if not self._closing:
            self._closing = True
            tasks.spawn(self.nursery, "backing.close", self._close_queued)

    async def _close_queued(self) -> None:
        """Close the queued descriptors of unlinked files in the metadata device's threads
        until none is left; at cancellation (unmount) what is left is closed here."""
        try:
            while self._to_close:
                fds, self._to_close = self._to_close, []
                await trio.to_thread.run_sync(_close_all, fds, limiter=self.meta.limiter)
        finally:
            self._closing = False
            if self._to_close:
                fds, self._to_close = self._to_close, []
                _close_all(fds)

    def _keep_committed(self, entry: InodeEntry, rel: bytes, st: os.stat_result) -> None:
        """A kept entry (its name replaced while the kernel held it: :meth:`preserve`) whose
        dirty file was committed meanwhile, during the replacing rename's wait for that
        commit: its data file is released now, so the backing file it became is kept open
        instead (the entry's orphan), or a reader that resolved the name before the rename
        (from the kernel's entry cache, without waiting for the rename) got ENOENT at open.
        Synchronous (one open, rarely: only in that race)."""
        try:
            fd, got = open_backing(self.tree, rel)
        except OSError:
            return
        if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)  # replaced already: nothing left to keep
            return
        entry.orphan = self._share_open(rel, got, fd)
        entry.kept = False

    # -- callbacks (inode table, write-back) ---------------------------------------------------
    def on_forget(self, entry: InodeEntry) -> None:
        if entry.orphan is not None:
            self.release_backing(entry.orphan)
            entry.orphan = None
        if entry.kept and entry.dirty is not None and self.nursery is not None:
            entry.kept = False
            tasks.spawn(self.nursery, "writeback.unkeep", self.wb.unkeep, entry.dirty)

    def on_clean(self, df: DirtyFile, st: os.stat_result | None) -> None:
        entry = self.inodes.by_inode.get(df.inode)
        if entry is None or entry.dirty is not df:
            return
        if entry.path is None and entry.kept and st is not None and df.path is not None:
            self._keep_committed(entry, df.path, st)
        entry.dirty = None
        if st is not None and df.path is not None:
            self.inodes.rekey(entry, (st.st_dev, st.st_ino))
            old = entry.last_key
            entry.last_key = Identity.of(key_path(self.tree.root, df.path), st).key
            if old is not None and old != entry.last_key and self.nursery is not None:
                # the cached chunks of the content before this write are stale: free them now
                tasks.spawn(self.nursery, "cache.drop_file", self.cache.drop_file, old)


class DirListing:
    """One open directory's merged listing (backing entries, a dirty file in the place of the
    backing entry it shadows, then the dirty files the backing store does not have yet), read
    from the backing store :data:`READDIR_BATCH` entries at a time, so a directory of any size
    is listed holding at most ``READDIR_KEEP + READDIR_BATCH`` entries (plus its dirty-only
    files) rather than all of them. The order is the backing directory's own (not sorted).

    Offsets are ordinals: entry ``i`` (from 0) goes out with next offset ``i + 1``. The kernel
    asks again from the offset of the last entry its caller took; one inside the kept window
    (the last :data:`READDIR_KEEP` entries sent) or at its end continues; offset 0 starts a
    fresh listing (``rewinddir``: entries made since show); any other offset (``seekdir`` to
    an old position) reads the directory again from the start up to it.
    """

    def __init__(self, ns: Namespace, rel: bytes) -> None:
        self.ns = ns
        self.rel = rel
        self.it: DirScan | None = None
        self.window: deque[tuple[bytes, Any]] = deque()
        self.first = 0  # ordinal of window[0]
        self.phase = 0  # 0: backing entries, 1: dirty-only files, 2: the end
        # the directory's dirty files when the listing started, by name, less those the
        # backing scan has met since: what phase 1 lists (taken first, so a file whose
        # write-back commits during the scan is listed by one phase or the other)
        self.dirty: dict[bytes, DirtyFile] = {}
        self.dirty_only: list[tuple[bytes, DirtyFile]] = []
        self.started = False

    @property
    def held(self) -> int:
        """Entries this listing holds now (the bound the class docstring gives)."""
        return len(self.window) + len(self.dirty_only) + len(self.dirty)

    def _skip(self, name: bytes) -> bool:
        return is_tmp_name(name) or (not self.rel and name == CONTROL_NAME)

    def close(self) -> None:
        if self.it is not None:
            self.it.close()
            self.it = None
        self.window.clear()
        self.dirty = {}
        self.dirty_only = []

    async def seek(self, off: int) -> None:
        """Be ready to answer entries from ordinal ``off`` on."""
        if self.started and off != 0 and off >= self.first:
            return
        self.close()
        self.first, self.phase, self.started = 0, 0, True
        self.dirty = dict(self.ns.wb.children(self.rel))
        self.it = await self.ns.meta.run(self.ns.tree.scan, self.rel)

    def get(self, i: int) -> tuple[bytes, Any] | None:
        """Entry ``i`` if the window holds it (no await: the common case), else None."""
        k = i - self.first
        if 0 <= k < len(self.window) and k <= READDIR_KEEP:
            return self.window[k]
        return None

    async def entry(self, i: int) -> tuple[bytes, Any] | None:
        """Entry ``i`` (``i >= first``: after :meth:`seek`), or None past the end."""
        while i >= self.first + len(self.window):
            if not await self._more():
                return None
            while len(self.window) > READDIR_KEEP and self.first < i:
                self.window.popleft()
                self.first += 1
        while i - self.first > READDIR_KEEP:
            self.window.popleft()
            self.first += 1
        return self.window[i - self.first]

    def _child(self, name: bytes) -> bytes:
        return self.rel + b"/" + name if self.rel else name

    async def _more(self) -> bool:
        """Append the next batch to the window; False at the end."""
        while True:
            if self.phase == 0:
                assert self.it is not None
                batch = await self.ns.meta.run(read_batch, self.it, READDIR_BATCH, self._skip)
                if batch:
                    for name, st in batch:
                        df = self.ns.wb.get(self._child(name))
                        self.dirty.pop(name, None)
                        self.window.append((name, df if df is not None else st))  # dirty shadows
                    return True
                self.it.close()
                self.it = None
                self.phase = 1
                # the dirty files the scan did not meet (written back since, they are
                # listed all the same: listed_attrs then answers for the backing file)
                self.dirty_only = sorted(self.dirty.items(), key=lambda x: x[0])
                self.dirty = {}
            elif self.phase == 1 and self.dirty_only:
                self.window.extend(self.dirty_only[:READDIR_BATCH])
                del self.dirty_only[:READDIR_BATCH]
                return True
            else:
                self.phase = 2
                return False

