"""Shared fixtures. ``tiermount`` mounts tierfs for real (a daemon process, as users run it) and
always unmounts in one ``finally``: ``tierfs umount``, then ``fusermount3 -u -z``, then SIGKILL
of the daemon; it then asserts the mount is gone.

The event-loop bound: every daemon a test starts runs with ``TIERFS_LOOP_BOUND_MS`` (default
:data:`LOOP_BOUND_MS`; tierfs.loopwatch), and a daemon stopped by the fixtures (``Mount.stop``,
``force_unmount``) whose loop was blocked longer than that fails its test, naming the
offending tasks when one place blocked it repeatedly or computed too long (anything else is a
warning: :func:`loop_offenders`). ``TIERFS_TEST_LOOP_STRICT=0`` reports instead of failing (a warning,
and a JSON line per offending daemon appended to ``$TIERFS_TEST_LOOP_REPORT`` if set).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FUSE_OK = os.path.exists("/dev/fuse") and os.geteuid() == 0

needs_fuse = pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse and root")

# The event loop may be blocked at most this long in one task step (docs/concurrency.md). Chosen
# from measurement on the 2-core development VM, loaded by other test runs: steps doing only
# event-loop work stayed under 36 ms there, while blocking calls that belong in a thread took
# 60 ms to seconds.
LOOP_BOUND_MS = 50
os.environ.setdefault("TIERFS_LOOP_BOUND_MS", str(LOOP_BOUND_MS))  # inherited by every daemon
LOOP_STRICT = os.environ.get("TIERFS_TEST_LOOP_STRICT", "1") != "0"
# Tests of scale (100,000 hinted paths, directory entries; a 1M-item control request) mount
# with this bound instead: single steps of 51-88 ms were measured in them on the 2-core VM (an
# OPEN with a 100,000-path plan held, a paced control answer), not yet explained (listed in
# docs/concurrency.md); they check that scale works and the loop stays within tens of ms.
SCALE_LOOP_BOUND_MS = 100
# A place whose steps exceed the bound in at least this fraction of all the daemon's steps (and
# twice on CPU, or three times) fails the test. On CI's slow machine, a test of 163,742 steps had
# two steps of 51-58 ms on CPU at the two ends of its write loop: noise, at a place that runs
# in every step. With `dd` keeping the page cache full
# beside the tests, calls made inline because they are cheap (lookups, readdir, journal commits)
# slept past the bound in 4e-5 to 2e-4 of the steps (up to 7 times at one place in 250,000
# steps); a blocking call that belongs in a thread blocks every time its request comes (an
# fsync per file of a tar -x: a tenth of the steps or more).
BLOCKED_STEPS_FATAL = 1e-3


@pytest.fixture
def scale_loop_bound(monkeypatch: pytest.MonkeyPatch) -> int:
    """Daemons this test starts run with the :data:`SCALE_LOOP_BOUND_MS` loop bound."""
    monkeypatch.setenv("TIERFS_LOOP_BOUND_MS", str(SCALE_LOOP_BOUND_MS))
    return SCALE_LOOP_BOUND_MS

# The FUSE transport the real-mount fixtures mount with (tierfs.transport): TIERFS_TEST_TRANSPORT
# = pyfuse3 | native | both (each real-mount test once per transport). Tests that mount through
# ``tierfs_cmd("mount", ...)`` themselves get the current one too. Default both (what `make test`
# and CI run): the whole suite of ~900 tests took 37:33 in CI (2026-12-02) and 47:06 on a slow
# day here, on 2 cores, inside CI's 90 minutes.
TRANSPORT_CHOICE = os.environ.get("TIERFS_TEST_TRANSPORT", "both")
if TRANSPORT_CHOICE not in ("pyfuse3", "native", "both"):
    raise pytest.UsageError(f"TIERFS_TEST_TRANSPORT={TRANSPORT_CHOICE!r}: pyfuse3, native or both")
TRANSPORTS = ["pyfuse3", "native"] if TRANSPORT_CHOICE == "both" else [TRANSPORT_CHOICE]
CURRENT = {"transport": TRANSPORTS[0]}
# mount options for a test of the daemon's own write path (write-through when the write tier is
# full, its log lines): with passthrough the kernel writes a file being written, by design
# overrunning a full tier instead (docs/writes.md, "Passthrough writes")
DAEMON_WRITES = ("-o", "passthrough=off")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "transport" in metafunc.fixturenames:
        only = ["native"] if metafunc.definition.get_closest_marker("native_only") else TRANSPORTS
        metafunc.parametrize("transport", only, indirect=True, scope="session")


@pytest.fixture(scope="session")
def transport(request: pytest.FixtureRequest) -> str:
    """The transport of this run of a real-mount test (parametrised: TIERFS_TEST_TRANSPORT)."""
    CURRENT["transport"] = request.param
    return str(request.param)


def tierfs_cmd(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the ``tierfs`` CLI as a user would (``python -m tierfs``); ``mount`` gets the
    current test transport and the hdd backing profile unless the arguments name them."""
    if args and args[0] == "mount" and "--transport" not in args and not any(
            a.startswith("transport=") or ",transport=" in a for a in args):
        args = (*args, "--transport", CURRENT["transport"])
    if args and args[0] == "mount" and "--backing" not in args and not any(
            "backing_profile=" in a for a in args):
        # The backing profile is detected from the disk under tmp_path (rotational here: hdd);
        # a machine whose /tmp is on an SSD would detect parallel, where misses pass through
        # to the backing file by default. Tests of the parallel profile ask for it by name.
        args = (*args, "--backing", "hdd")
    r = subprocess.run([sys.executable, "-m", "tierfs", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=REPO)
    if check and r.returncode != 0:
        raise AssertionError(f"tierfs {' '.join(args)} failed ({r.returncode}): {r.stderr}{r.stdout}")
    return r


def is_mounted(path: Path) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == real for line in f if len(line.split()) > 1)


