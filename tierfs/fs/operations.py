"""pyfuse3 ``Operations``: decode arguments, call collaborators, map errors. Nothing else.

This is the only place where tierfs errors and OSErrors become errnos (``FUSEError``): pyfuse3
lets no other exception leave a handler.

The mount shows the backing tree with the dirty files of :class:`~tierfs.writeback.manager.
WriteBack` laid over it: a path with a dirty file shows the dirty file. Namespace operations on
clean objects (mkdir, rename, unlink, chmod, ...) are applied to the backing store at once (they
are metadata; no partial file can appear); file *data* is written to the write tier and written
back later.

Kernel caching, chosen for correctness first:
* regular files: ``entry_timeout=0`` so every path resolution (every ``open``) asks the daemon,
  which re-stats the backing file; a change made behind tierfs' back is therefore seen by the
  next open. ``attr_timeout`` = the configured value for ``fstat`` on an open file.
* directories: both timeouts = the configured value (path walks stay cheap).
* ``keep_cache`` is set on open unless the backing file's identity changed since the last open,
  so the page cache survives across opens of unchanged files; ``direct_io`` is never set on data
  files (it breaks shared mmap: numpy, lmdb, safetensors; design brief).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pyfuse3
import trio

from tierfs import logevents
from tierfs.access import caller_of
from tierfs.backing_tree import BackingTree, proc_path, split
from tierfs.cache.manager import AccessState, Cache
from tierfs.errors import TierfsError
from tierfs.fs.control import ControlPlane
from tierfs.fs.handles import ControlHandle, DirHandle, FileHandle, HandleTable
from tierfs.fs.inodes import CONTROL_DIR, ROOT, InodeEntry, InodeTable
from tierfs.io import Device, open_backing
from tierfs.predict.readahead import Readahead
from tierfs.sched.backing import BackingFile, Identity, key_path
from tierfs.writeback.manager import DirtyFile, WriteBack, is_tmp_name
from tierfs_hints import wire

log = logging.getLogger("tierfs.fs")
CONTROL_NAME = wire.CONTROL_DIR.encode()
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR


@contextmanager
def fuse_errors(what: str) -> Iterator[None]:
    """Map typed tierfs errors and OSErrors to FUSEError (the FUSE boundary)."""
    try:
        yield
    except pyfuse3.FUSEError:
        raise
    except TierfsError as e:
        log.debug("%s: %s", what, e)
        raise pyfuse3.FUSEError(e.errno) from None
    except OSError as e:
        raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
    except KeyError:
        raise pyfuse3.FUSEError(errno.ENOENT) from None
    except trio.Cancelled:
        raise
    except Exception:
        # A bug must cost one request, never the daemon (and every user of the mount).
        log.exception("%s: unexpected error; answering EIO", what)
        raise pyfuse3.FUSEError(errno.EIO) from None


@contextmanager
def logged_errors(what: str) -> Iterator[None]:
    """For the handlers that cannot answer an error (release, releasedir, forget): log and
    swallow it, since any exception but FUSEError leaving a handler ends pyfuse3's main loop."""
    try:
        yield
    except trio.Cancelled:
        raise
    except Exception:
        log.exception("%s: unexpected error (ignored: the kernel takes no reply)", what)


def _lstat_or_none(tree: BackingTree, rel: bytes) -> os.stat_result | None:
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


