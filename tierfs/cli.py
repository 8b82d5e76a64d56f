"""The ``tierfs`` command. Each subcommand is ``cmd_X(args) -> int`` so tests call them
in-process through :func:`main`; only :func:`entry` exits."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import math
import os
import select
import shutil
import subprocess
import sys
import time
from typing import Any

from tierfs import logevents, private
from tierfs.config import Config, effective, load_toml, parse_mount_options, resolve, who_can_use
from tierfs.errors import ConfigError, MountError, TierfsError
from tierfs.units import format_size
from tierfs_hints import wire

log = logging.getLogger("tierfs")
READY_TIMEOUT_S = 120  # loading a large SSD catalog can take a while
ROOT_NOFILE = 65536  # descriptors a root daemon raises its limits to (mount/tierfs@.service LimitNOFILE)
FD_TABLE_SLOTS = 65536  # descriptor-table slots the daemon takes at start (at most its limit)


def _mount_config(args: argparse.Namespace) -> Config:
    """Layers, later ones winning: the config file, then flags, then ``-o`` options. Each value
    remembers its source (``tierfs config --print``)."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if args.config:
        layers.append((f"config file {args.config}", load_toml(args.config)))
    flags = {"ram": args.ram, "ssd": args.ssd, "chunk_size": args.chunk_size,
             "eviction": args.eviction, "log_level": args.log_level, "depth": args.depth,
             "write_tier": args.write_tier, "fsync": args.fsync, "transport": args.transport,
             "allow_other": args.allow_other, "metrics_port": args.metrics_port,
             "backing_profile": args.backing_profile}
    flag_names = {"backing_profile": "backing"}  # --backing: the key `backing` names the directory
    layers += [(f"flag --{'no-' if v is False else ''}{flag_names.get(k, k).replace('_', '-')}", {k: v})
               for k, v in flags.items() if v is not None]
    layers += [("-o", parse_mount_options(opt)) for opt in args.option or []]
    cfg = resolve(layers)
    backing, mountpoint = getattr(args, "backing", None), getattr(args, "mountpoint", None)
    if mountpoint is None:  # `tierfs mount --config FILE MOUNTPOINT`: the file names the backing dir
        backing, mountpoint = None, backing
    cfg.backing = backing or cfg.backing
    cfg.mountpoint = mountpoint or ""
    return cfg


def _setup_logging(level: str, path: str | None) -> None:
    logevents.setup(level, path)


