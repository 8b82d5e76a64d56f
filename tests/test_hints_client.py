"""Tests of the hints client (tierfs_hints.client, tierfs_hints.torch) against a fake daemon.

No FUSE: a :class:`FakeDaemon` stands in for ``wire.request`` and :class:`Roots` says which
temporary directories are "tierfs mounts". The real-mount tests are in test_hints_mount.py.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import math
import os
import subprocess
import sys
import time
import warnings
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    get_worker_info,
)

import tierfs_hints
from tierfs_hints import Client, TierfsHintWarning, wire
from tierfs_hints.client import WAIT_SLICE_S, parse_size
from tierfs_hints.torch import HintedSampler, files_of, hinted_shards

ROOT = Path(__file__).resolve().parents[1]
PROPS = settings(max_examples=60, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# ------------------------------------------------------------------------------------------
# The fake daemon
# ------------------------------------------------------------------------------------------


class Roots:
    """A picklable ``is_mount_root``: these directories are tierfs mounts; counts its calls."""

    def __init__(self, *roots: Path) -> None:
        self.roots = {str(r) for r in roots}
        self.calls = 0

    def __call__(self, d: str) -> bool:
        self.calls += 1
        return d in self.roots


class FakeDaemon:
    """Answers like the daemon of wire.py; records ``(root, request)``. Requests must be strict
    JSON (no NaN): a request the real wire could not carry fails the test."""

    def __init__(self, *, missing: set[str] = frozenset(), wait_rounds: int = 0,  # type: ignore[assignment]
                 flush_timeouts: int = 0, fail: dict[str, Exception] | None = None) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.missing = set(missing)
        self.wait_rounds = wait_rounds  # wait requests answered "timed out" before "done"
        self.flush_timeouts = flush_timeouts
        self.fail = fail or {}  # root -> exception raised for any request to it
        self.pids: list[int] = []
        self.ids = itertools.count(1)
        self.needs: dict[str, dict[str, Any]] = {}

    def __call__(self, root: str, req: dict[str, Any]) -> dict[str, Any]:
        json.dumps(req, allow_nan=False)
        self.requests.append((root, req))
        self.pids.append(os.getpid())
        if root in self.fail:
            raise self.fail[root]
        return getattr(self, "op_" + req["op"])(req)

    def ops(self, op: str) -> list[dict[str, Any]]:
        return [r for _, r in self.requests if r["op"] == op]

    def _register(self, rels: list[str], deadline: float | None) -> dict[str, Any]:
        nid = f"n{next(self.ids)}"
        present = [r for r in rels if r not in self.missing]
        total = 100 * len(set(present))
        self.needs[nid] = {"total": total, "deadline": deadline, "cancelled": False}
        return {"ok": True, "id": nid, "bytes": total, "files": len(set(present)),
                "missing": sorted({r for r in rels if r in self.missing})}

    def op_need(self, req: dict[str, Any]) -> dict[str, Any]:
        return self._register([i[0] for i in req["items"]], req["deadline_s"])

    def op_epoch(self, req: dict[str, Any]) -> dict[str, Any]:
        return self._register(req["paths"], req.get("deadline_s"))

    def op_phase(self, req: dict[str, Any]) -> dict[str, Any]:
        return self._register(req["paths"], req["at_s"])

    def op_progress(self, req: dict[str, Any], done: bool = False) -> dict[str, Any]:
        n = self.needs[req["id"]]
        total = n["total"]
        remaining = 0 if done else total // 2
        return {"ok": True, "id": req["id"], "label": "", "total_bytes": total,
                "resident_bytes": {"ram": total - remaining, "ssd": 0, "staging": 0},
                "remaining_bytes": remaining, "deadline_in_s": n["deadline"],
                "projected_s": None if done else 1.5, "done": done, "missed": False,
                "cancelled": n["cancelled"]}

    def op_wait(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.wait_rounds > 0:
            self.wait_rounds -= 1
            time.sleep(min(req["timeout"], 0.05))  # a real wait blocks up to its timeout
            return {**self.op_progress(req), "timed_out": True}
        return {**self.op_progress(req, done=True), "timed_out": False}

    def op_cancel(self, req: dict[str, Any]) -> dict[str, Any]:
        if req["id"] not in self.needs:
            raise wire.ControlError(f"unknown need {req['id']}", "value")
        self.needs[req["id"]]["cancelled"] = True
        return {"ok": True}

    def op_release(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "chunks": len(req["paths"])}

    def op_checkpoint(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "reserved_bytes": req["nbytes"]}

    def op_flush(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.flush_timeouts > 0:
            self.flush_timeouts -= 1
            time.sleep(min(req["timeout"], 0.05))
            raise wire.ControlError("timed out")  # what the daemon answers today
        return {"ok": True, "waited": req["paths"]}


class FileDaemon:
    """A picklable fake daemon for worker processes: appends ``{pid, root, req}`` JSON lines to
    a file (under flock) and answers need-like ops with an empty registration."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __call__(self, root: str, req: dict[str, Any]) -> dict[str, Any]:
        line = json.dumps({"pid": os.getpid(), "root": root, "req": req}, allow_nan=False) + "\n"
        with open(self.path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(line)
        return {"ok": True, "id": "n1", "bytes": 0, "files": 0, "missing": []}

    def records(self) -> list[dict[str, Any]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f]


@pytest.fixture
def env(tmp_path: Path) -> Any:
    """Two fake mounts m1, m2 and an ordinary directory off; a client and its fake daemon."""
    base = tmp_path.resolve()
    for d in ("m1/d", "m2/d", "off/d"):
        (base / d).mkdir(parents=True)

    class Env:
        m1, m2, off = base / "m1", base / "m2", base / "off"
        roots = Roots(base / "m1", base / "m2")
        daemon = FakeDaemon()
        client = Client(request=daemon, is_mount_root=roots)

    return Env


def sent(daemon: FakeDaemon, op: str) -> list[tuple[str, dict[str, Any]]]:
    return [(root, r) for root, r in daemon.requests if r["op"] == op]


def dedupe(xs: list[Any]) -> list[Any]:
    return [x for i, x in enumerate(xs) if i == 0 or xs[i - 1] != x]


# ------------------------------------------------------------------------------------------
# Import hygiene
# ------------------------------------------------------------------------------------------


def test_import_is_standard_library_only() -> None:
    code = (
        "import sys, tierfs_hints, tierfs_hints.client\n"
        "bad = [m for m in sys.modules if m in ('torch', 'numpy') or m == 'tierfs' "
        "or m.startswith('tierfs.') or m == 'tierfs_hints.torch']\n"
        "assert not bad, bad\n"
        "assert callable(tierfs_hints.need) and callable(tierfs_hints.epoch)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr


def test_module_functions_off_mount_warn_once_per_process(tmp_path: Path) -> None:
    """In a fresh process: the shared client warns once for all calls, then stays silent."""
    code = f"""
import warnings, tierfs_hints as th
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    h = th.need([{str(tmp_path / 'a')!r}, {str(tmp_path / 'b')!r}], by=5)
    assert h.progress().total_bytes == 0 and h.progress().done and h.wait(0)
    th.epoch([{str(tmp_path / 'c')!r}])
    th.release({str(tmp_path / 'a')!r})
    assert th.checkpoint({str(tmp_path)!r}, "1GiB", 60) == 0
    assert th.wait_durable([{str(tmp_path / 'a')!r}], timeout=1)
    th.phase("eval", 10, [{str(tmp_path / 'a')!r}])
assert len(w) == 1, [str(x.message) for x in w]
assert w[0].category is th.TierfsHintWarning and w[0].filename == "<string>", w[0]
print(w[0].message)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "is not on a tierfs mount" in r.stdout and "(and 1 more of 2 paths)" in r.stdout


# ------------------------------------------------------------------------------------------
# Off the mount
# ------------------------------------------------------------------------------------------


def test_off_mount_is_a_no_op_that_warns_once(env: Any) -> None:
    c, daemon, off = env.client, env.daemon, env.off
    with pytest.warns(TierfsHintWarning, match="not on a tierfs mount") as rec:
        h = c.need([off / "a", off / "b"])
    assert rec[0].filename == __file__  # points at the caller, not at the library
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # silent from now on
        assert c.release(off / "a") == 0
        h2 = c.epoch([off / "a"])
        assert c.checkpoint(off, 1 << 30, 60) == 0
        assert c.wait_durable(off / "a", timeout=0) is True
        h3 = c.phase("eval", 5, off / "a")
    for handle in (h, h2, h3):
        p = handle.progress()
        assert (p.total_bytes, p.remaining_bytes, p.fraction, p.done, p.missed) == (0, 0, 1.0, True, False)
        assert handle.wait() is True and handle.wait(0) is True
        handle.cancel()
    assert h.skipped == 2 and h.ids == []
    assert daemon.requests == []


def test_mixed_on_and_off_mount_sends_only_mounted(env: Any) -> None:
    c = env.client
    with pytest.warns(TierfsHintWarning):
        h = c.need([env.m1 / "x", env.off / "y", env.m1 / "z"])
    (root, req), = sent(env.daemon, "need")
    assert root == str(env.m1) and [i[0] for i in req["items"]] == ["x", "z"]
    assert h.skipped == 1


# ------------------------------------------------------------------------------------------
# Requests: shape, order, grouping
# ------------------------------------------------------------------------------------------


def test_need_request_fields(env: Any) -> None:
    c = env.client
    h = c.need([env.m1 / "d" / "a", (str(env.m1 / "b"), 4096, 100), (env.m1 / "c", 0, None)],
               by=30, priority=7, label="warmup")
    (root, req), = env.daemon.requests
    assert root == str(env.m1)
    assert req == {"op": "need", "items": [["d/a", 0, None], ["b", 4096, 100], ["c", 0, None]],
                   "deadline_s": 30.0, "priority": 7, "source": tierfs_hints.client.default_source(),
                   "label": "warmup"}
    assert h.ids == [(str(env.m1), "n1")] and h.files == 3 and h.nbytes == 300 and h.label == "warmup"


def test_path_forms(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """str, bytes, PathLike, relative to the cwd, with '.' and '..' inside the mount, '//'."""
    monkeypatch.chdir(env.m1 / "d")
    env.client.need(["rel", b"../bytes", Path("sub/../p"), f"{env.m1}//d/./q", f"{env.m1}/d/"])
    items = [i[0] for i in env.daemon.requests[0][1]["items"]]
    assert items == ["d/rel", "bytes", "d/p", "d/q", "d"]


def test_single_path_is_one_item(env: Any) -> None:
    env.client.need(str(env.m1 / "one"))
    env.client.release(env.m1 / "two")
    assert env.daemon.requests[0][1]["items"] == [["one", 0, None]]
    assert env.daemon.requests[1][1]["paths"] == ["two"]


def test_hundred_thousand_paths_one_request(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [f"{env.m1}/shard{i % 200:03d}/s{i}.bin" for i in range(100_000)]
    lstats: list[str] = []
    real_lstat = os.lstat

    def counting_lstat(p: Any, *a: Any, **kw: Any) -> os.stat_result:
        lstats.append(os.fspath(p))
        return real_lstat(p, *a, **kw)

    monkeypatch.setattr(os, "lstat", counting_lstat)
    h = env.client.need(paths)
    monkeypatch.undo()
    # one lstat per distinct directory (200 shard dirs and their ancestors), none per path
    assert len(lstats) == len(set(lstats)) and len(lstats) < 200 + len(env.m1.parts) + 1
    (root, req), = env.daemon.requests
    assert root == str(env.m1)
    assert [i[0] for i in req["items"]] == [f"shard{i % 200:03d}/s{i}.bin" for i in range(100_000)]
    assert all(i[1] == 0 and i[2] is None for i in req["items"])
    assert h.files == 100_000
    # lookups are per directory: 200 shard dirs + their ancestors, not one per path
    assert env.roots.calls < 1000
    # a second call hits the cache only
    calls = env.roots.calls
    env.client.epoch(paths)
    assert env.roots.calls == calls
    assert len(env.daemon.ops("epoch")[0]["paths"]) == 100_000


def test_grouping_across_two_mounts(env: Any) -> None:
    c, m1, m2 = env.client, env.m1, env.m2
    order = [m1 / "a", m2 / "b", m1 / "c", m2 / "d", m2 / "e", m1 / "f"]
    h = c.need(order, by=10)
    reqs = sent(env.daemon, "need")
    assert [(root, [i[0] for i in r["items"]]) for root, r in reqs] == [
        (str(m1), ["a", "c", "f"]), (str(m2), ["b", "d", "e"])]
    assert sorted(root for root, _ in h.ids) == [str(m1), str(m2)]
    p = h.progress()
    assert p.total_bytes == 600 and p.remaining_bytes == 300 and p.resident_bytes["ram"] == 300
    assert p.fraction == 0.5 and p.projected_s == 1.5 and p.deadline_in_s == 10.0 and not p.done
    assert h.wait() is True
    assert len(env.daemon.ops("wait")) == 2
    h.cancel()
    h.cancel()  # idempotent
    assert len(env.daemon.ops("cancel")) == 2
    assert h.wait() is False


def test_epoch_source_dedupe_and_ranges(env: Any) -> None:
    c, m1 = env.client, env.m1
    c.epoch([m1 / "a", m1 / "a", (m1 / "b", 0, 10), (m1 / "b", 10, 10), m1 / "a", m1 / "c"])
    c.epoch([m1 / "z"], source="rank3", by=timedelta(seconds=20))
    first, second = env.daemon.ops("epoch")
    assert first == {"op": "epoch", "paths": ["a", "b", "a", "c"],
                     "source": tierfs_hints.client.default_source()}
    assert second == {"op": "epoch", "paths": ["z"], "source": "rank3", "deadline_s": 20.0}


def test_client_source_default(env: Any) -> None:
    c = Client(request=env.daemon, is_mount_root=env.roots, source="job42")
    c.epoch([env.m1 / "a"])
    c.phase("eval", 3, [env.m1 / "a"])
    assert [r["source"] for _, r in env.daemon.requests] == ["job42", "job42"]


def test_phase_checkpoint_release_requests(env: Any) -> None:
    c, m1 = env.client, env.m1
    h = c.phase("eval", timedelta(minutes=5), [m1 / "val" / "a", m1 / "val" / "b"])
    assert env.daemon.requests[-1][1] == {"op": "phase", "name": "eval", "at_s": 300.0,
                                          "paths": ["val/a", "val/b"],
                                          "source": tierfs_hints.client.default_source()}
    assert h.label == "eval"
    assert c.checkpoint(m1 / "ckpt" / "run1", "2GiB", timedelta(minutes=30)) == 2 << 30
    assert env.daemon.requests[-1][1] == {"op": "checkpoint", "dir": "ckpt/run1",
                                          "nbytes": 2 << 30, "every_s": 1800.0}
    c.checkpoint(m1, 4096, 60)
    assert env.daemon.requests[-1][1]["dir"] == "."  # the mount root
    assert c.release([m1 / "a", m1 / "b", env.m2 / "c"]) == 3
    assert [(root, r["paths"]) for root, r in sent(env.daemon, "release")] == [
        (str(m1), ["a", "b"]), (str(env.m2), ["c"])]


def test_module_functions_use_wire_request(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``request=``, a client calls ``wire.request`` as it is at call time."""
    monkeypatch.setattr(wire, "request", env.daemon)
    c = Client(is_mount_root=env.roots)
    c.need([env.m1 / "a"])
    assert env.daemon.ops("need")[0]["items"] == [["a", 0, None]]


# ------------------------------------------------------------------------------------------
# Deadlines
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("by,expected", [
    (0, 0.0), (5, 5.0), (2.5, 2.5), (timedelta(minutes=2), 120.0),
    (lambda: datetime.now(UTC) + timedelta(seconds=30), 30.0),
    (lambda: datetime.now() + timedelta(seconds=60), 60.0),  # naive: local time
    (lambda: datetime.now(timezone(timedelta(hours=-7))) + timedelta(seconds=90), 90.0),
    (lambda: datetime.now() - timedelta(hours=1), 0.0),  # in the past: due now
])
def test_by_forms(env: Any, by: Any, expected: float) -> None:
    env.client.need([env.m1 / "a"], by=by() if callable(by) else by)
    assert env.daemon.requests[0][1]["deadline_s"] == pytest.approx(expected, abs=1.0)


def test_numpy_numbers_are_accepted(env: Any) -> None:
    np = pytest.importorskip("numpy")
    env.client.need([(env.m1 / "a", np.int64(8), np.int32(4))], by=np.float32(1.5),
                    priority=np.int16(2))
    req = env.daemon.requests[0][1]
    assert req["items"] == [["a", 8, 4]] and req["deadline_s"] == 1.5 and req["priority"] == 2
    assert type(req["items"][0][1]) is int


# ------------------------------------------------------------------------------------------
# Validation: each bad input raises ValueError naming the argument; nothing is sent
# ------------------------------------------------------------------------------------------

NAN, INF = math.nan, math.inf
BAD_CALLS = [
    ("paths must be a path or an iterable", lambda c, m: c.need(5)),
    (r"paths\[0\] must be a path", lambda c, m: c.need([5])),
    (r"paths\[1\] must be a path", lambda c, m: c.need([m / "a", None])),
    (r"paths\[0\] '' is not a valid path \(empty\)", lambda c, m: c.need([""])),
    (r"paths\[0\] .* \(contains NUL\)", lambda c, m: c.need([f"{m}/a\0b"])),
    (r"paths\[0\] offset must be >= 0", lambda c, m: c.need([(m / "a", -1, 10)])),
    (r"paths\[0\] offset must be an int", lambda c, m: c.need([(m / "a", 0.5, 10)])),
    (r"paths\[0\] offset must be an int, got bool", lambda c, m: c.need([(m / "a", True, 10)])),
    (r"paths\[0\] length must be >= 1", lambda c, m: c.need([(m / "a", 0, 0)])),
    (r"paths\[0\] length must be >= 1", lambda c, m: c.need([(m / "a", 0, -4096)])),
    (r"paths\[0\] length must be an int", lambda c, m: c.need([(m / "a", 0, "4k")])),
    (r"paths\[0\] must be a path or \(path, offset, length\)", lambda c, m: c.need([(m / "a", 0)])),
    (r"paths\[1\] must be a path .*or \(path, offset, length\), got int",
     lambda c, m: c.need((m / "a", 0, 10))),  # one range not wrapped in a list
    ("need: by must be >= 0", lambda c, m: c.need([m / "a"], by=-1)),
    ("need: by must be finite", lambda c, m: c.need([m / "a"], by=NAN)),
    ("need: by must be finite", lambda c, m: c.need([m / "a"], by=INF)),
    ("need: by must be seconds", lambda c, m: c.need([m / "a"], by="soon")),
    ("need: by must be seconds", lambda c, m: c.need([m / "a"], by=True)),
    ("need: by must be >= 0", lambda c, m: c.need([m / "a"], by=timedelta(seconds=-1))),
    ("need: priority must be an int", lambda c, m: c.need([m / "a"], priority=1.5)),
    ("need: priority must be an int, got bool", lambda c, m: c.need([m / "a"], priority=True)),
    ("need: priority must be an int", lambda c, m: c.need([m / "a"], priority="high")),
    ("need: priority must be in", lambda c, m: c.need([m / "a"], priority=2**31)),
    ("need: label must be a str", lambda c, m: c.need([m / "a"], label=5)),
    ("is in the tierfs control directory", lambda c, m: c.need([m / ".tierfs" / "ctl"])),
    ("is in the tierfs control directory", lambda c, m: c.release([m / ".tierfs"])),
    ("is the root of a tierfs mount, not a file", lambda c, m: c.need([m])),
    ("leaves the tierfs mount .* through '..'", lambda c, m: c.need([f"{m}/../off/x"])),
    ("leaves the tierfs mount .* through '..'", lambda c, m: c.need([f"{m}/d/../../x"])),
    ("epoch: source must not be empty", lambda c, m: c.epoch([m / "a"], source="")),
    ("epoch: source must be a str", lambda c, m: c.epoch([m / "a"], source=7)),
    (r"epoch: order\[0\] offset must be >= 0", lambda c, m: c.epoch([(m / "a", -1, 1)])),
    ("epoch: by must be finite", lambda c, m: c.epoch([m / "a"], by=NAN)),
    ("phase: name must not be empty", lambda c, m: c.phase("", 5, [m / "a"])),
    ("phase: name must not be empty", lambda c, m: c.phase("  ", 5, [m / "a"])),
    ("phase: name must be a str", lambda c, m: c.phase(None, 5, [m / "a"])),
    ("phase: at is required", lambda c, m: c.phase("eval", None, [m / "a"])),
    ("phase: at must be finite", lambda c, m: c.phase("eval", NAN, [m / "a"])),
    ("phase: at must be >= 0", lambda c, m: c.phase("eval", -3, [m / "a"])),
    (r"phase: needs\[0\] must be a path", lambda c, m: c.phase("eval", 5, [3.5])),
    ("checkpoint: nbytes must be >= 1", lambda c, m: c.checkpoint(m, 0, 60)),
    ("checkpoint: nbytes must be >= 1", lambda c, m: c.checkpoint(m, -1, 60)),
    ("checkpoint: nbytes must be an int", lambda c, m: c.checkpoint(m, 1.5, 60)),
    ("checkpoint: nbytes must be an int, got bool", lambda c, m: c.checkpoint(m, True, 60)),
    ("checkpoint: nbytes must be bytes .* or a size", lambda c, m: c.checkpoint(m, "lots", 60)),
    ("checkpoint: nbytes in bytes must be whole", lambda c, m: c.checkpoint(m, "1.5", 60)),
    ("checkpoint: every must be > 0", lambda c, m: c.checkpoint(m, 1 << 30, 0)),
    ("checkpoint: every must be > 0", lambda c, m: c.checkpoint(m, 1 << 30, -5)),
    ("checkpoint: every must be finite", lambda c, m: c.checkpoint(m, 1 << 30, NAN)),
    ("checkpoint: every must be seconds or a timedelta, got a datetime",
     lambda c, m: c.checkpoint(m, 1 << 30, datetime.now())),
    ("checkpoint: directory must be a path", lambda c, m: c.checkpoint(5, 1 << 30, 60)),
    ("checkpoint: directory '' is not a valid path", lambda c, m: c.checkpoint("", 1 << 30, 60)),
    ("checkpoint: directory .* control directory", lambda c, m: c.checkpoint(m / ".tierfs", 1, 60)),
    ("wait_durable: timeout must be >= 0", lambda c, m: c.wait_durable([m / "a"], timeout=-1)),
    ("wait_durable: timeout must be finite", lambda c, m: c.wait_durable([m / "a"], timeout=NAN)),
    (r"release: paths\[0\] must be a path", lambda c, m: c.release([object()])),
]


@pytest.mark.parametrize("match,call", BAD_CALLS, ids=[m for m, _ in BAD_CALLS])
def test_bad_input_raises_and_sends_nothing(env: Any, match: str, call: Any) -> None:
    env.client.need([env.m1 / "known"])  # m1 is a known mount root now
    env.daemon.requests.clear()
    with pytest.raises(ValueError, match=match):
        call(env.client, env.m1)
    assert env.daemon.requests == []


def test_one_bad_item_among_many_sends_nothing_anywhere(env: Any) -> None:
    good = [env.m1 / f"a{i}" for i in range(1000)] + [env.m2 / f"b{i}" for i in range(1000)]
    with pytest.raises(ValueError, match=r"paths\[2000\] length"):
        env.client.need([*good, (env.m2 / "z", 0, -1)])
    assert env.daemon.requests == []


def test_handle_wait_timeout_is_checked(env: Any) -> None:
    h = env.client.need([env.m1 / "a"])
    for bad in (-1, NAN, "1s"):
        with pytest.raises(ValueError, match="NeedHandle.wait: timeout"):
            h.wait(bad)


def test_relative_path_leaving_the_mount(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(env.m1)
    with pytest.raises(ValueError, match="through '..'"):
        env.client.need(["../off/x"])
    env.client.need(["d/../x", "a..b"])  # stays inside; '..' inside a name is a name
    assert [i[0] for i in env.daemon.requests[0][1]["items"]] == ["x", "a..b"]


def test_symlinked_directory_leaving_the_mount_is_refused(env: Any) -> None:
    (env.m1 / "out").symlink_to(env.off / "d")
    with pytest.raises(ValueError, match="outside it"):
        env.client.need([env.m1 / "out" / "x"])
    assert env.daemon.requests == []


def test_symlinked_directory_into_a_mount_resolves(env: Any) -> None:
    """A path reached through a symlink outside the mount goes to the mount, as its real path."""
    (env.off / "data").symlink_to(env.m1 / "d")
    (env.m1 / "latest").symlink_to("d")
    env.client.need([env.off / "data" / "x", env.m1 / "latest" / "y"])
    assert [i[0] for i in env.daemon.requests[0][1]["items"]] == ["d/x", "d/y"]


def test_parse_size() -> None:
    assert [parse_size(x) for x in (1, "1", "4k", "4K", "4KiB", "4kb", "2GiB", "1.5M", "3 TB")] == [
        1, 1, 4096, 4096, 4096, 4000, 2 << 30, 3 << 19, 3 * 10**12]
    for bad in ("", "0", "GiB", "1iB", "-1", "1.5", "12 apples", 0, -3):
        with pytest.raises(ValueError):
            parse_size(bad)


# ------------------------------------------------------------------------------------------
# Daemon errors
# ------------------------------------------------------------------------------------------


def test_control_error_kinds(env: Any) -> None:
    env.daemon.fail[str(env.m1)] = wire.ControlError("bad request: items[3] escapes", "value")
    with pytest.raises(ValueError, match=f"tierfs mount {env.m1} refused the need hint: bad request"):
        env.client.need([env.m1 / "a"])
    env.daemon.fail[str(env.m1)] = wire.ControlError("tier I/O error", "os")
    with pytest.raises(OSError, match="the epoch hint failed: tier I/O error"):
        env.client.epoch([env.m1 / "a"])


def test_dead_mount_is_oserror_and_forgotten(env: Any) -> None:
    env.client.need([env.m1 / "a"])
    calls = env.roots.calls
    env.daemon.fail[str(env.m1)] = OSError(errno.ENOTCONN, "Transport endpoint is not connected")
    with pytest.raises(OSError, match="did not answer the need hint .*still running") as e:
        env.client.need([env.m1 / "a"])
    assert e.value.errno == errno.ENOTCONN
    del env.daemon.fail[str(env.m1)]
    env.client.need([env.m1 / "a"])  # the mount is looked up again
    assert env.roots.calls > calls


def test_malformed_reply_is_oserror(env: Any) -> None:
    def garbage(root: str, req: dict[str, Any]) -> dict[str, Any]:
        return json.loads(b"<html>")  # type: ignore[no-any-return]

    c = Client(request=garbage, is_mount_root=env.roots)
    with pytest.raises(OSError, match="malformed reply") as e:
        c.need([env.m1 / "a"])
    assert e.value.errno == errno.EPROTO


def test_failure_on_second_mount_cancels_the_first(env: Any) -> None:
    env.daemon.fail[str(env.m2)] = OSError(errno.ENOTCONN, "gone")
    with pytest.raises(OSError):
        env.client.need([env.m1 / "a", env.m2 / "b"])
    assert [(root, r["op"]) for root, r in env.daemon.requests] == [
        (str(env.m1), "need"), (str(env.m2), "need"), (str(env.m1), "cancel")]


def test_missing_files_raise_after_registering_the_rest(env: Any) -> None:
    env.daemon.missing = {f"x{i}" for i in range(7)}
    paths = [env.m1 / "ok1"] + [env.m1 / f"x{i}" for i in range(7)] + [env.m1 / "ok2"]
    with pytest.raises(FileNotFoundError, match="7 of 9 paths do not exist") as e:
        env.client.need(paths)
    msg = str(e.value.strerror)
    assert msg.count(str(env.m1 / "x")) == 5 and ", ..." in msg
    assert e.value.filename == str(env.m1 / "x0")
    assert e.value.errno == errno.ENOENT and isinstance(e.value, OSError)
    assert len(e.value.missing) == 7  # type: ignore[attr-defined]
    handle = e.value.handle  # type: ignore[attr-defined]
    assert handle.files == 2
    handle.cancel()
    assert env.daemon.ops("cancel")
    h = env.client.epoch(paths, missing_ok=True)
    assert sorted(h.missing) == sorted(str(env.m1 / f"x{i}") for i in range(7))


def test_wait_loops_in_slices_until_done(env: Any) -> None:
    env.daemon.wait_rounds = 3
    h = env.client.need([env.m1 / "a"])
    assert h.wait() is True
    waits = env.daemon.ops("wait")
    assert len(waits) == 4 and all(0 < w["timeout"] <= WAIT_SLICE_S for w in waits)
    assert h.wait() is True and len(env.daemon.ops("wait")) == 4  # known done: no request


def test_wait_timeout_and_poll(env: Any) -> None:
    env.daemon.wait_rounds = 1000
    h = env.client.need([env.m1 / "a"])
    assert h.wait(0) is False
    assert env.daemon.ops("wait")[-1]["timeout"] == 0
    before = len(env.daemon.ops("wait"))
    assert h.wait(timedelta(seconds=0.2)) is False
    # the whole wait is bounded by its timeout: each request asks for what is left of it
    timeouts = [w["timeout"] for w in env.daemon.ops("wait")[before:]]
    assert timeouts and all(0 <= t <= 0.2 for t in timeouts)
    assert timeouts == sorted(timeouts, reverse=True)


def test_context_manager_cancels(env: Any) -> None:
    with env.client.need([env.m1 / "a"]) as h:
        assert not h.progress().cancelled
    assert env.daemon.ops("cancel") == [{"op": "cancel", "id": h.ids[0][1]}]
    assert h.progress().cancelled and h.wait(1) is False
    h2, h3 = env.client.need([env.m2 / "b"]), env.client.need([env.m2 / "c"])
    env.daemon.fail[str(env.m2)] = OSError(errno.ENOTCONN, "gone")
    with pytest.raises(KeyError):  # the original exception survives a failing cancel
        with h2:
            raise KeyError("x")
    with pytest.raises(OSError, match="did not answer the cancel hint"):
        with h3:
            pass


def test_cancel_retries_only_the_mounts_that_failed(env: Any) -> None:
    h = env.client.need([env.m1 / "a", env.m2 / "b"])
    env.daemon.fail[str(env.m2)] = OSError(errno.ENOTCONN, "gone")
    with pytest.raises(OSError):
        h.cancel()
    assert h.wait() is False  # cancelled as far as the caller is concerned
    del env.daemon.fail[str(env.m2)]
    env.daemon.requests.clear()
    h.cancel()
    h.cancel()
    assert env.daemon.requests == [(str(env.m2), {"op": "cancel", "id": h.ids[1][1]})]


def test_wait_durable(env: Any) -> None:
    c, m1 = env.client, env.m1
    assert c.wait_durable([m1 / "ckpt" / "a.pt", m1 / "b"]) is True
    assert env.daemon.requests[-1][1]["paths"] == ["ckpt/a.pt", "b"]
    env.daemon.flush_timeouts = 2
    assert c.wait_durable(m1 / "b") is True  # None: keeps waiting through timed-out slices
    assert len(env.daemon.ops("flush")) == 4
    env.daemon.flush_timeouts = 1000
    assert c.wait_durable(m1 / "b", timeout=0.2) is False
    assert c.wait_durable([], timeout=0) is True  # nothing to wait for


# ------------------------------------------------------------------------------------------
# tierfs_hints.torch: HintedSampler
# ------------------------------------------------------------------------------------------


class Files(Dataset):  # type: ignore[type-arg]
    """A map-style dataset of ``n`` samples, ``per_file`` consecutive samples per file."""

    def __init__(self, root: Path, n: int, per_file: int = 1) -> None:
        self.root, self.n, self.per_file = root, n, per_file

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i])

    def path_of(self, i: int) -> str:
        return f"{self.root}/f{i // self.per_file:04d}.bin"


def announced(daemon: FakeDaemon) -> list[str]:
    return daemon.ops("epoch")[-1]["paths"]


def rels(ds: Files, order: list[int]) -> list[str]:
    return dedupe([f"f{i // ds.per_file:04d}.bin" for i in order])


def test_sampler_random(env: Any) -> None:
    ds = Files(env.m1, 50, per_file=5)
    hs = HintedSampler(RandomSampler(ds, generator=torch.Generator().manual_seed(3)), ds.path_of,
                       client=env.client)
    plain = RandomSampler(ds, generator=torch.Generator().manual_seed(3))
    assert len(hs) == 50
    unused = iter(hs)  # the DataLoader makes one of these each epoch and drops it
    del unused
    assert env.daemon.requests == []
    for _ in range(2):  # two epochs, each announced
        order = list(hs)
        assert order == list(plain)
        assert announced(env.daemon) == rels(ds, order)
    assert len(env.daemon.ops("epoch")) == 2 and hs.handle is not None


def test_sampler_distributed_ranks(env: Any) -> None:
    ds = Files(env.m1, 41)
    seen: list[set[str]] = []
    indices: list[int] = []
    for rank in range(2):
        inner: DistributedSampler[int] = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=5)
        hs = HintedSampler(inner, ds.path_of, client=env.client)
        hs.set_epoch(3)
        assert inner.epoch == 3
        order = list(hs)
        assert order == list(inner)
        assert announced(env.daemon) == rels(ds, order)
        seen.append(set(announced(env.daemon)))
        indices += order
    assert seen[0] | seen[1] == {f"f{i:04d}.bin" for i in range(41)}
    assert set(indices) == set(range(41))
    assert len(seen[0] & seen[1]) <= 1  # 41 samples on 2 ranks: one index is repeated


