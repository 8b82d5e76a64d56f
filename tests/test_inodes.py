"""The inode table in-process: its path index agrees with the entries, and the per-name
operations (unlink, rename of a file, "who holds this name") do not walk every inode the kernel
holds (they did: ``rm -rf`` of 40,000 files cost 40,000^2 comparisons)."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.backing_tree import BackingTree
from tierfs.fs.inodes import InodeTable


class _NoScan(dict):  # type: ignore[type-arg]
    """A ``by_inode`` that fails a walk over it (look-ups by key stay allowed)."""

    armed = False

    def _walk(self):  # type: ignore[no-untyped-def]
        if self.armed:
            raise AssertionError("walked every inode")

    def values(self):  # type: ignore[no-untyped-def,override]
        self._walk()
        return super().values()

    def items(self):  # type: ignore[no-untyped-def,override]
        self._walk()
        return super().items()

    def __iter__(self):  # type: ignore[no-untyped-def]
        self._walk()
        return super().__iter__()


def _table(tmp_path, n: int) -> tuple[InodeTable, list[bytes]]:
    back = tmp_path / "back"
    (back / "d").mkdir(parents=True)
    names = []
    for i in range(n):
        (back / "d" / f"f{i}").write_bytes(b"x")
        names.append(b"d/f%d" % i)
    table = InodeTable(BackingTree(os.fsencode(back)))
    tree = table.tree
    table.remember(b"d", tree.lstat(b"d"))
    for p in names:
        table.remember(p, tree.lstat(p))
    guarded = _NoScan(table.by_inode)
    table.by_inode = guarded
    guarded.armed = True
    return table, names


def test_unlink_and_file_rename_do_not_walk_the_table(tmp_path):
    table, names = _table(tmp_path, 50)
    for p in names[:25]:
        assert [e.path for e in table.at_path(p)] == [p]
        assert len(table.naming(p)) == 1
        table.detach(p)
        assert table.at_path(p) == []
    for p in names[25:]:
        table.rename(p, p + b".moved", subtree=False)
        assert [e.path for e in table.naming(p + b".moved")] == [p + b".moved"]
        assert table.naming(p) == []


def test_directory_rename_moves_the_paths_beneath(tmp_path):
    table, names = _table(tmp_path, 5)
    table.by_inode.armed = False  # type: ignore[attr-defined]
    table.rename(b"d", b"e")
    assert sorted(e.path for e in table.by_inode.values() if e.path) == sorted(
        [b"e"] + [b"e/" + p[2:] for p in names])
    assert table.naming(b"d") == [] and len(table.naming(b"e")) == 1


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["remember", "forget", "detach", "rename",
                                                "rename_dir", "reattach"]),
                              st.integers(0, 5), st.integers(0, 5)), max_size=40))
def test_path_index_matches_a_scan(tmp_path_factory, ops):
    """Whatever the sequence of operations, the index answers what a scan of the live entries
    would (the behaviour before the index existed)."""
    back = tmp_path_factory.mktemp("back")
    for i in range(6):
        os.makedirs(back / f"d{i}", exist_ok=True)
        (back / f"d{i}" / "f").write_bytes(b"x")
    table = InodeTable(BackingTree(os.fsencode(back)))
    detached: list = []
    paths = [b"d%d" % i for i in range(6)] + [b"d%d/f" % i for i in range(6)]
    for op, a, b in ops:
        if op == "remember":
            p = paths[a + 6 * (b % 2)]
            try:
                table.remember(p, table.tree.lstat(p))
            except OSError:
                pass
        elif op == "forget":
            live = sorted(i for i in table.by_inode if i != 1)
            if live:
                table.forget(live[a % len(live)], 1)
        elif op == "detach":
            detached.append((paths[a + 6], table.naming(paths[a + 6])))
            table.detach(paths[a + 6])
        elif op == "rename":
            table.rename(paths[a + 6], paths[b + 6], subtree=False)
        elif op == "rename_dir":
            table.rename(paths[a], paths[b])
        elif op == "reattach" and detached:
            p, ents = detached.pop()
            table.reattach(p, ents)
        for p in set(paths) | {e.path for e in table.by_inode.values() if e.path is not None}:
            scan = [e for e in table.by_inode.values() if e.path == p]
            assert sorted(map(id, table.naming(p))) == sorted(map(id, scan))
            assert sorted(map(id, table.at_path(p))) == sorted(
                id(e) for e in scan if e.lookups > 0)
    assert table.paths_held() <= len(table.by_inode)


def test_a_backing_number_reused_behind_our_back_gets_a_new_inode(tmp_path):
    """A name replaced behind tierfs' back, then the old object's number reused by a new file
    (the filesystem recycles numbers), while the kernel still holds the old inode: the new file
    gets an inode of its own, never the old one (which served it the old name's content). A
    file renamed behind our back keeps its inode; a hard link keeps one inode."""
    back = tmp_path / "back"
    back.mkdir()
    (back / "a").write_bytes(b"A-v1")
    table = InodeTable(BackingTree(os.fsencode(back)))
    tree = table.tree
    old = table.remember(b"a", tree.lstat(b"a"))
    a_v1 = tree.lstat(b"a")
    # "a" replaced by a rename; then a new file "b" turns up with a-v1's (dev, ino)
    (back / "a.tmp").write_bytes(b"A-v2")
    os.rename(back / "a.tmp", back / "a")
    (back / "b").write_bytes(b"B")
    new = table.remember(b"b", a_v1)  # as if the filesystem gave b a-v1's number
    assert new is not old and new.inode != old.inode and new.path == b"b"
    assert old.path == b"a"  # an open of the old inode finds the new a there (ESTALE, relookup)
    assert table.by_dev_ino[(a_v1.st_dev, a_v1.st_ino)] is new
    assert table.get(old.inode) is old  # the kernel still holds it: still served to its handles

    # renamed behind our back (nothing at the old name): the same inode, under the new name (a
    # directory's open descriptors keep working; its st_ino does not change)
    (back / "c").write_bytes(b"C")
    c = table.remember(b"c", tree.lstat(b"c"))
    os.rename(back / "c", back / "c2")
    assert table.remember(b"c2", tree.lstat(b"c2")) is c and c.path == b"c2"

    # two names swapped behind our back: each object its own inode again
    (back / "s").write_bytes(b"S")
    (back / "t").write_bytes(b"T")
    s_, t_ = table.remember(b"s", tree.lstat(b"s")), table.remember(b"t", tree.lstat(b"t"))
    os.rename(back / "s", back / "x")
    os.rename(back / "t", back / "s")
    os.rename(back / "x", back / "t")
    assert table.remember(b"t", tree.lstat(b"t")) is not s_
    assert table.remember(b"s", tree.lstat(b"s")) is not t_

    # a hard link: one inode, two names
    (back / "h").write_bytes(b"H")
    h = table.remember(b"h", tree.lstat(b"h"))
    os.link(back / "h", back / "h2")
    assert table.remember(b"h2", tree.lstat(b"h2")) is h
