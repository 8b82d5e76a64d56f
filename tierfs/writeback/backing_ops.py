"""Blocking calls of the write path on the backing store (run in device threads, through the
scheduler), and the backing-directory lock. Every path is relative to the backing root and
resolved through a :class:`~tierfs.backing_tree.BackingTree`: never through a symlink, never
outside the root."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from tierfs.backing_tree import BackingTree, split
from tierfs.errors import MountError
from tierfs.io import pread_exact, pwrite_all, sync_range

log = logging.getLogger("tierfs.writeback")


# xattrs a copy carries: users' own, and trusted.* (root's: the kernel lets only CAP_SYS_ADMIN
# set them through the mount). A write-back also carries security.capability (set through the
# mount by a caller with CAP_SETFCAP, the kernel checks it): it was dropped, and a `setcap` on a
# file written through the mount did nothing once the file was written back. A copy-up does not:
# the first write of a file drops its capabilities (as on a local filesystem), and a copy-up is
# made for a write.
COPIED_XATTRS = ("user.", "trusted.")
CAPS_XATTR_NAME = "security.capability"


def _copy_xattrs(src: int | bytes, dst: int, caps: bool = False, exact: bool = False) -> None:
    """Copy ``src``'s xattrs of :data:`COPIED_XATTRS` (and ``security.capability`` with
    ``caps``) onto ``dst``; any that ``dst`` refuses is left out (a backing filesystem without
    xattrs, or without trusted.* for this user). ``exact``: ``dst`` holds an older version of
    the file (a write-back in place), whose xattrs of those names that ``src`` no longer has
    are removed."""
    def copied(n: str) -> bool:
        return n.startswith(COPIED_XATTRS) or (caps and n == CAPS_XATTR_NAME)

    try:
        names = [n for n in os.listxattr(src) if copied(n)]
    except OSError:
        return
    if exact:
        try:
            old = [n for n in os.listxattr(dst) if copied(n) and n not in names]
        except OSError:
            old = []
        for n in old:
            try:
                os.removexattr(dst, n)
            except OSError:
                pass
    for n in names:
        try:
            os.setxattr(dst, n, os.getxattr(src, n))
        except OSError:
            pass


def _copy_range(src: int, dst: int, offset: int, length: int) -> None:
    pwrite_all(dst, pread_exact(src, length, offset), offset)


def unrenewing_reader(fd: int) -> int:
    """A second descriptor of the file ``fd`` for a copy's reads alone, opened ``O_NOATIME``
    through ``/proc/self/fd`` (the same inode, whatever its name is now), so that the copy
    leaves the file's atime as it was: a read renews an atime older than the ctime (relatime),
    and the ``utime`` that set it (``tar -x``, ``cp -a``, ``touch -a``) moved the ctime. ``fd``
    itself where the open is refused (``O_NOATIME`` needs the file's owner or CAP_FOWNER: EPERM;
    a mode the daemon cannot read through: EACCES; no ``/proc``; no descriptor left). The
    caller closes it if it is not ``fd``."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NOATIME | os.O_CLOEXEC)
    except OSError:
        return fd


def _copy_data(src: int, dst: int, offset: int, end: int, limit: int, durable: bool) -> tuple[int, int]:
    """:func:`_copy_data_from` through :func:`unrenewing_reader` of ``src``: a write-back's or
    a switch to write-through's read of a data file leaves its atime as the mount shows it."""
    reader = unrenewing_reader(src)
    try:
        return _copy_data_from(reader, dst, offset, end, limit, durable)
    finally:
        if reader != src:
            os.close(reader)