def cmd_mount(args: argparse.Namespace) -> int:
    from tierfs import mount as mount_mod

    cfg = _mount_config(args)
    if not cfg.mountpoint:
        raise ConfigError("give MOUNTPOINT: tierfs mount BACKING MOUNTPOINT, or tierfs mount --config FILE MOUNTPOINT")
    if not cfg.backing:
        raise ConfigError("give BACKING, or backing = \"DIR\" in the --config file")
    logevents.check_target(cfg.log_file)
    plan = mount_mod.plan_mount(cfg)
    if args.foreground or args.ready_fd is not None:
        return _run_daemon(plan, args.ready_fd)
    os.close(mount_mod.open_state_dir(plan.state_dir))  # private: 0700, verified
    log_path = logevents.stdio_path(cfg.log_file, plan.state_dir)
    r, w = os.pipe()
    # -P: ``python -m`` would put the working directory first on the import path, and root
    # running ``tierfs mount`` in a directory another user can write (/tmp, a shared project)
    # would run that user's tierfs/__main__.py. The daemon imports this very tierfs instead.
    argv = [sys.executable, "-P", "-m", "tierfs", *args.raw_argv, "--ready-fd", str(w)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    with os.fdopen(private.open_log(log_path), "ab") as logf:
        proc = subprocess.Popen(argv, pass_fds=(w,), stdin=subprocess.DEVNULL, stdout=logf, env=env,
                                stderr=logf, start_new_session=True, close_fds=True)
    os.close(w)
    msg = b""
    deadline = time.monotonic() + READY_TIMEOUT_S
    with os.fdopen(r, "rb") as rf:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([rf], [], [], 0.5)
            if ready:
                msg = rf.readline()
                break
            if proc.poll() is not None:
                break
    text = msg.decode().strip()
    if text == "ok":
        where = cfg.log_file if logevents.is_syslog(cfg.log_file) else log_path
        print(f"tierfs: mounted {plan.backing} on {plan.mountpoint} (pid {proc.pid}, log {where}); "
              f"usable by {who_can_use(mount_mod.mount_options(plan.mountpoint))}")
        _note_unheld_ram_tiers(cfg.ram_dir)
        return 0
    if text.startswith("error:"):
        print(f"tierfs: {text[6:].strip()}", file=sys.stderr)
    else:
        print(f"tierfs: the daemon did not start (exit {proc.poll()}); see {log_path}", file=sys.stderr)
    if proc.poll() is None:
        proc.terminate()
    return 1


def _note_unheld_ram_tiers(ram_dir: str) -> None:
    """After a mount: say so if RAM tiers of other mountpoints were left behind (by a crash, or
    an unmount without ``--flush``): they hold memory, and maybe files a reboot loses, and
    nothing else would tell (``tierfs doctor`` does, if anyone runs it)."""
    from tierfs import mount as mount_mod

    try:
        left = mount_mod.unheld_ram_tiers(ram_dir)
    except OSError:
        return
    if left:
        print(f"tierfs: note: {len(left)} RAM tier(s) under {os.path.dirname(left[0])} are held by no "
              "daemon (left by a crash, or a write-back that failed at unmount; they keep memory, maybe files "
              "not yet written back): `tierfs doctor` says what each keeps and what to do")


def _presize_fd_table(slots: int) -> bool:
    """Grow this process's descriptor table to ``slots`` now, while it has one thread.

    The kernel doubles the table when a new descriptor does not fit, and in a process with
    more than one thread it waits for an RCU grace period first (``expand_fdtable``,
    fs/file.c): 7-16 ms each time on a 2-vCPU VM, with the event loop stopped. The daemon
    holds a descriptor per dirty file and per kept tier copy, so a ``tar -x`` of 3,000 files
    crossed 256, 512, ... 4,096 descriptors at its CREATEs: 33 us per CREATE on average went to
    those stalls. A table never shrinks: one ``dup2`` to the last slot grows it once, here.
    Costs 8 bytes of kernel memory per slot (512 KiB for 65,536). Returns False if nothing was
    done (``slots`` too small, or that slot is in use: the table is that large already)."""
    last = slots - 1
    if last < 1024:
        return False
    try:
        os.fstat(last)
        return False  # in use (inherited): the table holds it already
    except OSError:
        pass
    try:
        fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        os.dup2(fd, last, inheritable=False)
        os.close(last)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _run_daemon(plan: Any, ready_fd: int | None) -> int:
    import trio

    from tierfs import mount as mount_mod

    cfg = plan.cfg
    # Defense in depth: whatever tierfs creates is private unless given a mode explicitly (files
    # created for users get their exact mode with fchmod; tierfs' own state is 0600/0700 anyway)
    os.umask(0o077)
    # Every dirty file and open backing file holds a descriptor: take the hard limit (systemd's
    # default soft limit is 1024, its hard limit 524288); a quarter of it is each user's share
    # of dirty files (WriteBack.user_dirty_bound)
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < ROOT_NOFILE and os.geteuid() == 0:
        # root started outside the unit (a shell, fstab via mount(8)) may raise its hard
        # limit to the unit's LimitNOFILE: kept passthrough registrations of small files take
        # an eighth (measured: with a 20,000 limit only 2,500 of an 8,000-file dataset stayed
        # registered, and every other open paid a tier open and two ioctls)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (ROOT_NOFILE, ROOT_NOFILE))
            soft = hard = ROOT_NOFILE
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    _presize_fd_table(min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], FD_TABLE_SLOTS))
    _setup_logging(cfg.log_level, cfg.log_file or None)
    said = False
    real_mountpoint = os.path.realpath(plan.mountpoint)  # now, before it is mounted

    def ready(message: str | None) -> None:
        nonlocal said
        if said:
            return
        said = True
        if message is None:  # systemd, Type=notify: the mount is up
            logevents.sd_notify(f"READY=1\nSTATUS=serving {plan.backing} on {plan.mountpoint}")
        line = "ok\n" if message is None else f"error: {message}\n"
        if ready_fd is not None:
            os.write(ready_fd, line.encode())
            os.close(ready_fd)
        elif message is None:
            # (the mountpoint resolved before it was mounted: resolving it now, on the
            # daemon's loop, asked this very daemon for its attributes and could hang for good)
            print(f"tierfs: mounted {plan.backing} on {plan.mountpoint} (foreground); usable by "
                  f"{who_can_use(mount_mod.mount_options_at(real_mountpoint))}", flush=True)

    try:
        trio.run(mount_mod.serve, plan, ready)
    except TierfsError as e:
        ready(str(e))
        log.error("%s", e)
        return 1
    except BaseException as e:
        ready(f"daemon failed: {e!r}")
        log.exception("daemon failed")
        return 1
    return 0


def _control_path(mountpoint: str, name: str) -> str:
    return os.path.join(mountpoint, wire.CONTROL_DIR, name)


def _read_control(mountpoint: str, name: str) -> bytes:
    try:
        with open(_control_path(mountpoint, name), "rb") as f:
            return f.read()
    except OSError as e:
        raise MountError(f"{mountpoint} is not a live tierfs mount ({e.strerror})") from None


