"""The hints client: tell a tierfs mount what training will read, write and when.

Synchronous, standard library only, no open descriptors kept: safe in DataLoader workers and in
forked or spawned processes. Each call resolves its paths to the tierfs mount holding them and
sends one request per mount over the control file ``<mnt>/.tierfs/ctl`` (the wire format is
:mod:`tierfs_hints.wire`).

Paths
    A path is a ``str``, ``bytes`` or :class:`os.PathLike`, absolute or relative to the current
    directory. Where a call takes *paths*, it takes one path or an iterable of them (a list,
    a generator...); :func:`need` also takes ``(path, offset, length)`` items, a byte range
    (ints; ``offset >= 0`` bytes; ``length > 0`` bytes, or ``None`` for "to the end of the
    file"). A single range is passed in a list: ``need([(path, 0, 4096)])``.

    Each path is made absolute and normalised (not resolved: the file need not exist yet),
    its parent directory is resolved, symlinks followed (so a symlinked directory leading into
    a mount works), and the nearest enclosing directory that is a mount point holding
    ``.tierfs/ctl`` is its mount (:class:`MountFinder`). The daemon receives paths relative to
    the mount root, in the caller's order. Lookups are cached per directory (one ``lstat`` per
    new directory; results inside a mount kept until it stops answering, others for
    :data:`NEGATIVE_TTL_S` seconds), so a call costs no system call per path: ``need()`` of
    100 000 paths is one request and about 0.1-0.2 s of client time.

Off the mount
    Paths on no tierfs mount are skipped: the call is a no-op for them, and the first time it
    happens in a process (per :class:`Client`; the module functions share one) a
    :class:`TierfsHintWarning` says so. If every path is off-mount, :func:`need`, :func:`epoch`
    and :func:`phase` return a :class:`NeedHandle` that is already done with ``total_bytes=0``,
    :func:`release` returns 0, :func:`checkpoint` returns 0 and :func:`wait_durable` returns
    True. Scripts that use hints run unchanged on machines without tierfs.

Errors
    Every argument is checked before anything is sent, so bad input never reaches a daemon:
    ``ValueError`` naming the argument (and the index of a bad path) for wrong types, negative
    or non-finite numbers, an empty name, a path inside ``.tierfs/``, the mount root given as a
    file, or a path that enters a tierfs mount and leaves it again (through ``..`` or a symlinked
    directory pointing outside). A refusal by the daemon (``wire.ControlError``) becomes
    ``ValueError`` (kind "value": bad input, or over a request cap), ``PermissionError``
    (kind "perm": the calling user may not read a path, evict another user's file, or exceed
    its share) or ``OSError`` (kind "os"); a mount that stopped answering
    (daemon killed, unmounted) raises ``OSError`` naming the mount. Paths that do not exist on a
    mount are reported by the daemon; :func:`need`, :func:`epoch` and :func:`phase` then raise
    ``FileNotFoundError`` listing the first few, *after* the daemon registered the others: the
    exception's ``handle`` attribute is the :class:`NeedHandle` of what was registered (or pass
    ``missing_ok=True`` to get the handle with ``handle.missing`` instead of the exception).
    When a call spans several mounts and one refuses, the needs already registered on the
    others are cancelled before the exception propagates.
"""

from __future__ import annotations

import errno
import math
import numbers
import operator
import os
import re
import stat
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any

from tierfs_hints import wire

__all__ = [
    "Client",
    "MountFinder",
    "NeedHandle",
    "Progress",
    "TierfsHintWarning",
    "checkpoint",
    "default_client",
    "default_source",
    "epoch",
    "is_tierfs_root",
    "need",
    "parse_size",
    "phase",
    "release",
    "wait_durable",
]

#: Seconds a "not on a tierfs mount" answer is cached (a mount made later is seen after this).
NEGATIVE_TTL_S = 5.0
#: Longest single blocking request of :meth:`NeedHandle.wait` and :func:`wait_durable` when
#: waiting without a timeout, in seconds: a FUSE request cannot be interrupted, so Ctrl-C is
#: seen at the latest after this long.
WAIT_SLICE_S = 10.0
#: Missing paths named in a FileNotFoundError message (all of them are in ``.missing``).
MAX_LISTED = 5
#: Off-mount paths of one call tested for being a mount root themselves (bounds the cost of
#: an off-mount call; a root found once is known for good).
ROOT_CHECKS = 8
#: Priorities are limited to a signed 32-bit range.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
#: Longest label, phase name or source, in characters.
MAX_NAME = 1000
_TIERS = ("ram", "ssd", "staging")
_CONTROL_PREFIX = wire.CONTROL_DIR + "/"

PathArg = str | bytes | os.PathLike  # type: ignore[type-arg]
Deadline = float | int | datetime | timedelta | None


class TierfsHintWarning(UserWarning):
    """A hint was ignored (its paths are on no tierfs mount). Shown once per :class:`Client`."""


# --------------------------------------------------------------------------------------------
# Argument checks: each raises ValueError naming the function and the argument
# --------------------------------------------------------------------------------------------


