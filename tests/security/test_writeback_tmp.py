"""Write-back temporary files never follow a name planted by a user who can write the target's
directory on the backing store: neither a write-back's nor a written-through file's.

The attacker owns a directory of the backing tree (their home on the HDD, say) and plants
symlinks named as tierfs used to name its temporary files (``.tierfs-wb.<id>.<gen>``: the
journal id and the file's generation, both easy to guess) pointing at a root-only file. Then
they write a file there through the mount. The root-owned victim must stay as it was: same
bytes, same owner, same mode."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import tierfs_cmd
from tests.security.conftest import User

MiB = 1 << 20
PLANT = """
import os, sys
d, victim, ids, gens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for i in range(1, ids + 1):
    for g in range(gens + 1):
        os.symlink(victim, os.path.join(d, f".tierfs-wb.{i}.{g}"))
"""
WRITE = """
import os, sys
path, size = sys.argv[1], int(sys.argv[2])
with open(path, "wb") as f:
    for off in range(0, size, 1 << 20):
        f.write(b"A" * min(1 << 20, size - off))
"""


def _victim(shared_dir: Path) -> tuple[Path, os.stat_result]:
    victim = shared_dir / "victim"
    victim.write_bytes(b"root's secret, never overwritten")
    os.chmod(victim, 0o600)
    return victim, victim.stat()


@pytest.mark.parametrize("size_mib", [1, 40], ids=["writeback", "write_through"])
def test_planted_symlinks_at_temporary_names_are_never_followed(
        attacker: User, secmount, shared_dir: Path, size_mib: int) -> None:
    victim, before = _victim(shared_dir)
    home = shared_dir / "back" / "atk"
    home.mkdir()
    os.chown(home, attacker.uid, attacker.gid)
    # 40 MiB does not fit the 16 MiB write tier: written through (the temporary file is
    # created when the tier fills, at a generation of a few hundred writes)
    gens = 5 if size_mib == 1 else 700
    r = attacker.py(PLANT, str(home), str(victim), "8", str(gens))
    assert r.returncode == 0, r.stderr
    m = secmount(allow_other=True, ram="8MiB", ssd="16MiB")
    r = attacker.py(WRITE, str(m.mnt / "atk" / "mine"), str(size_mib * MiB), timeout=120)
    assert r.returncode == 0, r.stderr
    tierfs_cmd("flush", str(m.mnt))
    after = victim.stat()
    assert victim.read_bytes() == b"root's secret, never overwritten"
    assert (after.st_uid, after.st_gid, after.st_mode) == (before.st_uid, before.st_gid, before.st_mode)
    assert (home / "mine").stat().st_size == size_mib * MiB
    assert not (home / "mine").is_symlink()
    assert (home / "mine").stat().st_uid == attacker.uid
