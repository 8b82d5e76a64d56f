"""The backing store's profile: ``hdd`` or ``parallel``, and how the scheduler drives each.

* ``hdd``: one actuator. One request in flight, C-SCAN elevator order, long slices (32 MiB:
  ~180 ms at 180 MB/s), so the disk streams and seeks as little as possible.
* ``parallel``: an SSD/NVMe device or array, a RAID set, a network filesystem (NFS, Lustre,
  CIFS), tmpfs. Many requests in flight (``depth``, 16 by default: an NVMe queue, a RAID set of
  8-16 spindles and an NFS client's slot table all need several outstanding requests to reach
  their rate), no seek ordering (arrival order within a class), slices of one chunk, so each
  reader is woken as soon as its own chunk is there.

The class order (demand, then deadline work, then speculative readahead) holds in both.

Detection (:func:`detect`) asks the kernel about the filesystem holding the backing directory:
its entry in ``/proc/self/mountinfo`` (found by the directory's device number), then for a block
device ``/sys/dev/block/MAJ:MIN/queue/rotational``, following a partition to its disk and a
device-mapper/md device to the disks under it (``slaves/``). Every path it reads is a
parameter, so tests feed it fake trees.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tierfs.errors import ConfigError

HDD = "hdd"
PARALLEL = "parallel"
PROFILES = (HDD, PARALLEL)

MiB = 1 << 20
HDD_DEPTH = 1
HDD_SLICE = 32 * MiB
# 16: measured on the emulated parallel store (bench/bench_miss.py, 0.5 ms per request), 8
# readers need ~8 requests in flight, and readahead another 8 behind them; NVMe and NFS clients
# default to deeper queues than that (nfs: 64 slots), so 16 never starves them of work either.
PARALLEL_DEPTH = 16

# Filesystems whose data lives on many servers or on no local disk at all: nothing to seek.
NETWORK_FS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "ceph", "glusterfs", "beegfs", "gpfs",
    "9p", "virtiofs", "afs", "ocfs2", "orangefs", "pvfs2",
})
# Filesystems in memory (or made of other filesystems' files: overlay): nothing to seek either.
MEMORY_FS = frozenset({"tmpfs", "ramfs", "overlay", "devtmpfs", "hugetlbfs", "shm"})
# Filesystems on anonymous device numbers whose disks tierfs cannot name from mountinfo (a ZFS
# pool, a bcachefs set): the safe assumption is today's, one disk.
OPAQUE_FS = frozenset({"zfs", "bcachefs"})


@dataclass(frozen=True)
class MountInfo:
    """One line of ``/proc/self/mountinfo`` (the fields :func:`detect` needs)."""

    major: int
    minor: int
    mountpoint: str
    fstype: str
    source: str


@dataclass(frozen=True)
class Profile:
    """The effective profile of a mount.

    ``name``: ``hdd`` or ``parallel``; ``source``: ``detected`` or where the setting came from
    (``flag``, ``-o``, a config file); ``reason``: how it was decided, in words (shown by
    ``tierfs stats`` and ``tierfs doctor``); ``depth``: requests in flight; ``slice_size``:
    bytes of the longest transfer; ``elevator``: C-SCAN order within a class (else arrival).
    """

    name: str
    source: str
    reason: str
    depth: int
    slice_size: int

    @property
    def elevator(self) -> bool:
        return self.name == HDD


def parse_mountinfo(text: str) -> list[MountInfo]:
    """The lines of a mountinfo file (proc(5)): ``ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS
    [OPTIONAL...] - FSTYPE SOURCE SUPEROPTS``. Octal escapes (``\\040``) in paths are decoded.
    Malformed lines are skipped."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        try:
            sep = fields.index("-")
            major, minor = (int(x) for x in fields[2].split(":"))
            mp = _unescape(fields[4])
            fstype, source = fields[sep + 1], _unescape(fields[sep + 2])
        except (ValueError, IndexError):
            continue
        out.append(MountInfo(major, minor, mp, fstype, source))
    return out


def _unescape(s: str) -> str:
    return s.encode().decode("unicode_escape") if "\\" in s else s


def find_mount(entries: list[MountInfo], path: str, dev: int) -> MountInfo | None:
    """The mount holding ``path`` (a real path) whose device is ``dev`` (``st_dev``): among the
    entries with that device, the one with the longest mount point above ``path``, the last one
    listed winning a tie (mounted on top)."""
    best: MountInfo | None = None
    for e in entries:
        if os.makedev(e.major, e.minor) != dev:
            continue
        mp = e.mountpoint.rstrip("/") or "/"
        if not (path == mp or path.startswith(mp if mp.endswith("/") else mp + "/")):
            continue
        if best is None or len(mp) >= len(best.mountpoint.rstrip("/") or "/"):
            best = e
    if best is None:  # a device we cannot place by path (a bind mount's view): any entry of it
        best = next((e for e in reversed(entries) if os.makedev(e.major, e.minor) == dev), None)
    return best


