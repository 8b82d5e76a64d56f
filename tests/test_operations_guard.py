"""Handlers that cannot answer an error (release, releasedir, forget) never raise.

pyfuse3 ends its main loop when a handler raises anything but ``FUSEError``; for these three
the kernel ignores (or never expects) a reply, so an exception is logged and swallowed. Driven
in-process: the collaborators are stand-ins whose cleanup raises.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import trio

from tierfs.fs.handlers import Handlers
from tierfs.fs.handles import DirHandle, FileHandle


class Boom(RuntimeError):
    pass


def _ops(*, closed=None, forget=None) -> Handlers:
    async def wb_closed(dirty, writer):  # noqa: ANN001 - stand-in
        raise Boom("write-back close failed")

    def inodes_forget(inode, n):  # noqa: ANN001 - stand-in
        raise Boom("forget failed")

    wb = SimpleNamespace(closed=closed or wb_closed, on_clean=None)
    inodes = SimpleNamespace(forget=forget or inodes_forget, on_forget=None)
    cache = SimpleNamespace(forget_access=lambda access: None)
    readahead = SimpleNamespace(forget=lambda state: None)
    return Handlers(tree=None, inodes=inodes, cache=cache, writeback=wb, readahead=readahead,  # type: ignore[arg-type]
                      control=None, meta=None, attr_timeout=1.0)  # type: ignore[arg-type]


def test_release_swallows_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    ops = _ops()
    fh = ops.handles.add(FileHandle(inode=5, dirty=SimpleNamespace(), writer=True))  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="tierfs.fs"):
        trio.run(ops.release, fh)
    assert fh not in ops.handles.handles
    assert any("release" in r.getMessage() and r.exc_info for r in caplog.records)


def test_forget_swallows_and_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    seen = []

    def forget(inode: int, n: int) -> None:
        seen.append(inode)
        if inode == 7:
            raise Boom("forget failed")

    ops = _ops(forget=forget)
    with caplog.at_level(logging.ERROR, logger="tierfs.fs"):
        trio.run(ops.forget, [(7, 1), (8, 2)])
    assert seen == [7, 8]  # one bad inode does not leak the lookups of the others
    assert any("forget" in r.getMessage() for r in caplog.records)


def test_releasedir_swallows(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    ops = _ops()
    fh = ops.handles.add(DirHandle(inode=1))

    def pop(fh: int) -> None:
        raise Boom("handle table broken")

    monkeypatch.setattr(ops.handles, "pop", pop)
    with caplog.at_level(logging.ERROR, logger="tierfs.fs"):
        trio.run(ops.releasedir, fh)
    assert any("releasedir" in r.getMessage() for r in caplog.records)


def test_release_lets_cancellation_through() -> None:
    async def closed(dirty, writer):  # noqa: ANN001 - stand-in
        await trio.sleep_forever()

    ops = _ops(closed=closed)
    fh = ops.handles.add(FileHandle(inode=5, dirty=SimpleNamespace(), writer=True))  # type: ignore[arg-type]

    async def main() -> bool:
        with trio.move_on_after(0) as scope:
            await ops.release(fh)
        return scope.cancelled_caught

    assert trio.run(main)