def test_sampler_batches(env: Any) -> None:
    ds = Files(env.m1, 30, per_file=4)
    bs = BatchSampler(RandomSampler(ds, generator=torch.Generator().manual_seed(1)), 4, False)
    hs = HintedSampler(bs, ds.path_of, client=env.client)
    batches = list(hs)
    assert batches == list(BatchSampler(RandomSampler(ds, generator=torch.Generator().manual_seed(1)), 4, False))
    assert announced(env.daemon) == rels(ds, [i for b in batches for i in b])
    assert len(hs) == len(bs)


def test_sampler_lookahead(env: Any) -> None:
    ds = Files(env.m1, 20)
    inner: DistributedSampler[int] = DistributedSampler(ds, num_replicas=2, rank=1, seed=2)
    hs = HintedSampler(inner, ds.path_of, lookahead_epochs=2, client=env.client)
    hs.set_epoch(4)
    order = list(hs)
    expected = []
    for e in (4, 5, 6):
        s: DistributedSampler[int] = DistributedSampler(ds, num_replicas=2, rank=1, seed=2)
        s.set_epoch(e)
        expected += rels(ds, list(s))
    assert announced(env.daemon) == dedupe(expected)
    assert inner.epoch == 4 and order == list(inner)
    with pytest.raises(ValueError, match="lookahead_epochs needs a sampler"):
        HintedSampler(RandomSampler(ds), ds.path_of, lookahead_epochs=1)