@dataclass
class Mount:
    backing: Path
    mnt: Path
    ssd: Path | None
    args: list[str] = field(default_factory=list)
    pid: int = 0

    def stats(self) -> dict:
        return json.loads((self.mnt / ".tierfs" / "stats.json").read_bytes())

    def tier(self, name: str) -> dict:
        return next(t for t in self.stats()["tiers"] if t["name"] == name)

    def start(self) -> None:
        tierfs_cmd("mount", str(self.backing), str(self.mnt), *self.args)
        self.pid = int((self.mnt / ".tierfs" / "pid").read_text())

    def stop(self) -> None:
        """Clean unmount; returns only when the daemon has exited. Fails (after unmounting) if
        the daemon's event loop exceeded its bound (see the module docstring)."""
        blocked = None
        if is_mounted(self.mnt):
            blocked = loop_offenders(self)
            tierfs_cmd("umount", str(self.mnt))
        self.pid = 0
        fail_on_blocked_loop(blocked)

    def kill9(self) -> None:
        from tierfs.cli import _alive

        os.kill(self.pid, signal.SIGKILL)
        for _ in range(200):
            if not _alive(self.pid):  # gone, or a zombie nobody has reaped yet
                break
            time.sleep(0.01)


@dataclass(frozen=True)
class Blocked:
    """What blocked a daemon's event loop; ``fatal``: it fails the test (else a warning)."""

    text: str
    fatal: bool


