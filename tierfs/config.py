"""One configuration schema for command-line flags, ``-o`` mount options and TOML files.

Every option is a row of :data:`OPTIONS` (name, parser, default, unit and meaning). Values are
validated at the door: an unknown key or a bad value raises :class:`~tierfs.errors.ConfigError`
naming the key and what is allowed. :func:`resolve` records where each effective value came from.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierfs.errors import ConfigError
from tierfs.units import parse_duration, parse_size

MiB = 1 << 20


def _size(v: Any, key: str) -> int:
    return parse_size(v, key=key)


def _positive_size(v: Any, key: str) -> int:
    n = parse_size(v, key=key)
    if n <= 0:
        raise ConfigError(f"{key}: must be larger than 0, got {v!r}")
    return n


def _chunk_size(v: Any, key: str) -> int:
    n = _positive_size(v, key)
    if n % 4096 or n > 256 * MiB:
        raise ConfigError(f"{key}: must be a multiple of 4KiB and at most 256MiB, got {v!r}")
    return n


def _int_range(lo: int, hi: int) -> Callable[[Any, str], int]:
    def parse(v: Any, key: str) -> int:
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a whole number {lo}..{hi}, got {v!r}") from None
        if not lo <= n <= hi or isinstance(v, bool):
            raise ConfigError(f"{key}: expected a whole number {lo}..{hi}, got {v!r}")
        return n

    parse.kind = f"whole number {lo}..{hi}"  # type: ignore[attr-defined]
    return parse


def _ssd(v: Any, key: str) -> tuple[str, int | None] | None:
    """``DIR`` or ``DIR:SIZE``; the size defaults by :func:`default_ssd_size`."""
    if v in (None, "", "none", False):
        return None
    text = str(v)
    path, sep, size = text.rpartition(":")
    if sep and path:
        return (path, _positive_size(size, key))
    return (text, None)


def _int_or_auto(lo: int, hi: int) -> Callable[[Any, str], int | None]:
    """A whole number ``lo..hi`` or ``auto`` (None: the backing profile's value)."""
    inner = _int_range(lo, hi)

    def parse(v: Any, key: str) -> int | None:
        if v is None or str(v).lower() == "auto":
            return None
        try:
            return inner(v, key)
        except ConfigError:
            raise ConfigError(f"{key}: expected a whole number {lo}..{hi} or auto, got {v!r}") from None

    parse.kind = f"whole number {lo}..{hi} or auto"  # type: ignore[attr-defined]
    return parse


def _size_or_auto(v: Any, key: str) -> int | None:
    """A size > 0 or ``auto`` (None: the backing profile's value)."""
    if v is None or str(v).lower() == "auto":
        return None
    return _positive_size(v, key)


def _ram(v: Any, key: str) -> int | None:
    """``SIZE``, ``0`` (no RAM tier) or ``auto`` (the default rule)."""
    if v in (None, "auto"):
        return None
    return parse_size(v, key=key)


def _str(v: Any, key: str) -> str:
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{key}: expected a non-empty string, got {v!r}")
    return v


def _choice(*allowed: str) -> Callable[[Any, str], str]:
    def parse(v: Any, key: str) -> str:
        if str(v).lower() not in allowed:
            raise ConfigError(f"{key}: expected one of {', '.join(allowed)}, got {v!r}")
        return str(v).lower()

    parse.kind = "one of " + ", ".join(allowed)  # type: ignore[attr-defined]
    return parse


def _bool(v: Any, key: str) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).lower()
    if text in ("1", "true", "yes", "on", ""):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}: expected true or false, got {v!r}")


def _bool_or_auto(v: Any, key: str) -> bool | None:
    """``true``, ``false`` or ``auto`` (None: decided at mount, see the option's meaning)."""
    if v is None or str(v).lower() == "auto":
        return None
    try:
        return _bool(v, key)
    except ConfigError:
        raise ConfigError(f"{key}: expected true or false, or auto, got {v!r}") from None