def test_sampler_arguments(env: Any) -> None:
    ds = Files(env.m1, 8)
    for bad, match in (({"path_of": 5}, "path_of must be"), ({"lookahead_epochs": -1}, "lookahead_epochs"),
                       ({"by": NAN}, "by must be finite"), ({"by": datetime.now()}, "by must be seconds")):
        kw: dict[str, Any] = {"path_of": ds.path_of, **bad}
        with pytest.raises(ValueError, match=match):
            HintedSampler(SequentialSampler(ds), **kw)
    with pytest.raises(ValueError, match="sampler must be iterable"):
        HintedSampler(5, ds.path_of)  # type: ignore[arg-type]


def test_sampler_path_forms(env: Any) -> None:
    """path_of as a list; relative paths against mount=; None skipped; byte ranges."""
    names = ["a", "a", "b", None, "c"]
    hs = HintedSampler(SequentialSampler(range(5)), names, mount=env.m1, client=env.client)
    assert list(hs) == [0, 1, 2, 3, 4]
    assert announced(env.daemon) == ["a", "b", "c"]
    hs = HintedSampler(SequentialSampler(range(4)), lambda i: (f"{env.m1}/big.bin", i * 100, 100),
                       by=timedelta(seconds=9), client=env.client)
    list(hs)
    assert env.daemon.ops("epoch")[-1] == {"op": "epoch", "paths": ["big.bin"],
                                           "source": tierfs_hints.client.default_source(),
                                           "deadline_s": 9.0}