def _seconds(value: Any, who: str, arg: str, *, past_ok: bool, positive: bool = False,
             dates: bool = True) -> float:
    """Seconds from now, as a finite float >= 0 (> 0 if ``positive``).

    ``value`` is a number of seconds, a :class:`timedelta` or (if ``dates``) a
    :class:`datetime`: aware, or naive in local time. A datetime in the past gives 0 if
    ``past_ok`` (the work is due now); a negative number or timedelta is always an error."""
    if isinstance(value, datetime):
        if not dates:
            raise ValueError(f"{who}: {arg} must be seconds or a timedelta, got a datetime")
        s = value.timestamp() - time.time()
        if s < 0:
            if not past_ok:
                raise ValueError(f"{who}: {arg} {value.isoformat()} is in the past")
            s = 0.0
        return s
    if isinstance(value, timedelta):
        s = value.total_seconds()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        s = float(value)
    else:
        what = "seconds (int or float), a datetime or a timedelta" if dates else \
            "seconds (int or float) or a timedelta"
        raise ValueError(f"{who}: {arg} must be {what}, got {type(value).__name__} {value!r}")
    if not math.isfinite(s):
        raise ValueError(f"{who}: {arg} must be finite, got {value!r}")
    if s < 0 or (positive and s == 0):
        raise ValueError(f"{who}: {arg} must be {'>' if positive else '>='} 0 seconds, got {value!r}")
    return s


def _int(value: Any, who: str, arg: str, minimum: int, maximum: int | None = None) -> int:
    if type(value) is not int:
        if isinstance(value, bool):
            raise ValueError(f"{who}: {arg} must be an int, got bool {value!r}")
        try:
            value = operator.index(value)  # NumPy and other integer types
        except TypeError:
            raise ValueError(f"{who}: {arg} must be an int, got {type(value).__name__} {value!r}") from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{who}: {arg} must be {bound}, got {value}")
    return int(value)


