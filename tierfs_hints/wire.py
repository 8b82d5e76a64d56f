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
CTL_FILE = "ctl"  # read-write: one JSON request line in, one JSON reply out (see below)

# Requests to CTL_FILE, one JSON object per line: {"op": ..., ...}
#   {"op": "flush", "paths": [relative paths] or [], "timeout": seconds}
#     -> {"ok": true, "waited": [paths]} once they (or all dirty files) are on the backing store
# Replies on failure: {"ok": false, "error": "message"}. Paths are relative to the mount root.