def test_sampler_off_mount_warns_once_and_iterates(env: Any) -> None:
    ds = Files(env.off, 10)
    hs = HintedSampler(RandomSampler(ds, generator=torch.Generator().manual_seed(0)), ds.path_of,
                       client=env.client)
    with pytest.warns(TierfsHintWarning):
        first = list(hs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = list(hs)
    assert sorted(first) == sorted(second) == list(range(10))
    assert env.daemon.requests == [] and hs.handle is not None and hs.handle.progress().done


@PROPS
@given(order=st.lists(st.integers(0, 19), max_size=60),
       mapping=st.lists(st.sampled_from("abcde"), min_size=20, max_size=20),
       batch=st.integers(0, 4))
def test_sampler_announces_exactly_the_yielded_order(env: Any, order: list[int], mapping: list[str],
                                                     batch: int) -> None:
    """Any sampler order (optionally batched): the announcement is the consecutive-deduped
    files of exactly what is then yielded."""
    env.daemon.requests.clear()
    items: list[Any] = order if not batch else [order[i:i + batch] for i in range(0, len(order), batch)]
    hs = HintedSampler(items, lambda i: f"{env.m1}/{mapping[i]}", client=env.client)
    got = list(hs)
    assert got == items
    flat = [mapping[i] for i in order]
    if flat:
        assert announced(env.daemon) == dedupe(flat)
        assert all(a != b for a, b in itertools.pairwise(announced(env.daemon)))
    else:
        assert env.daemon.requests == []


@PROPS
@given(files=st.lists(st.sampled_from(["x", "y", "z"]), max_size=40))
def test_files_of_merges_consecutive_repeats_only(files: list[str]) -> None:
    out = files_of(range(len(files)), files.__getitem__)
    assert out == dedupe(files)
    assert sorted(set(out)) == sorted(set(files))


def _loader_batches(loader: DataLoader) -> list[list[list[int]]]:  # type: ignore[type-arg]
    return [b.tolist() for b in loader]


def test_sampler_in_dataloader_with_workers(env: Any) -> None:
    ds = Files(env.m1, 64, per_file=4)

    def loader(sampler: Any) -> DataLoader:  # type: ignore[type-arg]
        return DataLoader(ds, sampler=sampler, batch_size=8, num_workers=2)

    torch.manual_seed(11)
    plain = _loader_batches(loader(RandomSampler(ds)))
    torch.manual_seed(11)
    hs = HintedSampler(RandomSampler(ds), ds.path_of, client=env.client)
    hinted = _loader_batches(loader(hs))
    assert hinted == plain
    order = [row[0] for b in hinted for row in b]
    assert announced(env.daemon) == rels(ds, order)
    assert env.daemon.pids == [os.getpid()]  # announced from the main process


def test_batch_sampler_in_dataloader_with_workers(env: Any) -> None:
    ds = Files(env.m1, 40, per_file=8)
    g = torch.Generator().manual_seed(2)
    bs = BatchSampler(RandomSampler(ds, generator=g), 5, drop_last=True)
    hs = HintedSampler(bs, ds.path_of, client=env.client)
    g.manual_seed(2)
    hinted = _loader_batches(DataLoader(ds, batch_sampler=hs, num_workers=2))
    g.manual_seed(2)
    plain = _loader_batches(DataLoader(ds, batch_sampler=bs, num_workers=2))
    assert hinted == plain
    assert announced(env.daemon) == rels(ds, [row[0] for b in hinted for row in b])


# ------------------------------------------------------------------------------------------
# tierfs_hints.torch: hinted_shards
# ------------------------------------------------------------------------------------------


def test_hinted_shards_yields_unchanged_and_announces(env: Any) -> None:
    shards = [f"{env.m1}/s{i}.tar" for i in (3, 1, 2)]
    assert list(hinted_shards(shards, client=env.client)) == shards
    assert env.daemon.ops("epoch")[-1] == {"op": "epoch", "paths": ["s3.tar", "s1.tar", "s2.tar"],
                                           "source": tierfs_hints.client.default_source()}


def test_hinted_shards_webdataset_items(env: Any) -> None:
    items = [{"url": f"file:{env.m1}/a.tar"}, {"url": f"file://{env.m1}/b.tar"},
             {"url": f"pipe:cat {env.m1}/c.tar"}, {"url": "https://host/d.tar"}, {"x": 1},
             Path(env.m1 / "e.tar")]
    assert list(hinted_shards(items, client=env.client)) == items
    assert announced(env.daemon) == ["a.tar", "b.tar", "e.tar"]
    pipes = [f"pipe:cat {env.m1}/c{i}.tar" for i in range(3)]
    list(hinted_shards(pipes, path_of=lambda u: u.split()[-1], client=env.client))
    assert announced(env.daemon) == ["c0.tar", "c1.tar", "c2.tar"]


def test_hinted_shards_endless_stream(env: Any) -> None:
    stream = (f"{env.m1}/s{i % 7}.tar" for i in itertools.count())
    got = list(itertools.islice(hinted_shards(stream, limit=5, client=env.client), 12))
    assert got == [f"{env.m1}/s{i % 7}.tar" for i in range(12)]
    assert announced(env.daemon) == [f"s{i}.tar" for i in range(5)]


def test_hinted_shards_bad_arguments(env: Any) -> None:
    with pytest.raises(ValueError, match="limit must be >= 1"):
        next(hinted_shards([env.m1 / "a"], limit=0, client=env.client))
    with pytest.raises(ValueError, match=r"epoch: order\[0\] .* through '..'"):
        next(hinted_shards([f"{env.m1}/../x"], client=env.client))
    assert env.daemon.requests == []


class ShardSamples(IterableDataset):  # type: ignore[type-arg]
    """Each worker reads its own split of the shards (shard i holds samples 10i..10i+9)."""

    def __init__(self, shards: list[str], client: Client) -> None:
        self.shards, self.client = shards, client

    def __iter__(self) -> Any:
        info = get_worker_info()
        mine = self.shards if info is None else self.shards[info.id::info.num_workers]
        for shard in hinted_shards(mine, client=self.client):
            first = int(Path(shard).stem[1:]) * 10
            yield from range(first, first + 10)


def test_hinted_shards_in_dataloader_workers(env: Any, tmp_path: Path) -> None:
    daemon = FileDaemon(tmp_path / "requests.jsonl")
    c = Client(request=daemon, is_mount_root=env.roots)
    shards = [f"{env.m1}/s{i}.tar" for i in range(6)]
    for _ in range(2):  # two epochs: new worker processes each time
        got = [int(x) for x in DataLoader(ShardSamples(shards, c), num_workers=2, batch_size=None)]
        assert sorted(got) == list(range(60))
    recs = daemon.records()
    host = tierfs_hints.client.default_source().rsplit(":", 1)[0]
    assert len(recs) == 4 and all(r["pid"] != os.getpid() for r in recs)
    by_source: dict[str, list[list[str]]] = {}
    for r in recs:
        by_source.setdefault(r["req"]["source"], []).append(r["req"]["paths"])
    # each worker announces its own split, under a source that is stable across epochs
    assert by_source == {f"{host}:{os.getpid()}:w0": [["s0.tar", "s2.tar", "s4.tar"]] * 2,
                         f"{host}:{os.getpid()}:w1": [["s1.tar", "s3.tar", "s5.tar"]] * 2}


def test_item_cap_before_sending(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the daemon's MAX_ITEMS per mount: need() and phase() raise ValueError naming the cap
    and send nothing; epoch() (a forecast, fed by samplers over huge datasets) announces the
    first MAX_ITEMS files and warns once."""
    monkeypatch.setattr(wire, "MAX_ITEMS", 10)
    paths = [f"{env.m1}/d/f{i}" for i in range(15)]
    with pytest.raises(ValueError, match="MAX_ITEMS"):
        env.client.need(paths)
    with pytest.raises(ValueError, match="MAX_ITEMS"):
        env.client.phase("eval", 5, paths)
    assert env.daemon.requests == []
    with pytest.warns(TierfsHintWarning, match="MAX_ITEMS"):
        env.client.epoch(paths)
    (_, req), = sent(env.daemon, "epoch")
    assert req["paths"] == [f"d/f{i}" for i in range(10)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env.client.epoch(paths)  # warned once per client


def test_permission_refusal_is_a_permission_error(env: Any) -> None:
    def refuse(root: str, req: dict[str, Any]) -> dict[str, Any]:
        raise wire.ControlError("'d/x': permission denied (read)", "perm")

    c = Client(request=refuse, is_mount_root=env.roots)
    with pytest.raises(PermissionError, match="permission denied"):
        c.need([env.m1 / "d" / "x"])


def test_request_over_the_byte_cap_is_not_sent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(wire, "MAX_REQUEST_BYTES", 100)
    with pytest.raises(wire.ControlError, match="MAX_REQUEST_BYTES") as e:
        wire.request(str(tmp_path / "not-a-mount"), {"op": "where", "paths": ["x" * 200]})
    assert e.value.kind == "value"
