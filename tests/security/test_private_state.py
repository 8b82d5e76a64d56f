"""Private state: nothing tierfs keeps outside the mount (tiers, dirty files, journal, catalog,
the state directory and its log) can be read, planted in or removed by another local user.

Each test plays a hostile unprivileged user (``attacker``) against a root mount under a 0755
directory (``secmount``), as on a shared training box. Tier paths are read from the mount's own
``stats.json``, so each test states the attack, not where a version keeps its files.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.conftest import drop_page_cache, is_mounted, tierfs_cmd
from tests.security.conftest import User

SECRET = b"root-only secret 7f3a9c\n"


def _secret_file(back: Path, name: str = "secret", data: bytes = SECRET) -> Path:
    """``back/private/<name>``: root's, in a 0700 directory, mode 0600."""
    d = back / "private"
    d.mkdir(mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    p = d / name
    p.write_bytes(data)
    os.chmod(p, 0o600)
    return p


def _key(path: Path) -> str:
    from tierfs.sched.backing import Identity

    return Identity.of(str(path), os.stat(path)).key


def _tier_paths(m) -> list[str]:  # type: ignore[no-untyped-def]
    return [t["path"] for t in m.stats()["tiers"]]


_PLANT = r"""
import os, sys
for p in sys.argv[1:]:
    try:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        os.chmod(os.path.dirname(p), 0o777)
        fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o666)
        os.fchmod(fd, 0o666)
        os.close(fd)
        print("planted", p)
    except OSError as e:
        print("refused", p, e.errno)
"""

_READ_ALL = r"""
import os, sys
found = []
for top in sys.argv[1:]:
    for d, ds, fs in os.walk(top):
        for n in fs:
            try:
                with open(os.path.join(d, n), "rb") as f:
                    found.append(f.read().hex())
            except OSError:
                pass
print(" ".join(found))
"""


def _attacker_reads(attacker: User, *tops: str) -> bytes:
    """Every byte the attacker can read in files under ``tops`` (concatenated)."""
    r = attacker.py(_READ_ALL, *tops, check=True)
    return b"".join(bytes.fromhex(h) for h in r.stdout.decode().split())


# -- 1a: a pre-created tier file --------------------------------------------------------------
def test_1a_precreated_tier_file_does_not_receive_root_data(secmount, shared_dir: Path, attacker: User,
                                                           allow_other: bool) -> None:
    back = shared_dir / "back"
    secret = _secret_file(back)
    m = secmount(allow_other=allow_other)
    key = _key(secret)
    targets = [os.path.join(t, "data", key[:2], key) for t in _tier_paths(m)]
    attacker.py(_PLANT, *targets)
    assert (m.mnt / "private" / "secret").read_bytes() == SECRET  # root reads through the mount
    got = _attacker_reads(attacker, *_tier_paths(m))
    assert SECRET not in got, "the attacker read root's file from a tier file they planted"


# -- 1b: a tier file overwritten by the attacker ------------------------------------------------
def test_1b_attacker_cannot_change_what_root_reads_through_the_mount(secmount, shared_dir: Path,
                                                                   attacker: User, allow_other: bool) -> None:
    back = shared_dir / "back"
    good = b"#!/bin/sh\necho good\n"
    tool = back / "tool.sh"
    tool.write_bytes(good)
    os.chmod(tool, 0o755)
    m = secmount(allow_other=allow_other)
    key = _key(tool)
    targets = [os.path.join(t, "data", key[:2], key) for t in _tier_paths(m)]
    attacker.py(_PLANT, *targets)
    assert (m.mnt / "tool.sh").read_bytes() == good  # cached now
    evil = b"#!/bin/sh\necho evil\n"
    attacker.py("import sys\nfor p in sys.argv[2:]:\n"
                "    try: open(p, 'r+b').write(bytes.fromhex(sys.argv[1]))\n"
                "    except OSError: pass\n", evil.hex(), *targets)
    drop_page_cache(m.mnt / "tool.sh")
    assert (m.mnt / "tool.sh").read_bytes() == good, "root read the attacker's bytes through the mount"
    assert tool.read_bytes() == good


# -- 1c: symlinks planted in the dirty directory --------------------------------------------------
_SYMLINKS = r"""
import os, sys
d, target = sys.argv[1], sys.argv[2]
n = 0
for i in range(1, 60):
    try:
        os.symlink(target, os.path.join(d, str(i)))
        n += 1
    except OSError:
        pass
print(n)
"""


def test_1c_symlinks_planted_in_dirty_dir_do_not_redirect_writes(secmount, shared_dir: Path,
                                                               attacker: User, allow_other: bool) -> None:
    back = shared_dir / "back"
    (back / "pub").mkdir(mode=0o777)
    os.chmod(back / "pub", 0o777)
    root_file = shared_dir / "root-file"
    root_file.write_bytes(b"root's own\n")
    os.chmod(root_file, 0o600)
    m = secmount(allow_other=allow_other, extra=("-o", "writeback_deadline=3600"))
    ssd = next(t["path"] for t in m.stats()["tiers"] if t["name"] == "ssd")
    attacker.py(_SYMLINKS, os.path.join(ssd, "dirty"), str(root_file))
    if allow_other:  # the attacker writes through the mount
        r = attacker.py("import sys; open(sys.argv[1], 'wb').write(b'pwned')", str(m.mnt / "pub" / "x"))
        assert r.returncode == 0, r.stderr
    else:  # only root can use the mount: root writes
        (m.mnt / "pub" / "x").write_bytes(b"pwned")
    st = root_file.stat()
    assert root_file.read_bytes() == b"root's own\n", "a root file was overwritten through a planted symlink"
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600), "a root file was chowned/chmodded"


