"""`tierfs doctor MOUNTPOINT`: exit 0 on a healthy mount; otherwise exit 1 and an explanation
of each problem with what to do."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO, needs_fuse, tierfs_cmd, write_random
from tierfs.mount import mount_id

pytestmark = [needs_fuse, pytest.mark.fuse]
MiB = 1 << 20


def doctor(mnt: Path | None, *args: str) -> tuple[int, dict[str, list[str]]]:
    """Exit code and {check: ["LEVEL message", ...]} of `tierfs doctor [MNT] [ARGS]`."""
    r = tierfs_cmd("doctor", *([str(mnt)] if mnt is not None else []), *args, check=False, timeout=60)
    lines = r.stdout.splitlines()
    found: dict[str, list[str]] = {}
    last: list[str] = []
    for line in lines[:-1]:
        if line.startswith(" "):  # a continuation (log lines of a dead daemon)
            last[-1] += "\n" + line
            continue
        level, rest = line.split(None, 1)
        check, message = rest.split("  ", 1)
        last = found.setdefault(check, [])
        last.append(f"{level} {message.strip()}")
    problems = sum(x.startswith("PROBLEM") for v in found.values() for x in v)
    assert lines[-1] == (f"{problems} problem(s)" if problems else "healthy"), r.stdout
    assert r.returncode == (1 if problems else 0), r.stdout
    return r.returncode, found


def test_healthy_mount(tiermount, tmp_path: Path) -> None:
    write_random(tmp_path / "back" / "f", 5 * MiB)
    m = tiermount(ram="32MiB", ssd="64MiB", extra=("--backing", "auto"))  # (the fixture's is hdd)
    (m.mnt / "f").read_bytes()
    (m.mnt / "w").write_bytes(b"w" * 1000)
    rc, found = doctor(m.mnt)
    assert rc == 0
    assert set(found) == {"mount", "users", "transport", "tier ram", "tier ssd", "journal", "readahead",
                          "backing", "backing profile", "write-back"}
    assert all(v[0].startswith("ok") for v in found.values()), found
    assert any(str(m.pid) in x for x in found["mount"])
    # how the profile was decided is shown (the test backing dir's filesystem decides which)
    [prof] = found["backing profile"]
    assert "(detected: " in prof and " in flight" in prof, prof


def test_lowered_readahead_is_a_problem_with_its_fix(tiermount) -> None:
    m = tiermount(ram="16MiB")
    st = os.stat(m.mnt)
    bdi = Path(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb")
    assert bdi.read_text().strip() == "1024"  # raised by the daemon at mount
    bdi.write_text("128")
    rc, found = doctor(m.mnt)
    assert rc == 1
    [msg] = found["readahead"]
    assert msg.startswith("PROBLEM") and "128 KiB" in msg and f"echo 1024 > {bdi}" in msg
    assert all(v[0].startswith("ok") for k, v in found.items() if k != "readahead")


def test_dead_daemon_is_explained(tiermount) -> None:
    m = tiermount(ram="16MiB")
    fd = os.open(m.mnt / "unsaved", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"u" * 1000)  # open for writing: journaled, not written back yet
    m.kill9()
    # fsync(2) fails on a dead mount; close(2) does where it reaches the daemon (native with
    # passthrough writes answers FLUSH), not where FLUSH was answered ENOSYS once
    with pytest.raises(OSError):
        os.fsync(fd)
    with contextlib.suppress(OSError):
        os.close(fd)
    rc, found = doctor(m.mnt)
    assert rc == 1
    [msg] = found["mount"]
    assert "dead" in msg and "tierfs mount" in msg and "daemon.log" in msg
    assert "1 written file(s) wait in the RAM write tier" in found["journal"][0]
    m.start()  # as the doctor says: mounting again works and writes the file back
    assert (m.mnt / "unsaved").read_bytes() == b"u" * 1000
    assert doctor(m.mnt)[0] == 0


def test_journaled_file_without_data_is_a_problem(tiermount) -> None:
    m = tiermount(ram="16MiB")
    fds = []
    for name in ("a", "b"):  # open for writing: both stay dirty
        fds.append(os.open(m.mnt / name, os.O_WRONLY | os.O_CREAT, 0o644))
        os.write(fds[-1], name.encode() * 1000)
    try:
        ram = next(t for t in m.stats()["tiers"] if t["name"] == "ram")
        dirty = sorted(Path(ram["path"], "dirty").iterdir())
        assert len(dirty) == 2
        dirty[0].unlink()  # removed from outside (the daemon still holds it open)
        rc, found = doctor(m.mnt)
        assert rc == 1
        [msg] = found["journal"]
        assert msg.startswith("PROBLEM") and "1 journaled file(s) lost their data" in msg
        assert msg.endswith("older versions") and ": a." in msg
    finally:
        for fd in fds:
            os.close(fd)


def test_nothing_mounted(tmp_path: Path) -> None:
    rc, found = doctor(tmp_path)
    assert rc == 1
    assert "nothing is mounted" in found["mount"][0]


def test_mount_again_right_after_a_crash(tiermount) -> None:
    """The user guide's crash drill, at full speed: the kernel still holds the root's attributes
    (for attr_timeout; 60 s here to make the window certain) when the new mount checks the
    mountpoint, so a stat of it still works and the dead mount looked like a live one ("already
    mounted"). A statvfs is never answered from the cache."""
    m = tiermount(ram="16MiB", extra=("-o", "attr_timeout=60"))
    os.stat(m.mnt)
    m.kill9()
    os.stat(m.mnt)  # cached: no ENOTCONN
    m.start()
    assert doctor(m.mnt)[0] == 0


def test_doctor_says_who_can_use_the_mount(tiermount) -> None:
    """Root's mount is everyone's by default; --no-allow-other keeps it root's, which is worth
    a note (other users get EACCES on everything)."""
    shared = tiermount(ram="16MiB")
    _, found = doctor(shared.mnt)
    assert found["users"] == ["ok all users (allow_other, permissions checked by the kernel)"]
    other = shared.backing.parent / "back-private"  # one daemon per backing directory
    other.mkdir()
    private = tiermount(ram="16MiB", name="private", extra=("--no-allow-other",), backing=other)
    rc, found = doctor(private.mnt)
    assert rc == 0
    [msg] = found["users"]
    assert msg.startswith("note only uid 0") and "--allow-other" in msg


def test_backing_profile_set_by_flag_is_shown_with_what_detection_says(tiermount) -> None:
    m = tiermount(ram="16MiB", extra=["--backing", "parallel"])
    doc = json.loads((m.mnt / ".tierfs" / "stats.json").read_text())
    prof = doc["scheduler"]["profile"]
    assert (prof["name"], prof["source"], prof["elevator"]) == ("parallel", "flag --backing", False)
    assert doc["scheduler"]["depth"] == 16
    rc, found = doctor(m.mnt)
    [msg] = found["backing profile"]
    assert "parallel (flag --backing" in msg


def test_ram_tiers_no_daemon_holds_are_named_with_what_to_do_and_freed(tiermount, tmp_path: Path) -> None:
    """`tierfs doctor` without a mountpoint: a RAM tier left by a daemon that died (or was
    unmounted without --flush) holds memory for nothing, or files a reboot loses; it is
    listed with what it keeps and what to do. --free removes what nothing needs, never a file
    not yet written back; mounting again as told writes the file back."""
    ram_dir = Path(tempfile.mkdtemp(prefix="tierfs-test-", dir="/dev/shm"))  # this test's tiers only
    try:
        opt = ("-o", f"ram_dir={ram_dir}")
        (tmp_path / "back2").mkdir()
        (tmp_path / "back3").mkdir()
        dirty = tiermount(ram="16MiB", extra=opt)  # dies with a file open for writing
        clean = tiermount(ram="16MiB", extra=opt, backing=tmp_path / "back2", name="mnt2")
        live = tiermount(ram="16MiB", extra=opt, backing=tmp_path / "back3", name="mnt3")
        fd = os.open(dirty.mnt / "unsaved", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"u" * 1000)
        (clean.mnt / "cached").write_bytes(b"c" * 100_000)
        tierfs_cmd("flush", str(clean.mnt))
        (clean.mnt / "cached").read_bytes()
        dirty.kill9()
        clean.kill9()
        with contextlib.suppress(OSError):
            os.close(fd)
        mounts = {"dirty": dirty, "clean": clean, "live": live}
        tiers = {k: ram_dir / "tierfs" / mount_id(str(m.mnt)) for k, m in mounts.items()}
        assert all(p.is_dir() for p in tiers.values())

        rc, found = doctor(None, "--ram-dir", str(ram_dir))
        assert rc == 1
        by = {k: found[f"tier {p.name}"] for k, p in tiers.items()}
        [msg] = by["live"]
        assert msg.startswith("ok") and f"in use by daemon {live.pid}" in msg
        [msg] = by["clean"]
        assert msg.startswith("PROBLEM") and "nothing to write back" in msg and "--free" in msg
        [msg] = by["dirty"]
        assert msg.startswith("PROBLEM") and "1 file(s) not yet written back (unsaved)" in msg
        real = os.path.realpath
        # the command names the ram_dir the tier is under (it is found again only there)
        assert f"tierfs mount -o ram_dir={ram_dir} {real(tmp_path / 'back')} {real(dirty.mnt)}" in msg
        assert "lost at reboot" in msg

        # a mount tells of them too (nothing else would)
        (tmp_path / "back4").mkdir()
        (tmp_path / "mnt4").mkdir()
        r = tierfs_cmd("mount", str(tmp_path / "back4"), str(tmp_path / "mnt4"), "--ram", "16MiB", *opt)
        tierfs_cmd("umount", str(tmp_path / "mnt4"))
        assert "note: 2 RAM tier(s) under" in r.stdout and "tierfs doctor" in r.stdout, r.stdout

        rc, found = doctor(None, "--ram-dir", str(ram_dir), "--free")
        assert rc == 1  # the file to write back is still there
        assert not tiers["clean"].exists() and "removed" in found[f"tier {tiers['clean'].name}"][0]
        assert not (tiers["dirty"] / "data").exists()  # its cached data: freed
        assert len(list((tiers["dirty"] / "dirty").iterdir())) == 1
        assert (tiers["live"] / "data").is_dir()  # a live daemon's tier: untouched

        dirty.start()  # as told: mount it there again, then flush
        tierfs_cmd("flush", str(dirty.mnt))
        dirty.stop()
        assert (tmp_path / "back" / "unsaved").read_bytes() == b"u" * 1000
        rc, found = doctor(None, "--ram-dir", str(ram_dir))
        assert rc == 0 and set(found) == {f"tier {tiers['live'].name}"}, found
    finally:
        if (tmp_path / "mnt4").is_dir() and os.path.ismount(tmp_path / "mnt4"):
            subprocess.run(["fusermount3", "-u", "-z", str(tmp_path / "mnt4")], capture_output=True)
        shutil.rmtree(ram_dir, ignore_errors=True)


def test_free_and_ram_dir_are_for_the_whole_machine_not_a_mount(tmp_path: Path) -> None:
    r = tierfs_cmd("doctor", str(tmp_path), "--free", check=False)
    assert r.returncode != 0 and "give no MOUNTPOINT" in r.stderr


def test_tiers_doctor_cannot_vouch_for_are_never_freed(tmp_path: Path) -> None:
    """Made by hand, no mount: a tier with data files but no journal (their names are lost:
    kept, reported), one owned by another user (never touched, a note), and root's tiers seen
    by another user: a note, never a verdict on what it cannot read."""
    ram_dir = Path(tempfile.mkdtemp(prefix="tierfs-test-", dir="/dev/shm"))
    try:
        ram_dir.chmod(0o755)
        parent = ram_dir / "tierfs"
        parent.mkdir()
        parent.chmod(0o755)  # readable by others (as an older tierfs left it)
        nojournal = parent / "aaaaaaaaaaaa"
        (nojournal / "dirty").mkdir(parents=True)
        (nojournal / "data" / "ab").mkdir(parents=True)
        (nojournal / "dirty" / "1").write_bytes(b"unsaved")
        (nojournal / "data" / "ab" / "abcd").write_bytes(b"cached")
        (nojournal / "lock").touch()
        nojournal.chmod(0o700)
        foreign = parent / "bbbbbbbbbbbb"
        foreign.mkdir()
        os.chown(foreign, 65534, 65534)

        rc, found = doctor(None, "--ram-dir", str(ram_dir), "--free")
        assert rc == 1
        [note, msg] = found[f"tier {nojournal.name}"]
        assert note.startswith("note") and "cached data removed" in note
        assert msg.startswith("PROBLEM") and "no journal" in msg and "1 data file(s)" in msg
        assert (nojournal / "dirty" / "1").read_bytes() == b"unsaved" and not (nojournal / "data").exists()
        [msg] = found[f"tier {foreign.name}"]
        assert msg.startswith("note") and "owned by uid 65534" in msg and foreign.is_dir()

        parent.chmod(0o755)  # (--free tightened it, as any mount does)
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                            "-m", "tierfs", "doctor", "--ram-dir", str(ram_dir)],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
        # root's tier, to another user: named as another user's, no verdict on it
        assert f"{nojournal}: owned by uid 0" in r.stdout, r.stdout + r.stderr
        assert f"{nojournal}: no daemon holds it" not in r.stdout
    finally:
        shutil.rmtree(ram_dir, ignore_errors=True)