def _duration(v: Any, key: str) -> float:
    return parse_duration(v, key=key)


def _fraction(v: Any, key: str) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a fraction 0..1 (0.5 = half), got {v!r}") from None
    if isinstance(v, bool) or not 0.0 <= x <= 1.0:
        raise ConfigError(f"{key}: expected a fraction 0..1 (0.5 = half), got {v!r}")
    return x


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[Any, str], Any]
    default: Any
    help: str


OPTIONS: tuple[Option, ...] = (
    Option("ram", _ram, None, "RAM tier capacity in bytes (e.g. 16GiB); 0 = no RAM tier; "
           "default 'auto' = 25% of MemAvailable, at most half the free space of the RAM tier's filesystem"),
    Option("ram_dir", _str, "/dev/shm", "directory (a tmpfs) under which the RAM tier lives"),
    Option("ssd", _ssd, None, "SSD tier as DIR or DIR:SIZE; default size = 50% of the free space "
           "of DIR's filesystem; persistent across mounts"),
    Option("chunk_size", _chunk_size, 4 * MiB, "bytes: unit of residency, fetch and eviction"),
    Option("backing_profile", _choice("auto", "hdd", "parallel"), "auto", "how the backing store "
           "is driven: hdd (one request at a time in elevator order, long slices), parallel (SSD/NVMe, "
           "RAID, NFS/Lustre, tmpfs: many requests in flight, arrival order, one-chunk slices) or auto "
           "(detected at mount: the backing device's rotational flag, a network or memory filesystem; "
           "hdd when it cannot be told). Flag: --backing"),
    Option("slice_size", _size_or_auto, None, "bytes: longest single backing-store transfer; "
           "a demand read waits at most one slice. auto = 32MiB for hdd (~180 ms at 180 MB/s), "
           "one chunk for parallel"),
    Option("depth", _int_or_auto(1, 64), None, "backing-store requests in flight; auto = 1 for hdd, "
           "16 for parallel"),
    Option("readahead_max", _positive_size, 64 * MiB, "bytes: largest speculative readahead window per file"),
    Option("staging", _size, 256 * MiB, "bytes: daemon memory, on top of the tiers, for fetched "
           "chunks not (yet) in a tier: readahead, and chunks a full tier did not admit"),
    Option("eviction", _choice("nothrash", "lru"), "nothrash", "tier policy: nothrash (frequency "
           "admission; no churn on epoch-shuffled data) or lru (the baseline, for comparison)"),
    Option("write_tier", _choice("auto", "ssd", "ram"), "auto", "tier that absorbs writes: ssd, ram, "
           "or auto (the SSD tier if there is one, else RAM)"),
    Option("writeback_deadline", _duration, 120.0, "seconds after close by which a written file "
           "should be on the backing store (write-back starts at once when the disk is idle, or when a "
           "burst of writes ends: writeback_hold)"),
    Option("writeback_hold", _duration, 30.0, "seconds at most a burst of writes (16+ files closed "
           "per second: tar -x, cp -a) holds the write-back of the files it closed, so that it runs "
           "after the burst instead of slowing it; never more than half of writeback_deadline. A "
           "flush, an fsync that waits for the backing store, or a write tier 1/4 full of dirty "
           "data ends the hold; 0: write back at once"),
    Option("fsync", _choice("tier", "backing"), "tier", "what fsync waits for: durable on the write "
           "tier (tier) or on the backing store (backing)"),
    Option("transport", _choice("auto", "native", "pyfuse3"), "auto", "how the daemon speaks to the "
           "kernel: native (its own /dev/fuse protocol layer: kernel passthrough of resident and "
           "written files, interrupts, 1 MiB requests; needs root), pyfuse3 (libfuse: unprivileged "
           "mounts, any kernel), or auto (native when the kernel offers passthrough and the daemon "
           "has CAP_SYS_ADMIN, else pyfuse3)"),
    Option("passthrough", _choice("on", "writes", "off"), "on", "native transport: which opens "
           "the kernel serves straight from a tier file (passthrough). on (the default): files "
           "wholly resident in one tier (reads and mmap at the tier's speed) and files being "
           "written, in the write tier (checkpoints at the tier's speed); an open for writing of a "
           "file whose readers read its tier copy writes that copy in place, taken in at fsync "
           "and close; writes: written files only; off: none"),
    Option("passthrough_misses", _bool, True, "native transport with passthrough, parallel backing "
           "profile: a file not resident in a tier (and no larger than the tiers together) is read "
           "by the kernel straight from the backing store (a first epoch at the store's speed) "
           "and the cache fills a tier from it in the background once its readers close (from the "
           "page cache they leave); a writer beside such readers writes "
           "the backing file in place (no write-back), as through bindfs. Never on the hdd profile "
           "(the scheduler serializes every HDD access); false: misses are read through the daemon"),
    Option("ro", _bool, False, "read-only mount: no file or directory can be created, written, "
           "renamed or removed through it (EROFS), as for any filesystem mounted ro. A dataset "
           "mount: see kernel_opens. Hints (tierfs_hints), where, evict and flush reach the daemon as "
           "ioctls of its control file (native transport; on pyfuse3 they need a read-write mount)"),
    Option("kernel_opens", _bool, True, "a read-only mount (ro) on the native transport: the "
           "kernel answers every open and close itself, with no request to the daemon, and keeps "
           "each file's page cache across opens (an epoch of small files in the page cache runs "
           "at the page cache's speed); reads it cannot serve come to the daemon. A change made "
           "behind tierfs' back is then seen within attr_timeout, not at the next open. false: "
           "every open asks the daemon (passthrough of resident files; changes seen at the next "
           "open)"),
    Option("busy_poll_us", _int_range(0, 1000), 50, "native transport: microseconds the daemon "
           "polls for the next request after answering one before it sleeps (as net.core.busy_poll "
           "does for sockets): a serial client's next request (rm -rf, tar -x, a stat walk) is "
           "read without a wake-up on either side. Only with 2 or more CPUs, only when nothing "
           "else in the daemon could run, and it stops polling for a while when polls find "
           "nothing; 0: never"),
    Option("allow_other", _bool_or_auto, None, "let users other than the mounting one use the "
           "mount (the kernel checks each file's permissions: default_permissions). Default auto = "
           "true when root mounts (a shared training box), false for a user's own mount"),
    Option("user_hint_share", _fraction, 0.5, "fraction of the tiers' capacity one user other than "
           "root may claim through hints: bytes of its declared needs (of all tiers together) and of "
           "its checkpoint reservations (of the write tier); a hint over it is refused. Root is not "
           "bounded"),
    Option("read_ahead_kb", _int_range(0, 1 << 20), 1024, "KiB: kernel readahead of the mount, set "
           "after mounting (1024 makes the kernel send 1 MiB reads); 0 leaves the kernel default"),
    Option("attr_timeout", _duration, 60.0, "seconds the kernel caches attributes and directory "
           "entries. Every open still sees a change made behind tierfs' back (the daemon checks the "
           "backing file at each open); only stat of such a file may show its old attributes this "
           "long. 0: every stat and path lookup asks the daemon"),
    Option("log_level", _choice("debug", "info", "warning", "error"), "info", "daemon log level"),
    Option("log_file", _str, "", "where the daemon logs: a file; 'syslog' (/dev/log, which journald "
           "also serves) or 'syslog:SOCKET'; 'stderr'. Default: /run/tierfs/<mount id>/daemon.log "
           "in the background, stderr (the journal under systemd) in the foreground"),
    Option("metrics_port", _int_range(0, 65535), 0, "TCP port of the Prometheus metrics endpoint "
           "(http://ADDR:PORT/metrics); 0 = off"),
    Option("metrics_addr", _str, "127.0.0.1", "address the metrics endpoint listens on "
           "(loopback by default; 0.0.0.0 = every interface)"),
    Option("backing", _str, "", "backing directory; the BACKING argument of tierfs mount wins over "
           "it. In a config file it lets a systemd unit or fstab line name only the config file"),
)
OPTION_BY_NAME = {o.name: o for o in OPTIONS}


