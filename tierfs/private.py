"""Private state: the directories and files tierfs keeps outside the mount.

Tiers (cached data, dirty files, the journal, the SSD catalog, lock files) and the state
directory (the daemon's log) hold copies of users' files and the names of files being written.
Another local user must not read them, plant names in them (a symlink where the daemon is about
to create a file makes root write or ``chown`` whatever it points at), or remove them (losing
data not yet written back). So, whatever the daemon's umask:

* a directory tierfs keeps its state in is owned by the daemon's user and has mode 0700; one
  that exists already is *verified* when it is opened: a symlink, another owner, or group/other
  permission bits refuse the mount (:class:`PrivateStateError`, one line saying how to fix it),
  because someone else may have had a hand in what it holds. Directories *inside* a verified
  directory can only have been made by the daemon's user; their mode is tightened when found
  loose (left by an older tierfs), their owner and type are still checked;
* a directory is opened once (an ``O_DIRECTORY`` descriptor, never following a symlink) and
  everything in it is then created, opened and removed relative to that descriptor, so
  renaming or replacing a path component later changes nothing;
* files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 applied with ``fchmod``;
  an existing file is used only if it is a regular file owned by the daemon's user with one link
  (a file left by an earlier run of the same daemon: an SSD tier's cached data, a lock file);
* removal is descriptor-relative too (``shutil.rmtree(name, dir_fd=...)``, which never follows
  a symlink), after checking the owner, so nothing is deleted through a path someone redirected.

The parents *above* a tier or state directory are the operator's choice and are not verified;
``/run/tierfs`` and the RAM tier's ``<ram_dir>/tierfs`` are tierfs' own and are.

All functions block (a few metadata syscalls); they run at mount time or in a tier's device.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat

from tierfs.errors import MountError

DIR_MODE = 0o700
FILE_MODE = 0o600
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class PrivateStateError(MountError):
    """A tier or state directory (or a file in one) that others could read or have changed.
    The message names the path and the command that fixes it."""


def euid() -> int:
    return os.geteuid()


def is_private(st: os.stat_result) -> bool:
    """Owned by the daemon's user, no permission bits for group or others."""
    return st.st_uid == euid() and not st.st_mode & 0o077


