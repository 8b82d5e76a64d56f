"""Every access to the backing tree, resolved beneath its root and never through a symlink.

The backing directory is shared with the machine's users: a user who can write part of it can
swap a directory the kernel still holds for a symlink, or plant a symlink where tierfs is about
to create a file. A path-string design (``root + b"/" + rel``) follows such symlinks out of the
backing root, and cannot reach paths longer than ``PATH_MAX``. So every call here resolves its
path relative to an ``O_PATH`` descriptor of the root with ``openat2(2)`` and
``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`` (Linux 5.6+): a symlink anywhere on the way, or a
``..`` leading out, fails (ELOOP / EXDEV) instead of being followed. The object itself is then
acted on relative to its parent's descriptor with the ``*at`` calls and ``AT_SYMLINK_NOFOLLOW``
(or through ``/proc/self/fd/N``, which names exactly the inode the descriptor holds), so nothing
an unprivileged user does to the tree meanwhile can redirect it. Paths longer than ``PATH_MAX``
are walked in pieces, each piece resolved the same way from the descriptor of the last.

Why not libfuse passthrough_hp's / virtiofsd's one ``O_PATH`` descriptor per inode: it needs a
descriptor per inode the kernel holds (hundreds of thousands for an image dataset, against
``RLIMIT_NOFILE``) and it follows a directory that a user moved outside the backing root. Here a
lookup costs one extra ``openat2`` (~2 us) and a moved-out directory is simply gone.

All methods block: callers run them through an :class:`tierfs.io.Device`. Paths are ``bytes``
relative to the root (``b""`` is the root itself), as the inode table keeps them. Errors are
``OSError`` with the errno of the failing call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long

SYS_openat2 = 437  # the same number on x86_64 and the generic table (aarch64, riscv64)
SYS_renameat2 = {"x86_64": 316, "aarch64": 276, "riscv64": 276}.get(os.uname().machine, 316)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
AT_EMPTY_PATH = 0x1000
_libc.fchownat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_int]
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
# A piece of a long path resolved in one openat2 call: under PATH_MAX (4096) with room to spare.
PIECE_MAX = 3800
O_PATH_DIR = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: bytes, flags: int, mode: int = 0,
            resolve: int = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) -> int:
    """``openat2(2)``: open ``path`` relative to ``dirfd`` under the ``resolve`` restrictions.
    Retries the EAGAIN the kernel answers when a rename raced the walk. Raises OSError."""
    # openat2 refuses a mode without O_CREAT / O_TMPFILE (EINVAL), unlike openat
    # (O_TMPFILE includes the O_DIRECTORY bit: test all of its bits)
    creating = flags & os.O_CREAT or flags & os.O_TMPFILE == os.O_TMPFILE
    how = _OpenHow(flags, mode if creating else 0, resolve)
    for _ in range(64):
        fd = _libc.syscall(SYS_openat2, dirfd, path, ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return int(fd)
        e = ctypes.get_errno()
        if e not in (errno.EAGAIN, errno.EINTR):
            raise OSError(e, os.strerror(e), path)
    raise OSError(errno.EAGAIN, "path walk kept racing renames", path)


def openat2_supported() -> bool:
    """Whether this kernel has openat2 (Linux 5.6+)."""
    try:
        os.close(openat2(-100, b"/", O_PATH_DIR, resolve=0))  # AT_FDCWD
        return True
    except OSError as e:
        return e.errno != errno.ENOSYS


def _renameat2(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int) -> None:
    if flags == 0:
        os.rename(old, new, src_dir_fd=olddirfd, dst_dir_fd=newdirfd)
        return
    if _libc.syscall(SYS_renameat2, olddirfd, old, newdirfd, new, flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), new)


def split(rel: bytes) -> tuple[bytes, bytes]:
    """``(parent, name)`` of a relative path (``b"a/b/c"`` -> ``(b"a/b", b"c")``)."""
    parent, _, name = rel.rpartition(b"/")
    return parent, name


def proc_path(fd: int, name: bytes | None = None) -> bytes:
    """``/proc/self/fd/FD[/NAME]``: names exactly the object ``fd`` holds (or ``name`` in that
    directory) for the calls that have no ``*at`` or ``f*`` form (xattrs of a path, chmod of a
    fifo). The final ``name`` is still subject to the caller's nofollow choice."""
    base = b"/proc/self/fd/%d" % fd
    return base if name is None else base + b"/" + name


