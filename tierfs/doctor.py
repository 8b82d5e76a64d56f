"""``tierfs doctor MOUNTPOINT``: is this mount healthy, and if not, what to do.

Each check gives a :class:`Finding`: ``ok``, ``note`` (worth knowing, nothing to fix) or
``problem`` (the mount is dead or degraded; the message says why and what to do). The command
exits 1 if any check found a problem, else 0.

Without a mountpoint (:func:`check_ram_tiers`): the RAM tiers of the whole machine, each held
by a live daemon or left behind (by a crash, or an unmount without ``--flush``) with what it
keeps and what to do.

Checks of a mount: the mount is a live tierfs mount (daemon alive and answering); who may use it; each
tier is within its capacity, its filesystem not full, and writable; the write-back journal is a
sound database whose every dirty file has its data; the kernel readahead of the mount is what
was configured; the backing store answers; write-back keeps its deadlines; the metrics endpoint
listens.
Everything that might hang (a read through a stuck mount, a dead NFS backing store) runs in a
thread with a timeout.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sqlite3
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tierfs import private
from tierfs.sched import profile as profile_mod
from tierfs.units import format_size
from tierfs_hints import wire

T = TypeVar("T")
TIMEOUT_S = 10.0  # a daemon or backing store that does not answer within this is reported hung


@dataclass(frozen=True)
class Finding:
    level: str  # "ok", "note" or "problem"
    check: str  # "mount", "tier ram", "journal", ...
    message: str


class _Hung(Exception):
    pass


def _with_timeout(fn: Callable[[], T], timeout: float) -> T:
    """``fn()`` in a daemon thread; raises _Hung after ``timeout`` s (the thread is left behind:
    a process exit kills it even if it sleeps in a FUSE request)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise _Hung
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def _log_tail(path: str, n: int = 3) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = f.read().decode(errors="replace").splitlines()[-n:]
    except OSError:
        return ""
    return "".join(f"\n      | {line}" for line in lines)


def _check_dead(mnt: str, why: str) -> list[Finding]:
    from tierfs.mount import ram_tier_path, state_dir_for

    log_path = os.path.join(state_dir_for(mnt), "daemon.log")
    out = [Finding("problem", "mount",
                   f"the daemon of {mnt} is dead ({why}): programs "
                   f"using the mount get errors. Run the same `tierfs mount` command again (it "
                   f"cleans up the dead mount, reuses the SSD tier and writes back what was not "
                   f"written back yet), or `tierfs umount {mnt}`. Last lines of {log_path}:"
                   + (_log_tail(log_path) or " (none)"))]
    journal = os.path.join(ram_tier_path("/dev/shm", mnt), "journal.sqlite")
    if os.path.exists(journal):
        n = _journal_rows(journal)
        if n:
            out.append(Finding("note", "journal",
                               f"{n} written file(s) wait in the RAM write tier ({journal}); "
                               "mounting again writes them back"))
    return out


def _journal_rows(path: str) -> int:
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return int(db.execute("SELECT count(*) FROM dirty").fetchone()[0])
        finally:
            db.close()
    except sqlite3.Error:
        return 0


def _check_private(check: str, paths: list[str]) -> list[Finding]:
    """A problem for each of ``paths`` (tier or state directories) that others could read or
    change (see tierfs.private); a mount would refuse it."""
    out = []
    for p in paths:
        why = private.problem(p)
        if why:
            out.append(Finding("problem", check, f"not private: {why}. Until fixed, other users may "
                                                 "read or change cached data, and the next mount refuses it"))
    return out