def _name(value: Any, who: str, arg: str, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{who}: {arg} must be a str, got {type(value).__name__} {value!r}")
    if not empty_ok and not value.strip():
        raise ValueError(f"{who}: {arg} must not be empty")
    if len(value) > MAX_NAME:
        raise ValueError(f"{who}: {arg} is {len(value)} characters long; the limit is {MAX_NAME}")
    return value


def _timeout(value: Any, who: str) -> float | None:
    return None if value is None else _seconds(value, who, "timeout", past_ok=False, dates=False)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_POW = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(value: int | str, *, who: str = "parse_size", arg: str = "size") -> int:
    """A byte count from an int or a string like ``"2GiB"``, ``"512M"``, ``"1.5 GB"``.

    ``K/M/G/T/P`` and ``KiB/MiB/...`` are powers of 1024; ``KB/MB/...`` powers of 1000 (as the
    ``tierfs`` command line reads sizes). Returns bytes (an int > 0).

    Raises:
        ValueError: naming ``arg``, for anything else (zero, negative, a fraction of a byte).
    """
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m or (m.group(3) and not m.group(2)):
            raise ValueError(f"{who}: {arg} must be bytes (an int) or a size like '2GiB', got {value!r}")
        number, unit, binary, b = m.groups()
        base = 1000 if (unit and b and not binary) else 1024
        exact = float(number) * base ** _POW[unit.lower()]
        if exact != int(exact) and not unit:
            raise ValueError(f"{who}: {arg} in bytes must be whole, got {value!r}")
        value = int(exact)
    return _int(value, who, arg, 1)


# --------------------------------------------------------------------------------------------
# Mount discovery
# --------------------------------------------------------------------------------------------


def is_tierfs_root(directory: str) -> bool:
    """True if ``directory`` is a mount point with a tierfs control file (``.tierfs/ctl``) that
    takes hints (:func:`tierfs_hints.wire.takes_requests`: a read-only mount on the pyfuse3
    transport takes none, so its paths are skipped with a warning instead of failing each
    hint).

    Two to six system calls; a dead FUSE mount (``ENOTCONN``) is not a mount point here."""
    if not (os.path.ismount(directory) and os.path.exists(wire.control_path(directory, wire.CTL_FILE))):
        return False
    try:
        return wire.takes_requests(directory)
    except OSError:
        return False


def _inside(path: str, root: str) -> bool:
    return path == root or root == "/" or path.startswith(root + "/")


@dataclass(frozen=True)
class _Dir:
    """What a directory path means: its real path, the tierfs mount holding it (None: none),
    the directory relative to that mount with a trailing "/" ("" for the root), whether a
    symlink was followed to get there, until when this holds, or why it is refused."""

    real: str
    root: str | None
    prefix: str
    linked: bool
    expires: float
    error: str | None = None


def _is_link(path: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False  # does not exist (yet): taken as written


class MountFinder:
    """Finds the tierfs mount of a directory; caches the answer per directory.

    A directory is resolved from its parent's cached answer with one ``lstat`` (is it a
    symlink?) and, outside any tierfs mount, one ``is_mount_root`` test; inside a tierfs mount
    no further mount is looked for (a mount stacked on a directory of a tierfs mount is not
    supported). So a call costs a few system calls per *new* directory and none per path.

    ``is_mount_root(directory) -> bool`` decides whether an absolute, normalised real directory
    is a tierfs mount root (default :func:`is_tierfs_root`; tests pass a fake). Answers inside
    a mount are kept until :meth:`forget`; answers outside any mount, and those that followed a
    symlink (it may be re-pointed, as a ``latest`` checkpoint link is), for ``negative_ttl_s``
    seconds. Plain dicts, no lock: several threads may share a finder (at worst a directory is
    looked up twice)."""

    #: entries kept before the caches are cleared (a bound on memory, ~300 bytes each)
    MAX_ENTRIES = 200_000

    def __init__(self, is_mount_root: Callable[[str], bool] | None = None,
                 negative_ttl_s: float = NEGATIVE_TTL_S) -> None:
        self._is_root = is_mount_root or is_tierfs_root
        self._ttl = negative_ttl_s
        self._roots: dict[str, tuple[str | None, float]] = {}  # directory -> (root, expires)
        self._dirs: dict[str, _Dir] = {}  # directory as named (not resolved) -> its meaning
        self.known_roots: set[str] = set()

    def root_of(self, directory: str, now: float | None = None) -> str | None:
        """The nearest tierfs mount root at or above ``directory`` (absolute, normalised),
        walking up lexically; None if there is none."""
        now = time.monotonic() if now is None else now
        walked: list[str] = []
        d = directory
        while True:
            hit = self._roots.get(d)
            if hit is not None and hit[1] > now:
                root = hit[0]
                break
            if self.is_root(d):
                root = d
                break
            walked.append(d)
            parent = os.path.dirname(d)
            if parent == d:
                root = None
                break
            d = parent
        expires = math.inf if root is not None else now + self._ttl
        if len(self._roots) > self.MAX_ENTRIES:
            self._roots.clear()
        for w in walked:
            self._roots[w] = (root, expires)
        if root is not None:
            self._roots[root] = (root, math.inf)
        return root

    def directory(self, directory: str, now: float) -> _Dir:
        """The meaning of an absolute, normalised directory path (cached; see the class)."""
        chain: list[str] = []  # directory and its ancestors up to the first one cached
        d = directory
        up: _Dir | None = None
        while True:
            hit = self._dirs.get(d)
            if hit is not None and hit.expires > now:
                up = hit
                break
            chain.append(d)
            if d == "/":
                break
            d = d[:d.rfind("/")] or "/"
        if len(self._dirs) + len(chain) > self.MAX_ENTRIES:
            self._dirs.clear()
        for d in reversed(chain):
            up = self._dirs[d] = self._step(d, up, now)
        assert up is not None
        return up

    def _step(self, directory: str, up: _Dir | None, now: float) -> _Dir:
        """Resolve ``directory`` from the answer for its parent (None for "/")."""
        if up is None:
            root = "/" if self.is_root("/") else None
            return _Dir("/", root, "", False, math.inf if root else now + self._ttl)
        name = directory[directory.rfind("/") + 1:]
        candidate = (up.real if up.real != "/" else "") + "/" + name
        link = _is_link(candidate)
        real = os.path.realpath(candidate) if link else candidate
        if link:
            root = self.root_of(real, now)
        elif up.root is not None:
            root = up.root
        else:
            root = real if self.is_root(real) else None
        error = up.error
        if error is None and up.root is not None and root is None:
            error = (f"is on the tierfs mount {up.root} but {directory} resolves to {real}, "
                     "outside it (a symlink leaving the mount)")
        linked = up.linked or link
        if root is None or real == root:
            prefix = ""
        else:
            prefix = real[len(root) + 1 if root != "/" else 1:] + "/"
        expires = now + self._ttl if (root is None or linked) else math.inf
        return _Dir(real, root, prefix, linked, expires, error)

    def is_root(self, directory: str) -> bool:
        """``is_mount_root(directory)``, remembered when true."""
        if self._is_root(directory):
            self.known_roots.add(directory)
            return True
        return False

    def dotdot_error(self, path: str, cwd: str, resolved: str) -> str | None:
        """Why ``path`` (as given, containing "..") is refused: it enters a tierfs mount and
        leaves it through "..". None if it does not."""
        full = path if path.startswith("/") else cwd + "/" + path
        stack: list[str] = []
        for comp in full.split("/"):
            if comp == "..":
                root = self.root_of("/" + "/".join(stack))
                if root is not None and not _inside(resolved, root):
                    return f"leaves the tierfs mount {root} through '..' (it names {resolved})"
                if stack:
                    stack.pop()
            elif comp and comp != ".":
                stack.append(comp)
        return None

    def forget(self, root: str) -> None:
        """Drop every cached answer that led to ``root`` (it stopped answering)."""
        self.known_roots.discard(root)
        self._roots = {d: v for d, v in self._roots.items() if v[0] != root}
        self._dirs = {d: v for d, v in self._dirs.items() if v.root != root}


# --------------------------------------------------------------------------------------------
# Progress and handles
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """Where a need stands (a snapshot; summed over the mounts it spans).

    Attributes:
        total_bytes: bytes the need covers (each file or range counted once).
        resident_bytes: bytes of it held now per tier: ``{"ram": B, "ssd": B, "staging": B}``
            (staging: daemon memory, fetched but not in a tier).
        remaining_bytes: bytes still to fetch from the backing store.
        fraction: ``1 - remaining_bytes / total_bytes`` in [0, 1]; 1.0 when ``total_bytes`` is 0.
        deadline_in_s: seconds until the deadline (negative once passed); None without one.
        projected_s: the daemon's estimate of the seconds until done; None if unknown or done.
            Over several mounts, the largest.
        done: every byte is resident (True for a need with nothing on a tierfs mount).
        missed: the deadline passed before the need was done (on any mount).
        cancelled: :meth:`NeedHandle.cancel` was called.
    """

    total_bytes: int
    resident_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_TIERS, 0))
    remaining_bytes: int = 0
    fraction: float = 1.0
    deadline_in_s: float | None = None
    projected_s: float | None = None
    done: bool = True
    missed: bool = False
    cancelled: bool = False

    @classmethod
    def merge(cls, replies: list[dict[str, Any]], cancelled: bool = False) -> Progress:
        """Sum the ``progress`` replies of the daemons (one per mount)."""
        total = sum(int(r.get("total_bytes", 0)) for r in replies)
        remaining = sum(int(r.get("remaining_bytes", 0)) for r in replies)
        resident = dict.fromkeys(_TIERS, 0)
        for r in replies:
            for tier, b in (r.get("resident_bytes") or {}).items():
                resident[tier] = resident.get(tier, 0) + int(b)
        deadlines = [float(r["deadline_in_s"]) for r in replies if r.get("deadline_in_s") is not None]
        projected = [float(r["projected_s"]) for r in replies if r.get("projected_s") is not None]
        return cls(
            total_bytes=total, resident_bytes=resident, remaining_bytes=remaining,
            fraction=min(1.0, max(0.0, 1.0 - remaining / total)) if total else 1.0,
            deadline_in_s=min(deadlines) if deadlines else None,
            projected_s=max(projected) if projected else None,
            done=all(bool(r.get("done")) for r in replies),
            missed=any(bool(r.get("missed")) for r in replies),
            cancelled=cancelled or any(bool(r.get("cancelled")) for r in replies))


