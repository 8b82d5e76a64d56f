"""A read-only mount whose opens the kernel answers (``ro``, native transport): another user
still cannot open a file its modes forbid (the kernel checks them at the open, with no request:
``default_permissions``), reads what they allow, and gets the control files rendered for it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


@pytest.mark.native_only
def test_another_user_on_a_read_only_mount_reads_only_what_modes_allow(secmount, attacker, shared_dir: Path,
                                                                        transport: str) -> None:
    back = shared_dir / "back"
    (back / "secret").write_bytes(b"root only\n")
    os.chmod(back / "secret", 0o600)
    (back / "public").write_bytes(b"for all\n")
    os.chmod(back / "public", 0o644)
    m = secmount(allow_other=True, ssd=None, extra=("-o", "ro"))
    # root reads the secret first: its implicit read handle exists when the attacker tries
    assert (m.mnt / "secret").read_bytes() == b"root only\n"
    assert m.stats()["fuse"]["kernel_opens"] is True
    code = ("import json,sys,os\n"
            "m=sys.argv[1]\n"
            "try:\n open(m+'/secret','rb').read(); print('READ SECRET')\n"
            "except PermissionError: print('denied')\n"
            "print(open(m+'/public','rb').read().decode().strip())\n"
            "for _ in range(20): d=json.loads(open(m+'/.tierfs/stats.json','rb').read())\n"
            "print(d['fuse']['read_only'])\n"
            "try:\n open(m+'/public','r+b'); print('OPENED FOR WRITING')\n"
            "except OSError as e: print(e.errno)\n")
    r = attacker.py(code, str(m.mnt))
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().split() == ["denied", "for", "all", "True", "30"]  # 30: EROFS
    assert json.loads((m.mnt / ".tierfs" / "stats.json").read_bytes())["fuse"]["read_only"] is True


def test_control_files_on_kernel_opens_show_every_user_one_rendering_never_roots() -> None:
    """The kernel keeps one page cache per file for all users: a rendering per caller gave one
    user another's (root's view, with the paths of quarantined files, to any user) and tore
    each other's JSON. In-process: every caller, root included, gets the view of a user other
    than root, the size it announced matches what it reads."""
    from tierfs.fs.control import SHARED_VIEW_UID, ControlPlane
    from tierfs.fs.handles import HandleTable

    seen = []

    def render(uid: int) -> bytes:
        seen.append(uid)
        return b'{"secret": "root only"}\n' if uid == 0 else b'{}\n'

    cp = ControlPlane({"stats.json": render})
    inode = cp.by_name[b"stats.json"].inode
    cp.kernel_opens = True
    a = cp.attrs(inode, 60.0, uid=0)  # root asks first
    assert a.attr_timeout == 0.0 and a.st_size == len(b"{}\n")
    assert cp.read_rendered(inode, 1000, 0, 4096) == b"{}\n"  # then another user reads
    assert cp.read_rendered(inode, 0, 0, 4096) == b"{}\n"
    assert set(seen) == {SHARED_VIEW_UID}
    # without kernel opens each open gets its own snapshot, root's with its details
    cp.kernel_opens = False
    r = cp.open(inode, type("C", (), {"uid": 0, "gid": 0, "pid": 1})(), HandleTable())
    assert r.direct_io