def _check_tier(t: dict[str, Any]) -> list[Finding]:
    name, path = t["name"], t["path"]
    check = f"tier {name}"
    cap, used, dirty = t["capacity_bytes"], t["used_bytes"], t.get("dirty_bytes", 0)
    eff = t.get("effective_capacity_bytes", cap)
    out = []
    if used + dirty > cap:
        out.append(Finding("problem", check,
                           f"holds {format_size(used + dirty)}, more than its capacity "
                           f"{format_size(cap)}: a tierfs bug (report it with `tierfs stats --json`)"))
    if eff < cap:
        out.append(Finding("problem", check,
                           f"the filesystem of {path} is full: tierfs lowered the tier's capacity "
                           f"from {format_size(cap)} to {format_size(eff)} (reads still work, from "
                           "the backing store). Free space there, or give the tier a size that "
                           "fits (--ram SIZE, --ssd DIR:SIZE); it grows back as space frees"))
    out += _check_private(check, [path, os.path.join(path, "data"), os.path.join(path, "dirty")])
    probe = os.path.join(path, f".doctor-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        why = {errno.EROFS: "the filesystem is read-only (remounted after an error?)",
               errno.ENOSPC: "the filesystem is full",
               errno.ENOENT: "the tier directory is gone (removed while mounted?)"}.get(e.errno or 0, "")
        out.append(Finding("problem", check,
                           f"{path} is not writable: {e.strerror}{'; ' + why if why else ''}. "
                           "Chunks cannot be cached there and, for the write tier, writes go "
                           "through to the backing store or fail"))
        return out
    sv = os.statvfs(path)
    free = sv.f_bavail * sv.f_frsize
    room = eff - used - dirty
    if free < room:
        out.append(Finding("note", check,
                           f"may still grow by {format_size(room)}, but its filesystem has only "
                           f"{format_size(free)} free; if it fills, tierfs lowers the tier's "
                           "capacity (no error, a smaller cache)"))
    if t.get("errors"):
        out.append(Finding("note", check, f"{t['errors']} I/O error(s) so far (the chunks were "
                                          "dropped and read elsewhere); see the daemon log"))
    if not [f for f in out if f.level == "problem"]:
        out.insert(0, Finding("ok", check, f"{format_size(used)} cached + {format_size(dirty)} "
                                           f"dirty of {format_size(cap)}, writable ({path})"))
    return out


def _check_journal(tier_path: str) -> Finding:
    path = os.path.join(tier_path, "journal.sqlite")
    if not os.path.exists(path):
        return Finding("problem", "journal", f"{path} is missing: dirty files would not survive a crash")
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            verdict = db.execute("PRAGMA quick_check").fetchone()[0]
            if verdict != "ok":
                return Finding("problem", "journal", f"{path} is damaged ({verdict}): unmount with "
                                                     "--flush, then move it away before mounting again")
            rows = db.execute("SELECT id, path FROM dirty WHERE through = 0 AND path IS NOT NULL").fetchall()
            missing = []
            for id_, rel in rows:
                if not os.path.exists(os.path.join(tier_path, "dirty", str(id_))):
                    still = db.execute("SELECT 1 FROM dirty WHERE id = ?", (id_,)).fetchone()
                    if still:  # not written back and removed meanwhile
                        missing.append(os.fsdecode(rel))
        finally:
            db.close()
    except sqlite3.Error as e:
        return Finding("problem", "journal", f"{path} cannot be read: {e}")
    if missing:
        return Finding("problem", "journal",
                       f"{len(missing)} journaled file(s) lost their data in the write tier "
                       f"(removed from outside?): {', '.join(missing[:5])}. They cannot be "
                       "written back; the backing store keeps its older versions")
    return Finding("ok", "journal", f"consistent ({len(rows)} dirty file(s) journaled in {path})")


def _check_readahead(mnt: str, want_kb: int) -> Finding:
    st = os.stat(mnt)
    bdi = f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb"
    try:
        with open(bdi) as f:
            have = int(f.read())
    except OSError as e:
        return Finding("note", "readahead", f"cannot read {bdi}: {e.strerror}")
    if want_kb and have < want_kb:
        return Finding("problem", "readahead",
                       f"kernel readahead of the mount is {have} KiB, configured read_ahead_kb={want_kb}: "
                       f"reads reach tierfs as {have} KiB requests, up to 2-3x slower for large "
                       f"files. The daemon could not raise it (not root?) or something lowered it. "
                       f"Fix (as root): echo {want_kb} > {bdi}")
    return Finding("ok", "readahead", f"{have} KiB ({bdi})")


