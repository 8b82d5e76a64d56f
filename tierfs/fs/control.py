"""The control plane: files in ``<mnt>/.tierfs/``, and the protocol of its command file.

Read-only files (stats.json, ...) get their content made at open. Reads use ``direct_io`` (the
content has no fixed size, and the page cache must not keep an old snapshot); these files are
never mapped, so the mmap caveat of direct_io does not apply.

The command file (``ctl``) takes one JSON request line per write sequence and answers it on the
same descriptor (:meth:`ControlPlane.write`): requests are capped (``wire.MAX_REQUEST_BYTES``,
per-user and global byte budgets), answered in a task of their own, read back when ready.
Errors are :class:`~tierfs.fs.api.FuseError`; the handler layer (:mod:`tierfs.fs.handlers`)
calls in here for every control inode.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from tierfs import logevents, tasks
from tierfs.access import Caller, caller_of
from tierfs.fs.api import Attr, DirEmit, FuseError, OpenReply, RequestCtx
from tierfs.fs.handles import ControlHandle, HandleTable
from tierfs.fs.inodes import CONTROL_DIR, FIRST_CONTROL_FILE
from tierfs_hints import wire

log = logging.getLogger("tierfs.fs")

# A command gets the request line and the credentials of whoever opened the control file
# (an open descriptor is a capability, as in Unix: see tierfs.access).
Command = Callable[[bytes, Caller], Awaitable[bytes]]


@dataclass(frozen=True)
class ControlFile:
    """``render(uid)`` makes a read-only file's content at open, for the opener ``uid``. A
    *command* file instead takes a
    request (one JSON line, written) and answers it (read back from the same descriptor); the
    ``write`` returns only when the command has finished, so a command can wait (``flush``)."""

    inode: int
    name: bytes
    render: Callable[[int], bytes]
    command: Command | None = None


# Bytes of requests held at once over every open command file (collected, or being answered):
# four maximal requests. Beyond it a write fails (EFBIG) and the reply says so.
MAX_PENDING_BYTES = 4 * wire.MAX_REQUEST_BYTES
# Of those, what one user other than root may hold (two maximal requests): one user keeping
# unfinished request lines open on several descriptors used to take the whole budget and lock
# every other user, root included, out of the control plane. Root is held to no budget (its
# requests are the operator's; the bytes it may hold are bounded by its open descriptors).
MAX_USER_PENDING_BYTES = 2 * wire.MAX_REQUEST_BYTES
# what control files show on a mount whose opens the kernel answers (ControlPlane.attrs): the
# view of a user other than root, for everyone
SHARED_VIEW_UID = 65534
# how long one rendering answers a user's GETATTRs and READs (ns): see ControlPlane.attrs
RENDER_STABLE_NS = 1_000_000_000
# Requests sent as ioctls (a read-only mount: ControlPlane.ioctl). A session holds a handle and
# what its request and reply hold (those bytes are bounded by the budgets above): the caps
# bound the handles. Root is held to neither (as to no byte budget): users filling the daemon's
# sessions must not lock the operator out. 8 ranks x 10 DataLoader workers waiting on a need
# at once is ordinary: the per-user cap is far above that (a review: 64 refused 16 of 80).
MAX_USER_SESSIONS = 1024
MAX_SESSIONS = 8192
# A session ends when its client closes it; a client killed mid-request never does: a session
# whose process is gone is let go at the next new session or refused budget, one that moved no
# bytes for SESSION_IDLE_S (a process alive but stuck, or one tierfs cannot see: pid 0 in
# another pid namespace) at the next new session, and one whose request is still not whole
# after SESSION_MAX_S whatever it does.
SESSION_IDLE_S = 120.0
SESSION_MAX_S = 600.0
SWEEP_EVERY_S = 1.0  # the sweep at a new session reads /proc/PID/stat of each session's process
MAX_SWEEP_CHECKS = 256  # ... of at most this many (idle a second or more, the oldest first)


@dataclass(eq=False)
class _Session:
    """A request sent as ioctls (:meth:`ControlPlane.ioctl`)."""

    handle: ControlHandle
    started: float  # time.monotonic() at its first piece
    used: float  # time.monotonic() of its last piece that moved bytes
    process: tuple[int, bytes] | None  # (pid, start time) of its sender, None if unknown
    received: int = 0  # bytes of its request taken (the offset its next piece must have)
    busy: int = 0  # pieces being served now (never swept meanwhile)


def _process_of(pid: int) -> tuple[int, bytes] | None:
    """(pid, its start time from /proc/PID/stat): the process, not a later one with its pid."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return pid, f.read().rsplit(b")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _gone(process: tuple[int, bytes] | None) -> bool:
    return process is not None and _process_of(process[0]) != process


