"""Typed errors of tierfs.

Inner layers raise these; only the FUSE boundary (:mod:`tierfs.fs.handlers`) maps them to an
errno, and only the CLI turns :class:`ConfigError` / :class:`MountError` into a one-line message.
"""

from __future__ import annotations

import errno as _errno


class TierfsError(Exception):
    """Base class. ``errno`` is what the FUSE boundary answers for it."""

    errno: int = _errno.EIO


class ConfigError(TierfsError, ValueError):
    """A bad flag, config key or value. The message names the key and what is allowed."""

    errno = _errno.EINVAL


class MountError(TierfsError):
    """The mount cannot be set up (missing backing dir, busy mountpoint, no /dev/fuse, ...)."""


class ForeignJournal(MountError):
    """The write tier's journal holds files not yet written back to another backing directory
    (``recorded``) than the one being mounted: recovering them would write one store's files
    into another."""

    def __init__(self, msg: str, recorded: str, files: int) -> None:
        super().__init__(msg)
        self.recorded = recorded
        self.files = files


class TierFull(TierfsError):
    """A tier has no room for ``needed`` bytes. Never reaches a user: the cache falls back."""

    errno = _errno.ENOSPC

    def __init__(self, tier: str, needed: int) -> None:
        super().__init__(f"tier {tier!r} has no room for {needed} bytes")
        self.tier = tier
        self.needed = needed


class TierIOError(TierfsError):
    """A tier's device failed (EIO, ENOSPC from outside, ...). The cache drops the chunk and
    reads from the next tier or the backing store instead."""

    def __init__(self, tier: str, err: OSError) -> None:
        super().__init__(f"tier {tier!r}: {err}")
        self.tier = tier
        self.errno = err.errno or _errno.EIO


class BackingIOError(TierfsError):
    """The backing store failed for ``path``; carries the errno the user sees."""

    def __init__(self, path: str, err: OSError) -> None:
        super().__init__(f"backing store: {path}: {err.strerror or err}")
        self.path = path
        self.errno = err.errno or _errno.EIO


class BackingChanged(TierfsError):
    """The backing file changed (size/mtime/inode) while it was being read; the reader retries
    against the new identity at its next open."""

    errno = _errno.ESTALE


class HintError(TierfsError, ValueError):
    """A hint request the daemon refuses (bad field, path outside the mount); answered on the
    control file as ``{"ok": false, "kind": "value"}``, never a FUSE error."""

    errno = 22


class HintDenied(TierfsError):
    """The caller of a control request may not do what it asks (read a path, evict another
    user's data, exceed its share); answered on the control file as ``{"ok": false, "kind":
    "perm"}``, never a FUSE error. The message names what was refused."""

    errno = _errno.EACCES


class DirtyLimit(TierfsError):
    """A user other than root holds as many dirty files as one user may (each keeps one of the
    daemon's descriptors until it is written back); answered as EDQUOT."""

    errno = _errno.EDQUOT


class NotDurableYet(TierfsError, TimeoutError):
    """A wait for dirty files to reach the backing store ran out of time: ``pending`` of them
    are not there yet; ``durable`` names the files waited for that got there during the wait (a
    client that waits again, as ``tierfs flush`` does, reports those as well as the later
    ones)."""

    errno = _errno.ETIMEDOUT

    def __init__(self, pending: int, waited: int, timeout: float, durable: list[str]) -> None:
        super().__init__(f"{pending} of {waited} file(s) not yet durable after {timeout:g} s")
        self.pending = pending
        self.durable = durable
