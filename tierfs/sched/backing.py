"""Open backing files, shared by all handles (and queued fetches) of one file identity."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
import xxhash


def key_path(root: bytes, rel: bytes) -> str:
    """The path an :class:`Identity` carries for the file at canonical relative path ``rel``
    under the backing root ``root`` (bytes, as given at mount). The read path and the hint
    service both build it here, from the same canonical relative path, so that a hinted
    file's key is the key its reads look up (a realpath on one side and not the other made
    them differ whenever the backing path contained a symlink)."""
    return os.fsdecode(root + b"/" + rel if rel else root)


@dataclass(frozen=True)
class Identity:
    """What makes cached bytes valid: a change of any field is a different file (design
    invariant 6). ``mtime_ns`` catches in-place writes, ``ino`` catches rename-over.
    ``ctime_ns`` is the one field no user can set: path, size, mtime and inode number can all
    be reproduced by another user once a file is gone (create the name again in a shared
    directory, get the freed inode number back - ext4 and xfs reuse it at once - truncate,
    ``utime``), and that user would then read the old file's cached bytes through the mount."""

    path: str
    size: int
    mtime_ns: int
    ino: int
    dev: int
    ctime_ns: int = 0

    @classmethod
    def of(cls, path: str, st: os.stat_result) -> Identity:
        return cls(path, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns)

    @functools.cached_property
    def key(self) -> str:
        """Stable name of this identity: tier file name and catalog key (xxh3-64, hex).
        Computed once (an open of a resident file asked for it twice, ~1.5 us each)."""
        raw = f"{self.path}\0{self.size}\0{self.mtime_ns}\0{self.ino}\0{self.dev}\0{self.ctime_ns}".encode(
            "utf-8", "surrogateescape"
        )
        return xxhash.xxh3_64_hexdigest(raw)


@dataclass(eq=False)
class BackingFile:
    """An open file of the backing store. ``refs`` counts handles and queued fetches; the fd is
    closed when it drops to zero. ``order`` approximates the file's place on disk (device, inode:
    ext4 and xfs allocate inodes near their data's block group), for the elevator."""

    identity: Identity
    fd: int
    refs: int = 0
    opens: int = 0  # open handles (refs also counts queued fetches)
    stale: bool = False  # set when a fetch saw the file change under it
    # A reader passes through to it (the kernel reads it, not the daemon): its page cache is
    # that reader's, so a fetch into a tier leaves the pages it read there (see _copy_checked)
    kernel_reads: bool = False
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.key = self.identity.key

    @property
    def size(self) -> int:
        return self.identity.size

    @property
    def path(self) -> str:
        return self.identity.path

    @property
    def order(self) -> tuple[int, int]:
        return (self.identity.dev, self.identity.ino)

    def acquire(self) -> None:
        self.refs += 1

    def release(self, close: Callable[[int], object] = os.close) -> None:
        """Drop a reference; the last one closes the descriptor with ``close``."""
        self.refs -= 1
        if self.refs <= 0 and self.fd >= 0:
            fd, self.fd = self.fd, -1
            close(fd)


class Openings:
    """Opens of backing files under way, by path relative to the root. A reader's open and a
    prefetch's open of the same file often come within a millisecond of each other; the
    second waits for the first (:meth:`wait`) and then shares its descriptor instead of
    opening the file again."""

    def __init__(self) -> None:
        self._by_path: dict[bytes, trio.Event] = {}

    async def wait(self, rel: bytes) -> None:
        """Return once no open of ``rel`` is under way."""
        while (ev := self._by_path.get(rel)) is not None:
            await ev.wait()

    def busy(self, rel: bytes) -> bool:
        """Whether an open of ``rel`` is under way."""
        return rel in self._by_path

    def begin(self, rel: bytes) -> trio.Event:
        ev = self._by_path[rel] = trio.Event()
        return ev

    def end(self, rel: bytes, ev: trio.Event) -> None:
        if self._by_path.get(rel) is ev:
            del self._by_path[rel]
        ev.set()