def rotational_leaves(sys_root: str, major: int, minor: int, _depth: int = 0) -> list[tuple[str, bool]]:
    """(name, rotational) of the disks under block device MAJ:MIN: a partition stands for its
    disk; a device-mapper or md device for the devices in its ``slaves/`` (recursively); a
    plain disk for itself. Raises OSError when sysfs does not know the device."""
    node = os.path.realpath(os.path.join(sys_root, "dev/block", f"{major}:{minor}"))
    if os.path.exists(os.path.join(node, "partition")):
        node = os.path.dirname(node)  # /sys/devices/.../sda/sda1 -> .../sda
    slaves = os.path.join(node, "slaves")
    names = sorted(os.listdir(slaves)) if os.path.isdir(slaves) else []
    if names and _depth < 8:
        out = []
        for name in names:
            with open(os.path.join(slaves, name, "dev")) as f:
                smaj, smin = (int(x) for x in f.read().strip().split(":"))
            out.extend(rotational_leaves(sys_root, smaj, smin, _depth + 1))
        return out
    with open(os.path.join(node, "queue", "rotational")) as f:
        return [(os.path.basename(node), f.read().strip() == "1")]


def _mount_of(path: str, mountinfo: str, dev: int | None) -> MountInfo | None:
    """The mount holding directory ``path`` (see :func:`detect`). Raises OSError."""
    real = os.path.realpath(path)
    if dev is None:
        dev = os.stat(real).st_dev
    with open(mountinfo) as f:
        entries = parse_mountinfo(f.read())
    return find_mount(entries, real, dev)


def _is_fuse(fstype: str) -> bool:
    return fstype.split(".", 1)[0] in ("fuse", "fuseblk") and fstype != "fuseblk"


def local(path: str, *, mountinfo: str = "/proc/self/mountinfo", dev: int | None = None) -> bool:
    """Whether the filesystem holding directory ``path`` is local: neither a network
    filesystem nor a FUSE one (a call into either may wait on a server for as long as it is
    unreachable). False when it cannot tell."""
    try:
        m = _mount_of(path, mountinfo, dev)
    except OSError:
        return False
    base = m.fstype.split(".", 1)[0] if m is not None else ""
    return m is not None and base not in ("fuse", "fuseblk") and base not in NETWORK_FS


def detect(path: str, *, mountinfo: str = "/proc/self/mountinfo", sys_root: str = "/sys",
           dev: int | None = None) -> tuple[str, str]:
    """(profile, reason) of the filesystem holding directory ``path``. Never raises: what the
    kernel cannot tell gives ``hdd`` (today's behaviour, right for one disk and merely slower on
    anything else), with the reason saying why.

    ``dev``: the directory's ``st_dev`` (default: ``os.stat(path)``); ``mountinfo``/``sys_root``:
    where to read them (tests give fake trees)."""
    try:
        m = _mount_of(path, mountinfo, dev)
    except OSError as e:
        return HDD, f"cannot tell ({e.strerror or e}); hdd is the safe assumption"
    if m is None:
        return HDD, "cannot tell (the directory's filesystem is not in mountinfo); hdd is the safe assumption"
    fs = m.fstype
    base = fs.split(".", 1)[0]
    if _is_fuse(fs):
        return PARALLEL, f"{fs} at {m.mountpoint}: a FUSE filesystem (network or userspace store)"
    if base in NETWORK_FS:
        return PARALLEL, f"{fs} at {m.mountpoint}: a network filesystem"
    if base in MEMORY_FS:
        return PARALLEL, f"{fs} at {m.mountpoint}: no disk (memory or a stack of filesystems)"
    major, minor = m.major, m.minor
    if major == 0:  # an anonymous device number (btrfs, or no block device at all)
        if base in OPAQUE_FS:
            return HDD, f"{fs} at {m.mountpoint}: its disks cannot be told from here; hdd is the safe assumption"
        if not m.source.startswith("/dev/"):
            return PARALLEL, f"{fs} at {m.mountpoint}: no block device"
        try:
            rdev = os.stat(m.source).st_rdev
        except OSError:
            return HDD, f"{fs} at {m.mountpoint}: cannot stat its device {m.source}; hdd is the safe assumption"
        major, minor = os.major(rdev), os.minor(rdev)
    try:
        leaves = rotational_leaves(sys_root, major, minor)
    except (OSError, ValueError):
        return HDD, (f"{fs} at {m.mountpoint} on block device {major}:{minor}: sysfs does not say whether "
                     "it is rotational; hdd is the safe assumption")
    spinning = [name for name, rot in leaves if rot]
    names = ", ".join(name for name, _ in leaves)
    where = f"{fs} at {m.mountpoint} on {names}"
    if not spinning:
        return PARALLEL, f"{where}: not rotational (queue/rotational = 0)"
    if len(spinning) == 1:
        return HDD, f"{where}: rotational (queue/rotational = 1)"
    return PARALLEL, f"{where}: an array of {len(spinning)} rotational disks (requests run on several at once)"


def resolve(setting: str, source: str, path: str, *, chunk_size: int, depth: int | None,
            slice_size: int | None, detector=detect) -> Profile:  # type: ignore[no-untyped-def]
    """The effective :class:`Profile` of a mount of backing directory ``path``.

    ``setting``: ``auto`` (detect), ``hdd`` or ``parallel``; ``source``: where it came from.
    ``depth``/``slice_size``: as configured, or None for the profile's default (hdd: 1 and
    32 MiB; parallel: 16 and one chunk). Raises ConfigError for an unknown setting."""
    if setting == "auto":
        name, reason = detector(path)
        source = "detected"
    elif setting in PROFILES:
        name, reason = setting, f"set ({source})"
    else:
        raise ConfigError(f"backing_profile: expected hdd, parallel or auto, got {setting!r}")
    if name == HDD:
        d, s = HDD_DEPTH, HDD_SLICE
    else:
        d, s = PARALLEL_DEPTH, chunk_size
    return Profile(name, source, reason, depth if depth is not None else d,
                   max(chunk_size, slice_size if slice_size is not None else s))
