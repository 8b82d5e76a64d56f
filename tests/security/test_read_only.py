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