class NeedHandle:
    """The registration of one :func:`need`, :func:`epoch` or :func:`phase` call.

    Holds only strings and numbers (no descriptor; picklable if its client is). Dropping a
    handle does not cancel the need. As a context manager it cancels the need on exit.

    Attributes:
        ids: ``[(mount_root, need_id), ...]``, one per mount the call reached.
        label: the label (or phase name) given.
        files: files the daemons registered.
        nbytes: bytes the daemons registered (from their first reply).
        missing: absolute paths the daemons reported missing (not registered).
        skipped: paths ignored because they are on no tierfs mount.
    """

    def __init__(self, client: Client, ids: list[tuple[str, Any]], *, label: str = "",
                 files: int = 0, nbytes: int = 0, missing: list[str] | None = None,
                 skipped: int = 0) -> None:
        self.client = client
        self.ids = ids
        self.label = label
        self.files = files
        self.nbytes = nbytes
        self.missing = missing or []
        self.skipped = skipped
        self._done: set[int] = set()  # indices into ids: done
        self._withdrawn: set[int] = set()  # indices into ids: cancelled
        self._cancelled = False

    def __repr__(self) -> str:
        mounts = sorted({root for root, _ in self.ids})
        return (f"<NeedHandle {self.label!r}: {self.files} files, {self.nbytes} bytes on "
                f"{mounts}{', cancelled' if self._cancelled else ''}>")

    def progress(self) -> Progress:
        """A :class:`Progress` snapshot: one ``progress`` request per mount.

        Raises:
            OSError: a mount stopped answering. ValueError: the daemon no longer knows the need
            (it was restarted).
        """
        if not self.ids:
            return Progress(total_bytes=0, cancelled=self._cancelled)
        replies = [self.client._call(root, {"op": "progress", "id": nid}) for root, nid in self.ids]
        return Progress.merge(replies, self._cancelled)

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Block until every byte is resident; True if so, False on timeout or cancellation.

        ``timeout`` is seconds (or a timedelta) for the whole wait, over all mounts; None waits
        as long as it takes, in requests of at most :data:`WAIT_SLICE_S` seconds so that
        Ctrl-C (KeyboardInterrupt) is not held up longer than that. ``timeout=0`` polls.

        Raises:
            ValueError: a negative or non-finite timeout. OSError: a mount stopped answering.
        """
        limit = _timeout(timeout, "NeedHandle.wait")
        if self._cancelled:
            return False
        deadline = None if limit is None else time.monotonic() + limit
        for i, (root, nid) in enumerate(self.ids):
            while i not in self._done:
                left = WAIT_SLICE_S if deadline is None else \
                    max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic()))
                try:
                    reply = self.client._call(root, {"op": "wait", "id": nid, "timeout": left})
                except TimeoutError:  # a daemon that answers a timeout with an error
                    reply = {"timed_out": True}
                if reply.get("done"):
                    self._done.add(i)
                elif reply.get("cancelled") or not reply.get("timed_out", True):
                    return False  # cancelled (or the daemon gave up on it)
                elif deadline is not None and time.monotonic() >= deadline:
                    return False
        return True

    def cancel(self) -> None:
        """Withdraw the need on every mount (fetches not started are dropped; data already
        resident stays). Idempotent; a need the daemon no longer knows is ignored.

        Raises:
            OSError: a mount stopped answering.
        """
        self._cancelled = True
        for i, (root, nid) in enumerate(self.ids):
            if i in self._withdrawn:
                continue
            try:
                self.client._call(root, {"op": "cancel", "id": nid})
            except ValueError:
                pass  # unknown id: nothing left to cancel
            self._withdrawn.add(i)  # after an OSError, a later cancel() tries this mount again

    def __enter__(self) -> NeedHandle:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.cancel()
        except OSError:
            if exc_type is None:
                raise  # else keep the original exception


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------

_hostname: str | None = None


def default_source() -> str:
    """``"host:pid"`` of this process: the default ``source`` of :func:`epoch` and :func:`phase`
    (the daemon keeps one epoch order per source)."""
    global _hostname
    if _hostname is None:
        import socket

        _hostname = socket.gethostname()
    return f"{_hostname}:{os.getpid()}"


class _Groups:
    """Paths of one call, split by mount: ``items[root]`` in the caller's order."""

    __slots__ = ("items", "skipped", "first_skipped", "total")

    def __init__(self) -> None:
        self.items: dict[str, list[Any]] = {}
        self.skipped = 0
        self.first_skipped: str | None = None
        self.total = 0


