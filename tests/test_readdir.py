"""Directory listings stream: a directory of any size is listed whole and exactly once, holding
a bounded number of entries in the daemon, resuming from the kernel's offsets (also ones inside
the last reply), with dirty files laid over the backing entries."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from tests.conftest import needs_fuse
from tierfs.backing_tree import BackingTree
from tierfs.fs import namespace
from tierfs.fs.handlers import Handlers
from tierfs.fs.inodes import ROOT, InodeTable
from tierfs.io import Device


class _Dirty(SimpleNamespace):
    """Stands in for a DirtyFile in the listing (isinstance checks see a DirtyFile subclass)."""


def _handlers(back: Path, dirty: dict[bytes, object]) -> Handlers:
    tree = BackingTree(os.fsencode(back))

    def children(rel: bytes) -> list[tuple[bytes, object]]:
        prefix = rel + b"/" if rel else b""
        return [(p[len(prefix):], df) for p, df in dirty.items()
                if p.startswith(prefix) and b"/" not in p[len(prefix):]]

    wb = SimpleNamespace(get=dirty.get, children=children, on_clean=None)
    return Handlers(tree=tree, inodes=InodeTable(tree), cache=SimpleNamespace(), writeback=wb,  # type: ignore[arg-type]
                    readahead=SimpleNamespace(), control=SimpleNamespace(by_inode={}),  # type: ignore[arg-type]
                    meta=Device("meta", 1), attr_timeout=1.0)


async def _list(ops: Handlers, inode: int, reply: int, consume: int) -> list[bytes]:
    """List like the kernel does when each reply takes ``reply`` entries and its caller's buffer
    only ``consume`` of them: the next request starts at the offset of the last one consumed."""
    fh = await ops.opendir(inode)
    names: list[bytes] = []
    off = 0
    while True:
        got: list[tuple[bytes, int]] = []

        def emit(name: bytes, attrs: object, next_off: int, got: list = got) -> bool:
            if len(got) == reply:
                return False
            got.append((name, next_off))
            return True

        await ops.readdir(fh, off, emit)
        if not got:
            break
        taken = got[:consume]
        names += [n for n, _ in taken]
        off = taken[-1][1]
    await ops.releasedir(fh)
    return names


def test_listing_resumes_inside_the_last_reply_and_overlays_dirty_files(tmp_path: Path) -> None:
    back = tmp_path / "back"
    (back / "d").mkdir(parents=True)
    n = 3 * namespace.READDIR_KEEP + 7
    for i in range(n):
        (back / "d" / f"f{i}").write_bytes(b"")
    state = SimpleNamespace(value="dirty")
    shadow = _Dirty(path=b"d/f3", state=state, inode=0, id=1, in_place=False)
    new = _Dirty(path=b"d/new", state=state, inode=0, id=2, in_place=False)
    ops = _handlers(back, {b"d/f3": shadow, b"d/new": new})
    ops.ns.dirty_attrs = _fake_dirty_attrs(ops)  # type: ignore[method-assign]
    namespace.DirtyFile = _Dirty  # type: ignore[misc,assignment]  # the overlay's isinstance checks
    try:
        async def main() -> list[bytes]:
            d = await ops.lookup(ROOT, b"d")
            return await _list(ops, d.st_ino, reply=25, consume=11)

        names = trio.run(main)
    finally:
        from tierfs.writeback.manager import DirtyFile
        namespace.DirtyFile = DirtyFile  # type: ignore[misc]
    assert len(names) == len(set(names)) == n + 1
    assert set(names) == {b"f%d" % i for i in range(n)} | {b"new"}
    assert ops.readdir_held_max <= namespace.READDIR_KEEP + namespace.READDIR_BATCH + 1


def _fake_dirty_attrs(ops: Handlers):  # type: ignore[no-untyped-def]
    from tierfs.fs.api import Attr

    async def dirty_attrs(entry, df):  # type: ignore[no-untyped-def]
        return Attr(st_ino=entry.inode, st_mode=0o100644)
    return dirty_attrs


def test_rewind_lists_again_and_seek_back_rereads(tmp_path: Path) -> None:
    back = tmp_path / "back"
    back.mkdir()
    n = namespace.READDIR_KEEP + 2 * namespace.READDIR_BATCH
    for i in range(n):
        (back / f"f{i}").write_bytes(b"")
    ops = _handlers(back, {})

    async def main() -> None:
        fh = await ops.opendir(ROOT)
        seen: list[tuple[bytes, int]] = []

        def take_all(name: bytes, attrs: object, next_off: int) -> bool:
            seen.append((name, next_off))
            return True

        await ops.readdir(fh, 0, take_all)
        assert len(seen) == n
        order = [name for name, _ in seen]
        # seekdir to an early position, long out of the kept window: read again up to it
        seen.clear()
        await ops.readdir(fh, 5, take_all)
        assert [name for name, _ in seen] == order[5:]
        (back / "late").write_bytes(b"")  # rewinddir shows entries made since
        seen.clear()
        await ops.readdir(fh, 0, take_all)
        assert sorted(name for name, _ in seen) == sorted([*order, b"late"])
        await ops.releasedir(fh)

    trio.run(main)


@needs_fuse
@pytest.mark.fuse
@pytest.mark.slow
def test_hundred_thousand_entries_list_whole_with_bounded_memory(tiermount, tmp_path: Path,
                                                                  scale_loop_bound: int) -> None:
    d = tmp_path / "back" / "big"
    d.mkdir(parents=True)
    n = 100_000
    for i in range(n):
        os.close(os.open(d / f"entry-{i:06d}", os.O_CREAT | os.O_WRONLY, 0o644))
    m = tiermount(ram="16MiB")
    names = os.listdir(m.mnt / "big")
    assert len(names) == n
    assert set(names) == {f"entry-{i:06d}" for i in range(n)}
    held = json.loads((m.mnt / ".tierfs" / "stats.json").read_bytes())["fuse"]["readdir_entries_held_max"]
    assert 0 < held <= namespace.READDIR_KEEP + namespace.READDIR_BATCH
