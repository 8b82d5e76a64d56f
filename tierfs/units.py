"""Byte sizes and durations as people write them: ``16GiB``, ``512M``, ``4k``, ``250ms``."""

from __future__ import annotations

import re

from tierfs.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_POW = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str | int, *, key: str = "size") -> int:
    """Parse a byte size. ``K/M/G/T`` and ``KiB/MiB/...`` are powers of 1024 (as ``dd``, ``ls -h``
    and the kernel read them); ``KB/MB/...`` are powers of 1000. A bare number is bytes.

    Raises:
        ConfigError: naming ``key``, for anything else (negative, empty, unknown unit).
    """
    if isinstance(text, bool):
        raise ConfigError(f"{key}: expected a size like 16GiB or 512M, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"{key}: size must not be negative, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"{key}: expected a size like 16GiB, 512M or 4096, got {text!r}")
    number, unit, binary, b = m.groups()
    unit = unit.lower()
    if binary and not unit:
        raise ConfigError(f"{key}: expected a size like 16GiB, 512M or 4096, got {text!r}")
    base = 1000 if (unit and b and not binary) else 1024
    value = float(number) * base ** _POW[unit]
    if value != int(value) and not unit:
        raise ConfigError(f"{key}: a size in bytes must be whole, got {text!r}")
    return int(value)


def format_size(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'`` (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


_DUR_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h)?\s*$")
_DUR_MUL = {None: 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str | float, *, key: str = "duration") -> float:
    """Parse a duration in seconds: ``30``, ``2.5s``, ``250ms``, ``10m``, ``1h``.

    Raises:
        ConfigError: naming ``key``.
    """
    if isinstance(text, int | float) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"{key}: duration must not be negative, got {text}")
        return float(text)
    m = _DUR_RE.match(str(text))
    if not m:
        raise ConfigError(f"{key}: expected a duration like 30s, 250ms or 10m, got {text!r}")
    return float(m.group(1)) * _DUR_MUL[m.group(2)]
