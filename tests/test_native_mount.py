"""The native transport against the real kernel: passthrough of resident and written files, the
rule of one backing id per inode, interrupts, and what the daemon never sees.

Runs only where the native transport can (root, /dev/fuse; passthrough tests also need a kernel
that offers it: Linux 6.9+)."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trio

from tests.conftest import Mount, needs_fuse, tierfs_cmd, write_random
from tierfs.fs.api import Attr, FuseError, OpenReply
from tierfs.transport import native

pytestmark = [needs_fuse, pytest.mark.native_only]
MiB = 1 << 20


def transport_stats(m: Mount) -> dict:
    return m.stats()["transport"]


def needs_passthrough(m: Mount) -> None:
    t = transport_stats(m)
    assert t["name"] == "native"
    if not t["passthrough"]:
        pytest.skip(f"no kernel passthrough here: {t['why']}")


def make_resident(m: Mount, rel: str, size: int, deadline_s: float = 30) -> None:
    """Read ``rel`` through the mount until ``tierfs where`` shows all of it in the RAM tier
    (placement runs in the background after a read)."""
    end = time.monotonic() + deadline_s
    while True:
        (m.mnt / rel).read_bytes()
        r = tierfs_cmd("where", str(m.mnt / rel), "--json")
        if json.loads(r.stdout)[0]["resident_bytes"].get("ram", 0) == size:
            return
        assert time.monotonic() < end, f"{rel} not wholly resident after {deadline_s}s"


def wait_for(pred, what: str, deadline_s: float = 60) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + deadline_s
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def nm(tiermount, transport: str) -> Mount:  # type: ignore[no-untyped-def]
    m = tiermount(ram="128MiB", extra=("--transport", "native", "-o", "passthrough=on"))
    needs_passthrough(m)
    return m


def test_resident_read_passes_through_and_the_daemon_sees_no_read(nm: Mount) -> None:
    data = write_random(nm.backing / "f", 6 * MiB + 123)
    make_resident(nm, "f", len(data))
    before = nm.stats()
    assert (nm.mnt / "f").read_bytes() == data
    after = nm.stats()
    assert after["fuse"]["read_requests"] == before["fuse"]["read_requests"]
    t0, t1 = before["transport"], after["transport"]
    assert t1["passthrough_opens"] == t0["passthrough_opens"] + 1
    assert t1["passthrough_opens_by_tier"]["ram"] >= 1 and t1["backing_ids"] == 0


def test_numpy_mmap_r_and_torch_load_mmap_pass_through(nm: Mount) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    a = np.arange(2 * MiB, dtype=np.float32)
    np.save(nm.backing / "a.npy", a)
    sd = {"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(7)}
    torch.save(sd, nm.backing / "m.pt")
    for rel in ("a.npy", "m.pt"):
        make_resident(nm, rel, (nm.backing / rel).stat().st_size)
    before = nm.stats()["transport"]["passthrough_opens"]
    b = np.load(nm.mnt / "a.npy", mmap_mode="r")
    assert (b == a).all()
    got = torch.load(nm.mnt / "m.pt", mmap=True, weights_only=True)
    assert torch.equal(got["w"], sd["w"]) and torch.equal(got["b"], sd["b"])
    assert nm.stats()["transport"]["passthrough_opens"] >= before + 2
    del b, got


def test_memmap_r_plus_of_a_written_file_and_write_back(nm: Mount) -> None:
    np = pytest.importorskip("numpy")
    with open(nm.mnt / "w.npy", "wb") as f:  # held open: the file stays dirty, in the write tier
        np.save(f, np.zeros(MiB, dtype=np.int32))
        f.flush()
        reader = np.load(nm.mnt / "w.npy", mmap_mode="r")
        mm = np.load(nm.mnt / "w.npy", mmap_mode="r+")
        mm[::4096] = 7
        mm.flush()
        assert int(reader[4096]) == 7  # two handles see each other's writes
        del mm, reader
    t = nm.stats()["transport"]
    assert t["passthrough_opens"] >= 3 and t["passthrough_conflicts"] == 0
    want = np.zeros(MiB, dtype=np.int32)
    want[::4096] = 7
    mm = np.memmap(nm.mnt / "w.npy", mode="r+", dtype=np.int32, offset=128)  # again, written back or not
    mm[1] = 9
    mm.flush()
    del mm
    want[1] = 9
    assert (np.load(nm.mnt / "w.npy") == want).all()
    tierfs_cmd("flush", str(nm.mnt))
    wait_for(lambda: (np.load(nm.backing / "w.npy") == want).all(), "write-back of w.npy")


def test_passthrough_writer_size_visible_to_another_process_and_written_back(nm: Mount) -> None:
    data = os.urandom(3 * MiB + 5)
    tmp = nm.mnt / "ck.pt.tmp"
    with open(tmp, "wb") as f:  # as torch.save does: a temp name, then os.replace
        f.write(data[:MiB])
        f.flush()
        out = subprocess.run([sys.executable, "-c", f"import os; print(os.stat({str(tmp)!r}).st_size)"],
                             capture_output=True, text=True, check=True)
        assert int(out.stdout) == MiB
        f.write(data[MiB:])
    os.replace(tmp, nm.mnt / "ck.pt")
    assert (nm.mnt / "ck.pt").stat().st_size == len(data)
    s = nm.stats()
    assert s["transport"]["passthrough_opens"] >= 1 and s["fuse"]["write_requests"] == 0
    assert (nm.mnt / "ck.pt").read_bytes() == data
    tierfs_cmd("flush", str(nm.mnt))
    wait_for(lambda: (nm.backing / "ck.pt").exists() and (nm.backing / "ck.pt").read_bytes() == data,
             "write-back of ck.pt")



def test_passthrough_writes_send_the_daemon_no_request_per_write(nm: Mount) -> None:
    """Without FUSE_HANDLE_KILLPRIV_V2 the kernel asked the daemon for security.capability
    before every write(2) of a passthrough file (to drop file capabilities): a round trip per
    write, which held dd of 64 KiB blocks to 0.5 GB/s on tmpfs. Now it asks once per file."""
    t = transport_stats(nm)
    needs_passthrough(nm)
    assert "handle_killpriv_v2" in t["negotiated"].split()
    before = t["requests_by_opcode"]
    n = 500
    with open(nm.mnt / "many-writes", "wb", buffering=0) as f:
        for i in range(n):
            f.write(i.to_bytes(4, "little") * 1024)
    after = transport_stats(nm)["requests_by_opcode"]
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    assert grew.get("write", 0) == 0 and grew.get("getxattr", 0) <= 2, grew
    assert sum(grew.values()) < 20, grew
    got = (nm.mnt / "many-writes").read_bytes()
    assert len(got) == n * 4096 and got[-4096:] == (n - 1).to_bytes(4, "little") * 1024

def test_a_readers_release_is_done_as_the_request_is_read(nm: Mount) -> None:
    """The close of a file opened for reading with no dirty copy (every file of a small-file
    epoch) is done as its RELEASE is read, with no task; a writer's goes through its handler
    (it waits for the write-back's bookkeeping). Either way the file's open state is given
    back: its backing file is closed, and it opens again for writing and for reading."""
    (nm.backing / "r.bin").write_bytes(b"r" * 5000)
    before = transport_stats(nm)
    for _ in range(20):
        assert (nm.mnt / "r.bin").read_bytes() == b"r" * 5000
    mid = transport_stats(nm)
    assert mid["releases_answered_at_once"] - before["releases_answered_at_once"] >= 20
    with open(nm.mnt / "r.bin", "r+b") as f:
        f.write(b"w")
    after = transport_stats(nm)
    assert after["releases_answered_at_once"] == mid["releases_answered_at_once"]
    assert (nm.mnt / "r.bin").read_bytes() == b"w" + b"r" * 4999
    deadline = time.monotonic() + 20  # (a tier fill after the last close may hold it a moment)
    while nm.stats()["open_files"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert nm.stats()["open_files"] == 0


def test_the_getattr_after_an_open_is_answered_as_the_request_is_read(nm: Mount) -> None:
    """The fstat a program makes right after its open(2) reaches the daemon as a GETATTR (the
    passthrough reads before marked the atime stale): answered from the open's own fstat of the
    backing file with no task, and right (a change behind tierfs' back shows at the next
    open: docs/architecture.md, "Kernel caching")."""
    names = [f"g{i}.bin" for i in range(20)]
    for n in names:
        (nm.backing / n).write_bytes(n.encode() * 700)
    before = transport_stats(nm)["getattrs_answered_at_once"]
    # from the second epoch on, the opens' fstats are sent (the reads before marked the atime
    # stale) once the files pass through to their tier copies (filled after their first close)
    for _epoch in range(6):
        for n in names:
            with open(nm.mnt / n, "rb") as f:
                assert os.fstat(f.fileno()).st_size == len(n) * 700
                assert f.read() == n.encode() * 700
        if transport_stats(nm)["getattrs_answered_at_once"] - before >= 10:
            break
    assert transport_stats(nm)["getattrs_answered_at_once"] - before >= 10
    p = nm.backing / names[0]
    p.write_bytes(b"h" * 9000)  # behind tierfs' back
    with open(nm.mnt / names[0], "rb") as f:
        assert os.fstat(f.fileno()).st_size == 9000
        assert f.read() == b"h" * 9000


def test_a_new_files_capability_is_answered_as_the_request_is_read(nm: Mount) -> None:
    """The kernel asks for security.capability before the first write and each change of owner
    of a file (tar -x: twice per file): for a file tierfs created, which has none, it is
    answered with no task; once one is set, the handler reads it."""
    f = nm.mnt / "caps.bin"
    before = transport_stats(nm)["getxattrs_answered_at_once"]
    f.write_bytes(b"x" * 100)
    with pytest.raises(OSError) as e:
        os.getxattr(f, "security.capability")
    assert e.value.errno == errno.ENODATA
    assert transport_stats(nm)["getxattrs_answered_at_once"] - before >= 2  # the write's, and ours
    value = struct.pack("<IIIII", 0x02000000, 1 << 10, 0, 0, 0)  # cap_net_bind_service
    os.setxattr(f, "security.capability", value)
    mid = transport_stats(nm)["getxattrs_answered_at_once"]
    assert os.getxattr(f, "security.capability") == value
    assert transport_stats(nm)["getxattrs_answered_at_once"] == mid
    with pytest.raises(OSError) as e:
        os.getxattr(f, "user.none")
    assert e.value.errno == errno.ENODATA


def test_ten_thousand_concurrent_opens_share_one_backing_id(nm: Mount) -> None:
    data = write_random(nm.backing / "many", MiB)
    make_resident(nm, "many", len(data))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    n = 10_000
    if hard < n + 500:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {n + 500}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, n + 500), hard))
    fds: list[int] = []
    try:
        for _ in range(n):
            fds.append(os.open(nm.mnt / "many", os.O_RDONLY))
        t = nm.stats()["transport"]
        assert t["backing_ids"] == 1 and t["passthrough_conflicts"] == 0
        assert os.pread(fds[-1], 100, 5000) == data[5000:5100]
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    wait_for(lambda: nm.stats()["transport"]["backing_ids"] == 0, "the last release")


def test_kept_registrations_of_ram_copies_keep_their_descriptor_within_the_budget(nm: Mount) -> None:
    """A RAM-tier copy kept registered after its last close keeps its descriptor in the daemon
    while fewer than an eighth of the descriptor limit are held, so the next open reuses the
    registration without opening the tier file again (no reopen of a parked copy: beyond the
    budget, tests/test_kept_descriptors.py). The bytes are the file's, and a kept copy still
    yields to eviction."""
    n = 150
    files = {f"s{i:03d}": write_random(nm.backing / f"s{i:03d}", 20 * 1024 + i, seed=i) for i in range(n)}
    paths = [str(nm.mnt / name) for name in files]

    def all_resident() -> bool:
        for name in files:
            (nm.mnt / name).read_bytes()
        r = tierfs_cmd("where", *paths, "--json")
        return all(w["resident_bytes"].get("ram", 0) == len(files[Path(w["path"]).name])
                   for w in json.loads(r.stdout))

    wait_for(all_resident, "every file in the RAM tier")
    for name, data in files.items():  # passes through: kept at its close
        assert (nm.mnt / name).read_bytes() == data
    s = nm.stats()  # (the descriptors themselves: tests/test_lease.py, in-process)
    assert s["fuse"]["kept_passthrough"] == n and s["fuse"]["kept_passthrough_fds"] == n
    t0 = transport_stats(nm)
    for name, data in files.items():
        assert (nm.mnt / name).read_bytes() == data
    t1 = transport_stats(nm)
    assert t1["kept_backing_reuses"] == t0["kept_backing_reuses"] + n
    assert t1["backing_registrations"] == t0["backing_registrations"]
    s1 = nm.stats()
    assert s1["fuse"]["kept_passthrough_reuses"] >= s["fuse"]["kept_passthrough_reuses"] + n
    assert s1["fuse"]["kept_passthrough_reopens"] == s["fuse"]["kept_passthrough_reopens"]
    tierfs_cmd("evict", paths[0])  # a kept lease yields to eviction (its descriptor closed)
    s2 = nm.stats()
    assert s2["fuse"]["kept_passthrough"] == n - 1 and s2["fuse"]["kept_passthrough_fds"] == n - 1
    assert (nm.mnt / "s000").read_bytes() == files["s000"]


def test_small_resident_file_keeps_its_registration_between_opens(nm: Mount) -> None:
    """A small file read over and over (a small-file epoch) keeps its tier copy leased and its
    backing id registered after its last close: the next open costs no tier open and no
    FUSE_DEV_IOC_BACKING_OPEN. What is kept never outlives what it stands for: a change behind
    tierfs' back, a writer and ``tierfs evict`` each let it go, and every read sees the file."""
    data = write_random(nm.backing / "img.jpg", 200 * 1024)
    make_resident(nm, "img.jpg", len(data))
    assert (nm.mnt / "img.jpg").read_bytes() == data  # the first open that passes through
    t0 = transport_stats(nm)
    for _ in range(3):
        assert (nm.mnt / "img.jpg").read_bytes() == data
    s = nm.stats()
    t1 = s["transport"]
    assert t1["backing_registrations"] == t0["backing_registrations"]
    assert t1["kept_backing_reuses"] == t0["kept_backing_reuses"] + 3
    assert t1["kept_backing_ids"] == 1 and t1["backing_ids"] == 0 and s["fuse"]["kept_passthrough"] == 1
    assert s["fuse"]["kept_passthrough_reuses"] >= 3

    # changed behind tierfs' back: the next open reads the new bytes (not the kept copy)
    new = bytes(b ^ 0xFF for b in data[:4096]) + data[4096:]
    (nm.backing / "img.jpg").write_bytes(new)
    os.utime(nm.backing / "img.jpg", ns=(time.time_ns(), time.time_ns() + 10**9))
    assert (nm.mnt / "img.jpg").read_bytes() == new
    make_resident(nm, "img.jpg", len(new))
    assert (nm.mnt / "img.jpg").read_bytes() == new

    # a writer: its bytes are what the next reader sees
    with open(nm.mnt / "img.jpg", "r+b") as w:
        w.write(b"written")
    assert (nm.mnt / "img.jpg").read_bytes() == b"written" + new[7:]
    wait_for(lambda: (nm.backing / "img.jpg").read_bytes()[:7] == b"written", "write-back of img.jpg")

    # evicted: the kept lease and registration go with it
    data2 = write_random(nm.backing / "b.jpg", 100 * 1024, seed=2)
    make_resident(nm, "b.jpg", len(data2))
    assert (nm.mnt / "b.jpg").read_bytes() == data2
    kept = nm.stats()["fuse"]["kept_passthrough"]
    assert kept >= 1
    tierfs_cmd("evict", str(nm.mnt / "b.jpg"))
    assert nm.stats()["fuse"]["kept_passthrough"] == kept - 1
    r = tierfs_cmd("where", str(nm.mnt / "b.jpg"), "--json")
    assert json.loads(r.stdout)[0]["resident_bytes"].get("ram", 0) == 0
    assert (nm.mnt / "b.jpg").read_bytes() == data2


def test_an_open_of_a_kept_copy_is_answered_at_once_and_sees_changes_behind_tierfs(nm: Mount) -> None:
    """A reader's open of a file no handle has open, whose tier copy is kept registered since
    its last close, is answered as the transport reads it (Handlers.open_now): the open of
    every file of a small-file epoch after the first. It still opens and compares the backing
    file, so what a change behind tierfs' back does is seen at that open, as before: new bytes
    of the same size with the mtime put back, and a removal (ENOENT, not the kept copy)."""
    data = write_random(nm.backing / "k.jpg", 120 * 1024, seed=7)
    make_resident(nm, "k.jpg", len(data))
    assert (nm.mnt / "k.jpg").read_bytes() == data  # passes through: kept at its close
    t0 = transport_stats(nm)
    for _ in range(3):
        assert (nm.mnt / "k.jpg").read_bytes() == data
    t1 = transport_stats(nm)
    assert t1["opens_answered_at_once"] == t0["opens_answered_at_once"] + 3
    assert t1["kept_backing_reuses"] == t0["kept_backing_reuses"] + 3

    with open(nm.mnt / "k.jpg", "rb") as held:  # (at once); open now: the next is the handler's
        assert (nm.mnt / "k.jpg").read_bytes() == data
        assert transport_stats(nm)["opens_answered_at_once"] == t1["opens_answered_at_once"] + 1
        assert held.read() == data

    st = os.stat(nm.backing / "k.jpg")
    new = bytes(b ^ 0x5A for b in data[:8192]) + data[8192:]
    (nm.backing / "k.jpg").write_bytes(new)  # same inode, same size
    os.utime(nm.backing / "k.jpg", ns=(st.st_atime_ns, st.st_mtime_ns))  # (its ctime moved)
    assert (nm.mnt / "k.jpg").read_bytes() == new

    make_resident(nm, "k.jpg", len(new))
    assert (nm.mnt / "k.jpg").read_bytes() == new  # kept again
    before = transport_stats(nm)["opens_answered_at_once"]
    assert (nm.mnt / "k.jpg").read_bytes() == new
    assert transport_stats(nm)["opens_answered_at_once"] == before + 1
    os.unlink(nm.backing / "k.jpg")
    with pytest.raises(FileNotFoundError):
        (nm.mnt / "k.jpg").read_bytes()


def test_a_directory_changed_moments_ago_is_stat_at_once_and_forgotten_files_with_no_task(nm: Mount) -> None:
    """The GETATTR of a directory whose names a request just changed (the kernel drops its
    attributes at each create or unlink, and its permission check of the next one asks again)
    is answered as the transport reads it, from that request's own fstat of the directory; the
    FORGETs of removed files are done the same way. What the directory shows is its own."""
    d = nm.mnt / "dir"
    d.mkdir()
    t0, f0 = transport_stats(nm), nm.stats()["fuse"]
    for i in range(30):
        (d / f"f{i}").write_bytes(b"x" * 100)
    t1, f1 = transport_stats(nm), nm.stats()["fuse"]
    dir_getattrs = f1["dir_getattrs_from_change"] - f0["dir_getattrs_from_change"]
    assert dir_getattrs >= 20  # (one per create after the first)
    assert t1["getattrs_answered_at_once"] - t0["getattrs_answered_at_once"] >= dir_getattrs
    tierfs_cmd("flush", str(nm.mnt))  # no write-back commits into the directory meanwhile
    for i in range(0, 30, 3):
        os.unlink(d / f"f{i}")
        # the times the mount shows are the backing directory's, after the unlink
        assert os.stat(d).st_mtime_ns == os.stat(nm.backing / "dir").st_mtime_ns
    assert sorted(os.listdir(d)) == sorted(f"f{i}" for i in range(30) if i % 3)
    inodes = nm.stats()["inodes"]
    t2 = transport_stats(nm)
    subprocess.run(["rm", "-rf", str(d)], check=True)
    deadline = time.monotonic() + 10
    while transport_stats(nm)["forgets_done_at_once"] - t2["forgets_done_at_once"] < 15:
        assert time.monotonic() < deadline, transport_stats(nm)
        time.sleep(0.05)
    assert nm.stats()["inodes"] <= inodes - 15
    assert not (nm.backing / "dir").exists()


def test_unlinks_of_clean_names_are_answered_at_once_and_kept_files_go_to_the_handler(nm: Mount) -> None:
    """An UNLINK of a clean name no handle holds is done as the transport reads it
    (Handlers.unlink_now); a file a process holds open goes to the handler, which keeps it
    readable through its descriptor. A hard link unlinked at once leaves the other name whole,
    and the directory shows its backing times after. A file just written through the mount
    (dirty, or written back meanwhile) is gone for good once unlinked, through either path."""
    d = nm.backing / "u"
    d.mkdir()
    (d / "sub").mkdir()
    data = {name: write_random(d / name, 4000, seed=k) for k, name in enumerate(("a", "b", "held"))}
    os.link(d / "a", d / "a2")
    m = nm.mnt / "u"
    assert sorted(os.listdir(m)) == ["a", "a2", "b", "held", "sub"]
    t0 = transport_stats(nm)["unlinks_answered_at_once"]
    os.unlink(m / "a")
    os.unlink(m / "b")
    with pytest.raises(FileNotFoundError):
        os.unlink(m / "missing")
    with pytest.raises(IsADirectoryError):
        os.unlink(m / "sub")
    t1 = transport_stats(nm)["unlinks_answered_at_once"]
    assert t1 - t0 == 2  # (the kernel answers the two errors itself: a negative lookup, a directory)
    assert not (d / "a").exists() and not (d / "b").exists() and (d / "sub").is_dir()
    assert (m / "a2").read_bytes() == data["a"] and os.stat(m / "a2").st_nlink == 1
    assert os.stat(m).st_mtime_ns == os.stat(d).st_mtime_ns
    write_random(d / "behind", 100, seed=9)
    assert os.stat(m / "behind").st_size == 100  # the kernel holds the name now
    os.unlink(d / "behind")  # removed behind tierfs' back: the UNLINK's ENOENT is the store's
    with pytest.raises(FileNotFoundError):
        os.unlink(m / "behind")
    assert transport_stats(nm)["unlinks_answered_at_once"] == t1 + 1
    t1 += 1
    with open(m / "held", "rb") as held:
        os.unlink(m / "held")
        assert transport_stats(nm)["unlinks_answered_at_once"] == t1  # through the handler
        assert held.read() == data["held"]  # the unlinked file stays readable while held
    for i in range(5):
        with open(m / f"new{i}", "wb") as f:
            f.write(b"d" * 3000)
        os.unlink(m / f"new{i}")
    assert sorted(os.listdir(m)) == ["a2", "sub"]
    tierfs_cmd("flush", str(nm.mnt))
    assert sorted(os.listdir(d)) == ["a2", "sub"]
    assert sorted(os.listdir(m)) == ["a2", "sub"]


def test_lookups_are_answered_at_once_and_see_the_backing_store_and_the_write_tier(nm: Mount) -> None:
    """A LOOKUP of a clean name or of a missing one is answered as the transport reads it
    (Handlers.lookup_now); a name a dirty file holds goes to the handler (its data file's
    attributes). What each shows is what the name holds: a file made behind tierfs' back,
    a file written through the mount and not yet written back, a hard link of that file, a
    missing name, a directory."""
    (nm.backing / "d").mkdir()
    write_random(nm.backing / "d" / "behind", 3000, seed=3)
    t0 = transport_stats(nm)["lookups_answered_at_once"]
    assert os.stat(nm.mnt / "d" / "behind").st_size == 3000  # d and behind: at once
    with pytest.raises(FileNotFoundError):
        os.stat(nm.mnt / "d" / "missing")
    t1 = transport_stats(nm)["lookups_answered_at_once"]
    assert t1 - t0 >= 3
    with open(nm.mnt / "d" / "new", "wb") as f:  # its negative lookup at once, then CREATE
        f.write(b"n" * 5000)
    assert transport_stats(nm)["lookups_answered_at_once"] > t1
    assert nm.stats()["writeback"]["dirty_files"] >= 1
    # the kernel forgets the name (drop_caches), and a lookup of it now finds a dirty file
    subprocess.run(["sh", "-c", "echo 2 > /proc/sys/vm/drop_caches"], check=True)
    t2 = transport_stats(nm)["lookups_answered_at_once"]
    assert os.stat(nm.mnt / "d" / "new").st_size == 5000
    assert (nm.mnt / "d" / "new").read_bytes() == b"n" * 5000
    os.link(nm.backing / "d" / "behind", nm.backing / "d" / "linked")  # behind tierfs' back
    assert os.stat(nm.mnt / "d" / "linked").st_ino == os.stat(nm.mnt / "d" / "behind").st_ino
    assert os.stat(nm.mnt / "d").st_nlink >= 2
    assert transport_stats(nm)["lookups_answered_at_once"] > t2  # linked, at least
    assert sorted(os.listdir(nm.mnt / "d")) == ["behind", "linked", "new"]


def test_attribute_changes_of_a_file_being_written_are_answered_at_once_and_reach_the_backing_store(
        nm: Mount) -> None:
    """The chown, chmod and futimens that tar -x makes on each file it creates, while the file
    is dirty in the write tier, are answered as the transport reads them (Handlers.setattr_now):
    each shows at once through the mount, through the descriptor still open and after the
    kernel forgets the name, and the write-back carries them to the backing file. A change of
    one time keeps the other; a mode with set-ID bits and a truncate go to the handler and are
    still right; so does a directory's GETATTR after a change of its names, which these leave
    answered from that change's fstat."""
    t0 = transport_stats(nm)["setattrs_answered_at_once"]
    p = nm.mnt / "f"
    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, b"x" * 5000)
        os.fchown(fd, 1234, 5678)
        os.fchmod(fd, 0o640)
        os.utime(fd, ns=(1_000_000_000_123, 2_000_000_000_456))
        st = os.fstat(fd)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1234, 5678, 0o640)
        assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_000_123, 2_000_000_000_456)
    finally:
        os.close(fd)
    assert transport_stats(nm)["setattrs_answered_at_once"] - t0 == 3
    # only the mtime (touch -m: atime UTIME_OMIT), then only the atime: the other one is kept
    subprocess.run(["touch", "-m", "-d", "@3000", str(p)], check=True)
    subprocess.run(["touch", "-a", "-d", "@4000", str(p)], check=True)
    assert transport_stats(nm)["setattrs_answered_at_once"] - t0 == 5
    assert (os.stat(p).st_mtime, os.stat(p).st_atime) == (3000, 4000)  # (the reply's attributes)
    subprocess.run(["sh", "-c", "echo 2 > /proc/sys/vm/drop_caches"], check=True)
    st = os.stat(p)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777, st.st_size) == (1234, 5678, 0o640, 5000)
    assert st.st_mtime == 3000
    # set-ID bits and a truncate: through the handler, right all the same
    os.chmod(p, 0o4750)
    os.truncate(p, 100)
    assert transport_stats(nm)["setattrs_answered_at_once"] - t0 == 5
    assert os.stat(p).st_mode & 0o7777 == 0o4750 and os.stat(p).st_size == 100
    tierfs_cmd("flush", str(nm.mnt))
    b = os.stat(nm.backing / "f")
    assert (b.st_uid, b.st_gid, b.st_mode & 0o7777, b.st_size) == (1234, 5678, 0o4750, 100)
    # written back (clean): a change goes to the handler and reaches the backing file itself
    t1 = transport_stats(nm)["setattrs_answered_at_once"]
    os.chmod(p, 0o644)
    assert os.stat(nm.backing / "f").st_mode & 0o7777 == 0o644
    assert transport_stats(nm)["setattrs_answered_at_once"] == t1
    # files made as tar -x makes them: their attribute changes leave their directory's
    # GETATTR (the permission check before the next create) answered from the create's fstat
    (nm.mnt / "t").mkdir()
    d0 = nm.stats()["fuse"]["dir_getattrs_from_change"]
    for i in range(10):
        fd = os.open(nm.mnt / "t" / f"m{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, b"m" * 100)
            os.fchown(fd, 1234, 5678)
            os.fchmod(fd, 0o644)
            os.utime(fd, ns=(5_000_000_000, 6_000_000_000))
        finally:
            os.close(fd)
    assert nm.stats()["fuse"]["dir_getattrs_from_change"] - d0 >= 9
    assert transport_stats(nm)["setattrs_answered_at_once"] - t1 >= 30


def test_the_fstat_right_after_an_open_is_answered_by_the_opens_own_fstat(nm: Mount) -> None:
    """Python's open() fstat-s the new descriptor, and after a read passed through to the tier
    file (which marks the atime stale in the kernel) that fstat is a GETATTR: the backing file's
    fstat the OPEN took a moment before answers it, with no metadata call. Those attributes are
    the file's: its size, and a change made through the mount in between is seen."""
    data = write_random(nm.backing / "e.jpg", 150 * 1024)
    make_resident(nm, "e.jpg", len(data))
    before = nm.stats()["fuse"]
    for _ in range(4):
        with open(nm.mnt / "e.jpg", "rb") as f:
            assert os.fstat(f.fileno()).st_size == len(data)
            assert f.read() == data
    after = nm.stats()["fuse"]
    getattrs = after["requests"].get("getattr", 0) - before["requests"].get("getattr", 0)
    assert getattrs >= 3  # the kernel asked (atime stale after each passed-through read)
    assert after["getattrs_from_open"] - before["getattrs_from_open"] >= 3

    # a chmod through the mount between the open and the fstat: the new mode
    fd = os.open(nm.mnt / "e.jpg", os.O_RDONLY)
    try:
        os.chmod(nm.mnt / "e.jpg", 0o600)
        assert os.fstat(fd).st_mode & 0o777 == 0o600
    finally:
        os.close(fd)


def fcntl_accmode(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE


def wb_stats(m: Mount) -> dict:
    return m.stats()["writeback"]


def test_np_load_r_plus_of_a_resident_file_writes_in_place(nm: Mount) -> None:
    """np.load(mmap_mode='r+') holds a read-only open (passed through to the tier copy) while
    it opens the file for writing: the kernel wants one backing file per inode, so the writer
    passes through to the same tier copy and its writes are taken in at close."""
    np = pytest.importorskip("numpy")
    np.save(nm.backing / "r.npy", np.zeros(MiB, dtype=np.int32))
    make_resident(nm, "r.npy", (nm.backing / "r.npy").stat().st_size)
    mm = np.load(nm.mnt / "r.npy", mmap_mode="r+")
    mm[::4096] = 7
    mm.flush()
    del mm
    want = np.zeros(MiB, dtype=np.int32)
    want[::4096] = 7
    assert (np.load(nm.mnt / "r.npy") == want).all()
    s = nm.stats()
    assert s["transport"]["passthrough_conflicts"] == 0
    assert s["writeback"]["in_place_opens"] >= 1 and s["writeback"]["in_place_takes"] >= 1
    tierfs_cmd("flush", str(nm.mnt))
    wait_for(lambda: (np.load(nm.backing / "r.npy") == want).all(), "write-back of r.npy")


def test_writer_beside_tier_copy_readers_writes_in_place(nm: Mount) -> None:
    data = write_random(nm.backing / "ro", MiB)
    make_resident(nm, "ro", len(data))
    extra = os.urandom(100_000)
    with open(nm.mnt / "ro", "rb") as r:
        with open(nm.mnt / "ro", "r+b") as w:
            w.write(b"new")
            w.seek(len(data))
            w.write(extra)  # past the end: the file grows
            w.flush()
            r.seek(0)
            assert r.read(3) == b"new"  # the reader sees the writer's bytes at once
            out = subprocess.run([sys.executable, "-c", f"import os; print(os.stat({str(nm.mnt / 'ro')!r}).st_size)"],
                                 capture_output=True, text=True, check=True)
            assert int(out.stdout) == len(data) + len(extra)  # size right for every process
        want = b"new" + data[3:] + extra
        r.seek(0)
        assert r.read() == want
        assert (nm.mnt / "ro").read_bytes() == want  # another open, while the reader holds it
    assert (nm.mnt / "ro").read_bytes() == want  # after: from the dirty copy
    assert nm.stats()["transport"]["passthrough_conflicts"] == 0
    tierfs_cmd("flush", str(nm.mnt))
    wait_for(lambda: (nm.backing / "ro").read_bytes() == want, "write-back of ro")
    assert (nm.mnt / "ro").read_bytes() == want


def test_truncating_open_beside_tier_copy_readers(nm: Mount) -> None:
    data = write_random(nm.backing / "t", MiB)
    make_resident(nm, "t", len(data))
    with open(nm.mnt / "t", "rb") as r:
        with open(nm.mnt / "t", "wb") as w:  # O_TRUNC: the readers' copy is truncated too
            w.write(b"short")
        r.seek(0)
        assert r.read() == b"short"
        assert os.stat(nm.mnt / "t").st_size == 5
    assert (nm.mnt / "t").read_bytes() == b"short"
    tierfs_cmd("flush", str(nm.mnt))
    wait_for(lambda: (nm.backing / "t").read_bytes() == b"short", "write-back of t")


def test_truncate_by_path_beside_tier_copy_readers(nm: Mount) -> None:
    data = write_random(nm.backing / "p", MiB)
    make_resident(nm, "p", len(data))
    with open(nm.mnt / "p", "rb") as r:
        os.truncate(nm.mnt / "p", 1000)
        r.seek(0)
        assert r.read() == data[:1000]
    assert (nm.mnt / "p").read_bytes() == data[:1000]
    tierfs_cmd("flush", str(nm.mnt))
    wait_for(lambda: (nm.backing / "p").read_bytes() == data[:1000], "write-back of p")


def test_writer_that_writes_nothing_beside_readers_copies_nothing(nm: Mount) -> None:
    """sqlite and np.memmap open O_RDWR to read: no dirty copy, no write-back."""
    data = write_random(nm.backing / "n", MiB)
    mtime = (nm.backing / "n").stat().st_mtime_ns
    make_resident(nm, "n", len(data))
    time.sleep(0.15)  # the tier file's times are then older than a timestamp tick
    with open(nm.mnt / "n", "rb") as r, open(nm.mnt / "n", "r+b") as w:
        assert w.read(10) == data[:10] and r.read(10) == data[:10]
    s = wb_stats(nm)
    assert s["in_place_opens"] == 1 and s["in_place_takes"] == 0
    tierfs_cmd("flush", str(nm.mnt))
    assert (nm.backing / "n").stat().st_mtime_ns == mtime
    assert (nm.mnt / "n").stat().st_mtime_ns == mtime


def test_kill9_while_writing_in_place_serves_the_backing_bytes_after(tiermount, transport: str) -> None:
    """A crash while a writer writes a tier copy in place (not closed: nothing promised) must
    not leave the cache serving those bytes as the backing file's: the SSD tier's chunks are
    checked against their checksums when first read after a restart."""
    m = tiermount(ram="0", ssd="64MiB", extra=("--transport", "native", "-o", "passthrough=on"))
    needs_passthrough(m)
    data = write_random(m.backing / "s", 2 * MiB)
    end = time.monotonic() + 30
    while True:
        (m.mnt / "s").read_bytes()
        r = tierfs_cmd("where", str(m.mnt / "s"), "--json")
        if json.loads(r.stdout)[0]["resident_bytes"].get("ssd", 0) == len(data):
            break
        assert time.monotonic() < end, "s not wholly resident in the SSD tier"
    time.sleep(2.5)  # the SSD catalog is written every 2 s (Cache.run_flusher): it records the chunks
    r = open(m.mnt / "s", "rb")
    w = open(m.mnt / "s", "r+b")
    try:
        assert m.stats()["writeback"]["in_place_opens"] == 1
        w.write(b"X" * 4096)
        w.flush()
        m.kill9()
    finally:
        for f in (r, w):
            try:
                f.close()
            except OSError:
                pass
    m.start()
    assert (m.mnt / "s").read_bytes() == data
    assert m.stats()["cache"]["checksum_failures"] >= 1  # the restored chunk was refused


def test_unknown_opcode_is_enosys_and_the_daemon_lives(nm: Mount) -> None:
    (nm.mnt / "x").write_bytes(b"abc")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(nm.mnt / "x", os.O_RDWR)
    try:
        # FUSE_FALLOCATE is not implemented: ENOSYS, which the kernel reports as EOPNOTSUPP...
        # unless the file is passed through (then the tier file's filesystem does it)
        rc = libc.fallocate(fd, 0x01, ctypes.c_long(0), ctypes.c_long(4096))  # KEEP_SIZE
        assert rc == 0 or ctypes.get_errno() == errno.EOPNOTSUPP
    finally:
        os.close(fd)
    assert (nm.mnt / "x").read_bytes() == b"abc"


# -- interrupts against the real kernel, with a filesystem whose reads hang ---------------------------
class HangingFS:
    """One file, ``hang``, whose every read waits forever (a dead backing store)."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.reading = threading.Event()

    async def lookup(self, parent, name, ctx=None):  # type: ignore[no-untyped-def]
        if name != b"hang":
            raise FuseError(errno.ENOENT)
        return Attr(st_ino=2, st_mode=0o100644, st_nlink=1, st_size=4096, entry_timeout=60, attr_timeout=60)

    async def getattr(self, inode, ctx=None):  # type: ignore[no-untyped-def]
        if inode == 1:
            return Attr(st_ino=1, st_mode=0o40755, st_nlink=2)
        return Attr(st_ino=2, st_mode=0o100644, st_nlink=1, st_size=4096)

    async def open(self, inode, flags, ctx, kill_suidgid=False):  # type: ignore[no-untyped-def]
        # direct I/O: a read is then a request the reader waits on (page-cache readahead is
        # asynchronous in the kernel: a signal does not interrupt it)
        return OpenReply(1, direct_io=True)

    async def lease(self, fh):  # type: ignore[no-untyped-def]
        return None

    async def read(self, fh, off, size):  # type: ignore[no-untyped-def]
        self.reading.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            self.cancelled.set()
            raise
        return b""

    async def release(self, fh):  # type: ignore[no-untyped-def]
        return None

    def release_now(self, fh):  # type: ignore[no-untyped-def]
        return False  # (the transport's fast paths: none here)

    def getattr_now(self, inode):  # type: ignore[no-untyped-def]
        return None

    def forget_now(self, inode, n):  # type: ignore[no-untyped-def]
        return False

    def lookup_now(self, parent, name):  # type: ignore[no-untyped-def]
        return None

    def setattr_now(self, inode, attr):  # type: ignore[no-untyped-def]
        return None

    async def flush(self, fh):  # type: ignore[no-untyped-def]
        return None

    async def forget(self, items):  # type: ignore[no-untyped-def]
        return None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_read_blocked_on_a_hung_backing_read_is_interrupted(tmp_path: Path, transport: str, sig: int) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fs = HangingFS()
    fd, real = native.mount_fuse(str(mnt), fsname="hang", subtype="tierfs-test", allow_other=False)
    s = native.NativeSession(fs, fd, real, want_passthrough=False)  # type: ignore[arg-type]
    token: list = []

    async def serve() -> None:
        token.append(trio.lowlevel.current_trio_token())
        await s.init()
        await s.main()

    t = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    t.start()
    try:
        # SIGINT handled as Python does in a terminal: a test run started as a background job
        # (``make test &``, a script's ``cmd &``) inherits SIGINT ignored, and a Python child
        # then never installs its handler, so the signal never interrupted its read (the
        # reader hung 30 s; the "flake" of full runs started in the background)
        code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                f"open({str(mnt / 'hang')!r}, 'rb').read(10)")
        reader = subprocess.Popen([sys.executable, "-c", code])
        assert fs.reading.wait(30), "the read never reached the filesystem"
        reader.send_signal(sig)
        assert reader.wait(30) != 0  # killed, not stuck in the kernel waiting for the daemon
        assert fs.cancelled.wait(30), "the hung read was not cancelled"
        assert s.interrupted == 1 and s.interrupts >= 1
    finally:
        native.unmount_detach(str(mnt))
        t.join(30)
        s.close(unmount=False)
    assert not t.is_alive()


def test_passthrough_writes_only_leaves_resident_reads_to_the_daemon(tiermount, transport: str) -> None:
    m = tiermount(ram="64MiB", extra=("--transport", "native", "-o", "passthrough=writes"))
    needs_passthrough(m)
    data = write_random(m.backing / "ro", MiB)
    make_resident(m, "ro", len(data))
    with open(m.mnt / "ro", "rb") as r, open(m.mnt / "ro", "r+b") as w:  # no ETXTBSY here
        w.write(b"new")
        w.flush()
        assert r.read(3) == b"new"
    (m.mnt / "ck").write_bytes(b"x" * MiB)  # a written file still passes through
    t = m.stats()["transport"]
    assert t["passthrough_opens_by_tier"] == {"ram": 1} and "written files only" in t["why"]


LMDB_HOLD_READER = """
import lmdb, sys
env = lmdb.open(sys.argv[1], readonly=True, lock=True, subdir=True)
with env.begin() as txn:  # holds its read transaction (and data.mdb open) while the writer runs
    n = sum(1 for _ in txn.cursor())
print(n, flush=True)
sys.stdin.readline()
with env.begin() as txn:
    print(txn.get(b"new").decode(), sum(1 for _ in txn.cursor()), flush=True)
"""


@pytest.mark.parametrize("writemap", [False, True], ids=["pwrite", "writemap"])
def test_lmdb_writer_beside_readers_of_a_resident_database(nm: Mount, writemap: bool) -> None:
    """A clean lmdb database wholly in the RAM tier: a reader process passes through to the
    tier copy; a writer (pwrite, or a shared writable mapping) opens it beside the reader and
    writes the tier copy in place; the reader sees the commit, and the database is written back."""
    lmdb = pytest.importorskip("lmdb")
    db = nm.backing / "db"
    env = lmdb.open(str(db), map_size=16 * MiB)
    with env.begin(write=True) as txn:
        for i in range(500):
            txn.put(b"%06d" % i, bytes([i % 251]) * 1000)
    env.close()
    make_resident(nm, "db/data.mdb", (db / "data.mdb").stat().st_size)
    reader = subprocess.Popen([sys.executable, "-c", LMDB_HOLD_READER, str(nm.mnt / "db")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "500"
        env = lmdb.open(str(nm.mnt / "db"), map_size=16 * MiB, writemap=writemap)
        with env.begin(write=True) as txn:
            txn.put(b"new", b"value")
        env.sync(True)
        env.close()
        reader.stdin.write("\n")
        reader.stdin.flush()
        assert reader.stdout.readline().split() == ["value", "501"]
    finally:
        reader.kill()
        reader.wait()
    s = nm.stats()
    assert s["transport"]["passthrough_conflicts"] == 0 and s["writeback"]["in_place_opens"] >= 1
    tierfs_cmd("flush", str(nm.mnt))
    env = lmdb.open(str(db), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            assert txn.get(b"new") == b"value" and txn.stat()["entries"] == 501
    finally:
        env.close()


# -- misses passed through to the backing file (passthrough_misses, parallel profile) -------------
@pytest.fixture
def bm(tiermount, transport: str) -> Mount:  # type: ignore[no-untyped-def]
    m = tiermount(ram="128MiB", extra=("--transport", "native", "--backing", "parallel"))  # (the default)
    needs_passthrough(m)
    return m


def test_miss_is_read_from_the_backing_file_and_fills_the_tier(bm: Mount) -> None:
    data = write_random(bm.backing / "m", 5 * MiB + 7)
    assert (bm.mnt / "m").read_bytes() == data
    s = bm.stats()
    assert s["fuse"]["read_requests"] == 0 and s["transport"]["passthrough_opens_by_tier"] == {"backing": 1}
    assert s["transport"]["passthrough_misses"] is True
    end = time.monotonic() + 30
    while json.loads(tierfs_cmd("where", str(bm.mnt / "m"), "--json").stdout)[0]["resident_bytes"].get("ram", 0) != len(data):
        assert time.monotonic() < end, "the tier was not filled in the background"
        time.sleep(0.05)
    assert (bm.mnt / "m").read_bytes() == data  # now from the RAM tier
    assert bm.stats()["transport"]["passthrough_opens_by_tier"].get("ram") == 1


def page_cached_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache (mincore(2), by util-linux ``fincore``)."""
    r = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                       capture_output=True, text=True, check=True)
    return int(r.stdout.strip())


def test_the_fill_leaves_the_page_cache_of_readers_passing_through(bm: Mount) -> None:
    """A reader of a miss reads the backing file itself (passthrough); the daemon fills the
    tier from it once the reader closes, and more readers may come meanwhile: the fill must
    not drop the backing file's pages (``POSIX_FADV_DONTNEED``, what it does after the
    daemon's own reads), or they read again from the store what is in its page cache."""
    data = write_random(bm.backing / "pc", 8 * MiB)
    fd = os.open(bm.backing / "pc", os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if page_cached_bytes(bm.backing / "pc") > MiB:
        pytest.skip("the backing directory's filesystem keeps its pages (tmpfs?)")
    assert (bm.mnt / "pc").read_bytes() == data
    end = time.monotonic() + 30
    while json.loads(tierfs_cmd("where", str(bm.mnt / "pc"), "--json").stdout)[0]["resident_bytes"].get("ram", 0) != len(data):
        assert time.monotonic() < end, "the tier was not filled in the background"
        time.sleep(0.05)
    assert bm.stats()["transport"]["passthrough_opens_by_tier"] == {"backing": 1}
    # A fill that dropped what it copied would leave none of the file's pages: the fill runs
    # over all of it. The kernel itself may reclaim a few meanwhile, once the test run's page
    # cache fills the machine's memory (CI, after 20 minutes of tests: 32 KiB of the 8 MiB
    # gone), so a sliver of loss is the kernel's, not the daemon's.
    assert page_cached_bytes(bm.backing / "pc") >= len(data) - MiB


def test_writer_beside_backing_readers_writes_the_backing_file_in_place(bm: Mount) -> None:
    data = write_random(bm.backing / "w", 2 * MiB)
    with open(bm.mnt / "w", "rb") as r:
        assert r.read(10) == data[:10]
        with open(bm.mnt / "w", "r+b") as w:
            w.write(b"new")
            w.seek(len(data))
            w.write(b"tail")
            w.flush()
            os.fsync(w.fileno())
            assert (bm.backing / "w").read_bytes() == b"new" + data[3:] + b"tail"  # in place, at once
            assert os.pread(r.fileno(), 3, 0) == b"new"  # (not r.read: its buffer holds the old bytes)
            assert os.stat(bm.mnt / "w").st_size == len(data) + 4
    want = b"new" + data[3:] + b"tail"
    assert (bm.mnt / "w").read_bytes() == want
    s = bm.stats()
    assert s["writeback"]["dirty_files"] == 0 and s["transport"]["passthrough_conflicts"] == 0


def test_fstat_of_a_reader_after_a_writer_passing_through_shows_the_new_size(bm: Mount) -> None:
    """The fstat an open took stands for the GETATTR right after it only while nothing can have
    changed the file: a writer's open ends that (its writes pass through to the backing file,
    no request tells the daemon)."""
    data = write_random(bm.backing / "g", MiB)
    fd = os.open(bm.mnt / "g", os.O_RDONLY)  # no fstat: the open's own stays unused
    try:
        with open(bm.mnt / "g", "r+b") as w:
            w.seek(len(data))
            w.write(b"tail")
        assert os.fstat(fd).st_size == len(data) + 4
    finally:
        os.close(fd)
    # a writer already open: a reader's open (a fresh open(2) of the grown backing file) cannot
    # stand for the writes after it, which pass through with no request
    n = len(data) + 4
    r1 = os.open(bm.mnt / "g", os.O_RDONLY)  # passes through to the backing file
    w = os.open(bm.mnt / "g", os.O_WRONLY)  # shares it, writable
    try:
        os.pwrite(w, b"b" * 4096, n)
        r2 = os.open(bm.mnt / "g", os.O_RDONLY)
        try:
            os.pwrite(w, b"c" * 4096, n + 4096)
            assert os.fstat(r2).st_size == n + 8192
        finally:
            os.close(r2)
    finally:
        os.close(w)
        os.close(r1)


def test_truncates_beside_backing_readers_reach_the_backing_file(bm: Mount) -> None:
    data = write_random(bm.backing / "t", MiB)
    with open(bm.mnt / "t", "rb") as r:
        r.read(1)
        os.truncate(bm.mnt / "t", 1000)
        assert (bm.backing / "t").stat().st_size == 1000
        assert os.pread(r.fileno(), 2000, 0) == data[:1000]
        with open(bm.mnt / "t", "wb") as w:  # O_TRUNC
            w.write(b"x")
        assert (bm.backing / "t").read_bytes() == b"x"
    assert (bm.mnt / "t").read_bytes() == b"x"
    assert bm.stats()["writeback"]["dirty_files"] == 0


def test_misses_the_tiers_cannot_hold_or_asked_off_are_served_by_the_daemon(tiermount, transport: str) -> None:
    """A file larger than the tiers together is not passed through (its whole file would be
    queued for a tier at every open, for a random reader of a store-sized file); nor is any
    miss with ``passthrough_misses=false``."""
    small = tiermount(ram="16MiB", extra=("--transport", "native", "--backing", "parallel", "--chunk-size", "1MiB"))
    needs_passthrough(small)
    big = write_random(small.backing / "big", 17 * MiB)
    fits = write_random(small.backing / "fits", MiB, seed=2)
    with open(small.mnt / "big", "rb") as f:
        assert f.read(MiB) == big[:MiB]
    assert (small.mnt / "fits").read_bytes() == fits
    s = small.stats()
    assert s["fuse"]["read_requests"] > 0 and s["transport"]["passthrough_opens_by_tier"].get("backing") == 1
    small.stop()
    off = tiermount(ram="64MiB", name="off", extra=("--transport", "native", "--backing", "parallel",
                                                   "-o", "passthrough_misses=false"))
    assert (off.mnt / "fits").read_bytes() == fits
    s = off.stats()
    assert s["fuse"]["read_requests"] > 0 and "backing" not in s["transport"]["passthrough_opens_by_tier"]
    assert s["transport"]["passthrough_misses"] is False


def test_hdd_profile_never_passes_misses_through(tiermount, transport: str) -> None:
    m = tiermount(ram="64MiB", extra=("--transport", "native", "--backing", "hdd", "-o", "passthrough_misses=true"))
    needs_passthrough(m)
    data = write_random(m.backing / "h", MiB)
    assert (m.mnt / "h").read_bytes() == data
    s = m.stats()
    assert s["fuse"]["read_requests"] > 0 and "backing" not in s["transport"]["passthrough_opens_by_tier"]
    assert s["transport"]["passthrough_misses"] is False


def test_a_read_only_close_costs_no_flush_round_trip(nm: Mount) -> None:
    """FOPEN_NOFLUSH on read-only opens: a small-file epoch pays one synchronous FLUSH per
    image otherwise (answered once passthrough writes are negotiated); a writer's close still
    reaches the daemon (ENOSPC is told there)."""
    data = write_random(nm.backing / "r", 100_000)
    make_resident(nm, "r", len(data))

    def flushes() -> int:
        return nm.stats()["fuse"]["requests"].get("flush", 0)

    before = flushes()
    for _ in range(5):
        assert (nm.mnt / "r").read_bytes() == data  # passed through
    (nm.backing / "d").write_bytes(b"d" * 1000)
    for _ in range(5):
        assert (nm.mnt / "d").read_bytes() == b"d" * 1000  # served by the daemon
    assert flushes() == before
    with open(nm.mnt / "w", "wb") as f:
        f.write(b"w")
    assert flushes() == before + 1


@pytest.mark.parametrize("seed", range(8))
def test_random_readers_writers_and_truncates_of_a_resident_file_match_a_local_file(nm: Mount, tmp_path: Path,
                                                                                   seed: int) -> None:
    """Random opens (read-only, read-write), writes (also past the end), truncates (by path),
    fsyncs, write-backs and closes of a file resident in the RAM tier, mirrored on a local file:
    every read through any handle, every size, the content after the last close and the
    backing file after write-back are the local file's. Exercises the tier copy written in
    place while readers pass through to it, and its take-in at fsync and close."""
    import random

    rnd = random.Random(seed)
    data = write_random(nm.backing / "f", 3 * MiB + 11, seed=seed)
    make_resident(nm, "f", len(data))
    local = tmp_path / "local"
    local.write_bytes(data)
    handles: list[tuple[int, int]] = []  # (mount fd, local fd)
    try:
        for _ in range(60):
            op = rnd.random()
            if op < 0.2 or not handles:
                flags = os.O_RDWR if rnd.random() < 0.5 else os.O_RDONLY
                handles.append((os.open(nm.mnt / "f", flags), os.open(local, flags)))
            elif op < 0.45:
                m, lo = rnd.choice(handles)
                size = os.fstat(lo).st_size
                off, n = rnd.randrange(0, size + MiB), rnd.randrange(1, 300_000)
                assert os.pread(m, n, off) == os.pread(lo, n, off)
            elif op < 0.7:
                m, lo = rnd.choice(handles)
                off = rnd.randrange(0, os.fstat(lo).st_size + 100_000)
                buf = rnd.randbytes(rnd.randrange(1, 200_000))
                if os.get_blocking(lo) and fcntl_accmode(lo) == os.O_RDONLY:
                    with pytest.raises(OSError):
                        os.pwrite(m, buf, off)  # read-only: refused, as on the local file
                    continue
                os.pwrite(lo, buf, off)
                os.pwrite(m, buf, off)
            elif op < 0.78:
                size = rnd.randrange(0, 4 * MiB)
                os.truncate(local, size)
                os.truncate(nm.mnt / "f", size)
            elif op < 0.82:
                m, lo = rnd.choice(handles)
                os.fsync(m)
            elif op < 0.86:
                tierfs_cmd("flush", str(nm.mnt))  # written back (clean) while handles stay open
            else:
                m, lo = handles.pop(rnd.randrange(len(handles)))
                os.close(m)
                os.close(lo)
            assert os.stat(nm.mnt / "f").st_size == local.stat().st_size
    finally:
        for m, lo in handles:
            os.close(m)
            os.close(lo)
    want = local.read_bytes()
    assert (nm.mnt / "f").read_bytes() == want
    assert nm.stats()["transport"]["passthrough_conflicts"] == 0
    tierfs_cmd("flush", str(nm.mnt))
    wait_for(lambda: (nm.backing / "f").read_bytes() == want, "write-back of f")


def test_fill_of_a_passed_through_miss_survives_its_close(tiermount, transport: str) -> None:
    """The reader of a miss passed through to the backing file is often done before its chunks
    are fetched for the tier; closing it must not drop the fill (as it drops readahead)."""
    m = tiermount(ram="128MiB", extra=("--transport", "native", "--backing", "parallel", "--chunk-size", "1MiB",
                                       "-o", "passthrough_misses=true"))
    needs_passthrough(m)
    data = write_random(m.backing / "big", 48 * MiB)
    with open(m.mnt / "big", "rb") as f:
        assert f.read(10) == data[:10]  # 48 chunks queued, at most 16 in flight; then closed
    end = time.monotonic() + 60
    while json.loads(tierfs_cmd("where", str(m.mnt / "big"), "--json").stdout)[0]["resident_bytes"].get("ram", 0) != len(data):
        assert time.monotonic() < end, "the fill was dropped at close"
        time.sleep(0.1)


def test_writer_after_write_back_shares_the_data_file_its_readers_read(nm: Mount) -> None:
    """A file written back (clean) while handles still read its data file, which the kernel
    passes them through to: a later reader joins that data file, and a writer makes the same
    file dirty again (no ETXTBSY, no copy its readers would not see)."""
    (nm.mnt / "c").write_bytes(b"a" * 100_000)  # dirty, in the write tier
    r1 = os.open(nm.mnt / "c", os.O_RDONLY)  # passed through to the data file
    try:
        tierfs_cmd("flush", str(nm.mnt))  # written back: clean, r1 still reads the data file
        r2 = os.open(nm.mnt / "c", os.O_RDONLY)
        os.close(r1)
        r1 = -1
        try:
            with open(nm.mnt / "c", "r+b") as w:
                w.write(b"b" * 10)
                w.flush()
                assert os.pread(r2, 12, 0) == b"b" * 10 + b"aa"
        finally:
            os.close(r2)
    finally:
        if r1 >= 0:
            os.close(r1)
    s = nm.stats()
    assert s["transport"]["passthrough_conflicts"] == 0 and s["writeback"]["redirtied"] >= 1
    tierfs_cmd("flush", str(nm.mnt))
    assert (nm.backing / "c").read_bytes() == b"b" * 10 + b"a" * 99_990


def test_the_fill_waits_for_the_last_reader_passing_through(bm: Mount) -> None:
    """The tier is filled once the readers of a miss close, from the page cache they leave,
    not beside them (where it competed with them for the store and the CPU)."""
    data = write_random(bm.backing / "late", 3 * MiB)

    def ram() -> int:
        return json.loads(tierfs_cmd("where", str(bm.mnt / "late"), "--json").stdout)[0]["resident_bytes"].get("ram", 0)

    with open(bm.mnt / "late", "rb") as a, open(bm.mnt / "late", "rb") as b:
        assert a.read() == data and b.read(10) == data[:10]
        time.sleep(0.5)
        assert ram() == 0
    end = time.monotonic() + 30
    while ram() != len(data):
        assert time.monotonic() < end, "the tier was not filled after the last close"
        time.sleep(0.05)