@dataclass
class Config:
    """The effective configuration. Sizes in bytes, durations in seconds."""

    backing: str = ""
    mountpoint: str = ""
    ram: int | None = None
    ram_dir: str = "/dev/shm"
    ssd: tuple[str, int | None] | None = None
    chunk_size: int = 4 * MiB
    backing_profile: str = "auto"
    slice_size: int | None = None  # None: the backing profile's (tierfs.sched.profile)
    depth: int | None = None  # None: the backing profile's
    readahead_max: int = 64 * MiB
    staging: int = 256 * MiB
    eviction: str = "nothrash"
    write_tier: str = "auto"
    writeback_deadline: float = 120.0
    writeback_hold: float = 30.0
    fsync: str = "tier"
    transport: str = "auto"
    passthrough: str = "on"
    passthrough_misses: bool = True
    ro: bool = False
    kernel_opens: bool = True
    busy_poll_us: int = 50
    allow_other: bool | None = None  # None: auto (see effective_allow_other)
    user_hint_share: float = 0.5
    read_ahead_kb: int = 1024
    attr_timeout: float = 60.0
    log_level: str = "info"
    log_file: str = ""
    metrics_port: int = 0
    metrics_addr: str = "127.0.0.1"
    sources: dict[str, str] = field(default_factory=dict)


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file. Raises ConfigError on a missing or malformed file."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path}: {e}") from None