def _stack_level() -> int:
    """The ``stacklevel`` of the first frame outside this package (for warnings)."""
    f = sys._getframe(1)
    level = 1
    while f.f_back is not None and f.f_globals.get("__name__", "").startswith("tierfs_hints"):
        f = f.f_back
        level += 1
    return level


class Client:
    """Sends hints to tierfs mounts. The module functions (:func:`need`...) use one shared
    instance (:func:`default_client`); make another to fake the daemon in tests, or to have a
    separate cache and off-mount warning.

    Args:
        request: ``request(mount_root, req) -> reply`` (default :func:`tierfs_hints.wire.request`,
            looked up at each call).
        is_mount_root: the test of a mount root for :class:`MountFinder`.
        negative_ttl_s: seconds an off-mount answer is cached.
        source: the default ``source`` of :meth:`epoch` and :meth:`phase` (default
            :func:`default_source`, evaluated at each call, so a forked worker has its own).
    """

    def __init__(self, *, request: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None,
                 is_mount_root: Callable[[str], bool] | None = None,
                 negative_ttl_s: float = NEGATIVE_TTL_S, source: str | None = None) -> None:
        self._request = request
        self.finder = MountFinder(is_mount_root, negative_ttl_s)
        self.source = source
        self.warned = False
        self.warned_cap = False  # the MAX_ITEMS warning of epoch(), once per client

    # -- plumbing ---------------------------------------------------------------------------
    def _call(self, root: str, req: dict[str, Any]) -> dict[str, Any]:
        """One request to the daemon of ``root``, its errors mapped to ValueError / OSError."""
        op = req["op"]
        send = self._request or wire.request
        try:
            return send(root, req)
        except wire.ControlError as e:
            if e.kind == "os":
                raise OSError(f"tierfs mount {root}: the {op} hint failed: {e}") from e
            if e.kind == "perm":
                raise PermissionError(errno.EACCES, f"tierfs mount {root} refused the {op} hint: {e}") from e
            if e.kind == "timeout" or str(e) == "timed out":
                raise TimeoutError(f"tierfs mount {root}: the {op} request timed out") from e
            raise ValueError(f"tierfs mount {root} refused the {op} hint: {e}") from e
        except OSError as e:
            if isinstance(e, wire.DaemonBusy):  # the daemon answered: the mount is alive
                raise OSError(e.errno, f"the {op} hint: {e.strerror}") from e
            self.finder.forget(root)
            raise OSError(e.errno, f"tierfs mount {root} did not answer the {op} hint "
                                   f"({e.strerror or e}); is its daemon still running?") from e
        except ValueError as e:  # the reply is not JSON
            raise OSError(errno.EPROTO, f"tierfs mount {root}: malformed reply to {op} ({e})") from e

    def _warn_skipped(self, who: str, groups: _Groups) -> None:
        if groups.skipped and not self.warned:
            self.warned = True
            warnings.warn(
                f"tierfs_hints.{who}: {groups.first_skipped!r}"
                + (f" (and {groups.skipped - 1} more of {groups.total} paths)" if groups.skipped > 1 else "")
                + " is not on a tierfs mount that takes hints (read-only mounts on the pyfuse3 "
                "transport take none); hints "
                "for such paths are ignored (shown once)",
                TierfsHintWarning, stacklevel=_stack_level())

    def _source(self, source: str | None, who: str) -> str:
        if source is None:
            return self.source or default_source()
        return _name(source, who, "source")

    def _resolve(self, paths: Any, who: str, arg: str, *, ranges: bool, files: bool = True) -> _Groups:
        """Check and group ``paths`` by mount. ``ranges``: entries are ``[rel, offset, length]``
        (else rel strings; a range item is then reduced to its file and consecutive repeats of
        one file are merged). ``files``: the mount root itself is refused."""
        if isinstance(paths, str | bytes | os.PathLike):
            paths = (paths,)
        elif not isinstance(paths, Iterable):
            raise ValueError(f"{who}: {arg} must be a path or an iterable of paths, got "
                             f"{type(paths).__name__} {paths!r}")
        finder = self.finder
        dirs = finder._dirs
        normpath = os.path.normpath
        now = time.monotonic()
        cwd: str | None = None
        g = _Groups()
        last: dict[str, str] = {}
        n = -1
        for n, item in enumerate(paths):
            offset, length = 0, None
            if type(item) is str:
                s = item
            elif isinstance(item, tuple | list):
                s, offset, length = self._range(item, who, arg, n)
            else:
                s = _fspath(item, who, arg, n)
            if not s or "\0" in s:
                raise ValueError(f"{who}: {arg}[{n}] {s!r} is not a valid path "
                                 f"({'empty' if not s else 'contains NUL'})")
            if s[0] != "/":
                cwd = cwd or os.getcwd()
                s_abs = cwd + "/" + s
            else:
                s_abs = s
            # normpath (pure Python before 3.12) only where needed: most paths are normal
            ap = normpath(s_abs) if "//" in s_abs or "/." in s_abs or s_abs[-1] == "/" else s_abs
            k = ap.rfind("/")
            parent = ap[:k] or "/"
            d = dirs.get(parent)
            if d is None or d.expires <= now:
                d = finder.directory(parent, now)
            if d.error is not None:
                raise ValueError(f"{who}: {arg}[{n}] {s!r} {d.error}")
            if ".." in s:
                err = finder.dotdot_error(s, cwd or os.getcwd(), ap)
                if err is not None:
                    raise ValueError(f"{who}: {arg}[{n}] {s!r} {err}")
            root = d.root
            if root is None:
                # the mount root itself is a path outside its mount: known, or a few checked
                if ap in finder.known_roots or (g.skipped < ROOT_CHECKS and finder.is_root(ap)):
                    raise ValueError(f"{who}: {arg}[{n}] {s!r} is the root of a tierfs mount, not a file")
                g.skipped += 1
                if g.first_skipped is None:
                    g.first_skipped = s
                continue
            rel = d.prefix + ap[k + 1:]
            if rel == wire.CONTROL_DIR or rel.startswith(_CONTROL_PREFIX):
                raise ValueError(f"{who}: {arg}[{n}] {s!r} is in the tierfs control directory")
            lst = g.items.get(root)
            if lst is None:
                lst = g.items[root] = []
            if ranges:
                lst.append([rel, offset, length])
            elif last.get(root) != rel:
                lst.append(rel)
                last[root] = rel
        g.total = n + 1
        return g

    @staticmethod
    def _range(item: tuple[Any, ...] | list[Any], who: str, arg: str, n: int) -> tuple[str, int, int | None]:
        if len(item) != 3:
            raise ValueError(f"{who}: {arg}[{n}] must be a path or (path, offset, length), got "
                             f"a {type(item).__name__} of {len(item)} elements")
        p, offset, length = item
        s = p if type(p) is str else _fspath(p, who, arg, n)
        offset = _int(offset, who, f"{arg}[{n}] offset", 0)
        if length is not None:
            length = _int(length, who, f"{arg}[{n}] length", 1)
        return s, offset, length

    def _register(self, who: str, groups: _Groups, make: Callable[[list[Any]], dict[str, Any]],
                  label: str, missing_ok: bool) -> NeedHandle:
        """Send one need-like request per mount; a handle for all of them."""
        self._warn_skipped(who, groups)
        for root, items in groups.items.items():
            if len(items) <= wire.MAX_ITEMS:
                continue
            if who != "epoch":
                raise ValueError(f"{who}: {len(items)} paths on {root} are over the daemon's MAX_ITEMS "
                                 f"({wire.MAX_ITEMS}) per request; split them into several calls")
            # an epoch order is a forecast: its first MAX_ITEMS files are announced (readahead
            # serves the rest), so samplers over huge datasets keep working
            if not self.warned_cap:
                self.warned_cap = True
                warnings.warn(f"tierfs_hints.epoch: {len(items)} files on {root}; only the first "
                              f"{wire.MAX_ITEMS} (MAX_ITEMS) are announced (shown once)",
                              TierfsHintWarning, stacklevel=_stack_level())
            del items[wire.MAX_ITEMS:]
        ids: list[tuple[str, Any]] = []
        files = nbytes = 0
        missing: list[str] = []
        try:
            for root, items in groups.items.items():
                reply = self._call(root, make(items))
                ids.append((root, reply["id"]))  # sent back as received
                files += int(reply.get("files", 0))
                nbytes += int(reply.get("bytes", 0))
                missing += [os.path.join(root, m) for m in reply.get("missing") or ()]
        except BaseException:
            self._undo(ids)
            raise
        handle = NeedHandle(self, ids, label=label, files=files, nbytes=nbytes, missing=missing,
                            skipped=groups.skipped)
        if missing and not missing_ok:
            listed = ", ".join(missing[:MAX_LISTED]) + (", ..." if len(missing) > MAX_LISTED else "")
            e = FileNotFoundError(
                errno.ENOENT, f"{who}: {len(missing)} of {groups.total} paths do not exist: {listed} "
                "(the others are registered: cancel them with the exception's .handle, or pass "
                "missing_ok=True)", missing[0])
            e.handle = handle  # type: ignore[attr-defined]
            e.missing = missing  # type: ignore[attr-defined]
            raise e
        return handle

    def _undo(self, ids: list[tuple[str, Any]]) -> None:
        """Best effort: cancel needs registered by a call that then failed on another mount."""
        for root, nid in ids:
            try:
                self._call(root, {"op": "cancel", "id": nid})
            except (OSError, ValueError):
                pass

    # -- the hints --------------------------------------------------------------------------
    def need(self, paths: Any, by: Deadline = None, priority: int = 0, *, label: str = "",
             missing_ok: bool = False) -> NeedHandle:
        """Announce that these files (or byte ranges) will be read, in this order, and should be
        in a fast tier (RAM or SSD) by ``by``. See :func:`need`."""
        deadline = None if by is None else _seconds(by, "need", "by", past_ok=True)
        priority = _int(priority, "need", "priority", PRIORITY_MIN, PRIORITY_MAX)
        label = _name(label, "need", "label", empty_ok=True)
        missing_ok = bool(missing_ok)
        groups = self._resolve(paths, "need", "paths", ranges=True)
        source = self._source(None, "need")

        def make(items: list[Any]) -> dict[str, Any]:
            return {"op": "need", "items": items, "deadline_s": deadline, "priority": priority,
                    "source": source, "label": label}

        return self._register("need", groups, make, label, missing_ok)

    def release(self, paths: Any) -> int:
        """Say these files are not needed again soon: their chunks are evicted first. Returns
        the number of chunks marked (summed over mounts). See :func:`release`."""
        groups = self._resolve(paths, "release", "paths", ranges=False)
        self._warn_skipped("release", groups)
        return sum(int(self._call(root, {"op": "release", "paths": rels}).get("chunks", 0))
                   for root, rels in groups.items.items())

    def epoch(self, order: Any, *, source: str | None = None, by: Deadline = None,
              missing_ok: bool = False) -> NeedHandle:
        """Announce the full access order of the coming epoch. See :func:`epoch`."""
        src = self._source(source, "epoch")
        deadline = None if by is None else _seconds(by, "epoch", "by", past_ok=True)
        groups = self._resolve(order, "epoch", "order", ranges=False)

        def make(rels: list[Any]) -> dict[str, Any]:
            req: dict[str, Any] = {"op": "epoch", "paths": rels, "source": src}
            if deadline is not None:
                req["deadline_s"] = deadline  # an optional field (see docs/hints.md)
            return req

        return self._register("epoch", groups, make, f"epoch {src}", missing_ok)

    def phase(self, name: str, at: Deadline, needs: Any, *, missing_ok: bool = False) -> NeedHandle:
        """Announce a phase (eval, checkpoint load) starting at ``at`` that reads ``needs``.
        See :func:`phase`."""
        name = _name(name, "phase", "name")
        if at is None:
            raise ValueError("phase: at is required (seconds from now, a datetime or a timedelta)")
        at_s = _seconds(at, "phase", "at", past_ok=True)
        src = self._source(None, "phase")
        groups = self._resolve(needs, "phase", "needs", ranges=False)

        def make(rels: list[Any]) -> dict[str, Any]:
            return {"op": "phase", "name": name, "at_s": at_s, "paths": rels, "source": src}

        return self._register("phase", groups, make, name, missing_ok)

    def checkpoint(self, directory: PathArg, nbytes: int | str, every: float | timedelta) -> int:
        """Reserve write-tier room for checkpoints written periodically into ``directory``.
        Returns the bytes reserved. See :func:`checkpoint`."""
        s = _fspath(directory, "checkpoint", "directory", None)
        nbytes = parse_size(nbytes, who="checkpoint", arg="nbytes")
        every_s = _seconds(every, "checkpoint", "every", past_ok=False, positive=True, dates=False)
        if not s or "\0" in s:
            raise ValueError(f"checkpoint: directory {s!r} is not a valid path")
        ap = os.path.abspath(s)
        d = self.finder.directory(ap, time.monotonic())
        if d.error is not None:
            raise ValueError(f"checkpoint: directory {s!r} {d.error}")
        if ".." in s:
            err = self.finder.dotdot_error(s, os.getcwd(), ap)
            if err is not None:
                raise ValueError(f"checkpoint: directory {s!r} {err}")
        groups = _Groups()
        groups.total = 1
        if d.root is None:
            groups.skipped, groups.first_skipped = 1, s
            self._warn_skipped("checkpoint", groups)
            return 0
        rel = d.prefix.rstrip("/") or "."
        if rel == wire.CONTROL_DIR or rel.startswith(_CONTROL_PREFIX):
            raise ValueError(f"checkpoint: directory {s!r} is in the tierfs control directory")
        reply = self._call(d.root, {"op": "checkpoint", "dir": rel, "nbytes": nbytes, "every_s": every_s})
        return int(reply.get("reserved_bytes", 0))

    def wait_durable(self, paths: Any, timeout: float | timedelta | None = None) -> bool:
        """Block until these written files are durable on the backing store. See
        :func:`wait_durable`."""
        limit = _timeout(timeout, "wait_durable")
        groups = self._resolve(paths, "wait_durable", "paths", ranges=False)
        self._warn_skipped("wait_durable", groups)
        deadline = None if limit is None else time.monotonic() + limit
        for root, rels in groups.items.items():
            while True:
                left = WAIT_SLICE_S if deadline is None else \
                    max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic()))
                try:
                    reply = self._call(root, {"op": "flush", "paths": rels, "timeout": left})
                    if not reply.get("timed_out"):
                        break
                except TimeoutError:  # the daemon's answer to a flush that timed out
                    pass
                if deadline is not None and time.monotonic() >= deadline:
                    return False
        return True