def _alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie whose parent has not reaped it yet has
    exited: ``kill(pid, 0)`` alone would wait the full timeout for it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def cmd_umount(args: argparse.Namespace) -> int:
    from tierfs import mount as mount_mod

    mnt = os.path.abspath(args.mountpoint)
    try:
        pid = int(_read_control(mnt, wire.PID_FILE))
    except MountError:
        if mount_mod.is_mounted(mnt):  # a dead daemon's mount
            mount_mod.unmount(mnt, lazy=True)
            freed = mount_mod.free_dead_ram_tier(mnt)
            print(f"tierfs: cleaned up the dead mount on {mnt}" + (" and its RAM tier" if freed else ""))
            return 0
        raise
    if args.flush and os.statvfs(mnt).f_flag & os.ST_RDONLY:
        # Nothing is written through it, but files a crash left in its write tier are written
        # back by its daemon; its control file takes no flush (it cannot be opened for writing),
        # so wait on its stats until none is left (a daemon that exits first leaves them in
        # the tier, where a RAM tier loses them at the next reboot)
        n = _wait_written_back(mnt)
        print(f"tierfs: a read-only mount; waited for {n} file(s) a crash left to be written back" if n
              else "tierfs: a read-only mount: every file was on the backing store already")
    elif args.flush:
        reply = _flush(mnt, [], 1e9)
        if not reply.get("ok"):
            raise MountError(f"flush failed: {reply.get('error')}")
        n = len(reply["waited"])
        # (files a crash left were written back at the mount already: nothing to wait for here)
        print(f"tierfs: waited for {n} file(s) to be written back" if n
              else "tierfs: every file was on the backing store already")
    pending = 0 if args.flush else _ram_dirty_files(mnt)
    ram_tier = mount_mod.recorded_ram_tier(mnt) if pending else None
    if not mount_mod.unmount(mnt, lazy=args.lazy):
        raise MountError(f"{mnt} is busy (files open?); close them or use --lazy")
    if pending and not args.lazy:
        # a RAM write tier does not survive a reboot: the daemon writes them back before it exits
        print(f"tierfs: unmounted; daemon {pid} writes {pending} file(s) back from its RAM tier before it exits")
    if args.lazy:
        # detached now; the daemon serves the files still open and exits when they close
        print(f"tierfs: detached {mnt}; daemon {pid} exits when the last open file is closed")
        return 0
    # a RAM tier's write-back: waited for to its end (as umount(8) of a local filesystem waits
    # for its dirty pages), else the next mount of this mountpoint finds the tier still held
    deadline = time.monotonic() + (math.inf if pending else args.timeout)
    while time.monotonic() < deadline:
        if not _alive(pid):
            if ram_tier is not None and _left_files(ram_tier):
                # written back, the daemon removes its RAM tier: files were not (its log says why)
                print(f"tierfs: daemon {pid} exited with files not written back; they stay in {ram_tier} "
                      "until the next mount of this mountpoint, and are lost at a reboot "
                      f"(its log: {mount_mod.state_dir_for(mnt)})", file=sys.stderr)
                return 1
            return 0
        time.sleep(0.05)
    print(f"tierfs: unmounted, but daemon {pid} is still finishing", file=sys.stderr)
    return 0


def _left_files(ram_tier: str) -> bool:
    """Whether the RAM tier a daemon exited from still holds data files (not written back)."""
    from tierfs.mount import has_entries

    try:
        return has_entries(os.path.join(ram_tier, "dirty"))
    except OSError:
        return False


def _ram_dirty_files(mnt: str) -> int:
    """Dirty files the daemon of ``mnt`` holds in a RAM write tier (0 for an SSD write tier, or
    when its stats cannot be read)."""
    try:
        wb = json.loads(_read_control(mnt, wire.STATS_FILE))["writeback"]
    except (MountError, ValueError, KeyError, TypeError):
        return 0
    return int(wb.get("dirty_files", 0)) if wb.get("write_tier") == "ram" else 0


def _wait_written_back(mnt: str) -> int:
    """Wait until the daemon of ``mnt`` holds no dirty file (its ``stats.json``); returns how
    many it held at first. Ctrl-C works between the polls."""
    first = None
    while True:
        left = json.loads(_read_control(mnt, "stats.json"))["writeback"]["dirty_files"]
        first = left if first is None else first
        if not left:
            return first
        time.sleep(0.2)


def _unreachable(mountpoint: str, e: OSError, op: str) -> MountError:
    """Why the control file of ``mountpoint`` took no ``op`` request (its open failed)."""
    if e.errno == errno.EROFS:  # a read-only mount whose daemon takes no ioctl requests
        return MountError(f"{mountpoint} is a read-only tierfs mount (ro) on the pyfuse3 transport: it "
                          f"takes no {op} request (where, evict, flush and hints need a read-write "
                          "mount, or the native transport)")
    if isinstance(e, wire.DaemonBusy):  # the daemon answered: alive
        return MountError(e.strerror or str(e))
    return MountError(f"{mountpoint} is not a live tierfs mount ({e.strerror})")


def _command(mountpoint: str, request: dict[str, Any]) -> dict[str, Any]:
    """Send one request to the daemon's control file and return its reply."""
    try:
        reply = wire.send(mountpoint, json.dumps(request).encode() + b"\n")
    except OSError as e:
        raise _unreachable(mountpoint, e, str(request.get("op", "control"))) from None
    return json.loads(reply)


def _flush(mnt: str, rel: list[str], timeout: float) -> dict[str, Any]:
    """The daemon answers a flush within ~10 s (timed_out when not done yet): loop until done
    or ``timeout`` seconds. Ctrl-C works between the requests."""
    end = time.monotonic() + timeout
    waited: dict[str, None] = {}  # each reply names the files its request waited for
    while True:
        left = max(0.0, end - time.monotonic())
        reply = _command(mnt, {"op": "flush", "paths": rel, "timeout": left})
        waited.update(dict.fromkeys(reply.get("waited") or []))
        if not reply.get("timed_out") or left <= 0:
            if reply.get("ok"):
                reply["waited"] = list(waited)
            return reply


