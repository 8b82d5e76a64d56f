"""The FUSE layer, transport-neutral: the handler layer (handlers), the namespace overlay
(namespace), the control plane (control), inode and handle tables. Transports: tierfs.transport."""
