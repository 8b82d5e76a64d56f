"""The wire format shared by the daemon and its clients (``tierfs`` CLI, ``tierfs_hints``).

The control plane lives inside the mount, in a directory hidden from ``readdir``; clients read
and write small files there, so permissions follow the mount and no socket is needed.
Standard library only: DataLoader workers import this.
"""

from __future__ import annotations

CONTROL_DIR = ".tierfs"
STATS_FILE = "stats.json"  # read: the stats document (JSON, versioned)
PID_FILE = "pid"  # read: the daemon's pid, decimal
CONFIG_FILE = "config.json"  # read: the effective configuration
STATS_VERSION = 1
