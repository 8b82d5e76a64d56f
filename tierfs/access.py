"""Who asks, and what they may see: the credentials of a control request and the kernel's
permission check, applied to paths on the backing tree.

The daemon runs as root and the control file ``<mnt>/.tierfs/ctl`` is open to every user of the
mount, so a request must act with its caller's rights, not the daemon's. The caller is whoever
*opened* the control file (its uid, gid, supplementary groups and pid at open): an open
descriptor is a capability, as in Unix. Paths are then resolved the way the kernel resolves a
read by that caller: search (x) permission on every directory on the way, read permission on
the file; mode bits only (a tierfs mount uses ``default_permissions`` and has no ACLs); uid 0
passes. Resolution goes through :class:`~tierfs.backing_tree.BackingTree`, component by
component, so a symlink is followed only the way the kernel follows it through the mount (a
relative target inside the mount; an absolute one only if it points back into the mountpoint),
never out of the backing root; the result is the canonical relative path, the same one the
read path keys its cache by.

All resolution calls block (one ``lstat`` per new directory, one per file): run them through
an :class:`tierfs.io.Device`.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from tierfs.backing_tree import BackingTree
from tierfs.errors import HintDenied, HintError

R_OK, W_OK, X_OK = 4, 2, 1
MAX_SYMLINKS = 40  # as the kernel's path walk (ELOOP beyond)
MAX_DIRS = 65536  # directories a Resolver remembers (~100 bytes each)


@dataclass(frozen=True)
class Caller:
    """The credentials a control request acts with: the opener of the control file."""

    uid: int
    gid: int
    pid: int = 0
    groups: frozenset[int] = field(default_factory=frozenset)

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def may(self, st: os.stat_result, want: int) -> bool:
        """Whether the mode bits of ``st`` grant ``want`` (``R_OK|W_OK|X_OK`` bits) to this
        caller, as the kernel's ``generic_permission`` without ACLs: the owner's bits for the
        owner, the group's for a member of the file's group, else the others'. Root passes,
        except execute of a non-directory with no x bit at all."""
        mode = st.st_mode
        if self.uid == 0:
            return not (want & X_OK and not stat.S_ISDIR(mode) and not mode & 0o111)
        if st.st_uid == self.uid:
            bits = (mode >> 6) & 7
        elif st.st_gid == self.gid or st.st_gid in self.groups:
            bits = (mode >> 3) & 7
        else:
            bits = mode & 7
        return bits & want == want

    def owns(self, st: os.stat_result) -> bool:
        return self.uid == 0 or st.st_uid == self.uid


ROOT = Caller(0, 0)


def proc_groups(pid: int) -> frozenset[int]:
    """The supplementary groups of process ``pid`` (``Groups:`` of ``/proc/PID/status``);
    empty if the process is gone. A cheap procfs read (~20 us), done once per open."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()


def caller_of(uid: int, gid: int, pid: int) -> Caller:
    """The :class:`Caller` for a FUSE request context (fsuid, fsgid, pid of the opener)."""
    return Caller(uid, gid, pid, proc_groups(pid) if pid > 0 else frozenset())


def normalize(rel: str | bytes) -> bytes:
    """A request path as a normalised relative path (``b""`` = the mount root). Raises
    HintError for an absolute path, NUL, or ``..`` leading out of the mount."""
    b = os.fsencode(rel)
    if b"\0" in b:
        raise HintError("a path must not contain NUL")
    if b.startswith(b"/"):
        raise HintError("paths are relative to the mount root")
    norm = os.path.normpath(b) if b else b"."
    if norm == b".." or norm.startswith(b"../"):
        raise HintError("a path leads outside the mount")
    return b"" if norm == b"." else norm