class _DirFd:
    """:meth:`BackingTree.dir`: a class, not a ``@contextmanager`` generator. It runs for
    every metadata call on the backing store (twice for a rename): the generator and the
    nested one of :meth:`BackingTree.parent` cost ~5 us per call (``timeit``, Python 3.11),
    about a tenth of an ``unlink``'s own time in the daemon. The root itself is used as is
    (no ``dup``): it stays open while the tree does."""

    __slots__ = ("fd", "rel", "tree")

    def __init__(self, tree: BackingTree, rel: bytes) -> None:
        self.tree = tree
        self.rel = rel
        self.fd = -1

    def __enter__(self) -> int:
        if not self.rel:
            return self.tree.fd
        self.fd = self.tree.dir_fd(self.rel)
        return self.fd

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _ParentFd(_DirFd):
    """:meth:`BackingTree.parent`: ``(parent's descriptor, last component)``."""

    __slots__ = ("name",)

    def __init__(self, tree: BackingTree, rel: bytes) -> None:
        parent, self.name = split(rel)
        super().__init__(tree, parent)

    def __enter__(self) -> tuple[int, bytes]:  # type: ignore[override]
        return super().__enter__(), self.name


class BackingTree:
    """The backing directory, opened once; see the module docstring.

    Args:
        root: the backing directory (bytes). It is opened ``O_PATH`` here and held until
            :meth:`close`: a later change of what the path names does not move the tree.

    Raises:
        OSError: the root cannot be opened (missing, not a directory).
    """

    def __init__(self, root: bytes) -> None:
        self.root = root
        self.fd = os.open(root, O_PATH_DIR)
        self.opens = 0  # calls of open() (objects opened, not directories walked): stats, tests

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- resolution --------------------------------------------------------------------------
    def open(self, rel: bytes, flags: int, mode: int = 0o600) -> int:
        """A descriptor of ``rel`` opened with ``flags`` (``O_NOFOLLOW | O_CLOEXEC`` added; a
        final symlink is refused unless ``O_PATH`` is given, which then holds the link itself).
        Creating calls should pass ``O_EXCL``. Raises OSError (ELOOP: a symlink on the way;
        EXDEV: the path leads out of the root)."""
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC
        self.opens += 1
        if not rel:
            return openat2(self.fd, b".", flags, mode)
        if len(rel) <= PIECE_MAX:
            return openat2(self.fd, rel, flags, mode)
        parent, name = split(rel)
        with self.dir(parent) as dfd:
            return openat2(dfd, name, flags, mode)

    def dir_fd(self, rel: bytes) -> int:
        """An ``O_PATH`` descriptor of directory ``rel`` (the caller closes it). Long paths are
        walked in pieces of at most ``PIECE_MAX`` bytes. Raises OSError (ENOTDIR, ELOOP, ...)."""
        if not rel:
            return os.dup(self.fd)
        if len(rel) <= PIECE_MAX:
            return openat2(self.fd, rel, O_PATH_DIR)
        fd = os.dup(self.fd)
        try:
            rest = rel
            while rest:
                if len(rest) <= PIECE_MAX:
                    piece, rest = rest, b""
                else:
                    cut = rest.rfind(b"/", 0, PIECE_MAX)
                    if cut <= 0:
                        raise OSError(errno.ENAMETOOLONG, "path component too long", rel)
                    piece, rest = rest[:cut], rest[cut + 1:]
                nfd = openat2(fd, piece, O_PATH_DIR)
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def dir(self, rel: bytes) -> _DirFd:
        """``with tree.dir(rel) as dfd``: :meth:`dir_fd`, closed afterwards."""
        return _DirFd(self, rel)

    def parent(self, rel: bytes) -> _ParentFd:
        """``with tree.parent(rel) as (dfd, name)``: the parent directory's descriptor and the
        last component, for the ``*at`` calls. ``rel`` must not be the root."""
        if not rel:
            raise OSError(errno.EINVAL, "the backing root has no parent")
        return _ParentFd(self, rel)

    # -- reading -----------------------------------------------------------------------------
    def lstat(self, rel: bytes) -> os.stat_result:
        if not rel:
            return os.fstat(self.fd)
        with self.parent(rel) as (dfd, name):
            return os.stat(name, dir_fd=dfd, follow_symlinks=False)

    def lstat_or_none(self, rel: bytes) -> os.stat_result | None:
        try:
            return self.lstat(rel)
        except FileNotFoundError:
            return None

    def readlink(self, rel: bytes) -> bytes:
        with self.parent(rel) as (dfd, name):
            return os.readlink(name, dir_fd=dfd)

    def scandir(self, rel: bytes, skip: object = None) -> list[tuple[bytes, os.stat_result]]:
        """``(name, lstat)`` of every entry of directory ``rel`` (entries that vanish meanwhile
        are left out; ``skip(name) -> bool`` leaves out more)."""
        fd = self.open(rel, os.O_RDONLY | os.O_DIRECTORY)
        out = []
        try:
            with os.scandir(fd) as it:
                for de in it:
                    name = os.fsencode(de.name)
                    if skip is not None and skip(name):  # type: ignore[operator]
                        continue
                    try:
                        out.append((name, de.stat(follow_symlinks=False)))
                    except FileNotFoundError:
                        continue
        finally:
            os.close(fd)
        return out

    def scan(self, rel: bytes) -> DirScan:
        """Directory ``rel`` (opened beneath the root, no symlink followed), to be read a
        batch at a time (:func:`read_batch`); close it when done."""
        fd = self.open(rel, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return DirScan(fd)
        except BaseException:
            os.close(fd)
            raise

    def listdir(self, rel: bytes) -> list[bytes]:
        fd = self.open(rel, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return [os.fsencode(n) for n in os.listdir(fd)]
        finally:
            os.close(fd)

    def statvfs(self) -> os.statvfs_result:
        return os.fstatvfs(self.fd)

    def open_read(self, rel: bytes) -> tuple[int, os.stat_result]:
        """Open a regular file read-only and fstat it: ``(fd, stat)``. Raises OSError (ELOOP
        for a symlink, EISDIR / EINVAL-free: a directory opens but is refused here as EISDIR)."""
        fd = self.open(rel, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory", rel)
            return fd, st
        except BaseException:
            os.close(fd)
            raise

    # -- xattrs (no *at form: through the parent's /proc/self/fd entry, final link not followed)
    def getxattr(self, rel: bytes, attr: bytes) -> bytes:
        with self._xattr_path(rel) as p:
            return os.getxattr(p, attr, follow_symlinks=False)

    def listxattr(self, rel: bytes) -> list[str]:
        with self._xattr_path(rel) as p:
            return os.listxattr(p, follow_symlinks=False)

    def setxattr(self, rel: bytes, attr: bytes, value: bytes) -> None:
        with self._xattr_path(rel) as p:
            os.setxattr(p, attr, value, follow_symlinks=False)

    def removexattr(self, rel: bytes, attr: bytes) -> None:
        with self._xattr_path(rel) as p:
            os.removexattr(p, attr, follow_symlinks=False)

    @contextmanager
    def _xattr_path(self, rel: bytes) -> Iterator[bytes]:
        if not rel:
            yield proc_path(self.fd)
            return
        with self.parent(rel) as (dfd, name):
            yield proc_path(dfd, name)

    # -- changing ----------------------------------------------------------------------------
    def mkdir(self, rel: bytes, mode: int) -> None:
        with self.parent(rel) as (dfd, name):
            os.mkdir(name, mode, dir_fd=dfd)

    def mknod(self, rel: bytes, mode: int, device: int = 0) -> None:
        with self.parent(rel) as (dfd, name):
            os.mknod(name, mode, device, dir_fd=dfd)

    def make_node(self, rel: bytes, mode: int, uid: int, gid: int, device: int = 0) -> os.stat_result:
        """Create a directory (``S_IFDIR`` in ``mode``), fifo, socket, device or empty regular
        file at ``rel`` owned by ``uid`` and with exactly ``mode & 0o7777`` whatever the daemon's
        umask, as a local filesystem makes it for that caller: in a setgid directory the new
        object takes the directory's group, and a new subdirectory keeps the setgid bit.

        Owner and mode are applied to the new object itself: it is opened ``O_PATH |
        O_NOFOLLOW`` relative to the same parent descriptor it was made in (a symlink swapped in
        meanwhile is refused with ELOOP, never followed), then ``chown`` / ``chmod`` go through
        ``/proc/self/fd/N``, which names exactly that inode. The owner goes first: a chown
        clears the setgid bit. Returns the new object's ``lstat``. Raises OSError (EEXIST, ...).
        """
        return self.make_node_in(rel, mode, uid, gid, device)[0]

    def make_node_in(self, rel: bytes, mode: int, uid: int, gid: int,
                     device: int = 0) -> tuple[os.stat_result, os.stat_result]:
        """:meth:`make_node`, returning ``(the new object's lstat, its directory's fstat
        after)``: the directory's through the descriptor it was made in (no second walk)."""
        with self.parent(rel) as (dfd, name):
            pst = os.fstat(dfd)
            perm = mode & 0o7777
            if pst.st_mode & stat.S_ISGID:
                gid = pst.st_gid
                if stat.S_ISDIR(mode):
                    perm |= stat.S_ISGID
            if stat.S_ISDIR(mode):
                os.mkdir(name, 0o700, dir_fd=dfd)
            else:
                os.mknod(name, stat.S_IFMT(mode) | 0o600, device, dir_fd=dfd)
            fd = openat2(dfd, name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if stat.S_IFMT(st.st_mode) != stat.S_IFMT(mode):
                    raise OSError(errno.ELOOP, "created object was swapped", rel)
                os.chown(proc_path(fd), uid, gid)
                os.chmod(proc_path(fd), perm)
                return os.fstat(fd), os.fstat(dfd)
            finally:
                os.close(fd)

    def make_symlink(self, target: bytes, rel: bytes, uid: int, gid: int) -> os.stat_result:
        """Create symlink ``rel`` -> ``target`` owned by ``uid`` and ``gid`` (the parent's group
        if it is setgid). The owner is set on exactly the link made: it is opened ``O_PATH |
        O_NOFOLLOW`` in the same parent descriptor, checked to be a symlink, and changed with
        ``fchownat(fd, "", AT_EMPTY_PATH)``, so a name swapped meanwhile (a hard link to
        another's file) is never chowned. Returns its ``lstat``. Raises OSError."""
        return self.make_symlink_in(target, rel, uid, gid)[0]

    def make_symlink_in(self, target: bytes, rel: bytes, uid: int,
                        gid: int) -> tuple[os.stat_result, os.stat_result]:
        """:meth:`make_symlink`, returning ``(its lstat, its directory's fstat after)``."""
        with self.parent(rel) as (dfd, name):
            pst = os.fstat(dfd)
            if pst.st_mode & stat.S_ISGID:
                gid = pst.st_gid
            os.symlink(target, name, dir_fd=dfd)
            fd = openat2(dfd, name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                if not stat.S_ISLNK(os.fstat(fd).st_mode):
                    raise OSError(errno.ELOOP, "created symlink was swapped", rel)
                if _libc.fchownat(fd, b"", uid, gid, AT_EMPTY_PATH) != 0:
                    e = ctypes.get_errno()
                    raise OSError(e, os.strerror(e), rel)
                return os.fstat(fd), os.fstat(dfd)
            finally:
                os.close(fd)

    def symlink(self, target: bytes, rel: bytes) -> None:
        with self.parent(rel) as (dfd, name):
            os.symlink(target, name, dir_fd=dfd)

    def link(self, old: bytes, new: bytes) -> None:
        with self.parent(old) as (odfd, oname), self.parent(new) as (ndfd, nname):
            os.link(oname, nname, src_dir_fd=odfd, dst_dir_fd=ndfd, follow_symlinks=False)

    def unlink(self, rel: bytes) -> None:
        with self.parent(rel) as (dfd, name):
            os.unlink(name, dir_fd=dfd)

    def unlink_stat_dir(self, rel: bytes) -> tuple[int, os.stat_result]:
        """:meth:`unlink`, with one walk: ``(the object's link count before, the fstat of the
        directory it was in right after)``, through the descriptor the unlink resolved."""
        with self.parent(rel) as (dfd, name):
            try:
                nlink = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_nlink
            except FileNotFoundError:
                nlink = 1  # (the unlink says why)
            os.unlink(name, dir_fd=dfd)
            return nlink, os.fstat(dfd)

    def probe_create(self, rel: bytes, name_too: bool) -> tuple[os.stat_result, os.stat_result | None]:
        """Before ``rel`` is created: ``(fstat of its parent directory, lstat of rel or None
        if it does not exist)``, with one walk (the lstat only if ``name_too``). Resolving
        the parent refuses a directory swapped for a symlink (ELOOP) or a file (ENOTDIR)."""
        with self.parent(rel) as (dfd, name):  # (opened O_DIRECTORY: a directory, or ENOTDIR)
            pst = os.fstat(dfd)
            if not name_too:
                return pst, None
            try:
                return pst, os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                return pst, None

    def unlink_quiet(self, rel: bytes) -> None:
        try:
            self.unlink(rel)
        except FileNotFoundError:
            pass

    def rmdir(self, rel: bytes) -> None:
        with self.parent(rel) as (dfd, name):
            os.rmdir(name, dir_fd=dfd)

    def rename(self, old: bytes, new: bytes, flags: int = 0) -> None:
        """``renameat2`` (flags: ``RENAME_NOREPLACE``, ``RENAME_EXCHANGE``)."""
        with self.parent(old) as (odfd, oname), self.parent(new) as (ndfd, nname):
            _renameat2(odfd, oname, ndfd, nname, flags)

    def chown(self, rel: bytes, uid: int, gid: int) -> None:
        """``fchownat(AT_SYMLINK_NOFOLLOW)``: a symlink's own owner changes, never its target's."""
        if not rel:
            os.chown(proc_path(self.fd), uid, gid)
            return
        with self.parent(rel) as (dfd, name):
            os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)

    def chmod(self, rel: bytes, mode: int) -> None:
        """chmod of the object itself; a symlink has no mode of its own and is left alone."""
        fd = self.open(rel, os.O_PATH)
        try:
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                return
            os.chmod(proc_path(fd), mode)  # the magic link names exactly this inode
        finally:
            os.close(fd)

    def utime(self, rel: bytes, ns: tuple[int, int]) -> None:
        if not rel:
            os.utime(proc_path(self.fd), ns=ns)
            return
        with self.parent(rel) as (dfd, name):
            os.utime(name, ns=ns, dir_fd=dfd, follow_symlinks=False)

    def touch(self, rel: bytes) -> os.stat_result:
        """Set the object's access and modification times (and so its change time) to now: a
        directory whose entries changed only in the write tier (a file created, unlinked or
        renamed before its write-back) shows the change at once, as on a local filesystem.
        Returns its ``lstat`` after (the times as set), with the same walk."""
        if not rel:
            os.utime(proc_path(self.fd))
            return os.fstat(self.fd)
        with self.parent(rel) as (dfd, name):
            os.utime(name, dir_fd=dfd, follow_symlinks=False)
            return os.stat(name, dir_fd=dfd, follow_symlinks=False)

    def create_tmp(self, dir_rel: bytes, prefix: bytes) -> tuple[int, bytes]:
        """A new empty file ``prefix + <random>`` in directory ``dir_rel``, opened read-write
        with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (mode 0600), so a name planted in advance (a
        symlink, a file) is never opened: another name is drawn. Returns ``(fd, name)``."""
        with self.dir(dir_rel) as dfd:
            for _ in range(16):
                name = prefix + secrets.token_hex(6).encode()
                try:
                    fd = openat2(dfd, name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, 0o600)
                except FileExistsError:
                    continue
                return fd, name
        raise OSError(errno.EEXIST, "could not draw a free temporary name", dir_rel)

    def fsync_dir(self, rel: bytes) -> None:
        fd = self.open(rel, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def dir_times(self, rel: bytes) -> tuple[int, int]:
        st = self.lstat(rel)
        return st.st_atime_ns, st.st_mtime_ns


class DirScan:
    """An open directory and an ``os.scandir`` iterator over it (:meth:`BackingTree.scan`).
    The descriptor stays open with the iterator: its entries' ``stat()`` is an ``fstatat``
    relative to it (the iterator reads through a duplicate of it)."""

    def __init__(self, fd: int) -> None:
        self.it: Iterator[os.DirEntry[Any]] = os.scandir(fd)  # type: ignore[assignment]
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            self.it.close()  # type: ignore[attr-defined]
            os.close(self.fd)
            self.fd = -1


def read_batch(scan: DirScan, n: int, skip: Callable[[bytes], bool] | None = None
               ) -> list[tuple[bytes, os.stat_result]]:
    """Up to ``n`` more ``(name, lstat)`` entries of a :meth:`BackingTree.scan` (fewer only
    at its end); entries that vanish meanwhile, or that ``skip(name)`` names, are left out."""
    out: list[tuple[bytes, os.stat_result]] = []
    for de in scan.it:
        name = de.name if isinstance(de.name, bytes) else os.fsencode(de.name)
        if skip is not None and skip(name):
            continue
        try:
            out.append((name, de.stat(follow_symlinks=False)))
        except FileNotFoundError:
            continue
        if len(out) >= n:
            break
    return out
