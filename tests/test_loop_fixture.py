"""The mount fixtures' event-loop check fails a test whose daemon exceeded the bound (here a
bound of 1 us, which every step exceeds), and still unmounts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import conftest
from tests.conftest import Mount, force_unmount, is_mounted, needs_fuse

pytestmark = needs_fuse


def test_daemon_over_its_loop_bound_fails_the_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERFS_LOOP_BOUND_MS", "0.001")  # inherited by the daemon
    monkeypatch.setattr(conftest, "LOOP_STRICT", True)
    (tmp_path / "back").mkdir()
    (tmp_path / "mnt").mkdir()
    m = Mount(tmp_path / "back", tmp_path / "mnt", None, ["--ram", "16MiB"])
    m.start()
    try:
        os.listdir(m.mnt)
        loop = m.stats()["loop"]
        assert loop["bound_ms"] == pytest.approx(0.001) and loop["over"] > 0 and loop["worst_task"]
        assert loop["offenders"]
    finally:
        with pytest.raises(AssertionError, match="event loop was blocked longer than 0 ms"):
            force_unmount(m)
    assert not is_mounted(m.mnt)


def test_daemon_without_the_watch_reports_null(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERFS_LOOP_BOUND_MS")
    (tmp_path / "back").mkdir()
    (tmp_path / "mnt").mkdir()
    m = Mount(tmp_path / "back", tmp_path / "mnt", None, ["--ram", "16MiB"])
    m.start()
    try:
        assert m.stats()["loop"] is None
    finally:
        force_unmount(m)
