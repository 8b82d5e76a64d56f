"""Set-user-ID and set-group-ID bits go when a user changes a file, as on a local filesystem.

The kernel drops them when a caller without CAP_FSETID writes or truncates a file, and on every
chown: otherwise a user who may write a set-user-ID root program could put their own code in
it and run it as root. The native transport negotiates FUSE_HANDLE_KILLPRIV_V2, which hands
that job to the daemon (and spares a request per write(2) of a passthrough file), including
for writes the kernel passes through and never shows the daemon. Each case here runs once in a
local directory and once in the mount; the modes must be the same.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.conftest import Mount, tierfs_cmd
from tests.security.conftest import SYSTEM_PYTHON, User

pytestmark = [pytest.mark.fuse]

# Run as the attacker: ``argv[1]`` the directory, then steps "op:name".
_STEPS = r"""
import os, sys
d = sys.argv[1]
for step in sys.argv[2:]:
    op, name = step.split(":")
    p = os.path.join(d, name)
    if op == "write":
        fd = os.open(p, os.O_WRONLY); os.write(fd, b"user"); os.close(fd)
    elif op == "truncate":
        os.truncate(p, 2)
    elif op == "otrunc":
        os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))
    elif op == "create_setuid_then_write":  # its own file: made, chmod u+s, then written
        fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.fchmod(fd, 0o4755); os.write(fd, b"user"); os.close(fd)
"""

# Opened for writing by the attacker, made set-user-ID by root meanwhile, written again.
_HELD = r"""
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY)
os.write(fd, b"first")
print("open", flush=True)
sys.stdin.readline()
os.write(fd, b"second")
os.close(fd)
"""


def _modes(d: Path, user: User) -> dict[str, str]:
    """The cases in directory ``d`` (root's files, the attacker acting on them); name -> mode."""
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    start = {"w_suid_sgid": 0o6777, "w_sgid_no_gx": 0o2767, "truncate": 0o4777,
             "otrunc": 0o4777, "chown": 0o4755, "root_write": 0o4777, "held": 0o666}
    for name, mode in start.items():
        (d / name).write_bytes(b"0123456789")
        os.chmod(d / name, mode)
    steps = ["write:w_suid_sgid", "write:w_sgid_no_gx", "truncate:truncate", "otrunc:otrunc",
             "create_setuid_then_write:own"]
    r = user.py(_STEPS, str(d), *steps)
    assert r.returncode == 0, r.stderr
    os.chown(d / "chown", user.uid, -1)  # root's chown drops them too
    with open(d / "root_write", "r+b") as f:  # root (CAP_FSETID) keeps them
        f.write(b"root")
    cmd = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--inh-caps=-all",
           "--", SYSTEM_PYTHON, "-I", "-c", _HELD, str(d / "held")]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/") as p:
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.readline().strip() == "open"
        os.chmod(d / "held", 0o4777)
        p.stdin.write("go\n")
        p.stdin.close()
        assert p.wait(timeout=60) == 0
    return {n: oct(stat.S_IMODE(os.stat(d / n).st_mode)) for n in [*start, "own"]}


@pytest.mark.parametrize("kind", ["native", "pyfuse3"])
def test_setid_bits_dropped_as_on_a_local_filesystem(secmount, shared_dir: Path, attacker: User,
                                                     kind: str) -> None:
    m: Mount = secmount(allow_other=True, extra=("--transport", kind))
    local = _modes(shared_dir / "local", attacker)
    # what the kernel does on a local filesystem: the cases must test something
    assert local["w_suid_sgid"] == "0o777" and local["root_write"] == "0o4777" and local["held"] == "0o777"
    assert local["w_sgid_no_gx"] == "0o767"  # the attacker is not in root's group (Linux 6.2+)
    here = _modes(m.mnt / "t", attacker)
    t = m.stats()["transport"]
    assert t["name"] == kind
    if kind == "pyfuse3":
        # Without FUSE_HANDLE_KILLPRIV_V2 (which pyfuse3 does not pass on) the kernel's FUSE
        # code keeps a set-group-ID without group execute whoever writes (docs/reference.md)
        assert here.pop("w_sgid_no_gx") == "0o2767"
        local.pop("w_sgid_no_gx")
    elif t["passthrough"]:
        assert "handle_killpriv_v2" in t["negotiated"].split()
    assert here == local
    # and the backing store gets the same modes once written back
    tierfs_cmd("flush", str(m.mnt), timeout=60)
    assert {n: oct(stat.S_IMODE(os.stat(m.backing / "t" / n).st_mode)) for n in here} == here


def test_setid_bits_dropped_after_a_users_write_beside_passthrough_readers(
        secmount, shared_dir: Path, attacker: User) -> None:
    """A user's open for writing of a file that readers read through passthrough from its
    tier copy writes that copy in place, and the kernel never shows the daemon those writes:
    the bits go when the writer closes."""
    import json
    import time

    back = shared_dir / "back"
    (back / "f").write_bytes(os.urandom(100_000))
    os.chmod(back / "f", 0o4777)
    m: Mount = secmount(allow_other=True, extra=("--transport", "native"))
    t = m.stats()["transport"]
    if not t["passthrough"]:
        pytest.skip(f"no kernel passthrough here: {t['why']}")
    end = time.monotonic() + 30
    while True:  # resident in the RAM tier, so that readers pass through to its tier copy
        (m.mnt / "f").read_bytes()
        where = json.loads(tierfs_cmd("where", str(m.mnt / "f"), "--json").stdout)[0]
        if where["resident_bytes"].get("ram", 0) == 100_000:
            break
        assert time.monotonic() < end, "not resident"
        time.sleep(0.05)
    with open(m.mnt / "f", "rb") as reader:
        before = m.stats()["writeback"]["in_place_opens"]
        r = attacker.py(_STEPS, str(m.mnt), "write:f")
        assert r.returncode == 0, r.stderr
        assert m.stats()["writeback"]["in_place_opens"] == before + 1  # the path meant here
        assert reader.read(4) == b"user"
    assert oct(stat.S_IMODE(os.stat(m.mnt / "f").st_mode)) == "0o777"


def test_a_users_write_of_a_written_setid_file_beside_its_readers_drops_the_bits(
        secmount, shared_dir: Path, attacker: User) -> None:
    """A set-ID file written through the mount (dirty, in the write tier) and read by a
    passthrough reader: a user's open for writing joins the reader's data file (refused, it
    would fail ETXTBSY: the kernel wants one backing file per inode), and the bits go at its
    close."""
    m: Mount = secmount(allow_other=True, extra=("--transport", "native"))
    t = m.stats()["transport"]
    if not t["passthrough"]:
        pytest.skip(f"no kernel passthrough here: {t['why']}")
    (m.mnt / "w").write_bytes(b"0123456789")
    os.chmod(m.mnt / "w", 0o4777)
    with open(m.mnt / "w", "rb") as reader:
        r = attacker.py(_STEPS, str(m.mnt), "write:w")
        assert r.returncode == 0, r.stderr
        assert reader.read(4) == b"user"
    assert oct(stat.S_IMODE(os.stat(m.mnt / "w").st_mode)) == "0o777"