def _copy_data_from(src: int, dst: int, offset: int, end: int, limit: int, durable: bool) -> tuple[int, int]:
    """Copy the data segments of ``src`` between ``offset`` and ``end`` to the same offsets of
    ``dst``, at most ``limit`` bytes of data (one slice); holes are skipped (``dst`` was sized
    first, so they stay holes there: a sparse file stays sparse, and a huge sparse extension
    costs nothing to copy). Segments come from ``SEEK_DATA``/``SEEK_HOLE``; a filesystem that
    lacks them makes the whole range data. ``durable``: each piece is pushed to the disk
    (``sync_file_range``) before this returns. Returns ``(next offset, bytes copied)``; the
    next offset is ``end`` once nothing is left. Raises OSError."""
    off, copied = offset, 0
    while off < end and copied < limit:
        try:
            data = os.lseek(src, off, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole from here on
                return end, copied
            if e.errno != errno.EINVAL:
                raise
            data, hole = off, end  # SEEK_DATA unsupported: all data
        else:
            if data >= end:
                return end, copied
            hole = os.lseek(src, data, os.SEEK_HOLE)
        n = min(hole, end, data + limit - copied) - data
        _copy_range(src, dst, data, n)
        if durable:
            sync_range(dst, data, n)
        copied += n
        off = data + n
    return off, copied


MAX_SEGMENTS = 4096  # data segments a copy-up follows; a file in more pieces is copied whole


def data_segments(fd: int, size: int) -> list[tuple[int, int]] | None:
    """The data segments ``[(start, end), ...]`` (bytes) of the first ``size`` bytes of file
    ``fd``, from ``SEEK_DATA``/``SEEK_HOLE``: what a copy of it must copy (the rest are holes,
    read as zeros). None when the filesystem cannot tell or the file is in more than
    :data:`MAX_SEGMENTS` pieces (then copy it whole). Raises OSError."""
    out: list[tuple[int, int]] = []
    off = 0
    while off < size:
        try:
            data = os.lseek(fd, off, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole from here on
                break
            if e.errno == errno.EINVAL:  # SEEK_DATA unsupported
                return None
            raise
        if data >= size:
            break
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), size)
        if len(out) >= MAX_SEGMENTS:
            return None
        out.append((data, hole))
        off = hole
    return out


def _size_tmp(fd: int, size: int, in_place: bool = False) -> None:
    """Give a write-back's target its final size before the data segments are copied into it,
    so the holes between them stay holes (EFBIG here: the backing filesystem cannot hold a
    file that large). ``in_place``: the target holds an older version, whose bytes where the
    file now has holes must not show through: emptied first."""
    if in_place:
        os.ftruncate(fd, 0)
    os.ftruncate(fd, size)