def _check_backing(backing: str) -> Finding:
    try:
        _with_timeout(lambda: (os.stat(backing), os.listdir(backing)), TIMEOUT_S)
    except _Hung:
        return Finding("problem", "backing", f"{backing} does not answer within {TIMEOUT_S:.0f}s "
                                             "(a hung NFS server or a failing disk?)")
    except OSError as e:
        return Finding("problem", "backing", f"{backing}: {e.strerror}: misses and write-back fail")
    return Finding("ok", "backing", f"{backing} answers")


def _check_profile(doc: dict[str, Any]) -> Finding:
    """The backing profile the daemon uses and how it was decided; a note when it was set by
    hand and the kernel says otherwise (a mismatch costs throughput, never correctness)."""
    s = doc.get("scheduler", {})
    p = s.get("profile")
    if not p:
        return Finding("note", "backing profile", "the daemon does not report one (an older tierfs)")
    text = (f"{p['name']} ({p['source']}: {p['reason']}); {s.get('depth')} in flight, "
            f"slices of {format_size(int(s.get('slice_bytes', 0)))}")
    if p["source"] != "detected":
        try:
            detected, why = _with_timeout(lambda: profile_mod.detect(doc["backing"]), TIMEOUT_S)
        except _Hung:
            detected, why = p["name"], ""
        if detected != p["name"]:
            return Finding("note", "backing profile", f"{text}; detection would say {detected} ({why}). "
                                                      "Use --backing auto unless you know better")
    return Finding("ok", "backing profile", text)


def _check_writeback(wb: dict[str, Any]) -> list[Finding]:
    out = []
    if wb.get("late_files"):
        eta = wb.get("eta_s")
        out.append(Finding("note", "write-back",
                           f"{wb['late_files']} file(s) past their writeback_deadline; "
                           f"{format_size(wb['dirty_bytes'])} to write back"
                           f"{'' if eta is None else f', about {eta:.0f}s at the measured rate'}. "
                           "The data is safe in the write tier; the backing store is slower "
                           "than the writes (or failing: see the log)"))
    if wb.get("quarantined"):
        shown = ", ".join(wb.get("quarantined_paths") or [])
        out.append(Finding("problem", "write-back",
                           f"{wb['quarantined']} file(s) quarantined by crash recovery, not written "
                           f"back (their bytes were gone): {shown}. Whatever was kept is in the "
                           f"{wb.get('write_tier')} tier's quarantine/ directory; see docs/writes.md"))
    if wb.get("failures"):
        out.append(Finding("note", "write-back", f"{wb['failures']} failed write-back(s) so far, "
                                                 "retried; see the daemon log"))
    if not out:
        out.append(Finding("ok", "write-back", f"{wb['dirty_files']} dirty file(s), on schedule"))
    return out


def _check_users(mnt: str) -> Finding:
    """Who may use the mount, from the kernel's own record of its options."""
    from tierfs.config import who_can_use
    from tierfs.mount import mount_options

    who = who_can_use(mount_options(mnt))
    if who.startswith("all"):
        return Finding("ok", "users", who)
    return Finding("note", "users", f"{who}: other users get EACCES on everything; mount with "
                                    "--allow-other (-o allow_other) to let them in")


