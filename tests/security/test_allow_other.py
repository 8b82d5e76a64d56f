"""Who can use a root-run mount: everyone by default (the kernel checks each file's mode, as on
a local disk), only root with --no-allow-other; ``tierfs mount`` says which."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import tierfs_cmd
from tests.security.conftest import User

READ = "import sys; print(open(sys.argv[1]).read())"


def _prepare(shared_dir: Path) -> None:
    (shared_dir / "back" / "pub").write_bytes(b"public")
    os.chmod(shared_dir / "back" / "pub", 0o644)
    (shared_dir / "back" / "secret").write_bytes(b"root only")
    os.chmod(shared_dir / "back" / "secret", 0o600)


def test_root_mount_is_usable_by_other_users_by_default(attacker: User, secmount, shared_dir: Path) -> None:
    _prepare(shared_dir)
    m = secmount(allow_other=None, start=False)
    out = tierfs_cmd("mount", str(m.backing), str(m.mnt), *m.args).stdout
    m.pid = int((m.mnt / ".tierfs" / "pid").read_text())
    assert "usable by all users (allow_other, permissions checked by the kernel)" in out
    r = attacker.py(READ, str(m.mnt / "pub"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().strip() == "public"
    r = attacker.py(READ, str(m.mnt / "secret"))  # modes still hold (default_permissions)
    assert r.returncode != 0 and b"PermissionError" in r.stderr


def test_no_allow_other_keeps_the_mount_roots(attacker: User, secmount, shared_dir: Path) -> None:
    _prepare(shared_dir)
    m = secmount(allow_other=False, start=False)
    out = tierfs_cmd("mount", str(m.backing), str(m.mnt), *m.args).stdout
    m.pid = int((m.mnt / ".tierfs" / "pid").read_text())
    assert "usable by only uid 0" in out
    r = attacker.py(READ, str(m.mnt / "pub"))
    assert r.returncode != 0 and b"PermissionError" in r.stderr