class Resolver:
    """Resolves request paths for one caller within ``tree`` (see the module docstring). Keeps
    what it learnt about directories for its own lifetime: make one per request.

    Args:
        tree: the backing tree. caller: whose rights apply. mountpoint: the mount's absolute
            path (bytes), so that an absolute symlink pointing back into the mount resolves as
            the kernel would resolve it; other absolute targets lead outside.
    """

    def __init__(self, tree: BackingTree, caller: Caller, mountpoint: bytes = b"") -> None:
        self.tree = tree
        self.caller = caller
        self.mountpoint = mountpoint.rstrip(b"/")
        # given dir -> canonical dir, or the error it gave (type, args)
        self._dirs: dict[bytes, bytes | tuple[type[BaseException], tuple[Any, ...]]] = {}

    # -- files -----------------------------------------------------------------------------
    def file(self, rel: bytes, want: int = R_OK) -> tuple[bytes, os.stat_result]:
        """``(canonical relative path, stat)`` of the file ``rel`` names (normalised, see
        :func:`normalize`), which the caller may access with ``want`` (0: only reach it).

        Raises:
            FileNotFoundError: it does not exist (or a component on the way is not a directory).
            HintDenied: a directory on the way is not searchable by the caller, or the file not
                accessible with ``want`` (the same answer whether the file exists or not, when
                the directory is not searchable).
            HintError: the path leads outside the mount (through ``..`` or a symlink).
        """
        if not rel:
            raise FileNotFoundError(errno.ENOENT, "the mount root is not a file")
        canon, st = self._walk(rel)
        if want and not self.caller.may(st, want):
            raise HintDenied(f"permission denied ({_want_name(want)})")
        return canon, st

    def dir(self, rel: bytes) -> bytes:
        """The canonical path of directory ``rel``, searchable by the caller (every directory
        on the way too). Raises like :meth:`file` (NotADirectoryError for a non-directory)."""
        cached = self._dirs.get(rel)
        if cached is not None:
            if isinstance(cached, tuple):
                # a fresh exception each time: re-raising one cached instance grows its
                # traceback by every raise, and the frames it holds tie it into a cycle
                raise cached[0](*cached[1])
            return cached
        try:
            if not rel:
                st = self.tree.lstat(b"")
                canon = b""
            else:
                # resolve the ancestors first, outermost first, so that the walk below finds
                # its parent cached (no recursion as deep as the path)
                chain = []
                p = rel.rpartition(b"/")[0]
                while p and p not in self._dirs:
                    chain.append(p)
                    p = p.rpartition(b"/")[0]
                for p in reversed(chain):
                    self.dir(p)
                canon, st = self._walk(rel)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory")
            if not self.caller.may(st, X_OK):
                raise HintDenied("permission denied (search)")
        except (OSError, HintDenied, HintError) as e:
            self._remember(rel, (type(e), e.args))
            raise
        self._remember(rel, canon)
        return canon

    def _remember(self, rel: bytes, what: bytes | tuple[type[BaseException], tuple[Any, ...]]) -> None:
        if len(self._dirs) >= MAX_DIRS:
            self._dirs.clear()
        self._dirs[rel] = what

    def existing_prefix(self, rel: bytes) -> bytes:
        """For a directory that need not exist yet (a checkpoint dir): check that the caller
        may search every existing directory on the way; returns ``rel``. Raises HintDenied,
        HintError, NotADirectoryError."""
        parts = rel.split(b"/") if rel else []
        for i in range(len(parts) + 1):
            try:
                self.dir(b"/".join(parts[:i]))
            except FileNotFoundError:
                break
        return rel

    def _walk(self, rel: bytes) -> tuple[bytes, os.stat_result]:
        """Resolve ``rel`` (following symlinks the way the kernel follows them through the
        mount): ``(canonical path, lstat of the target)``; every directory on the way must be
        searchable by the caller."""
        links = 0
        parent, _, name = rel.rpartition(b"/")
        while True:
            cur = self.dir(parent)
            child = cur + b"/" + name if cur else name
            if name in (b"", b".", b".."):
                # only from a symlink target; normalise through the dir walk
                raise HintError("a path leads outside the mount")
            try:
                st = self.tree.lstat(child)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ENOTDIR):
                    raise FileNotFoundError(errno.ENOENT, "no such file") from None
                if e.errno in (errno.ELOOP, errno.EXDEV):
                    raise HintError("a path leads outside the mount") from None
                raise
            if not stat.S_ISLNK(st.st_mode):
                return child, st
            links += 1
            if links > MAX_SYMLINKS:
                raise HintError("too many levels of symbolic links")
            target = self.tree.readlink(child)
            if target.startswith(b"/"):
                if self.mountpoint and (target + b"/").startswith(self.mountpoint + b"/"):
                    target = target[len(self.mountpoint):].lstrip(b"/")
                    joined = target
                else:
                    raise HintError("a symlink leads outside the mount")
            else:
                joined = cur + b"/" + target if cur else target
            new = normalize(joined)
            if not new:
                return b"", self.tree.lstat(b"")
            parent, _, name = new.rpartition(b"/")


def _want_name(want: int) -> str:
    return "/".join(n for bit, n in ((R_OK, "read"), (W_OK, "write"), (X_OK, "execute")) if want & bit)