def _fspath(p: Any, who: str, arg: str, n: int | None) -> str:
    where = arg if n is None else f"{arg}[{n}]"
    try:
        s = os.fspath(p)
    except TypeError:
        what = "a path (str or os.PathLike)" + ("" if n is None else " or (path, offset, length)")
        raise ValueError(f"{who}: {where} must be {what}, got {type(p).__name__} {p!r}") from None
    return os.fsdecode(s) if isinstance(s, bytes) else s


# --------------------------------------------------------------------------------------------
# Module functions: the shared client
# --------------------------------------------------------------------------------------------

_default = Client()


def default_client() -> Client:
    """The :class:`Client` behind the module functions (one per process)."""
    return _default


def need(paths: Any, by: Deadline = None, priority: int = 0, *, label: str = "",
         missing_ok: bool = False) -> NeedHandle:
    """Announce that files (or byte ranges) will be read, in this order, and should be in a fast
    tier by ``by``; the daemon prefetches them, earliest deadline first.

    Args:
        paths: one path, or an iterable of paths and ``(path, offset, length)`` byte ranges
            (bytes; ``length`` None = to the end of the file), in the order they will be read.
            100 000 items are fine (one request per mount).
        by: the deadline: None (prefetch in order after all deadline work), seconds from now
            (int/float >= 0), a :class:`timedelta`, or a :class:`datetime` (aware, or naive in
            local time; one in the past means "now", without error).
        priority: an int in the signed 32-bit range, default 0: among needs with the same
            deadline (or none), higher priority is fetched first.
        label: free text shown in the daemon's stats and log.
        missing_ok: if True, paths that do not exist are listed in ``handle.missing`` instead of
            raising FileNotFoundError.

    Returns:
        A :class:`NeedHandle` (``progress()``, ``wait(timeout)``, ``cancel()``); done at once,
        with ``total_bytes=0``, if no path is on a tierfs mount.

    Raises:
        ValueError: bad arguments (nothing sent), or the daemon refused the request.
        FileNotFoundError: some paths do not exist on their mount (the others are registered;
            ``e.handle``). OSError: a mount did not answer.
    """
    return _default.need(paths, by, priority, label=label, missing_ok=missing_ok)


