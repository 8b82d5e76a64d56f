"""The daemon's log: where it goes, and one line per event that matters.

Events that matter are mount, unmount, a tier full, a write-back deadline missed, a backing-store
error and recovery after a crash; a read never logs (at ``info`` and above). An event that can
repeat at the rate of reads or writes (a backing store that fails every read, a write tier that
is full for every file of a checkpoint) goes through :func:`event`, which logs its first
occurrence and then at most one line per :data:`EVENT_INTERVAL_S` per kind, counting the
others. A condition that lasts (write-back behind its deadlines) is logged when it starts and
when it ends, by :class:`LateWatch`.

Targets (``log_file``): a file, ``stderr``, ``syslog`` (``/dev/log``: syslog or journald) or
``syslog:SOCKET``. On stderr under systemd (``$JOURNAL_STREAM``) lines carry ``<N>`` level
prefixes instead of timestamps, so the journal records their priority. :func:`sd_notify` tells
systemd (``Type=notify``) when the mount is ready.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from tierfs import private
from tierfs.errors import MountError

EVENT_INTERVAL_S = 60.0  # at most one line per kind of repeated event per minute
WATCH_INTERVAL_S = 2.0  # how often the condition watcher looks at the write-back state
SYSLOG_DEFAULT = "/dev/log"
_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class _JournalFormatter(logging.Formatter):
    """``<6>tierfs.mount: message``: sd-daemon(3) priority prefixes, no timestamp (the journal
    adds its own)."""

    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITY.get(record.levelno, 6)
        return "\n".join(f"<{prio}>{record.name}: {line}" for line in super().format(record).splitlines())


def _stderr_is_journal() -> bool:
    """True when stderr is connected to journald (systemd sets ``JOURNAL_STREAM=dev:ino``)."""
    want = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(2)
    except OSError:
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


def handler_for(target: str | None) -> logging.Handler:
    """The log handler for a ``log_file`` value (see the module docstring).

    Raises:
        OSError: the syslog socket does not exist.
        MountError: the file cannot be opened, or is a symlink or not the daemon's user's.
    """
    if target and (target == "syslog" or target.startswith("syslog:")):
        address = target.partition(":")[2] or SYSLOG_DEFAULT
        h: logging.Handler = logging.handlers.SysLogHandler(
            address=address, facility=logging.handlers.SysLogHandler.LOG_DAEMON)
        h.ident = f"tierfs[{os.getpid()}]: "  # type: ignore[attr-defined]
        h.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        return h
    if target and target != "stderr":
        # created 0600, never through a symlink (tierfs.private.open_log)
        h = logging.StreamHandler(os.fdopen(private.open_log(target), "a", buffering=1))
        h.setFormatter(logging.Formatter(_FORMAT))
        return h
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(_JournalFormatter("%(message)s") if _stderr_is_journal() else logging.Formatter(_FORMAT))
    return h


def is_syslog(target: str | None) -> bool:
    return bool(target) and (target == "syslog" or str(target).startswith("syslog:"))


def check_target(target: str | None) -> None:
    """Fail at the door on a syslog socket that does not exist.

    Raises:
        MountError: naming ``log_file`` and the socket.
    """
    if is_syslog(target):
        address = str(target).partition(":")[2] or SYSLOG_DEFAULT
        try:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                    s.connect(address)
            except OSError:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(address)  # as SysLogHandler tries them
        except OSError as e:
            raise MountError(f"log_file={target}: cannot reach the syslog socket "
                             f"({e.strerror or e}); no syslog daemon or journald here?") from None


def stdio_path(target: str | None, state_dir: str) -> str:
    """Where a background daemon's stdout and stderr go: the log file itself, or
    ``state_dir/daemon.log`` when logging to stderr or syslog (for a crash's traceback)."""
    if not target or target == "stderr" or is_syslog(target):
        return os.path.join(state_dir, "daemon.log")
    return target


MAX_MESSAGE_CHARS = 2000  # of one log message (a traceback after it is kept whole)
# C0 controls, DEL, C1 controls and the Unicode line/paragraph separators: anything that could
# end a log line or move the cursor, written as \xNN / \uNNNN
_UNSAFE = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]}
_UNSAFE.update({0x2028: "\\u2028", 0x2029: "\\u2029"})