def cmd_flush(args: argparse.Namespace) -> int:
    mnt = os.path.abspath(args.mountpoint)
    rel = []
    for p in args.paths:
        ap = os.path.abspath(p)
        if not (ap + os.sep).startswith(mnt + os.sep):
            raise MountError(f"{p} is not under the mount {mnt} (paths are taken from the current directory)")
        if not os.path.lexists(ap):
            raise MountError(f"{p}: no such file")
        rel.append(os.path.relpath(ap, mnt))
    t0 = time.monotonic()
    reply = _flush(mnt, rel, args.timeout)
    if not reply.get("ok"):
        print(f"tierfs: flush: {reply.get('error')}", file=sys.stderr)
        return 1
    if reply.get("timed_out"):
        print(f"tierfs: flush: timed out after {args.timeout:g}s; files are still being written back",
              file=sys.stderr)
        return 1
    waited = reply["waited"]
    print(f"tierfs: {len(waited)} file(s) durable on the backing store after {time.monotonic() - t0:.1f}s")
    for w in waited:
        print(f"  {w}")
    return 0


def _table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(100, shutil.get_terminal_size((120, 40)).columns))
    s = doc["scheduler"]
    c = doc["cache"]
    console.print(f"[bold]tierfs[/] {doc['backing']} on {doc['mountpoint']}  up {doc['uptime_s']:.0f}s  "
                  f"chunk {format_size(doc['chunk_size'])}  policy {c['policy']}  open files {doc['open_files']}")
    tr = doc.get("transport") or {}
    if tr:
        line = f"transport [bold]{tr.get('name')}[/]{' + kernel passthrough' if tr.get('passthrough') else ''}: {tr.get('why', '')}"
        if tr.get("passthrough"):
            wb_in_place = (doc.get("writeback") or {}).get("in_place_opens", 0)
            line += (f"; passthrough opens {tr.get('passthrough_opens', 0)} "
                     f"({format_size(tr.get('passthrough_bytes', 0))} made available), "
                     f"written in place {wb_in_place}, "
                     f"refused for a mixed inode {tr.get('passthrough_conflicts', 0)}")
        if tr.get("name") == "native":
            line += (f"; requests {tr.get('requests', 0)}, interrupted {tr.get('interrupted', 0)}, "
                     f"unexpected errors {tr.get('unexpected_errors', 0)}")
        console.print(line, highlight=False)
    t = Table(title="tiers")
    for col in ("tier", "path", "used", "dirty", "capacity", "use %", "hits", "misses", "hit ratio",
                "served", "promoted", "demoted", "evicted", "passthrough"):
        t.add_column(col, justify="left" if col in ("tier", "path") else "right")
    for tier in doc["tiers"]:
        cap = tier["capacity_bytes"]
        t.add_row(tier["name"], tier["path"], format_size(tier["used_bytes"]),
                  format_size(tier.get("dirty_bytes", 0)), format_size(cap),
                  f"{100 * (tier['used_bytes'] + tier.get('dirty_bytes', 0)) / cap:.0f}" if cap else "-",
                  str(tier["hits"]),
                  str(tier["misses"]), f"{tier['hit_ratio']:.2f}", format_size(tier["bytes_served"]),
                  str(tier["promotions"]), str(tier["demotions"]), str(tier["evictions"]),
                  # opens the kernel reads straight from the tier (not in hits or served)
                  str(tier.get("passthrough_opens", 0)))
    st = doc["staging"]
    t.add_row("staging", "(memory)", format_size(st["used_bytes"]), "", format_size(st["capacity_bytes"]),
              "", str(st["hits"]), "", "", format_size(st.get("bytes_served", 0)), "", "", "", "")
    t.add_row("backing", doc["backing"], "", "", "", "", "", "", "", format_size(c["bytes_served_from_backing"]),
              "", "", "", "")
    console.print(t)
    q = s["queued"]
    sched = Table(title="transaction scheduler (backing store)")
    sched.add_column("metric")
    sched.add_column("value", justify="right")
    rows = [
        ("queued demand / deadline / speculative", f"{q['demand']} / {q['deadline']} / {q['speculative']}"),
        ("in flight (depth)", f"{s['in_flight']} ({s['depth']})"),
        *([("backing profile", f"{s['profile']['name']} ({s['profile']['source']}: {s['profile']['reason']})")]
          if s.get("profile") else []),
        ("bytes read from backing", format_size(s["backing_bytes_read"])),
        ("transfers (mean size)", f"{s['backing_reads']} ({format_size(s['mean_transfer_bytes'])})"),
        ("busy fraction", f"{s['busy_fraction']:.2f}"),
        ("demand wait mean / p99", f"{1000 * s['demand_wait_mean_s']:.1f} ms / {1000 * s['demand_wait_p99_s']:.1f} ms"),
        ("prefetched used / wasted", f"{format_size(s['prefetch_used_bytes'])} / {format_size(s['prefetch_wasted_bytes'])}"),
        ("bytes served from tiers", f"{100 * c['tier_byte_ratio']:.0f}%"),
    ]
    if "io_tasks" in s:
        rows.append(("bytes written to backing", format_size(s["backing_bytes_written"])))
    for k, v in rows:
        sched.add_row(k, v)
    console.print(sched)
    wb = doc.get("writeback")
    if wb is not None:
        w = Table(title=f"write-back (write tier: {wb['write_tier']})")
        w.add_column("metric")
        w.add_column("value", justify="right")
        eta = wb["eta_s"]
        nd = wb["next_deadline_s"]
        for k, v in [
            ("dirty files / bytes", f"{wb['dirty_files']} / {format_size(wb['dirty_bytes'])}"),
            ("oldest dirty age", f"{wb['oldest_dirty_age_s']:.1f} s"),
            ("being written back / written through", f"{wb['writing']} / {wb['through_files']}"),
            ("written back: files / bytes", f"{wb['written_files']} / {format_size(wb['written_bytes'])}"),
            ("write-back throughput", f"{wb['throughput_bytes_per_s'] / 1e6:.1f} MB/s"),
            ("time until every dirty byte is durable", "unknown yet" if eta is None else f"{eta:.1f} s"),
            ("slack of the nearest write-back deadline", "-" if nd is None else f"{nd:.1f} s"),
            ("held for a burst of writes: now / in all",
             f"{'yes' if wb.get('holding') else 'no'} / {wb.get('hold_seconds', 0.0):.1f} s"),
            ("failures (retried)", str(wb["failures"])),
            ("passthrough opens (for writing) / over the tier's capacity",
             f"{wb.get('passthrough_opens', 0)} ({wb.get('passthrough_writable_opens', 0)}) / "
             f"{format_size(wb.get('passthrough_overrun_bytes', 0))}"),
        ]:
            w.add_row(k, v)
        console.print(w)
    hp = doc.get("hints")
    if hp is not None:
        h = Table(title="hint plan (tierfs_hints, tierfs warmup)")
        h.add_column("metric")
        h.add_column("value", justify="right")
        for k, v in [
            ("needs (finished)", f"{hp['needs']} ({hp['needs_finished']})"),
            ("bytes declared / resident / still to fetch",
             f"{format_size(hp['declared_bytes'])} / {format_size(hp['resident_bytes'])} / {format_size(hp['to_fetch_bytes'])}"),
            ("prefetched for hints", format_size(hp["prefetched_bytes"])),
            ("deadline misses (bytes)", f"{hp['deadline_misses']} ({format_size(hp['missed_bytes'])})"),
            ("projected to miss", str(hp["at_risk"])),
            ("released chunks", str(hp["released_chunks"])),
            ("write-tier room kept for checkpoints", format_size(hp["write_tier_kept_free_bytes"])),
        ]:
            h.add_row(k, v)
        for pd in hp["pending_deadlines"]:
            h.add_row(f"  {pd['id']} {pd['label']}: due in {pd['deadline_in_s']:.1f} s",
                      f"slack {pd['slack_s']:.1f} s, {format_size(pd['remaining_bytes'])} left"
                      + (" MISSED" if pd["missed"] else ""))
        console.print(h)


