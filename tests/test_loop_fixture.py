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


@pytest.mark.parametrize(("offenders", "over", "worst", "fatal"), [
    ({"pyfuse @ ? -> end": (1, 57.8)}, 1, 57.8, False),  # one lone step under twice the bound
    ({"pyfuse [forget] @ ? -> end": (2, 51.0)}, 2, 51.0, True),  # one place, twice
    ({"a": (1, 51.0), "b": (1, 52.0), "c": (1, 53.0)}, 3, 53.0, True),  # three steps
    ({"a": (1, 100.0)}, 1, 100.0, True),  # twice the bound
])
def test_which_blocked_loops_fail_a_test(monkeypatch: pytest.MonkeyPatch, offenders: dict, over: int,
                                         worst: float, fatal: bool) -> None:
    loop = {"bound_ms": 50.0, "steps": 1000, "over": over, "worst_ms": worst,
            "offenders": {k: {"count": c, "worst_ms": w, "worst_cpu_ms": w} for k, (c, w) in offenders.items()}}
    monkeypatch.setattr(Mount, "stats", lambda self: {"loop": loop})
    monkeypatch.setattr(conftest, "LOOP_STRICT", True)
    blocked = conftest.loop_offenders(Mount(Path("/b"), Path("/m"), None))
    assert blocked is not None and blocked.fatal is fatal
    if fatal:
        with pytest.raises(AssertionError, match="blocked longer than 50 ms"):
            conftest.fail_on_blocked_loop(blocked)
    else:
        with pytest.warns(UserWarning, match="blocked longer than 50 ms"):
            conftest.fail_on_blocked_loop(blocked)
