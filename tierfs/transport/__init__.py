"""FUSE transports: what carries kernel requests to :class:`tierfs.fs.handlers.Handlers`.

* :mod:`tierfs.transport.pyfuse` - pyfuse3 (libfuse 3): portable, unprivileged mounts through
  fusermount3, any kernel.
"""