def _allocated(fd: int, size: int) -> int:
    """Bytes the file ``fd`` occupies (``st_blocks`` * 512), at most its size rounded to 4 KiB
    blocks: what its write-back will actually copy."""
    st = os.fstat(fd)
    return min(st.st_blocks * 512, -(-size // 4096) * 4096)


def _probe_size(tree: BackingTree, prefix: bytes, size: int) -> bool:
    """Whether the backing filesystem holds a file of ``size`` bytes: a fresh empty temporary
    file in the backing root (``prefix`` + random, ``O_EXCL``) is sized to it (a hole: no
    space used) and removed. False only on EFBIG (or EINVAL, which some filesystems answer);
    raises OSError for anything else."""
    fd, name = tree.create_tmp(b"", prefix)
    try:
        os.ftruncate(fd, size)
        return True
    except OSError as e:
        if e.errno in (errno.EFBIG, errno.EINVAL):
            return False
        raise
    finally:
        os.close(fd)
        tree.unlink_quiet(name)


def _copy_range_durable(src: int, dst: int, offset: int, length: int) -> None:
    """One write-back slice: copy, then push it to the disk within this transaction."""
    _copy_range(src, dst, offset, length)
    sync_range(dst, offset, length)


def atime_before_copy(fd: int) -> int:
    """The atime (ns) of the data file ``fd`` as the mount shows it, taken before a write-back
    reads it. The copy reads through :func:`unrenewing_reader`, which leaves the atime alone;
    where that descriptor is refused, the copy's read renews it (relatime renews an atime older
    than the ctime, and the ``utime`` that set it, as ``tar -x``, ``cp -a`` and ``touch -a`` do,
    moved the ctime), and the atime an ``fstat`` after the copy sees is the write-back's own.
    An ``fstat`` of an open descriptor: no I/O."""
    return os.fstat(fd).st_atime_ns


def _finish_tmp(tmp_fd: int, src_fd: int, size: int, atime_ns: int) -> None:
    """Size, attributes and xattrs of the data file onto the temporary file, with the atime
    ``atime_ns`` (:func:`atime_before_copy`); fsync; close."""
    try:
        os.ftruncate(tmp_fd, size)
        if src_fd != tmp_fd:
            _finish_attrs_and_times(tmp_fd, src_fd, atime_ns)
        os.fsync(tmp_fd)
    finally:
        if src_fd != tmp_fd:
            os.close(tmp_fd)


def _copy_small(tmp_fd: int, src_fd: int, size: int, limit: int) -> int:
    """A file of at most ``limit`` bytes onto its temporary file in one call (one thread
    hand-off, one scheduler transaction, where sizing, copying and finishing took three):
    :func:`_size_tmp`, :func:`_copy_data` (durable), :func:`_finish_tmp` (attributes, fsync,
    close). ``tmp_fd`` is closed whatever happens. Returns the bytes of data copied."""
    try:
        atime_ns = atime_before_copy(src_fd)
        os.ftruncate(tmp_fd, size)
        _, copied = _copy_data(src_fd, tmp_fd, 0, size, limit, True)
    except BaseException:
        os.close(tmp_fd)
        raise
    _finish_tmp(tmp_fd, src_fd, size, atime_ns)
    return copied


def _finish_in_place(dst: int, src: int, size: int, atime_ns: int) -> os.stat_result:
    """Size, mode, xattrs and times of the data file ``src`` onto the backing file ``dst`` it
    was copied into (a hard-linked file), with the atime ``atime_ns``
    (:func:`atime_before_copy`); fsync. Returns ``dst``'s stat."""
    os.ftruncate(dst, size)
    st = os.fstat(src)
    os.fchmod(dst, st.st_mode & 0o7777)
    # after the data (a write drops the inode's capabilities) and the chmod: the xattrs the
    # file has through the mount, and no others of those names
    _copy_xattrs(src, dst, caps=True, exact=True)
    os.utime(dst, ns=(atime_ns, st.st_mtime_ns))
    os.fsync(dst)
    return os.fstat(dst)


DirTimes = tuple[tuple[int, int], int]  # (atime_ns, mtime_ns) before, mtime_ns after creating


def _parent(rel: bytes) -> bytes:
    return split(rel)[0]


def _create_tmp(tree: BackingTree, tmp: bytes, flags: int) -> tuple[int, DirTimes]:
    """Create the write-back temporary file ``tmp`` (``O_CREAT | O_EXCL | O_NOFOLLOW``, 0600,
    beneath the backing root: a planted file or symlink of that name fails with EEXIST or
    ELOOP, never is opened); returns it and its directory's times before and after (the commit
    gives the directory its times back: the temporary file is tierfs' business, not the
    user's)."""
    parent = _parent(tmp)
    before = tree.dir_times(parent)
    fd = tree.open(tmp, flags | os.O_CREAT | os.O_EXCL, 0o600)
    return fd, (before, tree.dir_times(parent)[1])


def _commit(tree: BackingTree, tmp: bytes, final: bytes, dir_times: DirTimes | None = None) -> os.stat_result:
    """Rename into place, give the directory back its times (those from before write-back
    touched it, or, if someone set them meanwhile - ``tar -x``, ``cp -a`` and ``rsync -a``
    restore directory times last - those), and make it durable."""
    parent = _parent(final)
    restore = None
    if dir_times is not None:
        before, after_create = dir_times
        now = tree.dir_times(parent)
        restore = before if now[1] == after_create else now
    tree.rename(tmp, final)
    if restore is not None:
        tree.utime(parent, restore)
    tree.fsync_dir(parent)
    return tree.lstat(final)


@dataclass
class GroupItem:
    """One small file of a group write-back (:func:`_group_create`, :func:`_group_commit`):
    its temporary name (journaled), final name (in the same directory), data file and size,
    and ``current()``, which says whether the copy is still of the file's current generation
    and name. The calls fill in the rest."""

    tmp: bytes
    final: bytes
    src_fd: int
    size: int
    current: Callable[[], bool]
    made: bool = False  # created, copied and fsynced under its temporary name
    outcome: os.stat_result | Exception | None = None  # stat of the committed file, or why not
    copied: int = 0
    tmp_left: bool = False  # the temporary file may still exist (the caller removes it)


def _group_create(tree: BackingTree, parent: bytes, items: list[GroupItem], limit: int) -> DirTimes:
    """The first half of a group write-back (group commit) of files of at most ``limit``
    bytes, all in directory ``parent``: each is created under its temporary name
    (``O_CREAT | O_EXCL | O_NOFOLLOW``: EEXIST or ELOOP when the name was planted), copied,
    given its attributes and fsynced (:func:`_copy_small`). An item that failed has its
    exception as outcome. Raises OSError only if nothing was created (the directory is gone).
    Returns the directory's times as :func:`_create_tmp` does."""
    before = tree.dir_times(parent)
    for it in items:
        try:
            fd = tree.open(it.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            it.outcome = e
            continue
        it.tmp_left = True
        try:
            it.copied = _copy_small(fd, it.src_fd, it.size, limit)  # (closes fd)
        except Exception as e:  # noqa: BLE001 - this item's outcome
            it.outcome = e
            continue
        it.made = True
    return before, tree.dir_times(parent)[1]


def _group_commit(tree: BackingTree, parent: bytes, items: list[GroupItem], dir_times: DirTimes) -> None:
    """The second half (its commit locks held by the caller): each item made and still
    current is renamed into place and every other temporary file removed; the directory gets
    its times back (as :func:`_commit`) and is fsynced once; only then are the renames
    durable, and each committed item's outcome is its final file's lstat (a stale item keeps
    None, a failed one its exception)."""
    before, after_create = dir_times
    committed = []
    try:
        now = tree.dir_times(parent)
        for it in items:
            if not it.made or not it.current():
                continue
            try:
                tree.rename(it.tmp, it.final)
            except OSError as e:
                it.outcome = e
                continue
            it.tmp_left = False
            committed.append(it)
        for it in items:
            if it.tmp_left:
                try:
                    tree.unlink(it.tmp)
                    it.tmp_left = False
                except FileNotFoundError:
                    pass  # moved with its directory: the caller removes it by its new name
        tree.utime(parent, before if now[1] == after_create else now)
        tree.fsync_dir(parent)
        for it in committed:
            it.outcome = tree.lstat(it.final)
    except OSError as e:
        for it in items:
            if it.made and not isinstance(it.outcome, os.stat_result):
                it.outcome = e  # renamed perhaps, not known durable: written back again


def _fsync_lstat(tree: BackingTree, fd: int, path: bytes) -> os.stat_result:
    os.fsync(fd)
    return tree.lstat(path)


def _other_mount(backing: bytes) -> str:
    """The mountpoint of another tierfs mount of ``backing`` (from /proc/self/mounts), or a
    description if none is listed (a daemon still starting, or in another mount namespace)."""
    want = os.path.realpath(backing)
    try:
        with open("/proc/self/mounts", "rb") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and parts[2] == b"fuse.tierfs":
                    src = parts[0].replace(b"\\040", b" ").replace(b"\\\\", b"\\")
                    if os.path.realpath(src) == want:
                        return os.fsdecode(parts[1].replace(b"\\040", b" "))
    except OSError:
        pass
    return "another tierfs daemon (not listed in /proc/self/mounts)"


def lock_backing(tree: BackingTree) -> int:
    """Take the backing directory for this daemon's life: ``flock(LOCK_EX | LOCK_NB)`` on a
    read-only descriptor of its root (the same inode whatever path or bind mount names it).
    Two daemons on one backing directory delete each other's temporary files and lose closed
    files. Returns the descriptor (closing it releases the lock). Raises MountError naming the
    other mount."""
    fd = tree.open(b"", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            # e.g. NFS, which emulates flock with byte-range locks a read-only descriptor of a
            # directory cannot take: mount anyway, undetected
            log.warning("cannot lock the backing directory %s (%s): a second tierfs mount of it "
                        "would not be refused", os.fsdecode(tree.root), e.strerror)
            return fd
        os.close(fd)
        raise MountError(f"backing directory {os.fsdecode(tree.root)} is already mounted by tierfs "
                         f"at {_other_mount(tree.root)}; unmount that first (two daemons on one "
                         "backing directory would lose each other's writes)") from None
    return fd


def _finish_attrs_only(dst: int, src: int) -> os.stat_result:
    """Mode, owner and xattrs (:func:`_copy_xattrs`, capabilities included: after the chown,
    which would drop them) of ``src`` onto ``dst``; returns ``src``'s stat."""
    st = os.fstat(src)
    try:
        os.fchown(dst, st.st_uid, st.st_gid)
    except PermissionError:
        pass
    # after the chown, which clears setuid/setgid: written back in the other order, a setuid
    # file lost its 0o4000 on the backing store (test_same_as_local[chmod_chown], ~1 run in 6)
    os.fchmod(dst, st.st_mode & 0o7777)
    _copy_xattrs(src, dst, caps=True)
    return st


def _finish_attrs_and_times(dst: int, src: int, atime_ns: int) -> None:
    """:func:`_finish_attrs_only`, then the data file's times onto ``dst``: ``atime_ns``, its
    atime before the copy (:func:`atime_before_copy`), and its mtime."""
    st = _finish_attrs_only(dst, src)
    os.utime(dst, ns=(atime_ns, st.st_mtime_ns))


def _remove_tmp(tree: BackingTree, tmp: bytes, dir_times: DirTimes | None) -> None:
    """Remove a temporary file that will not be committed and give its directory back its
    times, as :func:`_commit` does (an aborted write-back must not change the mtime ``tar -x``
    restored meanwhile)."""
    parent = _parent(tmp)
    restore = None
    if dir_times is not None:
        before, after_create = dir_times
        now = tree.dir_times(parent)
        restore = before if now[1] == after_create else now
    tree.unlink_quiet(tmp)
    if restore is not None:
        tree.utime(parent, restore)