def cmd_stats(args: argparse.Namespace) -> int:
    mnt = os.path.abspath(args.mountpoint)
    while True:
        doc = json.loads(_read_control(mnt, wire.STATS_FILE))
        if args.prometheus:
            from tierfs import metrics

            print(metrics.render(doc), end="")
        elif args.json:
            print(json.dumps(doc, indent=1))
        else:
            if args.watch:
                print("\x1b[2J\x1b[H", end="")
            _table(doc)
        if not args.watch:
            return 0
        sys.stdout.flush()
        time.sleep(args.watch)


def _mount_of(paths: list[str]) -> tuple[str, list[str]]:
    """The tierfs mount holding every path, and the paths relative to it. Raises MountError."""
    if not paths:
        raise MountError("name at least one path")
    mnt = None
    rel = []
    for p in paths:
        ap = os.path.abspath(p)
        d = ap if os.path.isdir(ap) else os.path.dirname(ap)
        while not (os.path.ismount(d) and os.path.exists(os.path.join(d, wire.CONTROL_DIR, wire.CTL_FILE))):
            if d == "/":
                raise MountError(f"{p} is not on a tierfs mount")
            d = os.path.dirname(d)
        if mnt is not None and d != mnt:
            raise MountError(f"{p} is on another mount ({d}) than {paths[0]} ({mnt})")
        mnt = d
        rel.append(os.path.relpath(ap, d))
    assert mnt is not None
    return mnt, rel


def _expand(paths: list[str], recursive: bool = True) -> list[str]:
    """Directories become the regular files under them (sorted: the order shards are read in)."""
    out: list[str] = []
    for p in paths:
        if recursive and os.path.isdir(p):
            for dirpath, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if d != wire.CONTROL_DIR)
                out.extend(os.path.join(dirpath, f) for f in sorted(files))
        else:
            out.append(p)
    return out


def _hint_request(mnt: str, req: dict[str, Any]) -> dict[str, Any]:
    try:
        return wire.request(mnt, req)
    except wire.ControlError as e:
        raise MountError(str(e)) from None
    except OSError as e:
        raise _unreachable(mnt, e, str(req.get("op", "control"))) from None


