"""Escapes from the backing directory: a user who can write part of the backing tree swaps a
directory for a symlink (one the kernel still holds, or one tierfs just created) and makes the
root daemon act outside the backing root; and setgid directories, honoured as a local
filesystem honours them.

The backing tree is shared with the attacker here: ``back/atk`` is theirs (as their home on the
HDD would be), and they change it directly, behind the mount's back.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pyfuse3
import pytest
import trio

from tests.conftest import tierfs_cmd
from tests.security.conftest import User
from tierfs.fs.api import FuseError

# The attacker holds ``mnt/atk/sub`` open (the kernel keeps its inode), swaps ``back/atk/sub``
# for a symlink to ``target`` behind the mount's back, then works relative to the held
# directory. Prints one line per attempt: ``name: ok <detail>`` or ``name: <errno name>``.
_SWAP_AND_USE = r"""
import errno, os, sys
mnt_sub, back_atk, target = sys.argv[1:4]
fd = os.open(mnt_sub, os.O_RDONLY | os.O_DIRECTORY)
os.rename(os.path.join(back_atk, "sub"), os.path.join(back_atk, "old"))
os.symlink(target, os.path.join(back_atk, "sub"))

def attempt(name, fn):
    try:
        print(name + ": ok", fn(), flush=True)
    except OSError as e:
        print(name + ":", errno.errorcode.get(e.errno, e.errno), flush=True)

def read_secret():
    f = os.open("secret.txt", os.O_RDONLY, dir_fd=fd)
    try:
        return os.read(f, 100).decode()
    finally:
        os.close(f)

def create():
    f = os.open("planted", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644, dir_fd=fd)
    os.write(f, b"attacker data")
    os.close(f)
    return "created"

attempt("stat", lambda: os.stat("secret.txt", dir_fd=fd).st_size)
attempt("read", read_secret)
attempt("create", create)
attempt("mkdir", lambda: os.mkdir("planted-dir", dir_fd=fd))
"""


def _attacker_home(shared_dir: Path, attacker: User) -> Path:
    atk = shared_dir / "back" / "atk"
    (atk / "sub").mkdir(parents=True)
    for p in (atk, atk / "sub"):
        os.chown(p, attacker.uid, attacker.gid)
        os.chmod(p, 0o755)
    return atk


def test_held_dir_swapped_for_symlink_reads_nothing_outside(attacker: User, secmount, shared_dir: Path) -> None:
    """A root 0700 directory outside the backing root: its 0644 file must stay out of reach
    through a held backing directory swapped for a symlink to it."""
    atk = _attacker_home(shared_dir, attacker)
    secret_dir = shared_dir / "rootonly"
    secret_dir.mkdir(mode=0o700)
    (secret_dir / "secret.txt").write_text("TOPSECRET")
    os.chmod(secret_dir / "secret.txt", 0o644)
    m = secmount(allow_other=True)
    r = attacker.py(_SWAP_AND_USE, str(m.mnt / "atk" / "sub"), str(atk), str(secret_dir))
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr.decode()
    assert "TOPSECRET" not in out, out
    assert "read: ok" not in out and "stat: ok" not in out, out


def test_held_dir_swapped_for_symlink_creates_nothing_outside(attacker: User, secmount, shared_dir: Path) -> None:
    """A root 0755 directory outside the backing root (the attacker cannot write it): no file
    or directory of theirs may appear in it through the mount, also after write-back."""
    atk = _attacker_home(shared_dir, attacker)
    root_dir = shared_dir / "rootdir"
    root_dir.mkdir(mode=0o755)
    m = secmount(allow_other=True)
    r = attacker.py(_SWAP_AND_USE, str(m.mnt / "atk" / "sub"), str(atk), str(root_dir))
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr.decode()
    tierfs_cmd("flush", str(m.mnt), timeout=60, check=False)
    assert sorted(os.listdir(root_dir)) == [], out
    assert "create: ok" not in out and "mkdir: ok" not in out, out


def test_setgid_directory_is_honoured(attacker: User, victim: User, secmount, shared_dir: Path) -> None:
    """In a setgid directory new files, directories, fifos and symlinks take the directory's group and a
    new subdirectory keeps the setgid bit (as on a local filesystem), also on the backing store."""
    g = shared_dir / "back" / "team"
    g.mkdir()
    os.chown(g, 0, victim.gid)
    os.chmod(g, 0o2777)
    m = secmount(allow_other=True)
    code = r"""
