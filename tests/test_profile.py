"""Backing-profile detection (tierfs.sched.profile) on fake mountinfo files and sysfs trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierfs.errors import ConfigError
from tierfs.sched import profile

MiB = 1 << 20


def mountinfo(tmp_path: Path, *lines: str) -> str:
    p = tmp_path / "mountinfo"
    base = ["22 1 0:21 / /proc rw,relatime - proc proc rw"]
    p.write_text("\n".join([*base, *lines]) + "\n")
    return str(p)


def disk(sys_root: Path, name: str, majmin: str, rotational: bool, *, parts: dict[str, str] | None = None,
         slaves: dict[str, str] | None = None) -> None:
    """A fake /sys: /sys/devices/virtual/block/NAME (queue/rotational, partitions, slaves) and
    the /sys/dev/block/MAJ:MIN links the kernel makes."""
    node = sys_root / "devices/virtual/block" / name
    (node / "queue").mkdir(parents=True)
    (node / "queue/rotational").write_text("1\n" if rotational else "0\n")
    (node / "dev").write_text(majmin + "\n")
    links = sys_root / "dev/block"
    links.mkdir(parents=True, exist_ok=True)
    os.symlink(node, links / majmin)
    for pname, pmm in (parts or {}).items():
        (node / pname).mkdir()
        (node / pname / "partition").write_text("1\n")
        (node / pname / "dev").write_text(pmm + "\n")
        os.symlink(node / pname, links / pmm)
    if slaves is not None:
        (node / "slaves").mkdir()
        for sname, target in slaves.items():
            os.symlink(sys_root / "devices/virtual/block" / target, node / "slaves" / sname)


def test_rotational_partition_is_hdd_and_ssd_partition_is_parallel(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    disk(sys_root, "sda", "8:0", True, parts={"sda1": "8:1"})
    disk(sys_root, "nvme0n1", "259:0", False, parts={"nvme0n1p2": "259:2"})
    mi = mountinfo(tmp_path, "30 1 8:1 / /data rw - ext4 /dev/sda1 rw",
                   "31 1 259:2 / /fast rw - xfs /dev/nvme0n1p2 rw")
    name, why = profile.detect("/data/x", mountinfo=mi, sys_root=str(sys_root), dev=os.makedev(8, 1))
    assert name == "hdd" and "sda" in why and "rotational" in why
    name, why = profile.detect("/fast/y", mountinfo=mi, sys_root=str(sys_root), dev=os.makedev(259, 2))
    assert name == "parallel" and "nvme0n1" in why


def test_dm_and_md_follow_their_slaves(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    disk(sys_root, "sdb", "8:16", True)
    disk(sys_root, "sdc", "8:32", True)
    disk(sys_root, "sdd", "8:48", False)
    disk(sys_root, "md0", "9:0", True, slaves={"sdb": "sdb", "sdc": "sdc"})  # RAID of two HDDs
    disk(sys_root, "dm-0", "253:0", True, slaves={"sdb": "sdb"})  # dm-crypt on one HDD
    disk(sys_root, "dm-1", "253:1", True, slaves={"sdd": "sdd"})  # LVM on an SSD (flag lies)
    disk(sys_root, "dm-2", "253:2", False, slaves={"dm-0": "dm-0"})  # stacked
    mi = mountinfo(tmp_path, "40 1 9:0 / /raid rw - ext4 /dev/md0 rw",
                   "41 1 253:0 / /crypt rw - ext4 /dev/mapper/c rw",
                   "42 1 253:1 / /lvm rw - ext4 /dev/mapper/v rw",
                   "43 1 253:2 / /stack rw - ext4 /dev/mapper/s rw")
    cases = {"/raid": ((9, 0), "parallel", "2 rotational disks"), "/crypt": ((253, 0), "hdd", "sdb"),
             "/lvm": ((253, 1), "parallel", "sdd"), "/stack": ((253, 2), "hdd", "sdb")}
    for path, ((ma, mi_), want, text) in cases.items():
        name, why = profile.detect(path, mountinfo=mi, sys_root=str(sys_root), dev=os.makedev(ma, mi_))
        assert (name, text in why) == (want, True), (path, name, why)


@pytest.mark.parametrize(("line", "want", "text"), [
    ("50 1 0:40 / /mnt/nfs rw - nfs4 srv:/export rw", "parallel", "network"),
    ("50 1 0:40 / /mnt/nfs rw - lustre 10.0.0.1@tcp:/fs rw", "parallel", "network"),
    ("50 1 0:40 / /mnt/nfs rw - cifs //srv/share rw", "parallel", "network"),
    ("50 1 0:40 / /mnt/nfs rw - fuse.sshfs u@h:/ rw", "parallel", "FUSE"),
    ("50 1 0:40 / /mnt/nfs rw - tmpfs tmpfs rw", "parallel", "no disk"),
    ("50 1 0:40 / /mnt/nfs rw - overlay overlay rw", "parallel", "no disk"),
    ("50 1 0:40 / /mnt/nfs rw - zfs tank/data rw", "hdd", "safe assumption"),
    ("50 1 0:40 / /mnt/nfs rw - weirdfs none rw", "parallel", "no block device"),
])
def test_filesystem_types(tmp_path: Path, line: str, want: str, text: str) -> None:
    mi = mountinfo(tmp_path, "27 1 254:0 / / rw - ext4 /dev/vda rw", line)
    name, why = profile.detect("/mnt/nfs/a/b", mountinfo=mi, sys_root=str(tmp_path / "nosys"),
                               dev=os.makedev(0, 40))
    assert name == want and text in why, why



@pytest.mark.parametrize(("fstype", "local"), [
    ("nfs4", False), ("lustre", False), ("cifs", False), ("fuse.sshfs", False), ("fuse", False),
    ("tmpfs", True), ("ext4", True), ("xfs", True), ("fuseblk", False),
])
def test_local_filesystems(tmp_path: Path, fstype: str, local: bool) -> None:
    """Backing-store data calls may run on the event loop only on a local filesystem: a call
    into a network or FUSE one may wait on a server for as long as it is unreachable."""
    mi = mountinfo(tmp_path, "27 1 254:0 / / rw - ext4 /dev/vda rw",
                   f"50 1 0:40 / /mnt/store rw - {fstype} src rw")
    assert profile.local("/mnt/store/a", mountinfo=mi, dev=os.makedev(0, 40)) is local
    # what cannot be told is not local
    assert profile.local("/x", mountinfo=mi, dev=os.makedev(7, 7)) is False
    assert profile.local("/x", mountinfo=str(tmp_path / "missing"), dev=1) is False

def test_longest_mountpoint_of_the_device_wins_and_unknowns_are_hdd(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    disk(sys_root, "vda", "254:0", False)
    mi = mountinfo(tmp_path, "27 1 254:0 / / rw - ext4 /dev/vda rw",
                   "60 27 0:50 / /data rw - tmpfs tmpfs rw",
                   "61 60 0:51 / /data/nfs rw - nfs4 s:/e rw")
    assert profile.detect("/data/nfs/x", mountinfo=mi, sys_root=str(sys_root), dev=os.makedev(0, 51))[0] == "parallel"
    name, why = profile.detect("/data/x", mountinfo=mi, sys_root=str(sys_root), dev=os.makedev(0, 50))
    assert name == "parallel" and "tmpfs at /data" in why
    assert profile.detect("/home", mountinfo=mi, sys_root=str(sys_root), dev=os.makedev(254, 0))[0] == "parallel"
    # no sysfs entry for the device, no mountinfo line, no mountinfo at all: hdd, and why
    name, why = profile.detect("/home", mountinfo=mi, sys_root=str(tmp_path / "nosys"), dev=os.makedev(254, 0))
    assert name == "hdd" and "sysfs" in why
    name, why = profile.detect("/x", mountinfo=mi, sys_root=str(sys_root), dev=os.makedev(7, 7))
    assert name == "hdd" and "not in mountinfo" in why
    name, why = profile.detect("/x", mountinfo=str(tmp_path / "missing"), sys_root=str(sys_root), dev=1)
    assert name == "hdd" and "cannot tell" in why


def test_escaped_mountpoints(tmp_path: Path) -> None:
    mi = mountinfo(tmp_path, "70 1 0:60 / /mnt/my\\040data rw - nfs s:/e rw")
    name, why = profile.detect("/mnt/my data/f", mountinfo=mi, sys_root=str(tmp_path), dev=os.makedev(0, 60))
    assert name == "parallel" and "/mnt/my data" in why


def test_this_machines_tmpfs_is_parallel() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    assert profile.detect("/dev/shm")[0] == "parallel"


def test_resolve_defaults_and_overrides() -> None:
    def det(path: str) -> tuple[str, str]:
        return "parallel", "tmpfs at /x"

    p = profile.resolve("auto", "default", "/x", chunk_size=4 * MiB, depth=None, slice_size=None, detector=det)
    assert (p.name, p.source, p.depth, p.slice_size, p.elevator) == ("parallel", "detected", 16, 4 * MiB, False)
    p = profile.resolve("hdd", "flag --backing", "/x", chunk_size=4 * MiB, depth=None, slice_size=None, detector=det)
    assert (p.name, p.depth, p.slice_size, p.elevator) == ("hdd", 1, 32 * MiB, True)
    assert "flag --backing" in p.reason
    p = profile.resolve("parallel", "-o", "/x", chunk_size=4 * MiB, depth=4, slice_size=8 * MiB, detector=det)
    assert (p.depth, p.slice_size) == (4, 8 * MiB)
    with pytest.raises(ConfigError):
        profile.resolve("ssd", "-o", "/x", chunk_size=4 * MiB, depth=None, slice_size=None, detector=det)