# -- 1d: dirty files removed by the attacker ------------------------------------------------------
def test_1d_attacker_cannot_remove_dirty_files(secmount, shared_dir: Path, attacker: User) -> None:
    back = shared_dir / "back"
    m = secmount(allow_other=True)
    # a file still open for writing is not written back yet (a closed one would soon be)
    fd = os.open(m.mnt / "precious", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"not yet written back\n")
    os.fsync(fd)  # durable in the (persistent) write tier
    ssd = next(t["path"] for t in m.stats()["tiers"] if t["name"] == "ssd")
    attacker.py("import os, sys\nd = sys.argv[1]\nfor n in os.listdir(d):\n"
                "    try: os.unlink(os.path.join(d, n))\n    except OSError: pass\n",
                os.path.join(ssd, "dirty"))
    m.kill9()  # then mount again: recovery writes back what the journal names
    try:
        os.close(fd)
    except OSError:
        pass
    assert not (back / "precious").exists()  # only in the write tier so far
    m.start()
    tierfs_cmd("flush", str(m.mnt))
    assert (back / "precious").read_bytes() == b"not yet written back\n", "a dirty file was lost"


# -- 2: the RAM tier's predictable path -----------------------------------------------------------
def _ram_path(mnt: Path) -> tuple[str, str]:
    """(where the RAM tier of ``mnt`` will be, the first component of it a user could create
    in /dev/shm)."""
    from tierfs import mount

    if hasattr(mount, "ram_tier_path"):
        path = mount.ram_tier_path("/dev/shm", str(mnt))
    else:  # the layout before the RAM tier moved under a private parent
        path = os.path.join("/dev/shm", "tierfs-" + mount.mount_id(str(mnt)))
    top = os.path.join("/dev/shm", os.path.relpath(path, "/dev/shm").split(os.sep)[0])
    return path, top


def _remove_planted(top: str) -> None:
    st = os.lstat(top) if os.path.lexists(top) else None
    if st is None:
        return
    if stat.S_ISLNK(st.st_mode):
        os.unlink(top)
    elif st.st_uid != 0:
        import shutil

        shutil.rmtree(top, ignore_errors=True)


def test_2_symlink_planted_at_the_ram_tier_path(secmount, shared_dir: Path, attacker: User,
                                                victim: User) -> None:
    vdir = shared_dir / "victim-dir"
    (vdir / "data").mkdir(parents=True)
    (vdir / "data" / "precious").write_bytes(b"victim's\n")
    for p in (vdir, vdir / "data", vdir / "data" / "precious"):
        os.chown(p, victim.uid, victim.gid)
    os.chmod(vdir, 0o755)
    before = sorted(str(p.relative_to(vdir)) for p in vdir.rglob("*"))
    path, top = _ram_path(shared_dir / "mnt")
    # plant at the first component that does not exist yet (the tier itself, or its parent)
    plant = top if not os.path.lexists(top) else path
    r = attacker.run(["ln", "-s", str(vdir), plant])
    try:
        try:
            secmount(allow_other=True)
            mounted_error = ""
        except AssertionError as e:
            mounted_error = str(e)
        after = sorted(str(p.relative_to(vdir)) for p in vdir.rglob("*"))
        assert (vdir / "data" / "precious").read_bytes() == b"victim's\n", "the victim's data was deleted"
        assert after == before, f"tierfs created state in the victim's directory: {after}"
        if r.returncode == 0 and mounted_error:
            assert "symlink" in mounted_error or "owned by" in mounted_error, mounted_error
    finally:
        _remove_planted(top)