def resolve(layers: Sequence[tuple[str, Mapping[str, Any]]]) -> Config:
    """Merge option layers, later ones winning (e.g. ``[("config file", toml), ("flag", flags)]``).

    Raises:
        ConfigError: an unknown key (naming the allowed ones) or a bad value (naming the key).
    """
    cfg = Config()
    for source, values in layers:
        for key, raw in values.items():
            if raw is None:
                continue
            name = str(key).replace("-", "_")
            opt = OPTION_BY_NAME.get(name)
            if opt is None:
                allowed = ", ".join(o.name for o in OPTIONS)
                near = difflib.get_close_matches(name, OPTION_BY_NAME, n=1)
                hint = f"did you mean {near[0]!r}? " if near else ""
                raise ConfigError(f"unknown option {key!r} ({source}); {hint}allowed: {allowed}")
            try:
                setattr(cfg, name, opt.parse(raw, name))
            except ConfigError as e:
                raise ConfigError(f"{e} ({source})") from None
            cfg.sources[name] = source
    if cfg.slice_size is not None and cfg.slice_size < cfg.chunk_size:
        raise ConfigError(f"slice_size ({cfg.slice_size}) must be at least chunk_size ({cfg.chunk_size})")
    return cfg


def effective_allow_other(cfg: Config, euid: int) -> bool:
    """``allow_other`` as mounted by the user ``euid``: as configured, else (auto) true for root,
    as bindfs does: a root-run mount is a shared one, and without it every other user gets
    EACCES on everything. Permissions stay checked by the kernel (default_permissions)."""
    return cfg.allow_other if cfg.allow_other is not None else euid == 0


def who_can_use(mount_options: set[str]) -> str:
    """Who may use a FUSE mount with these options (as in /proc/mounts: ``allow_other``,
    ``user_id=N``): for ``tierfs mount``'s output and ``tierfs doctor``."""
    if "allow_other" in mount_options:
        return "all users (allow_other, permissions checked by the kernel)"
    uid = next((o.partition("=")[2] for o in mount_options if o.startswith("user_id=")), "?")
    return f"only uid {uid}"


