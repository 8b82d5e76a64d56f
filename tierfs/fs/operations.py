"""pyfuse3 ``Operations``: decode arguments, call collaborators, map errors. Nothing else.

This is the only place where tierfs errors and OSErrors become errnos (``FUSEError``): pyfuse3
lets no other exception leave a handler.

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
import logging
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

import pyfuse3
import trio

from tierfs.cache.manager import Cache
from tierfs.errors import TierfsError
from tierfs.fs.control import ControlPlane
from tierfs.fs.handles import ControlHandle, DirHandle, FileHandle, HandleTable
from tierfs.fs.inodes import CONTROL_DIR, ROOT, InodeEntry, InodeTable
from tierfs.io import Device
from tierfs.predict.readahead import Readahead
from tierfs.sched.backing import BackingFile, Identity
from tierfs_hints import wire

log = logging.getLogger("tierfs.fs")
CONTROL_NAME = wire.CONTROL_DIR.encode()


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


def _open_backing(path: bytes) -> tuple[int, os.stat_result]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        return fd, os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise


def _scandir(path: bytes) -> list[tuple[bytes, os.stat_result]]:
    out = []
    with os.scandir(path) as it:
        for de in it:
            try:
                out.append((de.name, de.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue
    out.sort()
    return out


class Operations(pyfuse3.Operations):
    """Args:
        inodes, handles: the tables. cache: reads. readahead: per-handle prediction.
        control: ``.tierfs`` files. meta: device for backing-store metadata calls (stat,
        readdir, open), separate from the scheduler's data I/O. attr_timeout: seconds.
    """

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self, *, inodes: InodeTable, cache: Cache, readahead: Readahead, control: ControlPlane,
        meta: Device, attr_timeout: float, nursery: trio.Nursery | None = None,
    ) -> None:
        super().__init__()
        self.inodes = inodes
        self.handles = HandleTable()
        self.cache = cache
        self.readahead = readahead
        self.control = control
        self.meta = meta
        self.attr_timeout = attr_timeout
        self.open_files: dict[str, BackingFile] = {}
        self.nursery = nursery
        self.reads = 0  # FUSE read requests of data files
        self.read_bytes = 0
        self.max_read = 0

    # -- attributes ------------------------------------------------------------------------
    def _attrs(self, inode: int, st: os.stat_result) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.generation = 0
        is_dir = stat.S_ISDIR(st.st_mode)
        a.entry_timeout = self.attr_timeout if is_dir else 0
        a.attr_timeout = self.attr_timeout
        a.st_mode = st.st_mode
        a.st_nlink = st.st_nlink
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

    def _control_attrs(self, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        if inode == CONTROL_DIR:
            a.st_mode = stat.S_IFDIR | 0o555
            a.st_nlink = 2
        else:
            a.st_mode = stat.S_IFREG | 0o444
            a.st_nlink = 1
        a.st_uid = os.getuid()
        a.st_gid = os.getgid()
        a.entry_timeout = self.attr_timeout
        a.attr_timeout = self.attr_timeout
        return a

    def _is_control(self, inode: int) -> bool:
        return inode == CONTROL_DIR or inode in self.control.by_inode

    async def _lstat(self, entry: InodeEntry) -> os.stat_result:
        return await self.meta.run(os.lstat, self.inodes.backing_path(entry))

    # -- namespace -------------------------------------------------------------------------
    async def lookup(self, parent_inode, name, ctx=None):  # type: ignore[no-untyped-def,override]
        with fuse_errors("lookup"):
            if parent_inode == CONTROL_DIR:
                cf = self.control.by_name.get(name)
                if cf is None:
                    raise pyfuse3.FUSEError(errno.ENOENT)
                return self._control_attrs(cf.inode)
            if parent_inode == ROOT and name == CONTROL_NAME:
                return self._control_attrs(CONTROL_DIR)
            parent = self.inodes.get(parent_inode)
            if name == b".":
                entry = parent
                st = await self._lstat(entry)
                entry.lookups += 1
                return self._attrs(entry.inode, st)
            if name == b"..":
                rel = os.path.dirname(parent.path)
                st = await self.meta.run(os.lstat, self.inodes.backing_root + (b"/" + rel if rel else b""))
                entry = self.inodes.remember(rel, st) if rel else self.inodes.get(ROOT)
                if not rel:
                    entry.lookups += 1
                return self._attrs(entry.inode, st)
            path = self.inodes.child_path(parent, name)
            st = await self.meta.run(os.lstat, self.inodes.backing_root + b"/" + path)
            entry = self.inodes.remember(path, st)
            return self._attrs(entry.inode, st)

    async def forget(self, inode_list):  # type: ignore[no-untyped-def,override]
        for inode, n in inode_list:
            self.inodes.forget(inode, n)

    async def getattr(self, inode, ctx=None):  # type: ignore[no-untyped-def,override]
        with fuse_errors("getattr"):
            if self._is_control(inode):
                return self._control_attrs(inode)
            entry = self.inodes.get(inode)
            return self._attrs(inode, await self._lstat(entry))

    async def readlink(self, inode, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("readlink"):
            entry = self.inodes.get(inode)
            return await self.meta.run(os.readlink, self.inodes.backing_path(entry))

    async def statfs(self, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("statfs"):
            sv = await self.meta.run(os.statvfs, self.inodes.backing_root)
            out = pyfuse3.StatvfsData()
            for attr in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                         "f_ffree", "f_favail", "f_namemax"):
                setattr(out, attr, getattr(sv, attr))
            return out

    async def getxattr(self, inode, name, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("getxattr"):
            if self._is_control(inode):
                raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
            path = self.inodes.backing_path(self.inodes.get(inode))
            return await self.meta.run(lambda: os.getxattr(path, name, follow_symlinks=False))

    async def listxattr(self, inode, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("listxattr"):
            if self._is_control(inode):
                return []
            path = self.inodes.backing_path(self.inodes.get(inode))
            names = await self.meta.run(lambda: os.listxattr(path, follow_symlinks=False))
            return [n.encode("utf-8", "surrogateescape") for n in names]

    async def access(self, inode, mode, ctx):  # type: ignore[no-untyped-def,override]
        return True  # default_permissions: the kernel checks modes

    # -- directories -----------------------------------------------------------------------
    async def opendir(self, inode, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("opendir"):
            if inode == CONTROL_DIR:
                return self.handles.add(DirHandle(inode, []))
            entry = self.inodes.get(inode)
            entries = await self.meta.run(_scandir, self.inodes.backing_path(entry))
            if inode == ROOT:
                entries = [e for e in entries if e[0] != CONTROL_NAME]
            return self.handles.add(DirHandle(inode, entries))

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
            for i in range(start_id, len(h.entries)):
                name, st = h.entries[i]
                entry = self.inodes.remember(self.inodes.child_path(parent, name), st)
                entry.lookups -= 1  # counted only if the kernel takes the entry
                if not pyfuse3.readdir_reply(token, name, self._attrs(entry.inode, st), i + 1):
                    self.inodes.forget(entry.inode, 0)
                    return
                entry.lookups += 1

    async def releasedir(self, fh):  # type: ignore[no-untyped-def,override]
        self.handles.pop(fh)

    # -- files -----------------------------------------------------------------------------
    async def open(self, inode, flags, ctx):  # type: ignore[no-untyped-def,override]
        with fuse_errors("open"):
            if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
                raise pyfuse3.FUSEError(errno.EROFS)
            if inode in self.control.by_inode:
                data = self.control.by_inode[inode].render()
                return pyfuse3.FileInfo(fh=self.handles.add(ControlHandle(data)), direct_io=True)
            entry = self.inodes.get(inode)
            path = self.inodes.backing_path(entry)
            fd, st = await self.meta.run(_open_backing, path)
            identity = Identity.of(os.fsdecode(path), st)
            key = identity.key
            bf = self.open_files.get(key)
            if bf is None or bf.fd < 0:
                bf = BackingFile(identity, fd)
                self.open_files[key] = bf
            else:
                os.close(fd)
            bf.acquire()
            bf.opens += 1
            changed = entry.last_key is not None and entry.last_key != key
            if changed:
                old = entry.last_key
                log.info("backing file changed: %s; dropping its cached chunks", identity.path)
                if self.nursery is not None and old is not None:
                    self.nursery.start_soon(self.cache.drop_file, old)
            entry.last_key = key
            fh = self.handles.add(FileHandle(inode, bf))
            return pyfuse3.FileInfo(fh=fh, keep_cache=not changed, direct_io=False)

    async def read(self, fh, off, size):  # type: ignore[no-untyped-def,override]
        with fuse_errors("read"):
            h = self.handles.get(fh)
            if isinstance(h, ControlHandle):
                return h.data[off : off + size]
            assert isinstance(h, FileHandle)
            f = h.file
            self.reads += 1
            self.read_bytes += size
            self.max_read = max(self.max_read, size)
            if off >= f.size:
                return b""
            # Queue readahead first: the scheduler then coalesces the demand fetch below with
            # the following chunks into one long transfer.
            ahead = self.readahead.on_read(h.readahead, off, min(size, f.size - off), f.size)
            h.access.random = h.readahead.window == 0
            if ahead:
                self.cache.prefetch(f, ahead)
            return await self.cache.read(f, off, size, h.access)

    async def release(self, fh):  # type: ignore[no-untyped-def,override]
        h = self.handles.pop(fh)
        if isinstance(h, FileHandle):
            self.readahead.forget(h.readahead)
            f = h.file
            f.opens -= 1
            if f.opens == 0:
                # Nobody reads on: queued readahead of this file is waste.
                self.cache.scheduler.cancel_speculative(f.key)
                if self.open_files.get(f.key) is f:
                    del self.open_files[f.key]
            f.release()

    async def flush(self, fh):  # type: ignore[no-untyped-def,override]
        return None