def test_2_directory_planted_at_the_ram_tier_path(secmount, shared_dir: Path, attacker: User) -> None:
    _secret_file(shared_dir / "back")
    path, top = _ram_path(shared_dir / "mnt")
    plant = top if not os.path.lexists(top) else path
    r = attacker.run(["mkdir", "-m", "777", plant])
    try:
        try:
            m = secmount(allow_other=True)
        except AssertionError as e:  # refused: fine, if it says why
            assert r.returncode == 0 and "owned by" in str(e), e
            return
        assert (m.mnt / "private" / "secret").read_bytes() == SECRET
        for t in _tier_paths(m):  # no tier lives in (or under) a directory the attacker owns
            p = Path(t)
            for q in (p, *p.parents):
                assert q.stat().st_uid != attacker.uid, f"the tier {t} is in the attacker's {q}"
        if r.returncode == 0:
            assert SECRET not in _attacker_reads(attacker, plant)
    finally:
        _remove_planted(top)


# -- 7: the state directory and its log ------------------------------------------------------------
def test_7_state_dir_and_log_are_private(secmount, shared_dir: Path, attacker: User) -> None:
    from tierfs.mount import state_dir_for

    m = secmount(allow_other=True)
    state = Path(state_dir_for(str(m.mnt)))
    log = state / "daemon.log"
    assert log.exists()
    for p, mode in ((state.parent, 0o700), (state, 0o700), (log, 0o600)):
        st = p.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, mode), f"{p}: {stat.S_IMODE(st.st_mode):04o}"
    r = attacker.run(["cat", str(log)])
    assert r.returncode != 0, "the attacker read the daemon's log"
    assert attacker.run(["ls", str(state)]).returncode != 0


# -- 8a: dirty files and the journal ---------------------------------------------------------------
def test_8a_dirty_files_and_journal_are_not_readable_by_others(secmount, shared_dir: Path,
                                                             attacker: User, allow_other: bool) -> None:
    back = shared_dir / "back"
    (back / "private").mkdir(mode=0o700)
    os.chmod(back / "private", 0o700)
    m = secmount(allow_other=allow_other, extra=("-o", "writeback_deadline=3600"))
    f = m.mnt / "private" / "confidential-name.txt"
    f.write_bytes(SECRET)
    os.chmod(f, 0o644)  # readable by all, but inside root's 0700 directory
    wt = m.stats()["writeback"]["write_tier"]
    tier = next(t["path"] for t in m.stats()["tiers"] if t["name"] == wt)
    got = _attacker_reads(attacker, tier)
    assert SECRET not in got, "the attacker read a file being written from the write tier"
    assert b"confidential-name" not in got, "the attacker read the journal's paths"
    for name in ("journal.sqlite", "dirty"):
        st = os.stat(os.path.join(tier, name))
        assert not st.st_mode & 0o077, f"{name}: {stat.S_IMODE(st.st_mode):04o}"


# -- 8b: an SSD tier inside the backing directory ----------------------------------------------------
def test_8b_ssd_tier_inside_backing_dir_is_refused(shared_dir: Path) -> None:
    back = shared_dir / "back"
    (back / "sub").mkdir(parents=True)
    mnt = shared_dir / "mnt"
    mnt.mkdir()
    for ssd in (back / "cache", back / "sub" / "cache", back):
        r = tierfs_cmd("mount", str(back), str(mnt), "--ram", "0", "--ssd", f"{ssd}:64MiB", check=False)
        if is_mounted(mnt):
            tierfs_cmd("umount", str(mnt))
        assert r.returncode != 0, f"an SSD tier at {ssd} inside the backing directory was accepted"
        assert "inside the backing directory" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- what a tier or state directory must be ----------------------------------------------------------