def mem_available() -> int:
    """MemAvailable from /proc/meminfo, bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def fs_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def default_ram_size(ram_dir: str) -> int:
    """The documented rule: 25% of MemAvailable, at most half the free space of ``ram_dir``'s
    filesystem (tmpfs pages count against the same memory), rounded down to 64 MiB, at least
    64 MiB."""
    size = min(mem_available() // 4, fs_free(ram_dir) // 2)
    return max(64 * MiB, size // (64 * MiB) * (64 * MiB))


def default_ssd_size(ssd_dir: str) -> int:
    """50% of the free space of ``ssd_dir``'s filesystem, rounded down to 64 MiB."""
    return max(64 * MiB, fs_free(ssd_dir) // 2 // (64 * MiB) * (64 * MiB))


# -- the schema described: `tierfs config --print`, docs/reference.md, mount/tierfs.example.toml --
_KINDS: dict[Callable[[Any, str], Any], str] = {
    _size: "size in bytes (16GiB, 512M, 4096)",
    _positive_size: "size in bytes (16GiB, 512M, 4096), > 0",
    _chunk_size: "size in bytes, a multiple of 4KiB, at most 256MiB",
    _ram: "size in bytes, 0 (no RAM tier) or auto",
    _size_or_auto: "size in bytes (16GiB, 512M, 4096), > 0, or auto",
    _ssd: "DIR or DIR:SIZE",
    _duration: "seconds (30, 2.5s, 250ms, 10m)",
    _bool: "true or false",
    _fraction: "fraction 0..1",
    _bool_or_auto: "true, false or auto",
    _str: "text",
}


def describe(opt: Option) -> str:
    """The values ``opt`` accepts, with their unit (``"size in bytes (16GiB, ...)"``)."""
    return _KINDS.get(opt.parse) or str(getattr(opt.parse, "kind", "text"))


def _compact_size(n: int) -> str:
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def format_value(opt: Option, value: Any) -> str:
    """``value`` of ``opt`` as a user writes it (``4MiB``, ``120s``, ``auto``)."""
    if value is None and (opt.parse in (_ram, _bool_or_auto, _size_or_auto)
                          or str(getattr(opt.parse, "kind", "")).endswith("or auto")):
        return "auto"
    if opt.parse is _ssd:
        if value is None:
            return "none"
        path, size = value
        return path if size is None else f"{path}:{_compact_size(size)}"
    if opt.parse in (_size, _positive_size, _chunk_size, _ram, _size_or_auto):
        return _compact_size(int(value))
    if opt.parse is _duration:
        return f"{value:g}s"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if value != "" else '""'


def toml_value(opt: Option, value: Any) -> str:
    """``value`` of ``opt`` as a TOML value (``"4MiB"``, ``120``, ``true``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if opt.parse in (_duration, _fraction):
        return f"{value:g}"
    if isinstance(value, int) and opt.parse not in (_size, _positive_size, _chunk_size, _ram, _size_or_auto):
        return str(value)
    text = format_value(opt, value)
    return '""' if text == '""' else '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def parse_mount_options(text: str, source: str = "-o") -> dict[str, str]:
    """``-o`` option text (``ram=16GiB,ssd=/nvme/c:400GiB,allow_other``) as a dict. A bare
    boolean key means true. Keys are checked later, by :func:`resolve`.

    Raises:
        ConfigError: a bare key that needs a value (naming the key and what it takes).
    """
    out: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        k, sep, v = item.partition("=")
        k = k.strip()
        opt = OPTION_BY_NAME.get(k.replace("-", "_"))
        if not sep and opt is not None and opt.parse not in (_bool, _bool_or_auto):
            raise ConfigError(f"{source} {item!r}: expected {k}=VALUE ({describe(opt)})")
        out[k] = v.strip() if sep else "true"
    return out


def effective(cfg: Config) -> list[tuple[str, str, str]]:
    """Every option's effective value and where it came from: ``(key, value, source)``; the
    source is ``default`` or the layer name given to :func:`resolve`."""
    return [(o.name, format_value(o, getattr(cfg, o.name)), cfg.sources.get(o.name, "default"))
            for o in OPTIONS]
