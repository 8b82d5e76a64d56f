"""Run tierfs like any filesystem: the ``mount(8)`` helper, and ``tierfs install-helper``.

``mount -t fuse.tierfs BACKING MOUNTPOINT -o ram=16GiB,ssd=/nvme/cache:400GiB`` and the
matching ``/etc/fstab`` line make ``mount(8)`` run ``/sbin/mount.fuse.tierfs BACKING MOUNTPOINT
-o OPTIONS`` (the ``mount.fuse3`` convention for type ``fuse.SUBTYPE``). :func:`main` maps the
options onto ``tierfs mount`` (the same schema as ``tierfs mount -o``), drops those that
``mount(8)`` or systemd handle (:data:`GENERIC`), and returns once the mount is ready.

``nofail``: mount(8) passes it on and does not act on a helper's failure, so the helper does:
with ``nofail`` a BACKING or MOUNTPOINT that does not exist is reported on stderr and the helper
exits 0 (``mount -a`` goes on, as for a missing device). Any other error still fails.
``_netdev`` and ``x-systemd.*`` act in systemd's fstab generator (ordering after the network,
``Requires=``); the helper ignores them. ``config=FILE`` reads options from a TOML file.

mount(8) runs helpers with a minimal ``PATH`` and from any directory, so
:func:`install` writes small shell wrappers that name this Python interpreter and this tierfs
by absolute path (:data:`WRAPPER`), plus the systemd unit template (:data:`UNIT`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from dataclasses import dataclass

import tierfs
from tierfs.errors import ConfigError

HELPER_NAME = "mount.fuse.tierfs"
FSTYPE = "fuse.tierfs"
# mount(8), FUSE and systemd options that are not tierfs options. tierfs mounts are always
# nosuid,nodev,noatime (FUSE's defaults for root plus tierfs' noatime); ``ro`` is a tierfs
# option (a read-only mount), passed on as such.
GENERIC = frozenset({
    "defaults", "auto", "noauto", "user", "nouser", "users", "owner", "group", "nofail", "_netdev",
    "rw", "nosuid", "nodev", "suid", "dev", "exec", "noexec", "noatime", "atime", "relatime",
    "norelatime", "strictatime", "nostrictatime", "lazytime", "nolazytime", "nodiratime", "diratime",
    "async", "silent", "loud", "default_permissions",
})
GENERIC_PREFIXES = ("x-", "comment=", "fsname=", "subtype=", "uhelper=", "helper=")
# exit codes of mount(8) (see its man page)
EX_USAGE, EX_FAIL = 1, 32


@dataclass(frozen=True)
class HelperArgs:
    backing: str
    mountpoint: str
    options: tuple[str, ...]  # tierfs `-o` items, in order
    config: str | None
    generic: frozenset[str]  # the generic options that were given
    fake: bool
    verbose: bool


def split_options(text: str) -> tuple[list[str], str | None, set[str]]:
    """``-o`` text from mount(8) -> (tierfs option items, ``config=`` file, generic options).

    Raises:
        ConfigError: an empty ``config=``.
    """
    items: list[str] = []
    generic: set[str] = set()
    config = None
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        key = item.partition("=")[0]
        if key == "config":
            config = item.partition("=")[2]
            if not config:
                raise ConfigError("config: expected config=FILE (a TOML file of tierfs options)")
        elif item == "rw":  # the last of ro and rw wins, as mount(8) reads them
            generic.add(key)
            items = [i for i in items if i != "ro"]
        elif item in GENERIC or item.startswith(GENERIC_PREFIXES):
            generic.add(key)
        else:
            items.append(item)
    return items, config, generic


def parse_args(argv: list[str]) -> HelperArgs:
    """``BACKING MOUNTPOINT [-o OPTS]... [-n] [-s] [-f] [-v] [-t fuse.tierfs]``, as mount(8)
    calls a helper. Raises ConfigError on bad options, SystemExit on bad usage."""
    p = argparse.ArgumentParser(prog=HELPER_NAME, description="mount(8) helper for tierfs")
    p.add_argument("backing")
    p.add_argument("mountpoint")
    p.add_argument("-o", dest="options", action="append", default=[])
    p.add_argument("-t", dest="type", default=FSTYPE)
    p.add_argument("-n", action="store_true", help="no mtab (ignored)")
    p.add_argument("-s", action="store_true", help="sloppy (ignored)")
    p.add_argument("-f", dest="fake", action="store_true", help="check the options, do not mount")
    p.add_argument("-v", dest="verbose", action="store_true")
    a = p.parse_args(argv)
    if a.type not in (FSTYPE, "tierfs"):
        raise ConfigError(f"-t {a.type}: this helper mounts type {FSTYPE}")
    items, config, generic = split_options(",".join(a.options))
    return HelperArgs(a.backing, a.mountpoint, tuple(items), config, frozenset(generic), a.fake, a.verbose)


def mount_argv(h: HelperArgs) -> list[str]:
    """The ``tierfs`` command line the helper runs for ``h``."""
    argv = ["mount", h.backing, h.mountpoint]
    if h.config:
        argv += ["--config", h.config]
    if h.options:
        argv += ["-o", ",".join(h.options)]
    return argv


def main(argv: list[str] | None = None) -> int:
    """The helper: mount(8)'s arguments in, mount(8)'s exit codes out (0, 1 usage, 32 failed)."""
    from tierfs import cli

    try:
        h = parse_args(list(sys.argv[1:] if argv is None else argv))
    except ConfigError as e:
        print(f"{HELPER_NAME}: {e}", file=sys.stderr)
        return EX_USAGE
    except SystemExit as e:
        return EX_USAGE if e.code else 0
    if "nofail" in h.generic:
        for what, path in (("backing directory", h.backing), ("mountpoint", h.mountpoint)):
            if not os.path.isdir(path):
                print(f"{HELPER_NAME}: {what} {path} does not exist; not mounted (nofail)", file=sys.stderr)
                return 0
    cmd = mount_argv(h)
    if h.verbose:
        print(f"{HELPER_NAME}: tierfs {' '.join(cmd)}", file=sys.stderr)
    if h.fake:  # check the options as the mount would (`tierfs config` resolves them the same way)
        cmd = ["config", *cmd[3:]]
    with contextlib.redirect_stdout(sys.stdout if h.verbose else io.StringIO()):
        rc = cli.main(cmd)  # mount(8) is silent on success; errors go to stderr
    return 0 if rc == 0 else EX_FAIL


# -- install-helper ------------------------------------------------------------------------
WRAPPER = """#!/bin/sh
# {what}
# Written by `tierfs install-helper`: runs tierfs with the Python below (mount(8) and systemd
# run programs with a minimal PATH, from any directory; -P: never import from the working
# directory, which another user may write). Run install-helper again after moving the checkout
# or the virtual environment.
PYTHONPATH={root}${{PYTHONPATH:+:$PYTHONPATH}}
export PYTHONPATH
exec {python} -P -m {module} "$@"
"""
HELPER_WHAT = f"mount(8) helper for type {FSTYPE}: mount.fuse.tierfs BACKING MOUNTPOINT -o OPTIONS"
CLI_WHAT = "the tierfs command"
MARKER = "Written by `tierfs install-helper`"
UNIT = """# tierfs@.service: one tierfs mount run by systemd.
#
# The instance is the escaped mountpoint and names the config file:
#   systemd-escape --path /mnt/data            -> mnt-data
#   /etc/tierfs/mnt-data.toml                  backing = "/data/hdd", and any mount option
#   systemctl enable --now tierfs@mnt-data.service
#
# Ready (Type=notify) once the mount works; `systemctl stop` writes every dirty file back
# first (umount --flush); restarted if the daemon dies. A backing store or SSD tier on another
# mount: add `RequiresMountsFor=/data/hdd /nvme` in a drop-in (systemctl edit tierfs@mnt-data).
# Written by `tierfs install-helper` with the path of the tierfs command it installed (the copy
# in the repository's mount/ is made by `python -m tierfs.docgen`, for /usr/local/bin/tierfs).