def _check_transport(t: dict[str, Any] | None) -> Finding:
    """Which FUSE transport serves the mount, and why (the daemon's own account)."""
    if not t:
        return Finding("note", "transport", "pyfuse3 (a daemon too old to say)")
    name = t.get("name", "?")
    what = f"{name}{' with kernel passthrough' if t.get('passthrough') else ''}: {t.get('why', '')}"
    if name == "native" and t.get("passthrough"):
        what += (f"; {t.get('passthrough_opens', 0)} opens passed through "
                 f"({format_size(t.get('passthrough_bytes', 0))})")
        if t.get("passthrough_misses"):
            what += "; misses read straight from the backing store"
    if t.get("unexpected_errors"):
        return Finding("problem", "transport", f"{what}; {t['unexpected_errors']} requests failed with an "
                                               "unexpected error (answered EIO): see the daemon's log")
    return Finding("ok", "transport", what)


def _check_metrics(addr: str, port: int) -> Finding:
    try:
        with socket.create_connection((addr if addr not in ("0.0.0.0", "::") else "127.0.0.1", port), 2):
            pass
    except OSError as e:
        return Finding("problem", "metrics", f"nothing listens on {addr}:{port} (metrics_port): {e.strerror}")
    return Finding("ok", "metrics", f"http://{addr}:{port}/metrics")


def diagnose(mountpoint: str, timeout: float = TIMEOUT_S) -> list[Finding]:
    """Every check of the module docstring, for the mount on ``mountpoint``."""
    from tierfs.mount import mount_entry

    mnt = os.path.abspath(mountpoint)
    entry = mount_entry(mnt)
    if entry is None:
        return [Finding("problem", "mount", f"nothing is mounted on {mnt}; mount it with "
                                            f"`tierfs mount BACKING {mnt}`")]
    if entry[1] != "fuse.tierfs":
        return [Finding("problem", "mount", f"{mnt} is a {entry[1]} mount, not tierfs")]

    def read(name: str) -> bytes:
        with open(wire.control_path(mnt, name), "rb") as f:
            return f.read()

    try:
        pid = int(_with_timeout(lambda: read(wire.PID_FILE), timeout))
        doc = json.loads(_with_timeout(lambda: read(wire.STATS_FILE), timeout))
        cfg = json.loads(_with_timeout(lambda: read(wire.CONFIG_FILE), timeout))
    except _Hung:
        return [Finding("problem", "mount", f"the daemon of {mnt} does not answer within {timeout:.0f}s "
                                            "(hung, or stuck on the backing store); see its log, and "
                                            "`py-spy dump --pid PID` with the PID from "
                                            "`ps -ef | grep 'tierfs mount'`")]
    except OSError as e:
        if e.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            return _check_dead(mnt, e.strerror or "not connected")
        return [Finding("problem", "mount", f"{mnt}: {e.strerror}")]
    from tierfs.mount import state_dir_for

    log_file = cfg.get("log_file") or os.path.join(state_dir_for(mnt), "daemon.log")
    out = [Finding("ok", "mount", f"daemon {pid} serves {doc['backing']} on {mnt} "
                                  f"(up {doc['uptime_s']:.0f}s; log: {log_file})")]
    out.append(_check_users(mnt))
    out.append(_check_transport(doc.get("transport")))
    for t in doc["tiers"]:
        out += _check_tier(t)
    state = state_dir_for(mnt)
    out += _check_private("state", [os.path.dirname(state), state])
    wb = doc.get("writeback") or {}
    write_tier = next((t for t in doc["tiers"] if t["name"] == wb.get("write_tier")), None)
    if write_tier is not None:
        out.append(_check_journal(write_tier["path"]))
    out.append(_check_readahead(mnt, int(cfg.get("read_ahead_kb", 0))))
    out.append(_check_backing(doc["backing"]))
    out.append(_check_profile(doc))
    if wb:
        out += _check_writeback(wb)
    if cfg.get("metrics_port"):
        out.append(_check_metrics(cfg.get("metrics_addr", "127.0.0.1"), int(cfg["metrics_port"])))
    return out


def _bytes_used(path: str) -> int:
    """Memory (or disk) the files under ``path`` take: allocated blocks, not apparent sizes."""
    total = 0
    for top, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
    return total