def cmd_where(args: argparse.Namespace) -> int:
    mnt, rel = _mount_of(_expand(args.paths))
    reply = _hint_request(mnt, {"op": "where", "paths": rel})
    if args.json:
        print(json.dumps(reply["files"], indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"residency on {mnt}")
    tier_names = [k for k in next((f["resident_bytes"] for f in reply["files"] if "resident_bytes" in f), {})]
    for col in ("path", "size", *tier_names, "resident %", "dirty"):
        t.add_column(col, justify="left" if col == "path" else "right")
    total = resident = 0
    for f in reply["files"]:
        if f.get("missing"):
            t.add_row(f["path"], "(not a file on the backing store)", *[""] * (len(tier_names) + 2))
            continue
        r = sum(f["resident_bytes"].values())
        total += f["size"]
        resident += min(r, f["size"])
        t.add_row(f["path"], format_size(f["size"]), *[format_size(f["resident_bytes"][n]) for n in tier_names],
                  f"{100 * min(r, f['size']) / f['size']:.0f}" if f["size"] else "-",
                  format_size(f["dirty_bytes"]) if f["dirty_bytes"] else "")
    Console(width=max(100, shutil.get_terminal_size((120, 40)).columns)).print(t)
    nfiles = len(reply["files"])
    print(f"{nfiles} file{'s' if nfiles != 1 else ''}, {format_size(resident)} of {format_size(total)} resident"
          + (f" ({100 * resident / total:.0f}%)" if total else ""))
    return 0


def parse_by(text: str, now: float | None = None) -> float:
    """``--by``: seconds from now (``90``), a duration (``30s``, ``10m``, ``2h``) or a clock
    time today (``14:05``, ``14:05:30``; tomorrow if already past). Returns seconds from now.
    Raises ConfigError."""
    import datetime as dt

    t = text.strip()
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        if ":" in t:
            parts = [int(x) for x in t.split(":")]
            if len(parts) not in (2, 3) or not (0 <= parts[0] < 24 and all(0 <= x < 60 for x in parts[1:])):
                raise ValueError
            now_dt = dt.datetime.fromtimestamp(time.time() if now is None else now)
            at = now_dt.replace(hour=parts[0], minute=parts[1], second=parts[2] if len(parts) == 3 else 0,
                                microsecond=0)
            if at < now_dt:
                at += dt.timedelta(days=1)
            return (at - now_dt).total_seconds()
        scale = units.get(t[-1:].lower(), None)
        value = float(t[:-1] if scale else t) * (scale or 1)
        if not value >= 0 or value == float("inf"):
            raise ValueError
        return value
    except ValueError:
        raise ConfigError(f"--by {text!r}: expected seconds (90), a duration (30s, 10m, 2h) or a clock "
                          "time (14:05)") from None


def _warm_by_reading(mnt: str, paths: list[str]) -> int:
    """``tierfs warmup`` on a mount that takes no need hint (read-only, on the pyfuse3
    transport): read the files through
    the mount (4 at a time; the daemon's scheduler orders the store's accesses), which fills
    the tiers as a first epoch would. Returns the exit status."""
    from concurrent.futures import ThreadPoolExecutor

    def read(p: str) -> int:
        n = 0
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                n += len(chunk)
        return n

    t0 = time.monotonic()
    files = [p for p in paths if os.path.isfile(p)]
    with ThreadPoolExecutor(4) as pool:
        total = sum(pool.map(read, files))
    print(f"tierfs: this read-only mount takes no hints: read {len(files)} files, {format_size(total)}, "
          f"through it in {time.monotonic() - t0:.1f}s (they are in its tiers as far as they fit)")
    for p in paths:
        if not os.path.isfile(p):
            print(f"  not a file: {p}", file=sys.stderr)
    return 0


def cmd_warmup(args: argparse.Namespace) -> int:
    paths = _expand(args.paths)
    mnt, rel = _mount_of(paths)
    if not wire.takes_requests(mnt):
        return _warm_by_reading(mnt, paths)
    req: dict[str, Any] = {"op": "need", "items": [[r, 0, None] for r in rel], "source": "tierfs warmup",
                           "label": "warmup"}
    if args.by is not None:
        req["deadline_s"] = parse_by(args.by)
    reply = _hint_request(mnt, req)
    print(f"tierfs: warming {reply['files']} files, {format_size(reply['bytes'])} (hint {reply['id']})")
    for m in reply["missing"]:
        print(f"  not a file on the backing store: {m}", file=sys.stderr)
    if args.no_wait:
        return 0
    t0 = time.monotonic()
    while True:  # short waits: Ctrl-C works between them
        left = args.timeout - (time.monotonic() - t0)
        w = _hint_request(mnt, {"op": "wait", "id": reply["id"], "timeout": max(0.0, min(5.0, left))})
        if w["done"] or w.get("stalled") or w["cancelled"] or left <= 5.0:
            break
    tiers = ", ".join(f"{k} {format_size(v)}" for k, v in w["resident_bytes"].items() if v)
    print(f"tierfs: {'done' if w['done'] else 'NOT done'} after {time.monotonic() - t0:.1f}s: {tiers or 'nothing'} "
          f"resident; {format_size(w['remaining_bytes'])} left" + ("; deadline MISSED" if w["missed"] else "")
          + ("; the tiers hold no more of it (full of data needed sooner, or too small)" if w.get("stalled") else ""))
    return 0 if w["done"] else 1


def cmd_evict(args: argparse.Namespace) -> int:
    mnt, rel = _mount_of(_expand(args.paths))
    reply = _hint_request(mnt, {"op": "evict", "paths": rel})
    print(f"tierfs: evicted {reply['chunks']} chunks, {format_size(reply['bytes'])}")
    return 0


def cmd_sim(args: argparse.Namespace) -> int:
    from tierfs import sim

    unknown = [t for t in args.trace or [] if t not in sim.TRACES]
    if unknown:
        raise ConfigError(f"unknown trace {unknown[0]!r}; known: {', '.join(sim.TRACES)}")
    results = sim.run(args.trace)
    missed = sim.check_targets(results)
    if args.json:
        print(json.dumps({"traces": results, "targets_missed": missed}, indent=1))
        return 0 if not missed else 1
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(100, shutil.get_terminal_size((120, 40)).columns))
    for name, per in results.items():
        t = Table(title=f"{name}: {sim.TRACES[name]().description}")
        for col in ("policy", "hit ratio", "vs Belady", "backing MB", "deadline misses", "data wait s"):
            t.add_column(col, justify="left" if col == "policy" else "right")
        best = per.get("belady", {}).get("hit_ratio") or 0.0
        for pol, m in per.items():
            t.add_row(pol, f"{m['hit_ratio']:.3f}", f"{m['hit_ratio'] / best:.2f}" if best else "-",
                      f"{m['backing_bytes'] / 1e6:.1f}", str(m["deadline_misses"]),
                      "-" if pol == "belady" else f"{m['data_wait_s']:.2f}")
        console.print(t)
    print("vs Belady: hit ratio over that of Belady's MIN *without prefetch*; prefetching policies can "
          "exceed 1 by hiding misses MIN must take.")
    print("targets: " + ("all met" if not missed else "; ".join(missed)))
    return 0 if not missed else 1


