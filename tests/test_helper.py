"""Run tierfs like any filesystem: the mount(8) helper, /etc/fstab lines through a real
`mount -a`, `tierfs install-helper`, and the systemd unit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import FUSE_OK, REPO, Mount, force_unmount, is_mounted, tierfs_cmd
from tierfs import helper
from tierfs.errors import ConfigError

MIN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}  # what mount(8) and systemd give a helper


# -- in-process -------------------------------------------------------------------------------
def test_options_are_split_into_tierfs_options_config_and_generic_ones() -> None:
    items, config, generic = helper.split_options(
        "rw,noatime,ram=16GiB,ssd=/nvme/cache:400GiB,nofail,_netdev,x-systemd.requires=a.service,"
        "defaults,nosuid,nodev,allow_other,config=/etc/tierfs/d.toml,comment=x,x-mount.mkdir")
    assert items == ["ram=16GiB", "ssd=/nvme/cache:400GiB", "allow_other"]
    assert config == "/etc/tierfs/d.toml"
    assert generic == {"rw", "noatime", "nofail", "_netdev", "x-systemd.requires", "defaults", "nosuid",
                       "nodev", "comment", "x-mount.mkdir"}
    # ro is a tierfs option (a read-only mount): passed on to tierfs mount -o
    assert helper.split_options("ro,ram=1G")[0] == ["ro", "ram=1G"]
    assert helper.split_options("ro,ram=1G,rw")[0] == ["ram=1G"]  # the last of ro and rw wins
    assert helper.split_options("rw,ro")[0] == ["ro"]


def test_arguments_as_mount_calls_a_helper() -> None:
    h = helper.parse_args(["/data", "/mnt", "-o", "rw,ram=1G", "-n", "-s", "-v", "-t", "fuse.tierfs",
                           "-o", "depth=2"])
    assert helper.mount_argv(h) == ["mount", "/data", "/mnt", "-o", "ram=1G,depth=2"]
    assert h.verbose and not h.fake
    h = helper.parse_args(["/data", "/mnt", "-o", "config=/c.toml,nofail"])
    assert helper.mount_argv(h) == ["mount", "/data", "/mnt", "--config", "/c.toml"]
    with pytest.raises(ConfigError, match="this helper mounts type fuse.tierfs"):
        helper.parse_args(["/data", "/mnt", "-t", "fuse.sshfs"])


def test_fake_mount_checks_the_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert helper.main(["/data", "/mnt", "-f", "-o", "rw,ram=1G,nofail"]) == 0
    assert helper.main(["/data", "/mnt", "-f", "-o", "ram=1G,chunk_sise=4M"]) == helper.EX_FAIL
    assert "unknown option 'chunk_sise'" in capsys.readouterr().err
    # nofail: a backing dir that does not exist is not a failure
    assert helper.main([str(tmp_path / "nope"), str(tmp_path), "-o", "ram=1G,nofail"]) == 0
    assert "does not exist; not mounted (nofail)" in capsys.readouterr().err


def test_install_writes_wrappers_and_unit_and_uninstall_removes_only_them(tmp_path: Path) -> None:
    sbin, bin_, units = (tmp_path / d for d in ("sbin", "bin", "units"))
    for d in (sbin, bin_, units):
        d.mkdir()
    (units / "other.service").write_text("[Service]\n")
    written = helper.install(str(sbin), str(bin_), str(units))
    assert written == [str(sbin / "mount.fuse.tierfs"), str(bin_ / "tierfs"), str(units / "tierfs@.service")]
    text = (sbin / "mount.fuse.tierfs").read_text()
    assert f"exec '{sys.executable}' -P -m tierfs.helper" in text and f"PYTHONPATH='{REPO}'" in text
    assert os.access(sbin / "mount.fuse.tierfs", os.X_OK) and os.access(bin_ / "tierfs", os.X_OK)
    unit = (units / "tierfs@.service").read_text()
    assert f"ExecStart={bin_ / 'tierfs'} mount --foreground --config /etc/tierfs/%i.toml %f" in unit
    # the wrappers work from anywhere with mount(8)'s minimal PATH
    r = subprocess.run([str(bin_ / "tierfs"), "config", "--print", "--ram", "1GiB"], cwd="/", env=MIN_ENV,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "flag --ram" in r.stdout, r.stderr
    r = subprocess.run([str(sbin / "mount.fuse.tierfs"), "/data", "/mnt", "-f", "-o", "ram=1G,bogus=1"],
                       cwd="/", env=MIN_ENV, capture_output=True, text=True)
    assert r.returncode == helper.EX_FAIL and "unknown option 'bogus'" in r.stderr
    # a file it did not write is not overwritten, unless forced
    (bin_ / "tierfs").write_text("#!/bin/sh\necho someone else's\n")
    with pytest.raises(ConfigError, match="not written by tierfs install-helper"):
        helper.install(str(sbin), str(bin_), str(units))
    assert helper.uninstall(str(sbin), str(bin_), str(units)) == [
        str(sbin / "mount.fuse.tierfs"), str(units / "tierfs@.service")]
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["other.service", "tierfs"]


def test_repository_helper_script_runs_from_a_checkout(tmp_path: Path) -> None:
    link = tmp_path / "mount.fuse.tierfs"
    link.symlink_to(REPO / "mount" / "mount.fuse.tierfs")  # as `ln -s` into /sbin
    env = dict(MIN_ENV, TIERFS_PYTHON=sys.executable)
    r = subprocess.run([str(link), "/data", "/mnt", "-f", "-o", "ram=1G,nofail"], cwd="/", env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(link), "/data", "/mnt", "-f", "-o", "eviction=mru"], cwd="/", env=env,
                       capture_output=True, text=True)
    assert r.returncode == helper.EX_FAIL and "expected one of nothrash, lru" in r.stderr


# -- systemd ----------------------------------------------------------------------------------
@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    bin_, units = tmp_path / "bin", tmp_path / "units"
    bin_.mkdir()
    units.mkdir()
    helper.install(str(tmp_path), str(bin_), str(units))
    # an instance of the template, as `systemctl enable tierfs@mnt-data` makes it
    inst = units / "tierfs@mnt-data.service"
    shutil.copy(units / "tierfs@.service", inst)
    r = subprocess.run(["systemd-analyze", "verify", str(inst)], capture_output=True, text=True, cwd=units)
    assert r.returncode == 0 and "tierfs@" not in r.stdout + r.stderr, r.stdout + r.stderr
    # and the check can fail: a unit whose ExecStart does not exist is refused
    inst.write_text(inst.read_text().replace(str(bin_ / "tierfs"), str(tmp_path / "nope")))
    r = subprocess.run(["systemd-analyze", "verify", str(inst)], capture_output=True, text=True, cwd=units)
    assert r.returncode != 0 and "not executable" in r.stderr


FSTAB_GENERATOR = "/usr/lib/systemd/system-generators/systemd-fstab-generator"


@pytest.mark.skipif(not os.access(FSTAB_GENERATOR, os.X_OK), reason="systemd's fstab generator is not installed")
def test_fstab_example_lines_become_systemd_mount_units(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    out.mkdir()
    env = dict(os.environ, SYSTEMD_FSTAB=str(REPO / "mount" / "fstab.example"))
    subprocess.run([FSTAB_GENERATOR, str(out), str(out), str(out)], env=env, check=True, capture_output=True)
    data = (out / "mnt-data.mount").read_text()
    assert "What=/data/hdd" in data and "Where=/mnt/data" in data and "Type=fuse.tierfs" in data
    assert (out / "local-fs.target.wants" / "mnt-data.mount").exists()  # nofail: wanted, not required
    assert "Before=local-fs.target" not in data
    ds = (out / "mnt-ds.mount").read_text()  # _netdev: a network mount
    assert (out / "remote-fs.target.wants" / "mnt-ds.mount").exists()
    assert "Options=config=/etc/tierfs/mnt-ds.toml,_netdev,nofail" in ds
    arch = (out / "mnt-arch.mount").read_text()  # x-systemd.requires=
    assert "Requires=nvme-ready.service" in arch and "After=nvme-ready.service" in arch
    assert not list(out.rglob("*.wants/mnt-arch.mount"))  # noauto


# -- mount(8) and /etc/fstab, for real --------------------------------------------------------
needs_mount8 = pytest.mark.skipif(not (FUSE_OK and shutil.which("mount") and shutil.which("umount")),
                                  reason="needs mount(8), /dev/fuse and root")


@pytest.fixture
def sbin_helper(tmp_path: Path) -> Iterator[Path]:
    """The helper installed where mount(8) looks (/sbin: mount(8) has no other search path);
    whatever was there before is put back afterwards."""
    path = Path("/sbin") / helper.HELPER_NAME
    saved = tmp_path / "saved-helper"
    if path.exists():
        shutil.copy2(path, saved)
    try:
        helper.install("/sbin", None, None, force=True)
        yield path
    finally:
        if saved.exists():
            shutil.copy2(saved, path)
        else:
            path.unlink(missing_ok=True)


def mounted_entry(mnt: Path) -> tuple[str, str] | None:
    from tierfs.mount import mount_entry

    return mount_entry(str(mnt))


def wait_gone(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    from tierfs.cli import _alive

    while time.monotonic() < deadline:
        if not _alive(pid):  # gone, or a zombie nobody has reaped yet
            return
        time.sleep(0.05)
    raise AssertionError(f"daemon {pid} did not exit")


@needs_mount8
@pytest.mark.fuse
def test_fstab_lines_with_mount_a(sbin_helper: Path, tmp_path: Path) -> None:
    back, mnt, mnt2 = tmp_path / "back", tmp_path / "mnt", tmp_path / "mnt2"
    for d in (back, mnt, mnt2):
        d.mkdir()
    (back / "hello").write_text("hello\n")
    fstab = tmp_path / "fstab"
    fstab.write_text(
        f"{back} {mnt} fuse.tierfs ram=32MiB,read_ahead_kb=512,nofail,_netdev,"
        f"x-systemd.requires=foo.service,defaults,noatime,nosuid,nodev 0 0\n"
        f"{tmp_path / 'missing'} {mnt2} fuse.tierfs ram=16MiB,nofail 0 0\n")
    m = Mount(back, mnt, None)
    try:
        r = subprocess.run(["mount", "-a", "-T", str(fstab)], capture_output=True, text=True, cwd="/",
                           env=MIN_ENV, timeout=120)
        assert r.returncode == 0, r.stderr  # the nofail line with a missing backing dir did not fail it
        assert "missing does not exist; not mounted (nofail)" in r.stderr
        assert mounted_entry(mnt) == (str(back), "fuse.tierfs") and not is_mounted(mnt2)
        m.pid = int((mnt / ".tierfs" / "pid").read_text())
        assert (mnt / "hello").read_text() == "hello\n"
        cfg = (mnt / ".tierfs" / "config.json").read_text()
        assert '"read_ahead_kb": 512' in cfg and f'"ram": {32 << 20}' in cfg
        # mount -a again: the line is seen as mounted and skipped
        r = subprocess.run(["mount", "-a", "-T", str(fstab)], capture_output=True, text=True, env=MIN_ENV)
        assert r.returncode == 0 and "already mounted" not in r.stderr, r.stderr
        # umount(8) ends the daemon cleanly
        subprocess.run(["umount", str(mnt)], check=True)
        wait_gone(m.pid)
        assert not is_mounted(mnt)
        # mount MOUNTPOINT takes the rest from the fstab
        r = subprocess.run(["mount", "-T", str(fstab), str(mnt)], capture_output=True, text=True, env=MIN_ENV)
        assert r.returncode == 0, r.stderr
        m.pid = int((mnt / ".tierfs" / "pid").read_text())
        assert (mnt / "hello").read_text() == "hello\n"
        tierfs_cmd("umount", str(mnt))
        assert not is_mounted(mnt)
    finally:
        force_unmount(m)


@needs_mount8
@pytest.mark.fuse
def test_mount_t_fuse_tierfs(sbin_helper: Path, tmp_path: Path) -> None:
    back, mnt = tmp_path / "back", tmp_path / "mnt"
    back.mkdir()
    mnt.mkdir()
    m = Mount(back, mnt, None)
    try:
        r = subprocess.run(["mount", "-t", "fuse.tierfs", str(back), str(mnt), "-o", "ram=32MiB,chunk_sise=4M"],
                           capture_output=True, text=True, env=MIN_ENV)
        assert r.returncode == helper.EX_FAIL and "unknown option 'chunk_sise'" in r.stderr
        assert "did you mean 'chunk_size'" in r.stderr and not is_mounted(mnt)
        r = subprocess.run(["mount", "-t", "fuse.tierfs", str(back), str(mnt), "-o", "ram=32MiB,chunk_size=8MiB"],
                           capture_output=True, text=True, env=MIN_ENV)
        assert r.returncode == 0 and r.stdout == "", r.stderr + r.stdout  # silent, as mount(8) is
        m.pid = int((mnt / ".tierfs" / "pid").read_text())
        assert m.stats()["chunk_size"] == 8 << 20
        (mnt / "written").write_text("through mount -t\n")
        tierfs_cmd("umount", "--flush", str(mnt))
        assert (back / "written").read_text() == "through mount -t\n"
    finally:
        force_unmount(m)