def release(paths: Any) -> int:
    """Mark files as not needed again soon: their cached chunks are evicted first (nothing is
    dropped before room is needed). Returns the number of chunks marked.

    Raises:
        ValueError: bad paths. OSError: a mount did not answer.
    """
    return _default.release(paths)


def epoch(order: Any, *, source: str | None = None, by: Deadline = None,
          missing_ok: bool = False) -> NeedHandle:
    """Announce the access order of the coming epoch: the files in the order they will be read,
    duplicates allowed (a file read twice). It replaces the previous order of the same
    ``source``, so calling it at the start of every epoch is right.

    Args:
        order: paths (``(path, offset, length)`` items are reduced to their file); consecutive
            repeats of one file are merged before sending.
        source: who reads in this order (default ``"host:pid"``, :func:`default_source`); DDP
            ranks and DataLoader workers each need their own.
        by: optional deadline for the whole order, as in :func:`need` (sent as the optional
            ``deadline_s`` field of the epoch request).
        missing_ok: as in :func:`need`.

    Returns:
        A :class:`NeedHandle` for the prefetch of the order.

    Raises:
        As :func:`need`.
    """
    return _default.epoch(order, source=source, by=by, missing_ok=missing_ok)


def phase(name: str, at: Deadline, needs: Any, *, missing_ok: bool = False) -> NeedHandle:
    """Announce a phase (evaluation, a checkpoint load) that starts at ``at`` and reads
    ``needs``: a need of those files with that deadline, labelled ``name``.

    Args:
        name: non-empty label, e.g. ``"eval"``.
        at: seconds from now, a timedelta, or a datetime (in the past: now).
        needs: paths, as for :func:`epoch`.
        missing_ok: as in :func:`need`.

    Returns:
        A :class:`NeedHandle`.

    Raises:
        As :func:`need`.
    """
    return _default.phase(name, at, needs, missing_ok=missing_ok)