_SECTION = "docs/troubleshooting.md, \"A RAM tier no daemon holds\""


def _entries(path: str) -> int:
    """How many entries directory ``path`` has (0 if it is missing or unreadable)."""
    try:
        return len(os.listdir(path))
    except OSError:
        return 0


def _unheld_tier(path: str) -> Finding:
    """What a RAM tier directory no daemon holds keeps, and what to do about it."""
    from tierfs.writeback.journal import summary

    name = os.path.basename(path)
    check = f"tier {name}"
    size = format_size(_bytes_used(path))
    try:
        j = summary(os.path.join(path, "journal.sqlite"))
    except FileNotFoundError:
        orphans = _entries(os.path.join(path, "dirty")) + _entries(os.path.join(path, "quarantine"))
        if orphans:
            return Finding("problem", check, f"{path} ({size}): no daemon holds it, it has no journal, "
                                             f"and it keeps {orphans} data file(s) in dirty/ or quarantine/ "
                                             "whose names no journal says: look inside before you remove "
                                             f"it by hand ({_SECTION}); `tierfs doctor --free` keeps them")
        return Finding("problem", check, f"{path}: no daemon holds it, and it keeps {size} of "
                                         "cached data: `tierfs doctor --free` removes it")
    except OSError as e:
        return Finding("problem", check, f"{path} ({size}): no daemon holds it, and its journal "
                                         f"cannot be read ({e.strerror}): it may name files not "
                                         f"written back ({_SECTION})")
    if not j.dirty and not j.quarantined:
        return Finding("problem", check, f"{path}: no daemon holds it, and it keeps {size} with "
                                         "nothing to write back: `tierfs doctor --free` removes it")
    mnt = os.fsdecode(j.mountpoint) if j.mountpoint else None
    backing = os.fsdecode(j.backing) if j.backing else None
    what = []
    if j.dirty:
        some = ", ".join(os.fsdecode(p) for p in j.paths) + (", ..." if j.dirty > len(j.paths) else "")
        what.append(f"{j.dirty} file(s) not yet written back ({some})")
    if j.quarantined:
        what.append(f"{j.quarantined} quarantined row(s)")
    msg = f"{path} ({size}): no daemon holds it, and it keeps {' and '.join(what)}"
    msg += f" of {backing}" if backing else " of a backing directory it does not name (an older tierfs)"
    msg += f", mounted on {mnt}" if mnt else ""
    msg += ". A RAM tier is lost at reboot. "
    if backing and mnt and os.path.isdir(backing):
        # the tier is found again only under the same ram_dir
        ram_dir = os.path.dirname(os.path.dirname(path))
        opt = "" if ram_dir == "/dev/shm" else f" -o ram_dir={ram_dir}"
        msg += (f"Mount it there again (`tierfs mount{opt} {backing} {mnt}`, with the other tier "
                f"options it had): the mount writes them back; `tierfs umount --flush {mnt}` then "
                "waits until all are")
    elif backing and not os.path.isdir(backing):
        msg += (f"{backing} no longer exists: the data files are in {path}/dirty, named by the "
                f"`id` of their row in {path}/journal.sqlite (`SELECT id, path FROM dirty`); copy out "
                f"what you need, then remove {path}")
    else:
        msg += ("Mount the backing directory they belong to on the mountpoint it served, to write "
                f"them back ({_SECTION})")
    if j.quarantined:
        msg += "; quarantined rows: docs/writes.md"
    return Finding("problem", check, msg)


