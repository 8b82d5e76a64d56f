"""The FUSE layer: a thin ``Operations`` translator plus its inode, handle and control tables."""