def checkpoint(directory: PathArg, nbytes: int | str, every: float | timedelta) -> int:
    """Declare that a checkpoint of about ``nbytes`` is written into ``directory`` every
    ``every`` seconds: the daemon keeps that much write-tier room free, so the write never waits
    for eviction. Calling it again for the same directory replaces the declaration.

    Args:
        directory: the checkpoint directory (need not exist yet).
        nbytes: bytes (int > 0), or a size string: ``"40GiB"``, ``"512M"`` (K/M/G/T and KiB...
            are powers of 1024, KB/MB... of 1000).
        every: the period, seconds > 0 or a timedelta.

    Returns:
        Bytes reserved (0 off-mount; the daemon may reserve less than asked if the write tier is
        smaller).

    Raises:
        ValueError: bad arguments, or refused. OSError: the mount did not answer.
    """
    return _default.checkpoint(directory, nbytes, every)


def wait_durable(paths: Any, timeout: float | timedelta | None = None) -> bool:
    """Block until these files, written through the mount, are durable on the backing store
    (written back and fsynced). Files that are not dirty count as durable.

    Args:
        paths: the files.
        timeout: seconds (or a timedelta) for the whole wait; None waits as long as it takes
            (in slices of :data:`WAIT_SLICE_S` s, so Ctrl-C works).

    Returns:
        True when durable, False on timeout. True at once off-mount or for no paths.

    Raises:
        ValueError: bad arguments. OSError: a mount did not answer, or a write-back failed.
    """
    return _default.wait_durable(paths, timeout)