def default_ram_dirs() -> list[str]:
    """Where RAM tiers live: ``/dev/shm`` and the ``ram_dir`` of each ``/etc/tierfs/*.toml``
    (the systemd unit's configs; one that cannot be read is skipped)."""
    from tierfs.config import load_toml

    dirs = ["/dev/shm"]
    try:
        names = sorted(os.listdir("/etc/tierfs"))
    except OSError:
        names = []
    for n in names:
        if n.endswith(".toml"):
            try:
                d = load_toml(os.path.join("/etc/tierfs", n)).get("ram_dir")
            except Exception:  # noqa: BLE001 - a broken config is `tierfs config`'s to report
                continue
            if isinstance(d, str) and d not in dirs:
                dirs.append(d)
    return dirs


def check_ram_tiers(ram_dirs: list[str], free: bool = False) -> list[Finding]:
    """Every RAM tier directory under ``<ram_dir>/tierfs``: held by a live daemon (ok), or left
    by one that died (or whose write-back at unmount failed), with what it keeps (a problem: RAM
    it holds for nothing, or files a reboot loses). ``free``: remove what no daemon holds and
    nothing needs (cached data; a tier with no file to write back), never a file not yet
    written back."""
    from tierfs.mount import RAM_PARENT, free_unheld_ram_tier

    out: list[Finding] = []
    holders = private.flock_holders()
    for ram_dir in dict.fromkeys(os.path.abspath(d) for d in ram_dirs):  # each once, in order
        parent = os.path.join(os.path.abspath(ram_dir), RAM_PARENT)
        try:
            names = sorted(os.listdir(parent))
        except FileNotFoundError:
            continue
        except PermissionError:
            out.append(Finding("note", "ram tiers", f"{parent}: another user's RAM tiers (private): run "
                                                    "`tierfs doctor` as that user"))
            continue
        except OSError as e:
            out.append(Finding("problem", "ram tiers", f"{parent}: {e.strerror}"))
            continue
        for name in names:
            path = os.path.join(parent, name)
            try:
                st = os.stat(path, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode) and st.st_uid == private.euid():
                    os.stat(os.path.join(path, "lock"), follow_symlinks=False)
            except FileNotFoundError:
                pass  # gone meanwhile, or no lock file: no daemon ever held it
            except PermissionError:
                out.append(Finding("note", f"tier {name}", f"{path}: not readable by this user: run "
                                                           "`tierfs doctor` as the user who mounted it"))
                continue
            if not stat.S_ISDIR(st.st_mode):
                continue
            if st.st_uid != private.euid():
                out.append(Finding("note", f"tier {name}", f"{path}: owned by uid {st.st_uid}, not by this "
                                                           "user: tierfs never touches it; check whose it is"))
                continue
            pid = private.lock_holder(path, holders)
            if pid is not None:
                out.append(Finding("ok", f"tier {name}", f"{path}: in use by daemon "
                                                         f"{pid or '(pid unknown)'}"))
                continue
            if free:
                had_data = _entries(os.path.join(path, "data")) > 0
                if free_unheld_ram_tier(path, whole=True):
                    if not os.path.exists(path):
                        out.append(Finding("ok", f"tier {name}", f"{path}: removed (nothing to write back)"))
                        continue
                    if had_data:
                        out.append(Finding("note", f"tier {name}", f"{path}: its cached data removed"))
            out.append(_unheld_tier(path))
    if not out:
        out.append(Finding("ok", "ram tiers", f"none under {', '.join(ram_dirs)}"))
    return out


def run(mountpoint: str | None, ram_dirs: list[str] | None = None, free: bool = False) -> int:
    """Print the findings (of the mount on ``mountpoint``; without one, of every RAM tier on
    this machine); 1 if any is a problem, else 0."""
    if mountpoint is None:
        findings = check_ram_tiers(ram_dirs or default_ram_dirs(), free=free)
    else:
        findings = diagnose(mountpoint)
    width = max(len(f.check) for f in findings)
    for f in findings:
        print(f"{f.level.upper() if f.level == 'problem' else f.level:8} {f.check:{width}}  {f.message}")
    problems = sum(f.level == "problem" for f in findings)
    print(f"{problems} problem(s)" if problems else "healthy")
    return 1 if problems else 0