def cmd_config(args: argparse.Namespace) -> int:
    from tierfs.config import OPTION_BY_NAME, toml_value

    cfg = _mount_config(args)
    if args.toml:
        print(f"# tierfs configuration (tierfs config --toml); {len(cfg.sources)} option(s) set, the rest default")
        for key, _shown, source in effective(cfg):
            line = f"{key} = {toml_value(OPTION_BY_NAME[key], getattr(cfg, key))}"
            print(line if source != "default" else f"# {line}")
        return 0
    rows = effective(cfg)
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    for key, value, source in rows:
        print(f"{key:{w0}}  {value:{w1}}  {source}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from tierfs import doctor

    if args.mountpoint is not None and (args.free or args.ram_dir):
        raise ConfigError("--free and --ram-dir check the RAM tiers of the whole machine: give no MOUNTPOINT")
    return doctor.run(args.mountpoint, args.ram_dir, free=args.free)


def cmd_install_helper(args: argparse.Namespace) -> int:
    from tierfs import helper

    bin_dir = None if args.no_bin else args.bin_dir
    unit_dir = None if args.no_unit else args.unit_dir
    if unit_dir is not None and args.unit_dir == "/etc/systemd/system" and not os.path.isdir(unit_dir):
        unit_dir = None  # no systemd here
    if args.uninstall:
        for path in helper.uninstall(args.sbin_dir, bin_dir, unit_dir):
            print(f"removed {path}")
        return 0
    try:
        written = helper.install(args.sbin_dir, bin_dir, unit_dir, force=args.force)
    except OSError as e:
        raise MountError(f"install-helper: {e.filename}: {e.strerror} (run as root?)") from None
    for path in written:
        print(f"wrote {path}")
    print(f"mount -t {helper.FSTYPE} BACKING MOUNTPOINT -o OPTIONS and /etc/fstab lines of type "
          f"{helper.FSTYPE} now work; see docs/user-guide.md")
    if unit_dir is not None:
        print("systemd: systemctl daemon-reload, then systemctl enable --now tierfs@$(systemd-escape --path MOUNTPOINT)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierfs", description="Tiered FUSE filesystem for ML training.")
    sub = p.add_subparsers(dest="command", required=True)
    # the options of a mount (one schema: tierfs.config.OPTIONS), shared by `mount` and `config`
    opts = argparse.ArgumentParser(add_help=False)
    opts.add_argument("--ram", help="RAM tier size, e.g. 16GiB (default: auto, see docs); 0 = none")
    opts.add_argument("--ssd", help="SSD tier DIR[:SIZE] (persistent across mounts)")
    opts.add_argument("--chunk-size", help="unit of caching, e.g. 4MiB")
    opts.add_argument("--eviction", help="nothrash (default) or lru")
    opts.add_argument("--depth", help="backing-store requests in flight (default auto: 1 for hdd, 16 for parallel)")
    opts.add_argument("--backing", dest="backing_profile", metavar="{hdd,parallel,auto}",
                      help="backing-store profile: hdd (one request at a time, elevator), parallel "
                           "(SSD/NVMe, RAID, NFS: many in flight) or auto (default: detected at mount)")
    opts.add_argument("--write-tier", help="tier that absorbs writes: ssd, ram or auto (default)")
    opts.add_argument("--transport", choices=("auto", "native", "pyfuse3"),
                      help="FUSE transport: native (kernel passthrough; root), pyfuse3, or auto "
                           "(default: native when the kernel offers passthrough and we are root)")
    opts.add_argument("--fsync", help="tier (default: fsync = durable on the write tier) or backing")
    opts.add_argument("--allow-other", action="store_true", default=None,
                      help="let other users use the mount (default when root mounts)")
    opts.add_argument("--no-allow-other", dest="allow_other", action="store_false",
                      help="only the mounting user may use the mount")
    opts.add_argument("--config", help="TOML file with the same options")
    opts.add_argument("-o", dest="option", action="append", help="key=value[,key=value] options")
    opts.add_argument("--log-level", help="debug, info, warning, error")
    opts.add_argument("--metrics-port", help="serve Prometheus metrics on this port (default 0: off)")
    m = sub.add_parser("mount", parents=[opts], help="mount BACKING on MOUNTPOINT (returns once ready)")
    m.add_argument("backing", nargs="?", help="backing directory (or backing = \"DIR\" in --config)")
    m.add_argument("mountpoint", nargs="?", help="an empty directory")
    m.add_argument("--foreground", "-f", action="store_true", help="stay in the foreground")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.set_defaults(func=cmd_mount)
    u = sub.add_parser("umount", help="unmount cleanly and wait for the daemon to exit")
    u.add_argument("mountpoint")
    u.add_argument("--lazy", action="store_true", help="detach now even if files are open")
    u.add_argument("--flush", action="store_true", help="first wait until every dirty file is on the backing store")
    u.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the daemon")
    u.set_defaults(func=cmd_umount)
    s = sub.add_parser("stats", help="show tiers, hit rates and the scheduler")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="print the versioned JSON document")
    s.add_argument("--prometheus", action="store_true", help="print the Prometheus text format")
    s.add_argument("--watch", type=float, nargs="?", const=2.0, help="refresh every N seconds (2)")
    s.set_defaults(func=cmd_stats)
    f = sub.add_parser("flush", help="wait until written files are durable on the backing store")
    f.add_argument("mountpoint")
    f.add_argument("paths", nargs="*", help="files (default: every dirty file)")
    f.add_argument("--timeout", type=float, default=1e9, help="seconds to wait at most")
    f.set_defaults(func=cmd_flush)
    w = sub.add_parser("where", help="per-tier residency of files (like vmtouch)")
    w.add_argument("paths", nargs="+", help="files or directories on a tierfs mount")
    w.add_argument("--json", action="store_true")
    w.set_defaults(func=cmd_where)
    wu = sub.add_parser("warmup", help="fetch files into the tiers (a need hint from the shell)")
    wu.add_argument("paths", nargs="+", help="files or directories, fetched in this order")
    wu.add_argument("--by", help="deadline: seconds (90), a duration (10m) or a clock time (14:05); default none")
    wu.add_argument("--no-wait", action="store_true", help="return once the hint is registered")
    wu.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait at most")
    wu.set_defaults(func=cmd_warmup)
    ev = sub.add_parser("evict", help="drop files from every tier now (a release hint, enforced)")
    ev.add_argument("paths", nargs="+")
    ev.set_defaults(func=cmd_evict)
    sm = sub.add_parser("sim", help="replay access traces through the real cache code; compare policies")
    sm.add_argument("--trace", action="append", help="trace to run (repeatable; default: all)")
    sm.add_argument("--json", action="store_true", help="per trace and policy: hit_ratio, backing_bytes, ...")
    sm.set_defaults(func=cmd_sim)
    c = sub.add_parser("config", parents=[opts], help="show the effective configuration and where each value came from")
    c.add_argument("--print", action="store_true", help="print it (the default)")
    c.add_argument("--toml", action="store_true", help="print it as a TOML config file")
    c.set_defaults(func=cmd_config)
    d = sub.add_parser("doctor", help="check a mount: alive, tiers, journal, readahead; explain each problem "
                                      "(without MOUNTPOINT: RAM tiers no daemon holds)")
    d.add_argument("mountpoint", nargs="?")
    d.add_argument("--ram-dir", action="append",
                   help="without MOUNTPOINT: look for RAM tiers under DIR/tierfs (default: /dev/shm and "
                        "the ram_dir of each /etc/tierfs/*.toml)")
    d.add_argument("--free", action="store_true",
                   help="without MOUNTPOINT: remove what tiers no daemon holds keep for nothing (cached "
                        "data; tiers with no file to write back); never a file not yet written back")
    d.set_defaults(func=cmd_doctor)
    i = sub.add_parser("install-helper", help="install the mount(8) helper, the tierfs command and the systemd unit")
    i.add_argument("--sbin-dir", default="/sbin", help="where mount(8) looks for helpers (/sbin)")
    i.add_argument("--bin-dir", default="/usr/local/bin", help="where to put the tierfs command (/usr/local/bin)")
    i.add_argument("--unit-dir", default="/etc/systemd/system", help="where to put tierfs@.service (/etc/systemd/system)")
    i.add_argument("--no-bin", action="store_true", help="do not install the tierfs command")
    i.add_argument("--no-unit", action="store_true", help="do not install the systemd unit")
    i.add_argument("--force", action="store_true", help="overwrite files install-helper did not write")
    i.add_argument("--uninstall", action="store_true", help="remove what install-helper wrote")
    i.set_defaults(func=cmd_install_helper)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.raw_argv = [a for a in argv]
    # warnings of the command itself (a dead mount cleaned up) read like its other messages;
    # the daemon replaces this with its own log target
    logging.basicConfig(format="tierfs: %(message)s", level=logging.WARNING)
    try:
        return int(args.func(args))
    except (ConfigError, MountError) as e:
        print(f"tierfs: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `tierfs stats --json | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def entry() -> None:
    sys.exit(main())