def loop_offenders(m: Mount) -> Blocked | None:
    """None if the daemon's event loop stayed within its bound, else what blocked it (read from
    its stats before it is unmounted; None also when the daemon cannot answer).

    Fatal when one place (task and where its step began and ended) blocked the loop in
    :data:`BLOCKED_STEPS_FATAL` of the daemon's steps and twice with the loop on CPU for the
    bound or longer (a computation), or three times whatever it waited for; or once on CPU for
    twice the bound. Anything else is a warning: code that blocks does so each time
    it runs, while single steps over the bound at a place are what a loaded machine does to any
    code. Seen on the shared 2-core VMs, once per place, never repeating: 50-65 ms steps in
    pyfuse3's own request loop with no tierfs handler in them, on CPU (the host steals CPU
    time from these VMs: ``/proc/stat``); on CI, single steps of 111-214 ms with 10-22 ms of
    CPU in them, the loop asleep in the kernel (reproduced with ``dd`` filling the page cache
    beside a test: the kernel pauses any process that dirties pages then, for up to 200 ms,
    and the daemon's loop writes its write-back journal; docs/concurrency.md)."""
    try:
        loop = m.stats().get("loop")
    except (OSError, ValueError):
        return None  # dead or killed: nothing to read
    if not loop or not loop["over"]:
        return None
    if os.environ.get("TIERFS_TEST_LOOP_REPORT"):
        with open(os.environ["TIERFS_TEST_LOOP_REPORT"], "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "?"), **loop}) + "\n")
    worst = sorted(loop["offenders"].items(), key=lambda kv: -kv[1]["worst_ms"])
    bound = loop["bound_ms"]
    often = loop["steps"] * BLOCKED_STEPS_FATAL
    fatal = any(v["count"] >= max(3, often) or (v["count"] >= max(2, often) and v["worst_cpu_ms"] >= bound)
                or v["worst_cpu_ms"] >= 2 * bound for v in loop["offenders"].values())
    return Blocked(f"the daemon's event loop was blocked longer than {bound:.0f} ms in "
            f"{loop['over']} of {loop['steps']} steps (worst {loop['worst_ms']:.1f} ms): "
            + "; ".join(f"{k}: {v['count']}x, worst {v['worst_ms']:.1f} ms ({v['worst_cpu_ms']:.1f} ms on CPU)"
                       for k, v in worst[:5]), fatal)


def run_as(uid: int, cwd: Path, fn: Callable[[], object]) -> tuple[str, str]:
    """Run ``fn`` in a forked child with uid and gid ``uid`` and no supplementary groups, whose
    cwd is ``cwd`` (entered before the ids change: the 0700 pytest tmp directories above it need
    not be traversable). Returns ``("ok", repr(result))``, ``("OSError", errno name)`` or
    ``(exception class name, message)``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.chdir(cwd)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                out = ("ok", repr(fn()))
            except OSError as e:
                out = ("OSError", errno.errorcode.get(e.errno or 0, str(e.errno)))
            except Exception as e:  # noqa: BLE001 - reported to the parent
                out = (type(e).__name__, str(e))
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    kind, value = json.loads(data) if data else ("?", "the child wrote nothing")
    return kind, value


def fail_on_blocked_loop(blocked: Blocked | None) -> None:
    if blocked is None:
        return
    if LOOP_STRICT and blocked.fatal:
        raise AssertionError(blocked.text + " (TIERFS_TEST_LOOP_STRICT=0 reports instead)")
    import warnings

    warnings.warn(blocked.text, stacklevel=2)


def force_unmount(m: Mount) -> None:
    blocked = None
    try:
        if is_mounted(m.mnt):
            blocked = loop_offenders(m)
            subprocess.run([sys.executable, "-m", "tierfs", "umount", str(m.mnt), "--timeout", "20"],
                           capture_output=True, timeout=60, cwd=REPO)
    finally:
        if is_mounted(m.mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(m.mnt)], capture_output=True)
        if m.pid:
            try:
                os.kill(m.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # A killed daemon leaves its RAM tier in /dev/shm (on purpose: a RAM write tier's dirty
        # files must survive it); a test's mountpoint is never mounted again, so remove it.
        from tierfs.mount import ram_tier_path, remove_ram_tier, state_dir_for

        remove_ram_tier(ram_tier_path("/dev/shm", str(m.mnt)), keep_dirty=False)
        # and its state directory (its log): kept for the user of a real mountpoint, one per
        # mountpoint, but every test mounts a new one (thousands a run)
        if not is_mounted(m.mnt):
            shutil.rmtree(state_dir_for(str(m.mnt)), ignore_errors=True)
    assert not is_mounted(m.mnt), f"{m.mnt} is still mounted"
    fail_on_blocked_loop(blocked)


def unmount_all(mounts: list[Mount]) -> None:
    """:func:`force_unmount` each mount (all of them, even when one fails), then raise the
    first failure."""
    errors = []
    for m in mounts:
        try:
            force_unmount(m)
        except AssertionError as e:
            errors.append(e)
    if errors:
        raise errors[0]


@pytest.fixture
def tiermount(tmp_path: Path, transport: str) -> Iterator:
    """Factory: ``tiermount(ram="64MiB", ssd="128MiB", extra=[...])`` mounts ``tmp_path/back``
    (created, for the test to fill first) on ``tmp_path/mnt`` and returns a :class:`Mount`."""
    mounts: list[Mount] = []
    (tmp_path / "back").mkdir(exist_ok=True)

    def make(*, ram: str = "64MiB", ssd: str | None = None, extra: tuple[str, ...] = (),
             backing: Path | None = None, name: str = "mnt") -> Mount:
        mnt = tmp_path / name
        mnt.mkdir(exist_ok=True)
        args = ["--ram", ram]
        ssd_dir = None
        if ssd is not None:
            ssd_dir = tmp_path / f"ssd-{name}"
            args += ["--ssd", f"{ssd_dir}:{ssd}"]
        m = Mount(backing or tmp_path / "back", mnt, ssd_dir, args + list(extra))
        mounts.append(m)
        m.start()
        return m

    try:
        yield make
    finally:
        unmount_all(mounts)


def join_all(procs: list, timeout: float) -> None:
    """Join with one shared deadline; kill (and fail on) whatever is still running after it."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    stuck = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not stuck, f"processes {stuck} did not finish within {timeout}s (hung in the mount?)"


def module_mount(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Mount]:
    """A writable mount (64 MiB RAM, 256 MiB SSD tier) shared by a test module; always unmounted.
    Its fixture should take ``transport`` (then it is made once per transport)."""
    base = tmp_path_factory.mktemp(name)
    (base / "back").mkdir()
    (base / "mnt").mkdir()
    m = Mount(base / "back", base / "mnt", base / "ssd", ["--ram", "64MiB", "--ssd", f"{base / 'ssd'}:256MiB"])
    try:
        m.start()
        yield m
    finally:
        force_unmount(m)


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``"64m"``) mounted on ``path`` (created if missing); unmounted in
    ``finally``, lazily if still busy (a tierfs mount on top of it is torn down later)."""
    path.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        assert not is_mounted(path)


def write_random(path: Path, size: int, seed: int = 0) -> bytes:
    """A file of ``size`` pseudo-random bytes (fast, reproducible)."""
    import random

    rnd = random.Random(seed)
    data = rnd.randbytes(size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def drop_page_cache(path: Path) -> None:
    """Drop a file's pages from the page cache (POSIX_FADV_DONTNEED)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
