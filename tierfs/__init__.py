"""tierfs: a tiered FUSE filesystem (RAM, SSD, slow backing store) for neural-network training.

Layout (imports flow one way): cli -> mount -> fs -> cache / sched / predict -> io.
"""

__version__ = "0.1.0"