@pytest.mark.parametrize("bad", ["mode0755", "mode0770", "symlink", "other_owner"])
def test_existing_ssd_dir_that_is_not_private_refuses_the_mount(shared_dir: Path, attacker: User, bad: str) -> None:
    back = shared_dir / "back"
    back.mkdir()
    mnt = shared_dir / "mnt"
    mnt.mkdir()
    ssd = shared_dir / "ssd"
    if bad == "symlink":
        (shared_dir / "real").mkdir(mode=0o700)
        ssd.symlink_to(shared_dir / "real")
    else:
        ssd.mkdir()
        os.chmod(ssd, {"mode0755": 0o755, "mode0770": 0o770, "other_owner": 0o700}[bad])
        if bad == "other_owner":
            os.chown(ssd, attacker.uid, attacker.gid)
    r = tierfs_cmd("mount", str(back), str(mnt), "--ram", "0", "--ssd", f"{ssd}:64MiB", check=False)
    if is_mounted(mnt):
        tierfs_cmd("umount", str(mnt))
    assert r.returncode != 0, f"a {bad} SSD tier directory was accepted"
    msg = r.stderr.strip()
    assert len(msg.splitlines()) == 1 and str(ssd) in msg, msg
    assert {"mode0755": "chmod 700", "mode0770": "chmod 700", "symlink": "symlink",
            "other_owner": "owned by"}[bad] in msg, msg


def test_tiers_and_their_files_are_private(secmount, shared_dir: Path) -> None:
    """Every directory and file in the tiers: the daemon's user's, 0700 / 0600 (dirty files
    carry the mode of the file they stand for, inside the 0700 dirty/ directory)."""
    back = shared_dir / "back"
    (back / "f").write_bytes(b"x" * 100_000)
    m = secmount(allow_other=True, extra=("-o", "writeback_deadline=3600"))
    assert (m.mnt / "f").read_bytes()
    (m.mnt / "w").write_bytes(b"y")
    tiers = _tier_paths(m)
    bad = []
    for t in tiers:
        for d, _ds, fs in os.walk(t):
            for n in [d, *(os.path.join(d, x) for x in fs)]:
                st = os.lstat(n)
                if os.path.basename(os.path.dirname(n)) == "dirty":
                    continue
                want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
                if st.st_uid != 0 or stat.S_IMODE(st.st_mode) != want:
                    bad.append(f"{n} {stat.S_IMODE(st.st_mode):04o} uid {st.st_uid}")
    assert not bad, bad


@pytest.mark.parametrize("ssd", [None, "128MiB"], ids=["ram_write_tier", "ssd_write_tier"])
def test_umount_leaves_nothing_in_dev_shm(secmount, shared_dir: Path, ssd: str | None) -> None:
    from tierfs.mount import mount_id

    before = set(os.listdir("/dev/shm"))
    (shared_dir / "back" / "f").write_bytes(b"x" * 100_000)
    m = secmount(allow_other=True, ssd=ssd)
    assert (m.mnt / "f").read_bytes()
    (m.mnt / "w").write_bytes(b"y" * 1000)
    tierfs_cmd("flush", str(m.mnt))
    mid = mount_id(str(m.mnt))
    m.stop()
    left = [n for n in set(os.listdir("/dev/shm")) - before
            if n.startswith("tierfs") and (mid in n or n == "tierfs")]
    left += [f"tierfs/{n}" for n in (os.listdir("/dev/shm/tierfs") if os.path.isdir("/dev/shm/tierfs") else [])
             if n == mid]
    assert not left, f"left in /dev/shm after umount: {left}"


def test_doctor_reports_a_tier_dir_that_is_not_private(secmount, shared_dir: Path) -> None:
    m = secmount(allow_other=True)
    ssd = next(t["path"] for t in m.stats()["tiers"] if t["name"] == "ssd")
    os.chmod(ssd, 0o755)
    try:
        r = tierfs_cmd("doctor", str(m.mnt), check=False)
    finally:
        os.chmod(ssd, 0o700)
    assert r.returncode == 1 and "chmod 700" in r.stdout and ssd in r.stdout, r.stdout


def test_stats_show_the_tier_paths(secmount) -> None:
    """The other tests find the tiers through stats.json; make sure it names real directories."""
    m = secmount(allow_other=False)
    for t in json.loads((m.mnt / ".tierfs" / "stats.json").read_bytes())["tiers"]:
        assert os.path.isdir(t["path"]), t