class SafeMessages(logging.Filter):
    """Every log message as one bounded line, whatever a module passed in: newlines and control
    characters escaped, cut at :data:`MAX_MESSAGE_CHARS`. Defense in depth behind
    :func:`user_text`, which log calls apply to user-supplied strings (file names, request
    paths): a name with a newline can then not forge a line in any module's messages."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is logging's own error to report
            return True
        safe = msg.translate(_UNSAFE)
        if len(safe) > MAX_MESSAGE_CHARS:
            safe = safe[:MAX_MESSAGE_CHARS] + f"...[{len(safe)} chars]"
        if safe != msg:
            record.msg, record.args = safe, None
        return True


def setup(level: str, target: str | None) -> None:
    """Send every ``tierfs`` log line at ``level`` and above to ``target`` (``log_file``); every
    message through :class:`SafeMessages`."""
    root = logging.getLogger()
    h = handler_for(target)
    h.addFilter(SafeMessages())
    root.handlers[:] = [h]
    root.setLevel(level.upper())
    logging.getLogger("pyfuse3").setLevel(logging.WARNING)


@dataclass
class Throttle:
    """At most one line per ``key`` per ``interval`` seconds; the next line that gets through
    says how many were held back. ``clock`` is injectable for tests."""

    interval: float = EVENT_INTERVAL_S
    clock: Callable[[], float] = time.monotonic
    _last: dict[str, float] = field(default_factory=dict)
    _held: dict[str, int] = field(default_factory=dict)

    def log(self, logger: logging.Logger, level: int, key: str, msg: str, *args: Any,
            exc_info: bool = False) -> bool:
        """Log ``msg % args`` unless a line of ``key`` was logged less than ``interval`` ago
        (``exc_info``: with the traceback of the exception being handled). Returns True if it
        was logged."""
        if not logger.isEnabledFor(level):
            return False
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        held = self._held.pop(key, 0)
        if held:
            msg += f" (and {held} more like it in the last {now - last:.0f}s)"  # type: ignore[operator]
        self._last[key] = now
        logger.log(level, msg, *args, exc_info=exc_info)
        return True


_THROTTLE = Throttle()


def event(logger: logging.Logger, level: int, key: str, msg: str, *args: Any,
          exc_info: bool = False) -> bool:
    """Log a repeatable event through the daemon's :class:`Throttle` (one line per ``key`` per
    :data:`EVENT_INTERVAL_S`)."""
    return _THROTTLE.log(logger, level, key, msg, *args, exc_info=exc_info)


@dataclass
class LateWatch:
    """Write-back behind its deadlines, logged once when it starts and once when it ends.

    :meth:`update` takes the write-back statistics (``late_files``: dirty files past their
    ``writeback_deadline``) and returns the line to log, if any, with its level."""

    late: bool = False

    def update(self, stats: Any) -> tuple[int, str] | None:
        late_files = getattr(stats, "late_files", 0)
        if late_files and not self.late:
            self.late = True
            eta = stats.eta_s
            return (logging.WARNING,
                    f"write-back deadline missed: {late_files} file(s) not on the backing store "
                    f"by writeback_deadline; {stats.dirty_files} dirty files, {stats.dirty_bytes} "
                    f"bytes, done in {'?' if eta is None else f'{eta:.0f}'}s at the measured rate "
                    "(the backing store is slower than the writes, or write-back fails: see above)")
        if not late_files and self.late:
            self.late = False
            return (logging.INFO, "write-back caught up: no file is past its deadline")
        return None


async def watch(writeback_stats: Callable[[], Any], logger: logging.Logger,
                interval: float = WATCH_INTERVAL_S) -> None:
    """Log the start and end of lasting conditions (:class:`LateWatch`) until cancelled."""
    late = LateWatch()
    while True:
        await trio.sleep(interval)
        line = late.update(writeback_stats())
        if line is not None:
            logger.log(*line)


def sd_notify(state: str) -> bool:
    """Send ``state`` (``"READY=1"``, ``"STOPPING=1"``, ``"STATUS=..."``) to systemd when it
    started us with ``Type=notify`` (``$NOTIFY_SOCKET``). Returns False when not under systemd
    or when the socket cannot be reached (never raises)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall(state.encode())
    except OSError:
        return False
    return True


USER_TEXT_LIMIT = 200  # characters of a user-supplied string kept in a log line


def user_text(s: str | bytes | None, limit: int = USER_TEXT_LIMIT) -> str:
    """A user-supplied string (a path from a control request, a checkpoint dir, a file name)
    made safe for one log line: newlines, control and other non-printable characters (and
    undecodable bytes) escaped as :func:`repr` escapes them, then cut to about ``limit``
    characters with a marker giving the full length. A newline in a request can then not
    start a forged log line, nor a 100 MB path make a 100 MB line."""
    if s is None:
        return "None"
    n, unit = len(s), "chars"
    if isinstance(s, bytes):
        unit = "bytes"
        s = s[: limit * 4].decode("utf-8", "surrogateescape")
    text = repr(s[:limit])[1:-1]
    if n > limit:
        text += f"...[{n} {unit}]"
    return text
