"""The FUSE boundary's error mapping (tierfs.fs.handlers.fuse_errors, logged_errors): pure."""

from __future__ import annotations

import errno
import logging

import pytest

from tierfs.errors import BackingIOError, DirtyLimit, HintError
from tierfs.fs.api import FuseError
from tierfs.fs.handlers import fuse_errors, logged_errors


@pytest.mark.parametrize("exc,want", [
    (DirtyLimit("too many dirty files"), errno.EDQUOT),  # a typed tierfs error: its errno
    (HintError("bad hint"), errno.EINVAL),  # (also a ValueError: the typed errno wins)
    (BackingIOError("a/b", OSError(errno.EIO, "I/O error")), errno.EIO),
    (PermissionError(errno.EACCES, "Permission denied"), errno.EACCES),
    (OSError("no errno"), errno.EIO),
    (KeyError(12345), errno.ENOENT),  # an unknown inode or handle
    (FuseError(errno.EXDEV), errno.EXDEV),  # already mapped: as it is
])
def test_fuse_errors_maps_to_errno(exc, want, caplog):
    with pytest.raises(FuseError) as ei, fuse_errors("op"):
        raise exc
    assert ei.value.errno == want
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # none is a bug
    assert ei.value.__suppress_context__ or isinstance(exc, FuseError)


def test_fuse_errors_answers_a_bug_eio_and_logs_it(caplog):
    with pytest.raises(FuseError) as ei, fuse_errors("lookup"):
        raise ZeroDivisionError("a bug")
    assert ei.value.errno == errno.EIO
    (rec,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "lookup: unexpected error" in rec.getMessage() and rec.exc_info[0] is ZeroDivisionError


def test_fuse_errors_lets_base_exceptions_and_success_through():
    with pytest.raises(KeyboardInterrupt), fuse_errors("op"):  # (as trio.Cancelled)
        raise KeyboardInterrupt
    with fuse_errors("op"):
        pass


def test_logged_errors_swallows_and_logs_exceptions_only(caplog):
    with logged_errors("release"):
        raise RuntimeError("a bug in release")
    (rec,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "release: unexpected error" in rec.getMessage() and rec.exc_info[0] is RuntimeError
    with pytest.raises(KeyboardInterrupt), logged_errors("release"):
        raise KeyboardInterrupt
