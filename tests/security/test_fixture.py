"""The suite's own fixtures work: the attacker really is unprivileged, and a root-only file is
out of its reach directly (so a test that shows it reached one through tierfs means something)."""

from __future__ import annotations

import os
from pathlib import Path

from tests.security.conftest import User


def test_attacker_is_unprivileged(attacker: User, shared_dir: Path) -> None:
    secret = shared_dir / "secret"
    secret.write_bytes(b"root only")
    os.chmod(secret, 0o600)
    r = attacker.py("import os,sys; print(os.getuid()); open(sys.argv[1]).read()", str(secret))
    assert r.stdout.decode().strip() == str(attacker.uid)
    assert r.returncode != 0 and b"PermissionError" in r.stderr


def test_mount_reachable_with_allow_other(attacker: User, secmount, shared_dir: Path) -> None:
    (shared_dir / "back" / "pub").write_bytes(b"public")
    os.chmod(shared_dir / "back" / "pub", 0o644)
    m = secmount(allow_other=True)
    r = attacker.py("import sys; print(open(sys.argv[1]).read())", str(m.mnt / "pub"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().strip() == "public"
