"""Mount validation against the machine (:func:`tierfs.mount.plan_mount`), in-process."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tierfs import io
from tierfs import mount as mount_mod
from tierfs.config import Config
from tierfs.errors import MountError


def _cfg(tmp_path: Path, **kw: object) -> Config:
    for d in ("backing", "mnt"):
        (tmp_path / d).mkdir(exist_ok=True)
    (tmp_path / "ssd").mkdir(mode=0o700, exist_ok=True)  # a tier directory must be private
    return Config(backing=str(tmp_path / "backing"), mountpoint=str(tmp_path / "mnt"), **kw)  # type: ignore[arg-type]


def _no_punch(fd: int, offset: int, length: int) -> None:
    raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))


def test_tier_without_hole_punch_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier filesystem that cannot punch holes would let the tier grow past its capacity
    (evictions free nothing, and Tier.punch counts the failure silently): refused at mount."""
    cfg = _cfg(tmp_path, ram=0, ssd=(str(tmp_path / "ssd"), 1 << 20))
    monkeypatch.setattr(io, "punch_hole", _no_punch)
    with pytest.raises(MountError, match="cannot punch holes"):
        mount_mod.plan_mount(cfg)
    assert os.listdir(tmp_path / "ssd") == []  # the probe leaves nothing behind


def test_ram_tier_without_hole_punch_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "shm").mkdir()
    cfg = _cfg(tmp_path, ram=1 << 20, ram_dir=str(tmp_path / "shm"))
    monkeypatch.setattr(io, "punch_hole", _no_punch)
    with pytest.raises(MountError, match="cannot punch holes"):
        mount_mod.plan_mount(cfg)


def test_tier_with_hole_punch_is_accepted(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, ram=0, ssd=(str(tmp_path / "ssd"), 1 << 20))
    plan = mount_mod.plan_mount(cfg)
    assert [t.name for t in plan.tiers] == ["ssd"]
    assert os.listdir(tmp_path / "ssd") == []
