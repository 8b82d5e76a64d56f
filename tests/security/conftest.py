"""Fixtures of the security suite: an unprivileged user (created for the session, removed after)
and root-run mounts whose directories that user can reach, as on a shared training box.

A test's ``tmp_path`` lives under a root-only 0700 directory, where no other user could even
reach the mount; these mounts live under a fresh 0755 directory in /tmp instead. Every finding is
tried twice where the mount option matters: with ``--allow-other`` (the usual deployment) and
without it (then other users must not reach anything, and the tiers must still be private).
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, Mount, needs_fuse, unmount_all

pytestmark = needs_fuse


SYSTEM_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else (shutil.which("python3") or sys.executable)


def hints_copy(dest: Path) -> Path:
    """A copy of ``tierfs_hints`` under ``dest`` (world-readable), for code run as another user
    that must import it (``sys.path.insert(0, str(dest))``). Returns ``dest``."""
    shutil.copytree(REPO / "tierfs_hints", dest / "tierfs_hints",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for p in [dest, *dest.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return dest


@dataclass(frozen=True)
class User:
    """An unprivileged local user. ``run`` and ``py`` execute as that user (setpriv: real and
    effective uid/gid, no supplementary groups, no capabilities)."""

    name: str
    uid: int
    gid: int

    def run(self, argv: list[str], *, check: bool = False, timeout: float = 60,
            input: bytes | None = None, cwd: str = "/") -> subprocess.CompletedProcess:
        cmd = ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
               "--inh-caps=-all", "--", *argv]
        return subprocess.run(cmd, capture_output=True, timeout=timeout, check=check, input=input,
                              cwd=cwd, env={"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8"})

    def py(self, code: str, *args: str, check: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run Python ``code`` as this user (``sys.argv[1:]`` = ``args``) with the system's
        ``python3``, isolated (-I): the test's own interpreter may sit under root's 0700 home.
        Attacker code is stdlib only; copy ``tierfs_hints`` next to it if a test needs it
        (:func:`hints_copy`)."""
        return self.run([SYSTEM_PYTHON, "-I", "-c", code, *args], check=check, timeout=timeout)


def _make_user(prefix: str) -> User:
    name = f"{prefix}{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--system", "--no-create-home", "--user-group",
                    "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True)
    pw = pwd.getpwnam(name)
    return User(name, pw.pw_uid, pw.pw_gid)


def _remove_user(user: User) -> None:
    subprocess.run(["userdel", user.name], capture_output=True)
    # a --user-group group goes with its user; make sure it is gone even if userdel kept it
    subprocess.run(["groupdel", user.name], capture_output=True)


@pytest.fixture(scope="session")
def attacker() -> Iterator[User]:
    """A hostile local user, created for the session and removed at its end."""
    user = _make_user("tfatk")
    try:
        yield user
    finally:
        _remove_user(user)


@pytest.fixture(scope="session")
def victim() -> Iterator[User]:
    """A second, innocent local user (owner of private files the attacker goes after)."""
    user = _make_user("tfvic")
    try:
        yield user
    finally:
        _remove_user(user)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A fresh 0755 directory under /tmp that every user can traverse; removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="tierfs-sec-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=[True, False], ids=["allow_other", "owner_only"])
def allow_other(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def secmount(shared_dir: Path) -> Iterator:
    """Factory: ``secmount(allow_other=True, ram="64MiB", ssd="128MiB", extra=[...])`` mounts
    ``shared_dir/back`` (0755, created, for the test to fill first) on ``shared_dir/mnt`` as root
    and returns a :class:`~tests.conftest.Mount`; the SSD tier is ``shared_dir/ssd``. Always
    unmounted."""
    mounts: list[Mount] = []
    back = shared_dir / "back"
    back.mkdir(mode=0o755, exist_ok=True)
    os.chmod(back, 0o755)

    def make(*, allow_other: bool | None = True, ram: str = "64MiB", ssd: str | None = "128MiB",
             extra: tuple[str, ...] = (), name: str = "mnt", start: bool = True) -> Mount:
        mnt = shared_dir / name
        mnt.mkdir(mode=0o755, exist_ok=True)
        args = ["--ram", ram]
        ssd_dir = None
        if ssd is not None:
            ssd_dir = shared_dir / f"ssd-{name}"
            args += ["--ssd", f"{ssd_dir}:{ssd}"]
        if allow_other is not None:  # None: the default (allow_other, as root mounts)
            args.append("--allow-other" if allow_other else "--no-allow-other")
        m = Mount(back, mnt, ssd_dir, args + list(extra))
        mounts.append(m)
        if start:
            m.start()
        return m

    try:
        yield make
    finally:
        unmount_all(mounts)


__all__ = ["REPO", "SYSTEM_PYTHON", "User", "hints_copy"]