def _new_owner_gid(tree: BackingTree, parent: bytes, gid: int) -> int:
    """The group of a new object in ``parent``: the directory's own if it is setgid (as a
    local filesystem does), else the caller's ``gid``. Resolving the parent also refuses a
    directory swapped for a symlink (ELOOP) before anything is created under it."""
    pst = tree.lstat(parent)
    if not stat.S_ISDIR(pst.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory")
    return pst.st_gid if pst.st_mode & stat.S_ISGID else gid


class Operations(pyfuse3.Operations):
    """Args:
        tree: the backing tree; every backing-store access goes through it (never a path
        string). inodes: the inode table. cache: reads of clean files. writeback: dirty files.
        readahead: per-handle prediction. control: ``.tierfs`` files. meta: device for
        backing-store metadata calls (stat, readdir, open, rename, ...), separate from the
        scheduler's data I/O. attr_timeout: seconds.
    """

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self, *, tree: BackingTree, inodes: InodeTable, cache: Cache, writeback: WriteBack, readahead: Readahead,
        control: ControlPlane, meta: Device, attr_timeout: float,
        nursery: trio.Nursery | None = None,
        on_open_read: Callable[[int, bytes], None] | None = None,
        on_read_end: Callable[[int, bytes], None] | None = None,
    ) -> None:
        """``on_open_read(pid, path)``: a process opened a file for reading;
        ``on_read_end(pid, path)``: its readahead reached the file's last chunk (both for
        next-file prediction; they must not block)."""
        super().__init__()
        self.tree = tree
        self.inodes = inodes
        self.handles = HandleTable()
        self.cache = cache
        self.wb = writeback
        self.readahead = readahead
        self.control = control
        self.meta = meta
        self.attr_timeout = attr_timeout
        self.open_files: dict[str, BackingFile] = {}
        self.nursery = nursery
        self.on_open_read = on_open_read
        self.on_read_end = on_read_end
        self.reads = 0  # FUSE read requests of data files
        self.read_bytes = 0
        self.max_read = 0
        self.writes = 0
        self.write_bytes = 0
        self._dirty_locks: dict[int, trio.Lock] = {}
        writeback.on_clean = self._on_clean
        inodes.on_forget = self._on_forget

    # -- attributes ------------------------------------------------------------------------
    def _attrs(self, inode: int, st: os.stat_result, *, nlink: int | None = None) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.generation = 0
        is_dir = stat.S_ISDIR(st.st_mode)
        a.entry_timeout = self.attr_timeout if is_dir else 0
        a.attr_timeout = self.attr_timeout
        a.st_mode = st.st_mode
        a.st_nlink = st.st_nlink if nlink is None else nlink
        a.st_uid = st.st_uid
        a.st_gid = st.st_gid
        a.st_rdev = st.st_rdev
        a.st_size = st.st_size
        a.st_blksize = st.st_blksize
        a.st_blocks = st.st_blocks
        a.st_atime_ns = st.st_atime_ns
        a.st_mtime_ns = st.st_mtime_ns
        a.st_ctime_ns = st.st_ctime_ns
        return a

    async def _dirty_attrs(self, entry: InodeEntry, df: DirtyFile) -> pyfuse3.EntryAttributes:
        nlink = 1 if df.path is not None else 0
        if df.in_place and df.path is not None:
            # hard-linked: the names are links of the backing inode it is written back into
            try:
                st = await self.meta.run(_lstat_or_none, self.tree, df.path)
            except OSError:
                st = None
            if st is not None and stat.S_ISREG(st.st_mode):
                nlink = st.st_nlink
        return self._attrs(entry.inode, await self.wb.stat(df), nlink=nlink)

    def _control_attrs(self, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        if inode == CONTROL_DIR:
            a.st_mode = stat.S_IFDIR | 0o555
            a.st_nlink = 2
        else:
            cf = self.control.by_inode[inode]
            a.st_mode = stat.S_IFREG | (0o666 if cf.command else 0o444)
            a.st_nlink = 1
        a.st_uid = os.getuid()
        a.st_gid = os.getgid()
        a.entry_timeout = self.attr_timeout
        a.attr_timeout = self.attr_timeout
        return a

    def _is_control(self, inode: int) -> bool:
        return inode == CONTROL_DIR or inode in self.control.by_inode

    def _held_fd(self, entry: InodeEntry) -> int | None:
        """A descriptor of what the entry's open handles read, if one is open: its attributes are
        that file's, whatever the name now names. First a dirty file's descriptor a handle
        reads (a file opened while dirty keeps reading its data file after its write-back, until
        closed: with the name unlinked, nothing else answers for it), then the copy of the
        backing file kept for an unlinked name, then a handle's backing file."""
        backing = None
        for h in self.handles.handles.values():
            if not isinstance(h, FileHandle) or h.inode != entry.inode:
                continue
            if h.dirty is not None and h.dirty.fd >= 0:
                return int(h.dirty.fd)
            if backing is None and h.file is not None and h.file.fd >= 0:
                backing = int(h.file.fd)
        if entry.orphan is not None and entry.orphan.fd >= 0:
            return int(entry.orphan.fd)
        return backing

    async def _lstat(self, entry: InodeEntry) -> os.stat_result:
        if entry.path is None:  # unlinked but open: its descriptor knows
            fd = self._held_fd(entry)
            if fd is None:
                raise FileNotFoundError(2, "unlinked")
            return os.fstat(fd)
        try:
            st = await self.meta.run(_lstat_or_none, self.tree, entry.path)
        except OSError as e:
            if e.errno not in (errno.ENOTDIR, errno.ELOOP, errno.EXDEV):
                raise
            st = None  # a directory on the way was swapped for a file or a symlink
        if st is not None and (st.st_dev, st.st_ino) == entry.dev_ino:
            return st
        # The name no longer names this entry's object (replaced or removed behind tierfs'
        # back): an open descriptor still serves the old file, as ext4 does.
        fd = self._held_fd(entry)
        if fd is not None:
            return os.fstat(fd)
        if st is None or (stat.S_ISLNK(st.st_mode) and entry.dev_ino[0] >= 0):
            # gone, or a symlink now where another object was: never show the link's
            # attributes for the held inode (the kernel would take it for a type change)
            raise FileNotFoundError(errno.ENOENT, "gone from the backing store")
        return st

    async def _entry_attrs(self, entry: InodeEntry) -> pyfuse3.EntryAttributes:
        if entry.dirty is not None:
            return await self._dirty_attrs(entry, entry.dirty)
        st = await self._lstat(entry)
        held_dirty = entry.path is None and any(
            isinstance(h, FileHandle) and h.inode == entry.inode and h.dirty is not None
            for h in self.handles.handles.values())
        # unlinked but open, answered by a data file: its link is the tier's, no name links it
        return self._attrs(entry.inode, st, nlink=0 if held_dirty else None)

    async def _lookup_path(self, path: bytes) -> pyfuse3.EntryAttributes:
        """Resolve a path of the merged view; one lookup is added to the inode returned."""
        df = self.wb.get(path)
        if df is not None:
            entry = self.inodes.remember_dirty(path, df)
            return await self._dirty_attrs(entry, df)
        st = await self.meta.run(self.tree.lstat, path)
        entry = self.inodes.remember(path, st)
        if entry.dirty is not None and entry.dirty.state.value == "clean":
            entry.dirty = None
        if entry.dirty is not None:  # another hard link of a file being written
            return await self._dirty_attrs(entry, entry.dirty)
        return self._attrs(entry.inode, st)

    async def _exists(self, path: bytes) -> os.stat_result | DirtyFile | None:
        df = self.wb.get(path)
        if df is not None:
            return df
        return await self.meta.run(_lstat_or_none, self.tree, path)

    # -- namespace: reading ------------------------------------------------------------------
    async def lookup(self, parent_inode, name, ctx=None):  # type: ignore[no-untyped-def,override]
        with fuse_errors("lookup"):
            if parent_inode == CONTROL_DIR:
                cf = self.control.by_name.get(name)
                if cf is None:
                    raise pyfuse3.FUSEError(errno.ENOENT)
                return self._control_attrs(cf.inode)
            if parent_inode == ROOT and name == CONTROL_NAME:
                return self._control_attrs(CONTROL_DIR)
            if is_tmp_name(name):
                raise pyfuse3.FUSEError(errno.ENOENT)
            parent = self.inodes.get(parent_inode)
            if name == b".":
                entry = parent
                st = await self._lstat(entry)
                entry.lookups += 1
                return self._attrs(entry.inode, st)
            if name == b"..":
                assert parent.path is not None
                rel = os.path.dirname(parent.path)
                st = await self.meta.run(self.tree.lstat, rel)
                entry = self.inodes.remember(rel, st) if rel else self.inodes.get(ROOT)
                if not rel:
                    entry.lookups += 1
                return self._attrs(entry.inode, st)
            return await self._lookup_path(self.inodes.child_path(parent, name))

    async def forget(self, inode_list):  # type: ignore[no-untyped-def,override]
        for inode, n in inode_list:
            with logged_errors("forget"):  # one bad inode must not leak the others' lookups
                self.inodes.forget(inode, n)

    async def getattr(self, inode, ctx=None):  # type: ignore[no-untyped-def,override]
        with fuse_errors("getattr"):
            if self._is_control(inode):
                return self._control_attrs(inode)
            return await self._entry_attrs(self.inodes.get(inode))

    async def readlink(self, inode, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("readlink"):
            entry = self.inodes.get(inode)
            return await self.meta.run(self.tree.readlink, self.inodes.rel(entry))

    async def statfs(self, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("statfs"):
            sv = await self.meta.run(self.tree.statvfs)
            out = pyfuse3.StatvfsData()
            for attr in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                         "f_ffree", "f_favail", "f_namemax"):
                setattr(out, attr, getattr(sv, attr))
            return out

    async def access(self, inode, mode, ctx):  # type: ignore[no-untyped-def,override]
        return True  # default_permissions: the kernel checks modes

    # -- xattrs ----------------------------------------------------------------------------
    async def getxattr(self, inode, name, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("getxattr"):
            if self._is_control(inode):
                raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
            entry = self.inodes.get(inode)
            if entry.dirty is not None:
                return await self.wb.xattr(entry.dirty, lambda fd: os.getxattr(fd, name))
            return await self.meta.run(self.tree.getxattr, self.inodes.rel(entry), name)

    async def listxattr(self, inode, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("listxattr"):
            if self._is_control(inode):
                return []
            entry = self.inodes.get(inode)
            if entry.dirty is not None:
                names = await self.wb.xattr(entry.dirty, os.listxattr)
            else:
                names = await self.meta.run(self.tree.listxattr, self.inodes.rel(entry))
            return [n.encode("utf-8", "surrogateescape") for n in names]  # type: ignore[union-attr]

    async def setxattr(self, inode, name, value, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("setxattr"):
            if self._is_control(inode):
                raise pyfuse3.FUSEError(errno.EPERM)
            entry = self.inodes.get(inode)
            if entry.dirty is not None:
                entry.dirty.touch()
                await self.wb.xattr(entry.dirty, lambda fd: os.setxattr(fd, name, value))
                return
            await self.meta.run(self.tree.setxattr, self.inodes.rel(entry), name, value)

    async def removexattr(self, inode, name, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("removexattr"):
            if self._is_control(inode):
                raise pyfuse3.FUSEError(errno.EPERM)
            entry = self.inodes.get(inode)
            if entry.dirty is not None:
                entry.dirty.touch()
                await self.wb.xattr(entry.dirty, lambda fd: os.removexattr(fd, name))
                return
            await self.meta.run(self.tree.removexattr, self.inodes.rel(entry), name)

    # -- directories -----------------------------------------------------------------------
    async def opendir(self, inode, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("opendir"):
            if inode == CONTROL_DIR:
                return self.handles.add(DirHandle(inode, []))
            entry = self.inodes.get(inode)
            self.inodes.rel(entry)  # ENOENT for a removed directory
            return self.handles.add(DirHandle(inode, []))

    async def _listing(self, entry: InodeEntry) -> list[tuple[bytes, Any]]:
        """The merged directory listing (backing entries, dirty files shadowing them)."""
        rel = self.inodes.rel(entry)
        listing: dict[bytes, Any] = dict(await self.meta.run(self.tree.scandir, rel, is_tmp_name))
        for name, df in self.wb.children(rel):
            listing[name] = df  # a dirty file shadows the backing one
        if entry.inode == ROOT:
            listing.pop(CONTROL_NAME, None)
        return sorted(listing.items())

    async def readdir(self, fh, start_id, token):  # type: ignore[no-untyped-def,override]
        with fuse_errors("readdir"):
            h = self.handles.get(fh)
            assert isinstance(h, DirHandle)
            if h.inode == CONTROL_DIR:
                files = sorted(self.control.by_name.values(), key=lambda c: c.name)
                for i in range(start_id, len(files)):
                    cf = files[i]
                    if not pyfuse3.readdir_reply(token, cf.name, self._control_attrs(cf.inode), i + 1):
                        return
                return
            parent = self.inodes.get(h.inode)
            if start_id == 0:
                # listed when read from the start (first read, rewinddir), not at open: entries
                # made after the open show, as on a local filesystem
                h.entries = await self._listing(parent)
            for i in range(start_id, len(h.entries)):
                name, obj = h.entries[i]
                path = self.inodes.child_path(parent, name)
                if isinstance(obj, DirtyFile) and obj.path != path:
                    continue  # renamed or unlinked since opendir
                if isinstance(obj, DirtyFile) and obj.state.value == "clean":
                    # written back since opendir: the backing file is the entry now
                    obj = await self.meta.run(_lstat_or_none, self.tree, path)
                    if obj is None:
                        continue
                if isinstance(obj, DirtyFile):
                    entry = self.inodes.remember_dirty(path, obj)
                    attrs = await self._dirty_attrs(entry, obj)
                else:
                    entry = self.inodes.remember(path, obj)
                    attrs = self._attrs(entry.inode, obj)
                entry.lookups -= 1  # counted only if the kernel takes the entry
                if not pyfuse3.readdir_reply(token, name, attrs, i + 1):
                    self.inodes.forget(entry.inode, 0)
                    return
                entry.lookups += 1

    async def releasedir(self, fh):  # type: ignore[no-untyped-def,override]
        with logged_errors("releasedir"):
            self.handles.pop(fh)

    async def fsyncdir(self, fh, datasync):  # type: ignore[no-untyped-def,override]
        with fuse_errors("fsyncdir"):
            h = self.handles.get(fh)
            if isinstance(h, DirHandle) and h.inode != CONTROL_DIR:
                await self.meta.run(self.tree.fsync_dir, self.inodes.rel(self.inodes.get(h.inode)))

    async def mkdir(self, parent_inode, name, mode, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("mkdir"):
            path = self._new_child(parent_inode, name)
            if self.wb.get(path) is not None:
                raise pyfuse3.FUSEError(errno.EEXIST)
            await self.meta.run(self.tree.make_node, path, stat.S_IFDIR | (mode & 0o7777), ctx.uid, ctx.gid)
            return await self._lookup_path(path)

    async def mknod(self, parent_inode, name, mode, rdev, ctx):  # type: ignore[no-untyped-def,override]
        """A fifo, socket (``bind()`` of a Unix socket), empty regular file or, for root,
        a character or block device; owned by the caller, setgid directories honoured."""
        with fuse_errors("mknod"):
            path = self._new_child(parent_inode, name)
            kind = stat.S_IFMT(mode)
            if kind not in (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFREG, stat.S_IFCHR, stat.S_IFBLK):
                raise pyfuse3.FUSEError(errno.EINVAL)
            if kind in (stat.S_IFCHR, stat.S_IFBLK) and ctx.uid != 0:
                raise pyfuse3.FUSEError(errno.EPERM)  # the kernel checks CAP_MKNOD too
            if await self._exists(path) is not None:
                raise pyfuse3.FUSEError(errno.EEXIST)
            await self.meta.run(self.tree.make_node, path, kind | (mode & 0o7777), ctx.uid, ctx.gid, rdev)
            return await self._lookup_path(path)

    async def rmdir(self, parent_inode, name, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("rmdir"):
            path = self._new_child(parent_inode, name)
            if self.wb.get(path) is not None:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            if self.wb.has_children(path):
                raise pyfuse3.FUSEError(errno.ENOTEMPTY)
            await self.wb.settle_dir(path)
            await self.meta.run(_rmdir_with_orphans, self.tree, path)
            self.inodes.detach(path)

    def _new_child(self, parent_inode: int, name: bytes) -> bytes:
        if parent_inode == CONTROL_DIR or (parent_inode == ROOT and name == CONTROL_NAME):
            raise pyfuse3.FUSEError(errno.EPERM)
        if is_tmp_name(name):
            raise pyfuse3.FUSEError(errno.EINVAL)  # names tierfs reserves for write-back
        return self.inodes.child_path(self.inodes.get(parent_inode), name)

    async def symlink(self, parent_inode, name, target, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("symlink"):
            path = self._new_child(parent_inode, name)
            if self.wb.get(path) is not None:
                raise pyfuse3.FUSEError(errno.EEXIST)
            await self.meta.run(self.tree.make_symlink, target, path, ctx.uid, ctx.gid)
            return await self._lookup_path(path)

    async def link(self, inode, new_parent_inode, new_name, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("link"):
            entry = self.inodes.get(inode)
            new_path = self._new_child(new_parent_inode, new_name)
            if await self._exists(new_path) is not None:
                raise pyfuse3.FUSEError(errno.EEXIST)
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
            return await self._lookup_path(new_path)

    async def _preserve(self, path: bytes) -> None:
        """Before ``path`` is unlinked or renamed over: an inode the kernel still holds for it
        (a process looked the name up and may open it next, e.g. a reader racing ``os.replace``)
        stays openable with its old content until the kernel forgets it, as on a local fs: a
        clean file through a held backing fd, a dirty one by keeping its data file."""
        for entry in self.inodes.at_path(path):
            df = entry.dirty
            if df is not None and df.state.value != "clean":
                if not getattr(entry, "kept", False):
                    df.keep += 1
                    entry.kept = True  # type: ignore[attr-defined]
            elif entry.orphan is None:
                st = await self.meta.run(_lstat_or_none, self.tree, path)
                if st is not None and stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == entry.dev_ino:
                    bf = await self._backing_file(path)
                    if (bf.identity.dev, bf.identity.ino) == entry.dev_ino:
                        entry.orphan = bf
                    else:  # replaced between the lstat and the open (a write-back committed)
                        self._release_backing(bf)

    def _on_forget(self, entry: InodeEntry) -> None:
        if entry.orphan is not None:
            self._release_backing(entry.orphan)
            entry.orphan = None
        if getattr(entry, "kept", False) and entry.dirty is not None and self.nursery is not None:
            entry.kept = False  # type: ignore[attr-defined]
            self.nursery.start_soon(self.wb.unkeep, entry.dirty)

    async def unlink(self, parent_inode, name, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("unlink"):
            path = self._new_child(parent_inode, name)
            await self._preserve(path)
            df = self.wb.get(path)
            if df is not None:
                await self.wb.unlink(df)
            # stat the backing store only now: a write-back may have just put the file there
            st = await self.meta.run(_lstat_or_none, self.tree, path)
            if df is None and st is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            if st is not None and stat.S_ISDIR(st.st_mode) and df is None:
                raise pyfuse3.FUSEError(errno.EISDIR)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                await self.meta.run(self.tree.unlink, path)
            else:  # only the write tier had it: the directory changed all the same
                await self.meta.run(self.tree.touch, split(path)[0])
            self.inodes.detach(path)

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("rename"):
            if flags & pyfuse3.RENAME_EXCHANGE:
                raise pyfuse3.FUSEError(errno.EINVAL)
            old = self._new_child(parent_inode_old, name_old)
            new = self._new_child(parent_inode_new, name_new)
            if old == new:
                return
            src = await self._exists(old)
            if src is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            target = await self._exists(new)
            if target is not None and flags & pyfuse3.RENAME_NOREPLACE:
                raise pyfuse3.FUSEError(errno.EEXIST)
            src_is_dir = isinstance(src, os.stat_result) and stat.S_ISDIR(src.st_mode)
            if isinstance(target, os.stat_result) and stat.S_ISDIR(target.st_mode) and not src_is_dir:
                raise pyfuse3.FUSEError(errno.EISDIR)
            if isinstance(target, DirtyFile) and src_is_dir:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            if src_is_dir and self.wb.has_children(new):
                raise pyfuse3.FUSEError(errno.ENOTEMPTY)  # the target dir holds unwritten files
            await self._preserve(new)
            # The target's inodes are detached before the rename (a lookup during its await
            # must not hand out the old target) and reattached if the backing store refuses
            # it (ENOTEMPTY, EISDIR, ...): the target stays as it was, usable.
            replaced = self.inodes.naming(new)
            self.inodes.detach(new)
            moved = False
            if isinstance(src, DirtyFile):
                moved = await self.wb.rename(src, new)
                if moved:
                    # an older version under the old name must not reappear there (stat only
                    # now: the dirty file itself is no longer at `old`)
                    shadowed = await self.meta.run(_lstat_or_none, self.tree, old)
                    if shadowed is not None and not stat.S_ISDIR(shadowed.st_mode):
                        await self.meta.run(self.tree.unlink, old)
                    for d in {split(old)[0], split(new)[0]}:  # both directories changed now
                        await self.meta.run(self.tree.touch, d)
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
            self.inodes.rename(old, new)

    # -- attributes (setattr) ----------------------------------------------------------------
    async def setattr(self, inode, attr, fields, fh, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("setattr"):
            if self._is_control(inode):
                raise pyfuse3.FUSEError(errno.EPERM)
            entry = self.inodes.get(inode)
            if fields.update_size:
                df = await self._make_dirty(entry, truncate=attr.st_size == 0)
                await self.wb.truncate(df, attr.st_size)
            mode = attr.st_mode if fields.update_mode else None
            uid = attr.st_uid if fields.update_uid else None
            gid = attr.st_gid if fields.update_gid else None
            times = None
            if fields.update_atime or fields.update_mtime:
                cur = await self._entry_attrs(entry)
                times = (attr.st_atime_ns if fields.update_atime else cur.st_atime_ns,
                         attr.st_mtime_ns if fields.update_mtime else cur.st_mtime_ns)
            if mode is not None or uid is not None or gid is not None or times is not None:
                if entry.dirty is not None:
                    await self.wb.set_attrs(entry.dirty, mode=mode, uid=uid, gid=gid, times=times)
                else:
                    await self.meta.run(_setattr_backing, self.tree, self.inodes.rel(entry),
                                        mode, uid, gid, times)
            return await self._entry_attrs(entry)

    # -- files -----------------------------------------------------------------------------
    async def _make_dirty(self, entry: InodeEntry, *, truncate: bool) -> DirtyFile:
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
            raise pyfuse3.FUSEError(errno.ENOENT)
        st = await self.meta.run(self.tree.lstat, path)
        if not stat.S_ISREG(st.st_mode):
            raise pyfuse3.FUSEError(errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL)
        if truncate or st.st_size == 0:
            df = await self.wb.create(path, st.st_mode, st.st_uid, st.st_gid)
            if st.st_nlink > 1:
                self.wb.set_in_place(df, st)
        else:
            bf = await self._backing_file(path)
            access = AccessState()
            try:
                # xattrs are read through the open descriptor (/proc/self/fd/N), not a path
                df = await self.wb.copy_up(
                    path, st, lambda off, n: self.cache.read(bf, off, n, access), proc_path(bf.fd))
            finally:
                self.cache.forget_access(access)
                self._release_backing(bf)
            if st.st_nlink > 1:
                self.wb.set_in_place(df, st)
        self.inodes.attach(entry, df)
        return df

    async def _backing_file(self, rel: bytes) -> BackingFile:
        fd, st = await self.meta.run(open_backing, self.tree, rel)
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

    def _release_backing(self, f: BackingFile) -> None:
        f.opens -= 1
        if f.opens == 0:
            # Nobody reads on: queued readahead of this file is waste.
            self.cache.scheduler.cancel_speculative(f.key)
            if self.open_files.get(f.key) is f:
                del self.open_files[f.key]
        f.release()

    async def open(self, inode, flags, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("open"):
            if inode in self.control.by_inode:
                cf = self.control.by_inode[inode]
                data = b"" if cf.command else cf.render(ctx.uid)
                # A write carries no request context: a command acts with the opener's
                # credentials, taken now (tierfs.access; one procfs read, ~20 us)
                caller = caller_of(ctx.uid, ctx.gid, ctx.pid) if cf.command else None
                h = ControlHandle(data, name=cf.name, caller=caller)
                return pyfuse3.FileInfo(fh=self.handles.add(h), direct_io=True)
            entry = self.inodes.get(inode)
            writer = bool(flags & _WRITE_FLAGS)
            if entry.path is None:
                return self._open_unlinked(entry, writer or bool(flags & os.O_TRUNC))
            h = FileHandle(inode, writer=writer, append=bool(flags & os.O_APPEND), pid=ctx.pid)
            if not writer and self.on_open_read is not None:
                self.on_open_read(ctx.pid, entry.path)
            if flags & os.O_TRUNC:
                df = await self._make_dirty(entry, truncate=True)
                if df.size:
                    await self.wb.truncate(df, 0)
            # Opened for writing but not truncated: the file becomes dirty at its first write,
            # not here. sqlite opens every database O_RDWR, fio's verify pass and np.memmap r+
            # too: an eager copy-up copied and wrote back whole files nobody changed.
            df = entry.dirty if entry.dirty is not None and entry.dirty.state.value != "clean" else None
            if df is not None:
                h.dirty = df
                self.wb.opened(df, writer)
                return pyfuse3.FileInfo(fh=self.handles.add(h), keep_cache=True, direct_io=False)
            bf = await self._backing_file(self.inodes.rel(entry))
            h.file = bf
            key = bf.key
            changed = entry.last_key is not None and entry.last_key != key
            if changed:
                old = entry.last_key
                # throttled: the owner of a backing directory can change a file and open it
                # again in a loop, and one line each grew the log (in /run) without bound
                logevents.event(log, logging.INFO, "backing-changed",
                                "backing file changed: %s; dropping its cached chunks", logevents.user_text(bf.path))
                if self.nursery is not None and old is not None:
                    self.nursery.start_soon(self.cache.drop_file, old)
            entry.last_key = key
            return pyfuse3.FileInfo(fh=self.handles.add(h), keep_cache=not changed, direct_io=False)

    def _open_unlinked(self, entry: InodeEntry, writer: bool) -> pyfuse3.FileInfo:
        """Open of an inode whose name was unlinked or replaced after the kernel looked it up:
        the old content, kept by :meth:`_preserve` (reading only)."""
        if writer:
            raise pyfuse3.FUSEError(errno.ESTALE)
        h = FileHandle(entry.inode)
        if entry.dirty is not None and entry.dirty.fd >= 0:
            h.dirty = entry.dirty
            self.wb.opened(entry.dirty, False)
        elif entry.orphan is not None:
            h.file = entry.orphan
            entry.orphan.acquire()
            entry.orphan.opens += 1
        else:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return pyfuse3.FileInfo(fh=self.handles.add(h), keep_cache=True, direct_io=False)

    async def create(self, parent_inode, name, mode, flags, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("create"):
            path = self._new_child(parent_inode, name)
            existing = await self._exists(path)
            if existing is not None and flags & os.O_EXCL:
                raise pyfuse3.FUSEError(errno.EEXIST)
            # the parent is resolved beneath the backing root first (a directory swapped for a
            # symlink is refused here) and gives the group of the new file if it is setgid
            gid = await self.meta.run(_new_owner_gid, self.tree, split(path)[0], ctx.gid)
            df = await self.wb.create(path, stat.S_IFREG | (mode & 0o7777), ctx.uid, gid)
            if isinstance(existing, os.stat_result):
                self.inodes.detach(path)
            elif existing is None:
                # a new name: the directory changed now, not at write-back (POSIX; pjdfstest
                # open/00.t), and write-back keeps the directory's times as they are then
                await self.meta.run(self.tree.touch, split(path)[0])
            entry = self.inodes.remember_dirty(path, df)
            h = FileHandle(entry.inode, dirty=df, writer=True, append=bool(flags & os.O_APPEND))
            self.wb.opened(df, True)
            fi = pyfuse3.FileInfo(fh=self.handles.add(h), keep_cache=True, direct_io=False)
            return fi, await self._dirty_attrs(entry, df)

    async def read(self, fh, off, size):  # type: ignore[no-untyped-def,override]
        with fuse_errors("read"):
            h = self.handles.get(fh)
            if isinstance(h, ControlHandle):
                if h.answered is not None:
                    await h.answered.wait()
                return h.data[off : off + size]
            assert isinstance(h, FileHandle)
            self.reads += 1
            self.read_bytes += size
            self.max_read = max(self.max_read, size)
            entry = self.inodes.by_inode.get(h.inode)
            df = entry.dirty if entry is not None and entry.dirty is not None else h.dirty
            if df is not None and (df.state.value != "clean" or df is h.dirty):
                return await self.wb.read(df, off, size)
            f = h.file
            if f is None or (entry is not None and entry.last_key not in (None, f.key)):
                # opened while dirty (or the file was written back since): read the backing file
                if entry is None or entry.path is None:
                    raise pyfuse3.FUSEError(errno.ESTALE)
                if f is not None:
                    self._release_backing(f)
                f = h.file = await self._backing_file(self.inodes.rel(entry))
                entry.last_key = f.key
            if off >= f.size:
                return b""
            # Queue readahead first: the scheduler then coalesces the demand fetch below with
            # the following chunks into one long transfer.
            ahead = self.readahead.on_read(h.readahead, off, min(size, f.size - off), f.size)
            h.access.random = h.readahead.window == 0
            if ahead:
                self.cache.prefetch(f, ahead)
            if self.on_read_end is not None and entry is not None and entry.path is not None and (
                    (ahead and ahead[-1] == (f.size - 1) // self.cache.chunk_size)
                    or (off == 0 and f.size <= self.cache.chunk_size)):  # a one-chunk file: at once
                self.on_read_end(h.pid, entry.path)
            return await self.cache.read(f, off, size, h.access)

    async def write(self, fh, off, buf):  # type: ignore[no-untyped-def,override]
        with fuse_errors("write"):
            h = self.handles.get(fh)
            if isinstance(h, ControlHandle):
                return await self._control_write(h, buf)
            assert isinstance(h, FileHandle)
            if not h.writer:
                raise pyfuse3.FUSEError(errno.EBADF)
            df = h.dirty
            if df is None or df.state.value == "clean":
                # the first write through this handle: now the file becomes dirty
                df = await self._make_dirty(self.inodes.get(h.inode), truncate=False)
                if h.dirty is not None:
                    await self.wb.closed(h.dirty, True)
                h.dirty = df
                self.wb.opened(df, True)
            if h.append:
                off = df.size
            self.writes += 1
            self.write_bytes += len(buf)
            return await self.wb.write(df, off, buf)

    async def flush(self, fh):  # type: ignore[no-untyped-def,override]
        return None

    async def fsync(self, fh, datasync):  # type: ignore[no-untyped-def,override]
        with fuse_errors("fsync"):
            h = self.handles.get(fh)
            if isinstance(h, FileHandle) and h.dirty is not None and h.dirty.state.value != "clean":
                await self.wb.fsync(h.dirty)

    async def release(self, fh):  # type: ignore[no-untyped-def,override]
        with logged_errors("release"):  # the kernel ignores release's answer
            h = self.handles.pop(fh)
            if isinstance(h, ControlHandle):
                if h.caller is not None:  # a request never finished, a reply held
                    self.control.unhold(h.caller.uid, len(h.request) + h.held)
                    h.held = 0
                h.closed = True
                h.request = bytearray()
            if isinstance(h, FileHandle):
                self.readahead.forget(h.readahead)
                self.cache.forget_access(h.access)
                if h.file is not None:
                    self._release_backing(h.file)
                if h.dirty is not None:
                    await self.wb.closed(h.dirty, h.writer)

    # -- control commands --------------------------------------------------------------------
    async def _control_write(self, h: ControlHandle, buf: bytes) -> int:
        cf = self.control.by_name[h.name]
        if cf.command is None or h.caller is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        if h.overflow:
            # the rest of a request that went over its cap: dropped up to its newline
            h.overflow = b"\n" not in buf
            raise pyfuse3.FUSEError(errno.EFBIG)
        if h.answered is not None and not h.answered.is_set():
            raise pyfuse3.FUSEError(errno.EBUSY)  # one request at a time per descriptor
        n = len(buf)
        uid = h.caller.uid
        error = None
        if len(h.request) + n > wire.MAX_REQUEST_BYTES:
            error = (f"request line longer than MAX_REQUEST_BYTES ({wire.MAX_REQUEST_BYTES} bytes); "
                     "send fewer paths per request")
        else:
            # bounded per user too (MAX_USER_PENDING_BYTES): one user's unfinished requests
            # must not lock everyone else out
            error = self.control.hold(uid, n)
        if error is not None:
            # Cut off here, not at the newline: a request line used to grow without limit
            # (2.25 GiB of daemon memory, never returned). The reply names the cap.
            self.control.unhold(uid, len(h.request) + h.held)
            h.held = 0
            h.request = bytearray()
            h.overflow = not buf.endswith(b"\n")
            h.data = json.dumps({"ok": False, "kind": "value", "error": error}).encode() + b"\n"
            h.answered = None
            logevents.event(log, logging.INFO, f"ctl-refused:{h.caller.uid}",
                            "control request of uid %d (pid %d) refused: %s", h.caller.uid, h.caller.pid, error)
            raise pyfuse3.FUSEError(errno.EFBIG)
        h.request += buf
        if h.request.endswith(b"\n"):
            # The write returns at once and the reply is read back when ready: the kernel holds
            # the file's inode lock during a FUSE write, so a command answered inside the write
            # (a 10 s "wait") would hold up every other client's request behind it.
            request, h.request = h.request, bytearray()  # handed over, not copied
            size = len(request)
            answered = h.answered = trio.Event()
            caller = h.caller
            # the previous reply on this descriptor is replaced by this one
            self.control.unhold(caller.uid, h.held)
            h.held = 0

            async def answer() -> None:
                request_held = size
                try:
                    data = await cf.command(request, caller)  # type: ignore[misc, arg-type]
                    self.control.unhold(caller.uid, request_held)
                    request_held = 0
                    # A reply stays in memory until its descriptor is closed or sends the next
                    # request: it counts against the same per-user budget as requests (one
                    # user holding replies of 50 MB on a thousand descriptors grew the daemon
                    # without bound).
                    error = None if h.closed else self.control.hold(caller.uid, len(data))
                    if h.closed:
                        data = b""
                    elif error is None:
                        h.held = len(data)
                    else:
                        data = json.dumps({"ok": False, "kind": "value",
                                           "error": f"reply of {len(data)} bytes not kept: {error}"}).encode() + b"\n"
                    h.data = data
                finally:
                    self.control.unhold(caller.uid, request_held)
                    answered.set()

            if self.nursery is None:
                await answer()
            else:
                self.nursery.start_soon(answer)
        return len(buf)

    # -- write-back callbacks ----------------------------------------------------------------
    def _on_clean(self, df: DirtyFile, st: os.stat_result | None) -> None:
        entry = self.inodes.by_inode.get(df.inode)
        if entry is None or entry.dirty is not df:
            return
        entry.dirty = None
        if st is not None and df.path is not None:
            self.inodes.rekey(entry, (st.st_dev, st.st_ino))
            old = entry.last_key
            entry.last_key = Identity.of(key_path(self.tree.root, df.path), st).key
            if old is not None and old != entry.last_key and self.nursery is not None:
                # the cached chunks of the content before this write are stale: free them now
                self.nursery.start_soon(self.cache.drop_file, old)