def problem(path: str) -> str | None:
    """Why ``path`` is not a private directory (for ``tierfs doctor``), or None if it is one
    or does not exist."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return _dir_problem(path, st)


def _dir_problem(path: str, st: os.stat_result) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink: remove it (rm {path}); tierfs creates the directory itself"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory: remove it, or choose another path"
    if st.st_uid != euid():
        return (f"{path} is owned by uid {st.st_uid}, not by the daemon's user (uid {euid()}): "
                f"remove it (rm -r {path}) or chown -R {euid()} {path}, after checking what it holds")
    if st.st_mode & 0o077:
        return (f"{path} is accessible to other users (mode {stat.S_IMODE(st.st_mode):04o}): "
                f"chmod 700 {path}")
    return None


def open_dir(path: str, *, tighten: bool = False) -> int:
    """Open (creating it if missing, mode 0700) the private directory ``path``, verified.
    Missing parents are created 0700 too; existing parents are taken as they are.
    ``tighten``: for tierfs' own shared parents (``/run/tierfs``, ``<ram_dir>/tierfs``): one of
    ours that others can read but not write (an older tierfs made it 0755) holds nothing they
    could have planted, so its mode is set to 0700 instead of refusing.

    Returns:
        an ``O_DIRECTORY`` descriptor (the caller closes it).

    Raises:
        PrivateStateError: ``path`` is a symlink, not a directory, not owned by the daemon's
            user, or accessible to others.
        MountError: it cannot be created or opened (the message has the OS error).
    """
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    for _ in range(8):  # another daemon may remove an empty shared parent meanwhile: retry
        try:
            os.makedirs(parent, mode=DIR_MODE, exist_ok=True)
            pfd = os.open(parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise MountError(f"{parent}: {e.strerror}") from None
        try:
            return _subdir(pfd, name, path, verify_mode=not tighten)
        except FileNotFoundError:
            continue  # the parent went away between open and mkdir
        finally:
            os.close(pfd)
    raise MountError(f"{path}: its parent directory keeps disappearing")


def open_in(parent_path: str, name: str) -> int:
    """``open_dir(parent_path)``, then the private directory ``name`` in it (both verified).
    For ``/run/tierfs/<id>`` and ``<ram_dir>/tierfs/<id>``. Raises as :func:`open_dir`."""
    for _ in range(8):
        pfd = open_dir(parent_path, tighten=True)
        try:
            return _subdir(pfd, name, os.path.join(parent_path, name), verify_mode=True)
        except FileNotFoundError:
            continue  # an empty parent was removed by a daemon that just exited: make it again
        finally:
            os.close(pfd)
    raise MountError(f"{parent_path}: keeps disappearing")


def subdir(dir_fd: int, name: str, path: str = "") -> int:
    """The directory ``name`` inside the verified directory ``dir_fd`` (created 0700 if missing;
    an existing one owned by the daemon's user and writable by nobody else gets its mode
    tightened to 0700).

    Raises:
        PrivateStateError: it is a symlink, not a directory, owned by someone else, or
            writable by others.
        OSError: the calls failed.
    """
    return _subdir(dir_fd, name, path or name, verify_mode=False)


def _subdir(dir_fd: int, name: str, path: str, *, verify_mode: bool) -> int:
    created = False
    try:
        os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
        created = True
    except FileExistsError:
        pass
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            raise PrivateStateError(_dir_problem(path, st) or f"{path}: {e.strerror}") from None
        raise
    try:
        st = os.fstat(fd)
        loose_ok = not verify_mode and (created or not st.st_mode & 0o022)
        if created or (st.st_uid == euid() and loose_ok):
            if st.st_uid != euid():
                raise PrivateStateError(_dir_problem(path, st) or path)
            if stat.S_IMODE(st.st_mode) != DIR_MODE:
                os.fchmod(fd, DIR_MODE)  # exact, whatever the umask did
        else:
            why = _dir_problem(path, st)
            if why:
                raise PrivateStateError(why)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_file(fd: int, what: str, attrs: bool) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or (attrs and st.st_uid != euid()):
        raise OSError(errno.EPERM, f"{what} is not a private regular file of the daemon's user "
                                   f"(uid {st.st_uid}, {st.st_nlink} links)")
    if attrs and stat.S_IMODE(st.st_mode) != FILE_MODE:
        os.fchmod(fd, FILE_MODE)


def create_file(dir_fd: int, name: str, flags: int = os.O_RDWR) -> int:
    """A new file ``name`` in ``dir_fd`` (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600).
    Raises OSError (EEXIST if the name is taken, whatever it is)."""
    fd = os.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE,
                 dir_fd=dir_fd)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_path(path: str, flags: int = os.O_RDWR) -> int:
    """:func:`create_file` for a ``path`` that names a file in a verified directory through
    :func:`fd_path` (so nothing above it can be redirected). Raises OSError."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(dir_fd: int, name: str, flags: int = os.O_RDWR, *, create: bool = True,
              attrs: bool = True) -> int:
    """Open the file ``name`` in ``dir_fd``: created as :func:`create_file` if missing (when
    ``create``); an existing one must be a regular file of the daemon's user with one link (its
    mode is set to 0600). With ``create``, an existing name that fails the check is removed
    and created anew (it can only be debris of the daemon's own user). ``attrs=False``: the
    owner and mode are the file's payload (a dirty file carries those of the file it stands for,
    in a private directory): only the type and link count are checked.

    Raises:
        OSError: ENOENT (missing and not ``create``), EPERM (fails the check, not ``create``),
            or what the calls raised.
    """
    flags &= ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)
    for _ in range(4):
        if create:
            try:
                return create_file(dir_fd, name, flags)
            except FileExistsError:
                pass
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            if create:
                continue  # removed meanwhile: create it
            raise
        except OSError as e:
            if not create or e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise
            remove(dir_fd, name)
            continue
        try:
            _check_file(fd, name, attrs)
        except OSError:
            os.close(fd)
            if not create:
                raise
            remove(dir_fd, name)
            continue
        if flags & os.O_NONBLOCK == 0:
            os.set_blocking(fd, True)
        return fd
    raise OSError(errno.EAGAIN, f"{name}: kept changing while being opened")