[Unit]
Description=tierfs mount on %f
After=local-fs.target remote-fs.target network-online.target
Wants=network-online.target
Before=umount.target
Conflicts=umount.target

[Service]
Type=notify
NotifyAccess=main
ExecStart={tierfs} mount --foreground --config /etc/tierfs/%i.toml %f
ExecStop={tierfs} umount --flush %f
Restart=on-failure
RestartSec=5s
# exit 2: a bad option or config file; restarting cannot help
RestartPreventExitStatus=2
# loading a large SSD catalog; writing every dirty file back at stop
TimeoutStartSec=5min
TimeoutStopSec=30min
KillMode=mixed
LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
"""
UNIT_NAME = "tierfs@.service"
DEFAULT_BIN = "/usr/local/bin/tierfs"


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def wrapper(module: str, what: str, python: str | None = None, root: str | None = None) -> str:
    """A wrapper script running ``python -m module`` with this tierfs on its path."""
    python = python or sys.executable
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(tierfs.__file__)))
    return WRAPPER.format(what=what, root=_sh_quote(root), python=_sh_quote(python), module=module)


def unit(tierfs_bin: str = DEFAULT_BIN) -> str:
    return UNIT.format(tierfs=tierfs_bin)


def _write(path: str, text: str, mode: int, force: bool) -> None:
    if os.path.exists(path) and not force:
        with open(path, errors="replace") as f:
            if MARKER not in f.read():
                raise ConfigError(f"{path} exists and was not written by tierfs install-helper; "
                                  "move it away or pass --force")
    tmp = f"{path}.tierfs-tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def install(sbin_dir: str = "/sbin", bin_dir: str | None = os.path.dirname(DEFAULT_BIN),
            unit_dir: str | None = "/etc/systemd/system", *, force: bool = False) -> list[str]:
    """Write the mount helper to ``sbin_dir``, the ``tierfs`` command to ``bin_dir`` and the
    systemd unit template to ``unit_dir`` (each skipped when None). Returns the paths written.

    Raises:
        ConfigError: a file there was not written by install-helper (unless ``force``).
        OSError: a directory is missing or not writable.
    """
    written = []
    helper = os.path.join(sbin_dir, HELPER_NAME)
    _write(helper, wrapper("tierfs.helper", HELPER_WHAT), 0o755, force)
    written.append(helper)
    tierfs_bin = DEFAULT_BIN
    if bin_dir is not None:
        tierfs_bin = os.path.join(os.path.abspath(bin_dir), "tierfs")
        _write(tierfs_bin, wrapper("tierfs", CLI_WHAT), 0o755, force)
        written.append(tierfs_bin)
    if unit_dir is not None:
        path = os.path.join(unit_dir, UNIT_NAME)
        _write(path, unit(tierfs_bin), 0o644, force)
        written.append(path)
    return written


def uninstall(sbin_dir: str = "/sbin", bin_dir: str | None = os.path.dirname(DEFAULT_BIN),
              unit_dir: str | None = "/etc/systemd/system") -> list[str]:
    """Remove what :func:`install` wrote (only files it wrote). Returns the paths removed."""
    removed = []
    for d, name in ((sbin_dir, HELPER_NAME), (bin_dir, "tierfs"), (unit_dir, UNIT_NAME)):
        if d is None:
            continue
        path = os.path.join(d, name)
        try:
            with open(path, errors="replace") as f:
                ours = MARKER in f.read()
        except OSError:
            continue
        if ours:
            os.unlink(path)
            removed.append(path)
    return removed


if __name__ == "__main__":
    sys.exit(main())