import os, sys
d = sys.argv[1]
os.umask(0o022)
open(os.path.join(d, "f"), "w").close()
os.mkdir(os.path.join(d, "sub"), 0o755)
os.mkfifo(os.path.join(d, "fifo"), 0o644)
os.symlink("f", os.path.join(d, "link"))
"""
    r = attacker.py(code, str(m.mnt / "team"))
    assert r.returncode == 0, r.stderr.decode()
    for name in ("f", "sub", "fifo", "link"):
        st = os.lstat(m.mnt / "team" / name)
        assert (st.st_uid, st.st_gid) == (attacker.uid, victim.gid), name
    sub = os.lstat(m.mnt / "team" / "sub")
    assert stat.S_IMODE(sub.st_mode) == 0o2755
    tierfs_cmd("flush", str(m.mnt), timeout=60)
    for name in ("f", "sub", "fifo", "link"):
        st = os.lstat(g / name)
        assert (st.st_uid, st.st_gid) == (attacker.uid, victim.gid), name
    assert stat.S_IMODE(os.lstat(g / "sub").st_mode) == 0o2755


# -- mkdir then chmod: a symlink swapped in between (deterministic, in-process) -----------------
def _operations(back: Path):
    """A ``Handlers`` over ``back`` with only what ``mkdir`` touches (no mount)."""
    from tierfs.backing_tree import BackingTree
    from tierfs.fs.handlers import Handlers
    from tierfs.fs.inodes import InodeTable
    from tierfs.io import Device

    tree = BackingTree(os.fsencode(back))
    wb = SimpleNamespace(get=lambda path: None, on_clean=None)
    return Handlers(tree=tree, inodes=InodeTable(tree), cache=None, writeback=wb,  # type: ignore[arg-type]
                      readahead=None, control=SimpleNamespace(by_inode={}),  # type: ignore[arg-type]
                      meta=Device("meta", 1), attr_timeout=1.0)


def test_mkdir_then_chmod_never_follows_a_swapped_symlink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon creates a directory, then sets its mode and owner. A user who can write the
    parent swaps the new directory for a symlink to a root 0600 file in between (here: inside
    the mkdir call, deterministically): the file's mode and owner must not change."""
    back = tmp_path / "back"
    back.mkdir()
    victim_file = tmp_path / "shadow"
    victim_file.write_text("root only")
    os.chmod(victim_file, 0o600)
    real_mkdir = os.mkdir

    def mkdir_then_swap(path, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
        real_mkdir(path, mode, dir_fd=dir_fd)
        os.rmdir(path, dir_fd=dir_fd)
        os.symlink(str(victim_file), path, dir_fd=dir_fd)

    ops = _operations(back)
    monkeypatch.setattr(os, "mkdir", mkdir_then_swap)
    ctx = SimpleNamespace(uid=12345, gid=12345, pid=1)

    async def main() -> None:
        with pytest.raises(FuseError):
            await ops.mkdir(pyfuse3.ROOT_INODE, b"d", 0o777, ctx)

    trio.run(main)
    st = os.lstat(victim_file)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, 0, 0)


def test_dir_swapped_after_create_gets_no_write_back_outside(attacker: User, secmount, shared_dir: Path) -> None:
    """The attacker writes a file through the mount (legitimately), then, before its write-back,
    swaps its backing directory for a symlink to a root directory outside the backing root: the
    write-back must not create the file there."""
    atk = _attacker_home(shared_dir, attacker)
    root_dir = shared_dir / "rootdir"
    root_dir.mkdir(mode=0o755)
    m = secmount(allow_other=True, extra=("-o", "writeback_deadline=3600"))
    code = r"""
import os, sys
mnt_sub, back_atk, target = sys.argv[1:4]
with open(os.path.join(mnt_sub, "planted"), "wb") as f:
    f.write(b"attacker data")
os.rename(os.path.join(back_atk, "sub"), os.path.join(back_atk, "old"))
os.symlink(target, os.path.join(back_atk, "sub"))
"""
    r = attacker.py(code, str(m.mnt / "atk" / "sub"), str(atk), str(root_dir))
    assert r.returncode == 0, r.stderr.decode()
    tierfs_cmd("flush", str(m.mnt), timeout=60, check=False)
    assert os.listdir(root_dir) == []


def test_unprivileged_user_cannot_make_devices(attacker: User, secmount, shared_dir: Path) -> None:
    """The daemon runs as root: a device node made on behalf of a user would give them the
    device. A fifo, yes; a character device, EPERM (as on a local filesystem)."""
    pub = shared_dir / "back" / "pub"
    pub.mkdir(mode=0o777)
    os.chmod(pub, 0o1777)
    m = secmount(allow_other=True)
    code = r"""
import errno, os, stat, sys
d = sys.argv[1]
os.mkfifo(os.path.join(d, "fifo"), 0o600)
try:
    os.mknod(os.path.join(d, "mem"), stat.S_IFCHR | 0o666, os.makedev(1, 1))
    print("made")
except OSError as e:
    print(errno.errorcode[e.errno])
"""
    r = attacker.py(code, str(m.mnt / "pub"))
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().strip() == "EPERM"
    assert not os.path.lexists(pub / "mem")
    assert os.lstat(pub / "fifo").st_uid == attacker.uid