def remove(dir_fd: int, name: str) -> None:
    """Remove ``name`` from ``dir_fd`` whatever it is (a directory with its contents), never
    following a symlink. Missing is fine. Raises OSError."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)  # fd-based, refuses to follow symlinks
    else:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass


def remove_dir(parent: str, name: str, *, only_if_empty: bool = False) -> bool:
    """Remove the private directory ``parent/name`` (relative to a descriptor of ``parent``),
    only if it is a real directory owned by the daemon's user. ``only_if_empty``: ``rmdir``.
    Returns True if it was removed (or was already gone)."""
    try:
        pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return True
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != euid():
            return False  # not ours: never touched
        try:
            if only_if_empty:
                os.rmdir(name, dir_fd=pfd)
            else:
                shutil.rmtree(name, dir_fd=pfd)
        except OSError:
            return False
        return True
    finally:
        os.close(pfd)


def lock(dir_fd: int, path: str) -> int:
    """Take the exclusive lock of the tier or state directory ``dir_fd`` (its ``lock`` file,
    private). Returns the lock's descriptor (closing it releases the lock).

    Raises:
        MountError: another daemon holds it.
        OSError: the lock file cannot be opened.
    """
    fd = open_file(dir_fd, "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise MountError(f"tier directory {path} is in use by another tierfs daemon (or being freed by "
                         "`tierfs doctor --free`: try again)") from None
    return fd


def flock_holders() -> dict[str, int] | None:
    """``{"MAJ:MIN:INODE": pid}`` of every flock on the machine (``/proc/locks``), read without
    taking any lock, so a mount starting meanwhile is never refused because of the reader;
    None if unreadable."""
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out: dict[str, int] = {}
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 27490 00:1a:1213336 0 EOF"; waiters are "1: -> FLOCK ..."
        if len(parts) >= 6 and parts[1] == "FLOCK":
            out[parts[5]] = int(parts[4])
    return out


def lock_holder(dir_path: str, holders: dict[str, int] | None) -> int | None:
    """The pid of the daemon holding the tier or state directory ``dir_path`` (the flock of its
    ``lock`` file, :func:`lock`), 0 if it is held by a process that cannot be named, None if
    nothing holds it. ``holders``: :func:`flock_holders` (None: probe with a shared lock that is
    dropped at once)."""
    lock_path = os.path.join(dir_path, "lock")
    try:
        st = os.stat(lock_path, follow_symlinks=False)
    except OSError:
        return None  # no lock file: no daemon ever held it
    if holders is not None:
        return holders.get(f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}")
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0
    finally:
        os.close(fd)
    return None


def fd_path(dir_fd: int, name: str = "") -> str:
    """``/proc/self/fd/N[/name]``: a path that names exactly what ``dir_fd`` holds, for APIs
    that only take paths (sqlite, ``os.stat``). Valid while the descriptor is open."""
    return f"/proc/self/fd/{dir_fd}" + (f"/{name}" if name else "")


def open_log(path: str) -> int:
    """Open a log file for appending, never through a symlink: created 0600 if missing; an
    existing one must be a regular file with one link owned by the daemon's user (its mode is
    left as the operator set it). Returns a descriptor.

    Raises:
        MountError: it exists but fails the check, or cannot be opened.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, FILE_MODE)
            os.fchmod(fd, FILE_MODE)
            return fd
        except FileExistsError:
            fd = os.open(path, flags | os.O_NONBLOCK)
    except OSError as e:
        raise MountError(f"log file {path}: {e.strerror}"
                         + (" (a symlink: give the real path)" if e.errno == errno.ELOOP else "")) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != euid() or st.st_nlink != 1:
        os.close(fd)
        raise MountError(f"log file {path} is not a regular file of the daemon's user with one "
                         f"link (uid {st.st_uid}, {st.st_nlink} links): remove it, or choose another")
    os.set_blocking(fd, True)
    return fd
