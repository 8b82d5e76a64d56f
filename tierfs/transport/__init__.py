"""FUSE transports: what carries kernel requests to :class:`tierfs.fs.handlers.Handlers`.

* :mod:`tierfs.transport.pyfuse` - pyfuse3 (libfuse 3): portable, unprivileged mounts through
  fusermount3, any kernel.
* :mod:`tierfs.transport.native` - the kernel protocol over ``/dev/fuse`` in the trio loop
  (:mod:`tierfs.transport.codec`): kernel passthrough, interrupts, 1 MiB requests; root only.

:func:`start_session` mounts with the transport a configuration asks for (``auto``: native
when the kernel offers passthrough at INIT and the daemon has CAP_SYS_ADMIN, else pyfuse3) and
returns a :class:`Session`; the mount code drives every transport through that.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from tierfs.errors import MountError
from tierfs.fs.handlers import Handlers

log = logging.getLogger("tierfs.transport")
TRANSPORTS = ("auto", "native", "pyfuse3")


class Session(Protocol):
    """A mounted FUSE connection. ``name``: "native" or "pyfuse3"; ``why``: the reason this
    transport runs (for the log line, ``tierfs stats`` and ``doctor``)."""

    name: str
    why: str

    @property
    def passthrough(self) -> bool: ...

    async def main(self) -> None:
        """Serve until unmounted (or :meth:`terminate`)."""

    def terminate(self) -> None: ...

    def close(self, unmount: bool = True) -> None: ...

    def statistics(self) -> dict[str, Any]: ...


class Pyfuse3Session:
    name = "pyfuse3"
    passthrough = False

    def __init__(self, handlers: Handlers, mountpoint: str, options: set[str], why: str) -> None:
        import pyfuse3

        from tierfs.transport.pyfuse import Pyfuse3Operations

        self.why = why
        self._pyfuse3 = pyfuse3
        try:
            pyfuse3.init(Pyfuse3Operations(handlers), mountpoint, options)
        except RuntimeError as e:
            raise MountError(f"FUSE mount of {mountpoint} failed: {e}") from None

    async def main(self) -> None:
        await self._pyfuse3.main()

    def terminate(self) -> None:
        self._pyfuse3.terminate()

    def close(self, unmount: bool = True) -> None:
        self._pyfuse3.close(unmount=unmount)

    def statistics(self) -> dict[str, Any]:
        return {"name": "pyfuse3", "passthrough": False, "why": self.why,
                "protocol": "7.31 (libfuse 3)"}


async def start_session(kind: str, handlers: Handlers, mountpoint: str, *, fsname: str,
                        options: set[str], passthrough: str = "on", kernel_opens: bool = False,
                        busy_poll_s: float = 0.0) -> Session:
    """Mount ``mountpoint`` with transport ``kind`` (``auto``/``native``/``pyfuse3``) and
    answer INIT. ``options``: the pyfuse3 mount options (``allow_other`` is read from them for
    the native transport). ``passthrough``: on (resident and written files), writes (dirty files only) or off (the
    ``passthrough`` config key). ``"ro"`` in ``options``: a read-only mount; ``kernel_opens``
    (read-only mounts on the native transport): the kernel answers opens (the
    ``kernel_opens`` config key; no passthrough then). ``busy_poll_s``: the native transport's
    poll for the next request (the ``busy_poll_us`` config key). Raises MountError."""
    from tierfs.transport import native

    if kind not in TRANSPORTS:
        raise MountError(f"unknown transport {kind!r}: one of {', '.join(TRANSPORTS)}")
    if kind == "pyfuse3":
        return Pyfuse3Session(handlers, mountpoint, options, "asked for (transport = pyfuse3)")
    cap = native.has_cap_sys_admin()
    if kind == "auto" and not cap:
        return Pyfuse3Session(handlers, mountpoint, options,
                              "auto: the daemon lacks CAP_SYS_ADMIN, which kernel passthrough needs "
                              "(an unprivileged mount goes through fusermount3)")
    if not cap:
        raise MountError("the native transport mounts with mount(2) and needs root (CAP_SYS_ADMIN); "
                         "use --transport pyfuse3 for an unprivileged mount")
    read_only = "ro" in options
    kernel_opens = kernel_opens and read_only
    fd, mountpoint = native.mount_fuse(mountpoint, fsname=fsname, subtype="tierfs",
                                       allow_other="allow_other" in options, read_only=read_only)
    # (opens the kernel answers pass nothing through: passthrough is set up by an open's reply)
    no_pt = passthrough == "off" or kernel_opens
    s = native.NativeSession(handlers, fd, mountpoint, want_passthrough=not no_pt,
                             clean_passthrough=passthrough == "on", read_only=read_only,
                             kernel_opens=kernel_opens, busy_poll_s=busy_poll_s)
    try:
        ir = await s.init()
    except BaseException:
        s.close(unmount=True)
        raise
    proto = f"kernel FUSE 7.{ir.kernel_minor}"
    if kind == "auto" and not ir.passthrough and not no_pt:
        s.close(unmount=True)
        return Pyfuse3Session(handlers, mountpoint, options,
                              f"auto: the {proto} offers no passthrough (Linux 6.9+ with "
                              "CONFIG_FUSE_PASSTHROUGH)")
    if ir.passthrough:
        s.why = (f"{'auto' if kind == 'auto' else 'asked for'}: the {proto} offers passthrough "
                 "and the daemon has CAP_SYS_ADMIN"
                 + ("; written files only (passthrough = writes)" if passthrough == "writes"
                    else "; resident and written files (passthrough = on)"))
    elif kernel_opens:
        s.why = (f"{'auto' if kind == 'auto' else 'asked for'}; a read-only mount whose opens the "
                 "kernel answers (kernel_opens): no passthrough")
    elif no_pt:
        s.why = f"{'auto' if kind == 'auto' else 'asked for'}; passthrough off (passthrough = off)"
    else:
        s.why = f"asked for; passthrough off: the {proto} does not offer it"
    return s