class ControlPlane:
    """Args:
        files: name -> render; ``render(uid)`` makes a read-only file's content at open for the
            opener ``uid`` (a file may show root more than other users).
        commands: name -> command (see :data:`Command`).
    """

    def __init__(self, files: dict[str, Callable[[int], bytes]],
                 commands: dict[str, Command] | None = None) -> None:
        self.pending_bytes = 0  # held by users other than root, see MAX_PENDING_BYTES
        self.pending_by_uid: dict[int, int] = {}  # see MAX_USER_PENDING_BYTES
        self.by_name: dict[bytes, ControlFile] = {}
        self.by_inode: dict[int, ControlFile] = {}
        # a read-only mount whose opens the kernel answers (Handlers.read_inode): no open makes a
        # snapshot, so a GETATTR of a file renders it, kept here for the READs that follow:
        # inode -> (content, time_ns)
        self.kernel_opens = False
        self.rendered: dict[int, tuple[bytes, int]] = {}
        # requests sent as ioctls: (uid, token) -> session (see ioctl)
        self.sessions: dict[tuple[int, bytes], _Session] = {}
        self.sessions_by_uid: dict[int, int] = {}
        self.swept_at = -math.inf  # time.monotonic() of the last sweep at a new session
        items: list[tuple[str, Callable[[int], bytes], Command | None]] = [
            (n, r, None) for n, r in files.items()]
        items += [(n, lambda uid: b"", c) for n, c in (commands or {}).items()]
        for i, (name, render, command) in enumerate(sorted(items, key=lambda t: t[0])):
            cf = ControlFile(FIRST_CONTROL_FILE + i, name.encode(), render, command)
            self.by_name[cf.name] = cf
            self.by_inode[cf.inode] = cf

    def hold(self, uid: int, n: int) -> str | None:
        """Account ``n`` more request bytes held for ``uid``; None if within the budgets, else
        why not (then nothing is accounted). Before refusing, the sessions of clients that are
        gone give their bytes back (:meth:`_sweep_sessions`)."""
        if uid == 0:
            return None
        error = self._hold(uid, n)
        if error is not None and self.sessions and self._sweep_sessions(eager=True):
            error = self._hold(uid, n)
        return error

    def _hold(self, uid: int, n: int) -> str | None:
        mine = self.pending_by_uid.get(uid, 0)
        if mine + n > MAX_USER_PENDING_BYTES:
            return (f"uid {uid} already holds {mine} bytes of requests (MAX_USER_PENDING_BYTES "
                    f"{MAX_USER_PENDING_BYTES}); finish or close earlier requests")
        if self.pending_bytes + n > MAX_PENDING_BYTES:
            return (f"the daemon already holds {self.pending_bytes} bytes of requests "
                    f"(MAX_PENDING_BYTES {MAX_PENDING_BYTES}); retry later")
        self.pending_by_uid[uid] = mine + n
        self.pending_bytes += n
        return None

    def unhold(self, uid: int, n: int) -> None:
        """Give back ``n`` request bytes accounted by :meth:`hold` for ``uid``."""
        if uid == 0 or n == 0:
            return
        self.pending_bytes -= n
        left = self.pending_by_uid.get(uid, 0) - n
        if left > 0:
            self.pending_by_uid[uid] = left
        else:
            self.pending_by_uid.pop(uid, None)

    # -- the protocol (called by the handler layer for control inodes) ---------------------------
    def is_control(self, inode: int) -> bool:
        return inode == CONTROL_DIR or inode in self.by_inode

    def attrs(self, inode: int, attr_timeout: float, uid: int | None = None) -> Attr:
        """Attributes of the control directory or one of its files (owned by the daemon's user;
        a command file is writable by all: a request acts with the opener's rights).

        With :attr:`kernel_opens` (and a caller), a read-only file is rendered now and kept for
        the READs that follow (:meth:`read_rendered`): its size is the content's, its mtime
        the rendering's, and its attributes are never cached (``attr_timeout`` 0), so the
        kernel asks again before each read(2) and drops its pages of an older rendering
        (auto_inval_data): the page cache it keeps across the opens it answers never serves an
        old snapshot. A rendering is kept for :data:`RENDER_STABLE_NS`: a reader whose read(2)
        calls each ask again (a short read, then one at the end) must not get the end of a
        newer rendering of another size (torn JSON, seen at once when each GETATTR rendered
        anew). It is the one every user other than root gets (:data:`SHARED_VIEW_UID`), for
        every caller: the kernel keeps one page cache per file for all users, so a rendering
        per caller gave one user another's (root's, with the paths of quarantined files) and
        tore each other's JSON."""
        size, when = 0, 0
        if inode == CONTROL_DIR:
            mode, nlink = stat.S_IFDIR | 0o555, 2
        else:
            cf = self.by_inode[inode]
            mode, nlink = stat.S_IFREG | (0o666 if cf.command else 0o444), 1
            if self.kernel_opens:
                attr_timeout = 0.0
                if uid is not None and cf.command is None:
                    got = self._rendering(cf)
                    size, when = len(got[0]), got[1]
        return Attr(st_ino=inode, entry_timeout=attr_timeout, attr_timeout=attr_timeout,
                    st_mode=mode, st_nlink=nlink, st_uid=os.getuid(), st_gid=os.getgid(),
                    st_size=size, st_mtime_ns=when, st_ctime_ns=when)

    def read_rendered(self, inode: int, uid: int, off: int, size: int) -> bytes:
        """``size`` bytes at ``off`` of control file ``inode`` as last rendered (:meth:`attrs`;
        the same for every caller, ``uid`` included). A command file reads empty: its requests
        need a read-write mount (its replies come on the descriptor that wrote them)."""
        cf = self.by_inode[inode]
        if cf.command is not None:
            return b""
        return self._rendering(cf, fresh=False)[0][off : off + size]

    def _rendering(self, cf: ControlFile, fresh: bool = True) -> tuple[bytes, int]:
        """The kept rendering of ``cf`` (content, time_ns): a new one if none is kept, or if
        ``fresh`` and the kept one is older than :data:`RENDER_STABLE_NS`."""
        now = time.time_ns()
        got = self.rendered.get(cf.inode)
        if got is None or (fresh and now - got[1] > RENDER_STABLE_NS):
            got = self.rendered[cf.inode] = (cf.render(SHARED_VIEW_UID), now)
        return got

    def lookup(self, name: bytes, attr_timeout: float, uid: int | None = None) -> Attr:
        cf = self.by_name.get(name)
        if cf is None:
            raise FuseError(errno.ENOENT)
        return self.attrs(cf.inode, attr_timeout, uid)

    def readdir(self, start_id: int, emit: DirEmit, attr_timeout: float) -> None:
        files = sorted(self.by_name.values(), key=lambda c: c.name)
        for i in range(start_id, len(files)):
            cf = files[i]
            if not emit(cf.name, self.attrs(cf.inode, attr_timeout), i + 1):
                return

    def open(self, inode: int, ctx: RequestCtx, handles: HandleTable) -> OpenReply:
        cf = self.by_inode[inode]
        data = b"" if cf.command else cf.render(ctx.uid)
        # A write carries no request context: a command acts with the opener's
        # credentials, taken now (tierfs.access; one procfs read, ~20 us)
        caller = caller_of(ctx.uid, ctx.gid, ctx.pid) if cf.command else None
        h = ControlHandle(data, name=cf.name, caller=caller)
        return OpenReply(handles.add(h), direct_io=True)

    @staticmethod
    async def read(h: ControlHandle, off: int, size: int) -> bytes:
        """The snapshot, or the reply to the last request once it is ready."""
        if h.answered is not None:
            await h.answered.wait()
        return h.data[off : off + size]

    def release(self, h: ControlHandle) -> None:
        if h.caller is not None:  # a request never finished, a reply held
            self.unhold(h.caller.uid, len(h.request) + h.held)
            h.held = 0
        h.closed = True
        h.request = bytearray()

    async def ioctl(self, inode: int, data: bytes, ctx: RequestCtx, nursery: trio.Nursery | None) -> bytes:
        """A piece of a request sent as ioctls of the command file
        (:data:`tierfs_hints.wire.CTL_IOC`, where a read-only mount refuses the writes the
        file takes elsewhere): ``data`` is the ioctl's buffer, the result its out buffer.

        A session is one request on one descriptor's stead: a :class:`ControlHandle` with the
        credentials of the process that sent its first piece, named by the token the client
        drew together with that process's uid (a token another user sends finds nothing). Its
        pieces go through :meth:`write` and :meth:`read`, under the same caps and budgets; a
        WRITE piece carries its offset in the request, so a piece sent again (its ioctl was
        interrupted by a signal after the daemon took it) is taken once. It ends at
        CTL_OP_CLOSE, or when its client is gone (see :data:`SESSION_IDLE_S`). Raises
        FuseError: ENOTTY (not the command file), EINVAL (malformed, or a piece out of order),
        ENOENT (no such session), EMFILE (too many sessions), and those of :meth:`write`."""
        cf = self.by_inode.get(inode)
        if cf is None or cf.command is None:
            raise FuseError(errno.ENOTTY)
        if len(data) < wire.CTL_IOC_IN.size:
            raise FuseError(errno.EINVAL)
        magic, op, token, offset, n = wire.CTL_IOC_IN.unpack_from(data, 0)
        if magic != wire.CTL_IOC_MAGIC or n > len(data) - wire.CTL_IOC_IN.size:
            raise FuseError(errno.EINVAL)
        key = (ctx.uid, bytes(token))
        s = self.sessions.get(key)
        if op == wire.CTL_OP_CLOSE:
            if s is not None:
                self._end_session(key, s)
            return wire.CTL_IOC_OUT.pack(0, 0)
        if op == wire.CTL_OP_WRITE:
            if s is None:
                if offset:
                    raise FuseError(errno.ENOENT)  # (let go meanwhile: its start is lost)
                s = self._new_session(key, cf, ctx)
            if offset + n <= s.received and n:
                return wire.CTL_IOC_OUT.pack(0, 0)  # sent again after an interrupted ioctl: taken
            if offset != s.received:
                raise FuseError(errno.EINVAL)
            if n == 0:
                return wire.CTL_IOC_OUT.pack(0, 0)
            s.busy += 1
            try:
                s.received += n
                await self.write(s.handle, data[wire.CTL_IOC_IN.size:wire.CTL_IOC_IN.size + n], nursery)
            finally:
                s.busy -= 1
                s.used = time.monotonic()
            return wire.CTL_IOC_OUT.pack(0, 0)
        if op == wire.CTL_OP_READ:
            if s is None:
                raise FuseError(errno.ENOENT)
            s.busy += 1
            try:
                piece = await self.read(s.handle, offset, wire.CTL_IOC_SIZE - wire.CTL_IOC_OUT.size)
            finally:
                s.busy -= 1
                s.used = time.monotonic()
            return wire.CTL_IOC_OUT.pack(len(s.handle.data), len(piece)) + piece
        raise FuseError(errno.EINVAL)

    def _full(self, uid: int) -> bool:
        return uid != 0 and (len(self.sessions) >= MAX_SESSIONS
                             or self.sessions_by_uid.get(uid, 0) >= MAX_USER_SESSIONS)

    def _new_session(self, key: tuple[int, bytes], cf: ControlFile, ctx: RequestCtx) -> _Session:
        uid = key[0]
        now = time.monotonic()
        if self.sessions and (now - self.swept_at >= SWEEP_EVERY_S or self._full(uid)):
            self.swept_at = now
            self._sweep_sessions()
        if self._full(uid):
            logevents.event(log, logging.INFO, f"ctl-sessions:{uid}",
                            "control request of uid %d (pid %d) refused: too many requests in flight", uid, ctx.pid)
            raise FuseError(errno.EMFILE)
        # as an open of the file takes them (ControlPlane.open): one procfs read
        h = ControlHandle(b"", name=cf.name, caller=caller_of(ctx.uid, ctx.gid, ctx.pid))
        s = self.sessions[key] = _Session(h, now, now, _process_of(ctx.pid))
        self.sessions_by_uid[uid] = self.sessions_by_uid.get(uid, 0) + 1
        return s

    def _end_session(self, key: tuple[int, bytes], s: _Session) -> None:
        if self.sessions.pop(key, None) is None:
            return
        self.release(s.handle)
        left = self.sessions_by_uid.get(key[0], 0) - 1
        if left > 0:
            self.sessions_by_uid[key[0]] = left
        else:
            self.sessions_by_uid.pop(key[0], None)

    def _sweep_sessions(self, eager: bool = False) -> bool:
        """End the sessions no piece is being served in whose process is gone, that moved no
        bytes for :data:`SESSION_IDLE_S`, or whose request is not whole after
        :data:`SESSION_MAX_S`. A process is looked up (in /proc, on the event loop) for at
        most :data:`MAX_SWEEP_CHECKS` sessions, the oldest first, and only for those idle a
        second or more unless ``eager`` (a budget about to be refused). Returns whether it
        ended any."""
        now = time.monotonic()
        ended = False
        checks = 0  # /proc reads, bounded per sweep (it runs on the event loop)
        for key, s in list(self.sessions.items()):  # the oldest first
            if s.busy:
                continue
            unfinished = s.handle.answered is None and not s.handle.data
            gone = False
            if (eager or now - s.used > SWEEP_EVERY_S) and checks < MAX_SWEEP_CHECKS:
                checks += 1  # (a live client's pieces follow each other within microseconds)
                gone = _gone(s.process)
            if gone or now - s.used > SESSION_IDLE_S or (unfinished and now - s.started > SESSION_MAX_S):
                self._end_session(key, s)
                ended = True
        return ended

    def _refuse(self, h: ControlHandle, buf: bytes, error: str) -> FuseError:
        """Cut a request off here, not at the newline: a request line used to grow without
        limit (2.25 GiB of daemon memory, never returned). The reply names the cap."""
        assert h.caller is not None
        self.unhold(h.caller.uid, len(h.request) + h.held)
        h.held = 0
        h.request = bytearray()
        h.overflow = not buf.endswith(b"\n")
        h.data = json.dumps({"ok": False, "kind": "value", "error": error}).encode() + b"\n"
        h.answered = None
        logevents.event(log, logging.INFO, f"ctl-refused:{h.caller.uid}",
                        "control request of uid %d (pid %d) refused: %s", h.caller.uid, h.caller.pid, error)
        return FuseError(errno.EFBIG)

    async def write(self, h: ControlHandle, buf: bytes, nursery: trio.Nursery | None) -> int:
        """Collect a request; at its newline, answer it in a task of ``nursery`` (inline if
        None). Raises FuseError: EBADF (not a command file), EFBIG (over a cap: the reply
        says which), EBUSY (the previous request on this descriptor is not answered yet)."""
        cf = self.by_name[h.name]
        if cf.command is None or h.caller is None:
            raise FuseError(errno.EBADF)
        if h.overflow:
            # the rest of a request that went over its cap: dropped up to its newline
            h.overflow = b"\n" not in buf
            raise FuseError(errno.EFBIG)
        if h.answered is not None and not h.answered.is_set():
            raise FuseError(errno.EBUSY)  # one request at a time per descriptor
        n = len(buf)
        if len(h.request) + n > wire.MAX_REQUEST_BYTES:
            raise self._refuse(h, buf, f"request line longer than MAX_REQUEST_BYTES ({wire.MAX_REQUEST_BYTES} "
                                       "bytes); send fewer paths per request")
        # bounded per user too (MAX_USER_PENDING_BYTES): one user's unfinished requests
        # must not lock everyone else out
        error = self.hold(h.caller.uid, n)
        if error is not None:
            raise self._refuse(h, buf, error)
        h.request += buf
        if h.request.endswith(b"\n"):
            # The write returns at once and the reply is read back when ready: the kernel holds
            # the file's inode lock during a FUSE write, so a command answered inside the write
            # (a 10 s "wait") would hold up every other client's request behind it.
            request, h.request = h.request, bytearray()  # handed over, not copied
            answered = h.answered = trio.Event()
            # the previous reply on this descriptor is replaced by this one
            self.unhold(h.caller.uid, h.held)
            h.held = 0
            if nursery is None:
                await self._answer(h, cf.command, request, h.caller, answered)
            else:
                tasks.spawn(nursery, "control.answer", self._answer, h, cf.command, request, h.caller, answered)
        return len(buf)

    async def _answer(self, h: ControlHandle, command: Command, request: bytearray, caller: Caller,
                      answered: trio.Event) -> None:
        request_held = len(request)
        try:
            data = await command(request, caller)  # type: ignore[arg-type]
            self.unhold(caller.uid, request_held)
            request_held = 0
            # A reply stays in memory until its descriptor is closed or sends the next
            # request: it counts against the same per-user budget as requests (one
            # user holding replies of 50 MB on a thousand descriptors grew the daemon
            # without bound).
            error = None if h.closed else self.hold(caller.uid, len(data))
            if h.closed:
                data = b""
            elif error is None:
                h.held = len(data)
            else:
                data = json.dumps({"ok": False, "kind": "value",
                                   "error": f"reply of {len(data)} bytes not kept: {error}"}).encode() + b"\n"
            h.data = data
        finally:
            self.unhold(caller.uid, request_held)
            answered.set()
