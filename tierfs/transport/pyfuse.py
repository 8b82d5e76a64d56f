"""The pyfuse3 transport: a ``pyfuse3.Operations`` that hands each request to the handler layer.

Translation only: pyfuse3's argument objects become the neutral types of :mod:`tierfs.fs.api`,
the handlers' replies become pyfuse3 objects, :class:`~tierfs.fs.api.FuseError` becomes
``pyfuse3.FUSEError``. pyfuse3 ends its main loop when a handler raises anything but FUSEError,
so any other exception (a bug here) is logged and answered EIO.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable
from typing import TypeVar

import pyfuse3
import trio

from tierfs import loopwatch
from tierfs.fs.api import Attr, FuseError, OpenReply, SetAttr
from tierfs.fs.handlers import Handlers

log = logging.getLogger("tierfs.fs")
T = TypeVar("T")
_STATVFS_FIELDS = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                   "f_ffree", "f_favail", "f_namemax")
_ATTR_FIELDS = ("st_ino", "generation", "entry_timeout", "attr_timeout", "st_mode", "st_nlink",
                "st_uid", "st_gid", "st_rdev", "st_size", "st_blksize", "st_blocks",
                "st_atime_ns", "st_mtime_ns", "st_ctime_ns")


def entry_attributes(a: Attr) -> pyfuse3.EntryAttributes:
    out = pyfuse3.EntryAttributes()
    for name in _ATTR_FIELDS:
        setattr(out, name, getattr(a, name))
    return out


def file_info(r: OpenReply) -> pyfuse3.FileInfo:
    return pyfuse3.FileInfo(fh=r.fh, keep_cache=r.keep_cache, direct_io=r.direct_io)


def set_attr(attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields) -> SetAttr:
    """pyfuse3 resolves UTIME_NOW itself (the time is in ``attr``)."""
    return SetAttr(
        size=attr.st_size if fields.update_size else None,
        mode=attr.st_mode if fields.update_mode else None,
        uid=attr.st_uid if fields.update_uid else None,
        gid=attr.st_gid if fields.update_gid else None,
        atime_ns=attr.st_atime_ns if fields.update_atime else None,
        mtime_ns=attr.st_mtime_ns if fields.update_mtime else None)


async def _call(what: str, aw: Awaitable[T]) -> T:
    loopwatch.request[0] = what
    try:
        return await aw
    except FuseError as e:
        raise pyfuse3.FUSEError(e.errno) from None
    except (pyfuse3.FUSEError, trio.Cancelled):
        raise
    except Exception:
        log.exception("%s: unexpected error in the pyfuse3 transport; answering EIO", what)
        raise pyfuse3.FUSEError(errno.EIO) from None


class Pyfuse3Operations(pyfuse3.Operations):
    """``handlers``: the filesystem (:class:`~tierfs.fs.handlers.Handlers`)."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, handlers: Handlers) -> None:
        super().__init__()
        self.h = handlers

    async def lookup(self, parent_inode, name, ctx=None):  # type: ignore[no-untyped-def,override]
        return entry_attributes(await _call("lookup", self.h.lookup(parent_inode, name, ctx)))

    async def forget(self, inode_list):  # type: ignore[no-untyped-def,override]
        await _call("forget", self.h.forget(inode_list))

    async def getattr(self, inode, ctx=None):  # type: ignore[no-untyped-def,override]
        return entry_attributes(await _call("getattr", self.h.getattr(inode, ctx)))

    async def readlink(self, inode, ctx):  # type: ignore[no-untyped-def,override]
        return await _call("readlink", self.h.readlink(inode, ctx))

    async def statfs(self, ctx):  # type: ignore[no-untyped-def,override]
        sv = await _call("statfs", self.h.statfs(ctx))
        out = pyfuse3.StatvfsData()
        for attr in _STATVFS_FIELDS:
            setattr(out, attr, getattr(sv, attr))
        return out

    async def access(self, inode, mode, ctx):  # type: ignore[no-untyped-def,override]
        return True  # default_permissions: the kernel checks modes

    async def getxattr(self, inode, name, ctx):  # type: ignore[no-untyped-def,override]
        return await _call("getxattr", self.h.getxattr(inode, name, ctx))

    async def listxattr(self, inode, ctx):  # type: ignore[no-untyped-def,override]
        return await _call("listxattr", self.h.listxattr(inode, ctx))

    async def setxattr(self, inode, name, value, ctx):  # type: ignore[no-untyped-def,override]
        await _call("setxattr", self.h.setxattr(inode, name, value, ctx))

    async def removexattr(self, inode, name, ctx):  # type: ignore[no-untyped-def,override]
        await _call("removexattr", self.h.removexattr(inode, name, ctx))

    async def opendir(self, inode, ctx):  # type: ignore[no-untyped-def,override]
        return await _call("opendir", self.h.opendir(inode, ctx))

    async def readdir(self, fh, start_id, token):  # type: ignore[no-untyped-def,override]
        def emit(name: bytes, a: Attr, next_id: int) -> bool:
            return bool(pyfuse3.readdir_reply(token, name, entry_attributes(a), next_id))

        await _call("readdir", self.h.readdir(fh, start_id, emit))

    async def releasedir(self, fh):  # type: ignore[no-untyped-def,override]
        await _call("releasedir", self.h.releasedir(fh))

    async def fsyncdir(self, fh, datasync):  # type: ignore[no-untyped-def,override]
        await _call("fsyncdir", self.h.fsyncdir(fh, datasync))

    async def mkdir(self, parent_inode, name, mode, ctx):  # type: ignore[no-untyped-def,override]
        return entry_attributes(await _call("mkdir", self.h.mkdir(parent_inode, name, mode, ctx)))

    async def mknod(self, parent_inode, name, mode, rdev, ctx):  # type: ignore[no-untyped-def,override]
        return entry_attributes(await _call("mknod", self.h.mknod(parent_inode, name, mode, rdev, ctx)))

    async def rmdir(self, parent_inode, name, ctx):  # type: ignore[no-untyped-def,override]
        await _call("rmdir", self.h.rmdir(parent_inode, name, ctx))

    async def symlink(self, parent_inode, name, target, ctx):  # type: ignore[no-untyped-def,override]
        return entry_attributes(await _call("symlink", self.h.symlink(parent_inode, name, target, ctx)))

    async def link(self, inode, new_parent_inode, new_name, ctx):  # type: ignore[no-untyped-def,override]
        return entry_attributes(await _call("link", self.h.link(inode, new_parent_inode, new_name, ctx)))

    async def unlink(self, parent_inode, name, ctx):  # type: ignore[no-untyped-def,override]
        await _call("unlink", self.h.unlink(parent_inode, name, ctx))

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):  # type: ignore[no-untyped-def,override]
        await _call("rename", self.h.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx))

    async def setattr(self, inode, attr, fields, fh, ctx):  # type: ignore[no-untyped-def,override]
        return entry_attributes(await _call("setattr", self.h.setattr(inode, set_attr(attr, fields), fh, ctx)))

    async def open(self, inode, flags, ctx):  # type: ignore[no-untyped-def,override]
        # An O_TRUNC open drops set-user/group-ID for a caller without CAP_FSETID (root is taken
        # for one that has it): the kernel skips that itself when opens truncate (atomic_o_trunc)
        kill = bool(flags & os.O_TRUNC) and ctx.uid != 0
        return file_info(await _call("open", self.h.open(inode, flags, ctx, kill_suidgid=kill)))

    async def create(self, parent_inode, name, mode, flags, ctx):  # type: ignore[no-untyped-def,override]
        fi, attrs = await _call("create", self.h.create(parent_inode, name, mode, flags, ctx))
        return file_info(fi), entry_attributes(attrs)

    async def read(self, fh, off, size):  # type: ignore[no-untyped-def,override]
        return await _call("read", self.h.read(fh, off, size))

    async def write(self, fh, off, buf):  # type: ignore[no-untyped-def,override]
        return await _call("write", self.h.write(fh, off, buf))

    async def flush(self, fh):  # type: ignore[no-untyped-def,override]
        await _call("flush", self.h.flush(fh))

    async def fsync(self, fh, datasync):  # type: ignore[no-untyped-def,override]
        await _call("fsync", self.h.fsync(fh, datasync))

    async def release(self, fh):  # type: ignore[no-untyped-def,override]
        await _call("release", self.h.release(fh))

