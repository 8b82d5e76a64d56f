"""Where a kept passthrough copy keeps its descriptor (Handlers._keep_descriptor), in-process.

A small file's tier copy stays leased after its last close, for the next open. It keeps its
descriptor while fewer than ``kept_fds_max`` kept copies hold one; beyond that a RAM tier copy
parks (its descriptor closed, reopened at its next open) and a copy in another tier takes the
slot of the least recently closed RAM copy holding one, which parks; with none of those it is
not kept. (Through a real mount, within the budget: tests/test_native_mount.py,
``-k kept_registrations``; parking itself: tests/test_lease.py.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.test_writeback_inprocess import Disks, instance
from tierfs.fs.handlers import Handlers, _TierPassthrough
from tierfs.fs.inodes import InodeTable
from tierfs.io import Device


class _Cache(SimpleNamespace):
    """The cache's side: RAM tier leases park (the keeper alone holds them here)."""

    def __init__(self) -> None:
        super().__init__(filling=set(), scheduler=SimpleNamespace(cancel_speculative=lambda key: None))
        self.parked: list[str] = []
        self.unkept: list[str] = []

    def parks(self, lkey: tuple[str, str, str]) -> bool:
        return lkey[1] == "ram"

    def park_kept(self, lkey: tuple[str, str, str]) -> bool:
        if not self.parks(lkey):
            return False
        self.parked.append(lkey[2])
        return True

    def unkeep(self, key: str) -> None:
        self.unkept.append(key)


class _Keeper:
    def __init__(self) -> None:
        self.released = False

    def release(self) -> None:
        self.released = True


def _closed(ops: Handlers, inode: int, tier: str) -> _TierPassthrough:
    """The last open of ``inode`` (a copy in ``tier``) closes, with a keeper: what
    :meth:`Handlers._tier_lease_released` makes of it."""
    tp = _TierPassthrough(("tier", tier, f"k{inode}"), f"k{inode}", fd=100 + inode, handles=1, keeper=_Keeper())  # type: ignore[arg-type]
    ops.tier_passthrough[inode] = tp
    ops._tier_lease_released(inode, tp)
    return tp


async def test_kept_copies_hold_descriptors_up_to_the_budget_then_ram_copies_park(tmp_path: Path) -> None:
    disks = Disks(tmp_path / "d")
    async with instance(disks, deadline_s=3600) as wb:
        cache = _Cache()
        ops = Handlers(tree=wb.tree, inodes=InodeTable(wb.tree), cache=cache, writeback=wb,  # type: ignore[arg-type]
                       readahead=SimpleNamespace(), control=SimpleNamespace(by_inode={}),  # type: ignore[arg-type]
                       meta=Device("meta", 2), attr_timeout=60.0)
        ended: list[int] = []
        ops.on_passthrough_end = ended.append
        ops.kept_fds_max = 2

        a, b = _closed(ops, 1, "ram"), _closed(ops, 2, "ram")  # within the budget: descriptors kept
        assert a.holds_fd and b.holds_fd and a.fd == 101 and ops.kept_fds == 2 and cache.parked == []
        c = _closed(ops, 3, "ram")  # beyond it: a RAM copy parks
        assert not c.holds_fd and c.fd == -1 and cache.parked == ["k3"] and ops.kept_fds == 2
        assert list(ops.kept_passthrough) == [1, 2, 3]

        s = _closed(ops, 4, "ssd")  # cannot park: takes the oldest RAM copy's slot, which parks
        assert s.holds_fd and s.fd == 104 and ops.kept_fds == 2
        assert not a.holds_fd and a.fd == -1 and cache.parked == ["k3", "k1"]
        assert 1 in ops.kept_passthrough and not a.keeper.released  # type: ignore[union-attr]

        ops._unkept(2, b)  # the next open reuses b: its slot is free again
        assert ops.kept_fds == 1
        ops.tier_passthrough[2] = b
        b.handles = 1
        ops._tier_lease_released(2, b)  # closed again: a descriptor, within the budget
        assert b.holds_fd and ops.kept_fds == 2

        t = _closed(ops, 5, "ssd")  # the RAM copy b holds the last slot: it yields too
        assert t.holds_fd and not b.holds_fd and b.fd == -1 and ops.kept_fds == 2
        u = _closed(ops, 6, "ssd")  # no RAM copy holds one: not kept, its passthrough ends
        assert not u.holds_fd and 6 not in ops.kept_passthrough and u.keeper is None
        assert ended == [6] and cache.unkept == ["k6"] and ops.kept_fds == 2
        assert ops.kept_fds == sum(tp.holds_fd for tp in ops.kept_passthrough.values())
