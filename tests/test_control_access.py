"""The control plane's pieces in-process: credentials and the kernel's mode-bit check
(``tierfs.access``), path resolution through the backing tree into the key the read path uses,
the capped incremental request parser and reply encoder (``tierfs.fs.ctl``), escaping of user
text in log lines, and the plan freeing what finished needs held."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs import logevents
from tierfs.access import ROOT, Caller, Resolver, caller_of, normalize
from tierfs.backing_tree import BackingTree
from tierfs.cache.manager import Cache
from tierfs.cache.plan import HintPlan
from tierfs.cache.policy import Policy
from tierfs.cache.tier import Tier
from tierfs.errors import HintDenied, HintError
from tierfs.fs import ctl
from tierfs.io import Device
from tierfs.predict.hints import EncodedList, HintService
from tierfs.sched.backing import Identity
from tierfs.sched.scheduler import TransactionScheduler
from tierfs_hints import wire

CS = 64 * 1024
USER = Caller(12345, 12345, groups=frozenset({777}))


def st_of(mode: int, uid: int = 0, gid: int = 0) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))


# -- credentials ----------------------------------------------------------------------------------
def test_mode_bits_as_the_kernel_checks_them() -> None:
    f = 0o100000
    assert USER.may(st_of(f | 0o400, uid=12345), 4) and not USER.may(st_of(f | 0o040, uid=12345), 4)
    assert USER.may(st_of(f | 0o040, gid=777), 4)  # a supplementary group
    assert USER.may(st_of(f | 0o040, gid=12345), 4)  # the primary group
    assert not USER.may(st_of(f | 0o600), 4) and USER.may(st_of(f | 0o604), 4)
    assert not USER.may(st_of(0o040700), 1)  # a root 0700 directory: no search
    assert ROOT.may(st_of(f | 0o000), 4) and ROOT.may(st_of(0o040000), 1)
    assert not ROOT.may(st_of(f | 0o600), 1)  # exec of a file with no x bit: not even root
    assert USER.owns(st_of(f, uid=12345)) and not USER.owns(st_of(f)) and ROOT.owns(st_of(f, uid=5))


def test_caller_of_reads_the_supplementary_groups() -> None:
    c = caller_of(os.getuid(), os.getgid(), os.getpid())
    assert c.groups == frozenset(os.getgroups())
    assert caller_of(1, 1, 0).groups == frozenset()


# -- resolution -------------------------------------------------------------------------------------
@pytest.fixture
def tree(tmp_path: Path) -> BackingTree:
    b = tmp_path / "back"
    (b / "pub").mkdir(parents=True)
    (b / "pub" / "f").write_bytes(b"x" * 100)
    os.chmod(b / "pub" / "f", 0o644)
    (b / "pub" / "secret").write_bytes(b"s")
    os.chmod(b / "pub" / "secret", 0o600)
    (b / "priv").mkdir(mode=0o700)
    os.chmod(b / "priv", 0o700)
    (b / "priv" / "f").write_bytes(b"y")
    os.chmod(b / "priv" / "f", 0o644)
    os.symlink("pub/f", b / "alias")
    os.symlink("../../../etc/passwd", b / "pub" / "out")
    os.symlink("/etc/passwd", b / "abs")
    os.symlink("/mnt/x/pub/f", b / "intomount")
    os.symlink("loop", b / "loop")
    os.chmod(b, 0o755)
    os.chmod(b / "pub", 0o755)
    t = BackingTree(os.fsencode(b))
    yield t
    t.close()


def test_resolver_checks_like_a_read(tree: BackingTree) -> None:
    r = Resolver(tree, USER, b"/mnt/x")
    assert r.file(b"pub/f")[0] == b"pub/f"
    with pytest.raises(HintDenied):
        r.file(b"pub/secret")
    # a file in a directory the caller cannot search: refused whether it exists or not
    with pytest.raises(HintDenied) as e1:
        r.file(b"priv/f")
    with pytest.raises(HintDenied) as e2:
        r.file(b"priv/nothere")
    assert str(e1.value) == str(e2.value)
    with pytest.raises(FileNotFoundError):
        r.file(b"pub/nothere")
    assert Resolver(tree, ROOT).file(b"priv/f")[0] == b"priv/f"
    assert r.file(b"pub/secret", 0)[0] == b"pub/secret"  # reach only (evict checks ownership)


def test_resolver_follows_symlinks_as_the_kernel_does_through_the_mount(tree: BackingTree) -> None:
    r = Resolver(tree, ROOT, b"/mnt/x")
    assert r.file(b"alias")[0] == b"pub/f"  # canonical: the path reads are keyed by
    assert r.file(b"intomount")[0] == b"pub/f"  # absolute, back into the mountpoint
    for outside in (b"pub/out", b"abs"):
        with pytest.raises(HintError):
            r.file(outside)
    with pytest.raises(HintError):
        r.file(b"loop")


def test_normalize_refuses_what_leaves_the_mount() -> None:
    assert normalize("a/./b//c") == b"a/b/c" and normalize(".") == b"" and normalize("a/../b") == b"b"
    for bad in ("/etc/passwd", "..", "a/../../b", "a\0b"):
        with pytest.raises(HintError):
            normalize(bad)


def _service(root: bytes, tmp_path: Path, **kw: object) -> HintService:
    plan = HintPlan()

    async def read(f, offset, length):  # type: ignore[no-untyped-def]
        return bytes(length)

    sched = TransactionScheduler(read, chunk_size=CS, slice_size=CS)
    dev = Device("t", 1, inline_under=math.inf)
    cache = Cache([Tier("ram", str(tmp_path / "ram"), 64 * CS, inline=True)], [dev],
                  Policy("nothrash", 1000, plan=plan), sched, chunk_size=CS, staging_bytes=4 * CS)
    return HintService(cache=cache, scheduler=sched, backing_root=root, meta=dev, chunk_size=CS,
                       write_tier=0, budget=4 * CS, **kw)  # type: ignore[arg-type]


async def test_hint_keys_match_read_keys_through_a_symlinked_backing_path(tmp_path: Path) -> None:
    """The read path keys a file by ``Identity.of(<backing path as given> + "/" + rel)``; a
    hint for the same file, given directly or through a symlink in the tree, must produce the
    same key, also when the backing path itself goes through a symlink."""
    real = tmp_path / "real"
    (real / "d").mkdir(parents=True)
    (real / "d" / "f").write_bytes(bytes(3 * CS))
    os.symlink("d/f", real / "alias")
    link = tmp_path / "link"
    os.symlink(real, link)
    root = os.fsencode(str(link))
    hints = _service(root, tmp_path)
    read_key = Identity.of(os.fsdecode(root + b"/d/f"), os.stat(real / "d" / "f")).key  # as Operations does
    for name in ("d/f", "alias", "d/../d/f"):
        reply = await hints.handle({"op": "need", "items": [[name, 0, None]]})
        need = hints.plan.needs[reply["id"]]
        assert {c[0] for c in need.chunks} == {read_key}, name
    hints.close()
    hints.cache.close()


async def test_per_user_volume_and_ownership(tmp_path: Path) -> None:
    back = tmp_path / "back"
    back.mkdir()
    for i in range(4):
        (back / f"f{i}").write_bytes(bytes(16 * CS))  # 1 MiB each; the tier is 4 MiB
    os.chmod(back, 0o755)
    hints = _service(os.fsencode(str(back)), tmp_path, user_share=0.5)
    user = Caller(12345, 12345)
    a = await hints.handle({"op": "need", "items": [["f0", 0, None], ["f1", 0, None]]}, user)
    with pytest.raises(HintDenied, match="user_hint_share"):
        await hints.handle({"op": "need", "items": [["f2", 0, None]]}, user)
    # an epoch order replaces the same source's last one: it does not count twice
    e = await hints.handle({"op": "epoch", "paths": ["f2"], "source": "s"}, Caller(777, 777))
    await hints.handle({"op": "epoch", "paths": ["f3", "f2"], "source": "s"}, Caller(777, 777))
    await hints.handle({"op": "need", "items": [["f3", 0, None]] * 2}, ROOT)  # root: not bounded
    with pytest.raises(HintDenied):
        await hints.handle({"op": "cancel", "id": a["id"]}, Caller(777, 777))
    with pytest.raises(HintDenied):
        await hints.handle({"op": "progress", "id": e["id"]}, user)
    await hints.handle({"op": "cancel", "id": a["id"]}, user)
    await hints.handle({"op": "need", "items": [["f2", 0, None]]}, user)  # room again
    # an epoch order over the share is cut to its head instead of refused (samplers keep working)
    r = await hints.handle({"op": "epoch", "paths": ["f0", "f1", "f2", "f3"], "source": "big"}, Caller(4242, 4242))
    assert r["bytes"] == 2 * 16 * CS and r["truncated_bytes"] == 2 * 16 * CS
    need = hints.plan.needs[r["id"]]
    assert [f.path for f in need.files] == [b"f0", b"f1"] and len(need.chunks) == 32
    hints.close()
    hints.cache.close()


# -- plan memory ------------------------------------------------------------------------------------
def test_removed_needs_keep_only_a_summary() -> None:
    from tests.test_hints_plan import make_need

    plan = HintPlan()
    n = plan.add(make_need(plan, [("k", i) for i in range(1000)]))
    total = n.total_bytes
    plan.cancel(n.id)
    assert plan.recent[n.id] is n and n.shed and not n.chunks and not n.files and len(n.consumed) == 0
    assert n.total_bytes == total and not plan._occ and not plan._by_source
    m = plan.add(make_need(plan, [("k", 0), ("k", 1)]))
    plan.consume(("k", 0))
    plan.consume(("k", 1))
    plan.check_deadlines(0.0, lambda c: False)
    assert m.id not in plan.needs and m.shed and m.finished_at is not None  # read to the end: freed
    # a large need leaves the plan at once and is swept out of the index in slices
    big = plan.add(make_need(plan, [("b", i) for i in range(10_000)] + [("k", 7)]))
    small = plan.add(make_need(plan, [("k", 7)]))
    plan.cancel(big.id)
    assert big.id not in plan.needs and not big.shed and plan.sweeping
    assert plan.next_use(("b", 5)) is None and plan.next_use(("k", 7)) == small.rank(0)
    assert plan.consume(("k", 7)) and small.consumed[0] == 1  # the removed need's occurrence is skipped
    steps = 0
    while plan.sweep(1000):
        steps += 1
    assert steps >= 9 and big.shed and set(plan._occ) == {("k", 7)}


# -- parsing and encoding -------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 62), 1 << 62) | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5),
    max_leaves=30)


def _lists(v: object) -> object:
    if isinstance(v, (list, tuple)):
        return [_lists(x) for x in v]
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    return v


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=8), json_values, max_size=6), st.sampled_from([None, 0, 2]))
def test_parser_agrees_with_json(doc: dict, indent: int | None) -> None:
    data = json.dumps(doc, indent=indent, ensure_ascii=False).encode() + b"\n"
    assert _lists(ctl.parse_now(data)) == _lists(json.loads(data))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["ok", "n", "files", "missing"]), st.one_of(
    st.lists(json_values, max_size=2500), json_values), max_size=4),
    st.lists(st.dictionaries(st.text(max_size=4), st.integers(), max_size=2), max_size=3000), st.integers(1, 9))
def test_reply_encoder_agrees_with_json(reply: dict, entries: list, per: int) -> None:
    """The reply line decodes to the reply, its long lists encoded slice by slice and an
    EncodedList (JSON fragments of ``per`` entries each) joined as it is."""
    line = ctl.run_now(ctl.encode_steps(reply))
    assert line.endswith(b"}\n") and json.loads(line) == json.loads(json.dumps(reply))
    encoded = EncodedList(json.dumps(entries[i:i + per])[1:-1] for i in range(0, len(entries), per))
    line = ctl.run_now(ctl.encode_steps({**reply, "files": encoded}))
    assert json.loads(line) == {**json.loads(json.dumps(reply)), "files": entries}


def test_reply_encoder_long_lists() -> None:
    """Lists and EncodedLists longer than a slice: the pieces join with one separator each."""
    n = 3 * ctl.SLICE + 7
    entries = [{"i": i} for i in range(n)]
    encoded = EncodedList(json.dumps([e])[1:-1] for e in entries)
    reply = {"ok": True, "missing": [f"m{i}" for i in range(n)], "files": encoded}
    assert json.loads(ctl.run_now(ctl.encode_steps(reply))) == {**reply, "files": entries}
    assert json.loads(ctl.run_now(ctl.encode_steps({"files": encoded}))) == {"files": entries}


def test_parser_caps_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "MAX_ITEMS", 10)
    with pytest.raises(HintError, match="MAX_ITEMS"):
        ctl.parse_now(json.dumps({"op": "need", "items": [["a", 0, None]] * 11}).encode())
    assert len(ctl.parse_now(json.dumps({"op": "need", "items": [["a", 0, None]] * 10}).encode())["items"]) == 10
    with pytest.raises(HintError, match="MAX_PATH_BYTES"):
        ctl.parse_now(json.dumps({"op": "where", "paths": ["x" * (ctl.MAX_STRING_CHARS + 10)]}).encode())
    for bad in (b"{not json", b"[1, 2]", b'{"a": 1} x', b'{"a": "\xff"}', b'{"a": [' * 20 + b"]" * 20 + b"}",
                b'{"a": 1' + b" " * 5000 + b"}", b'{"a": "unterminated'):
        with pytest.raises(ValueError):
            ctl.parse_now(bad)
    # escaped quotes inside strings do not end them
    assert ctl.parse_now(b'{"a": "x\\"y\\\\", "b": 1}') == {"a": 'x"y\\', "b": 1}


def test_refused_request_is_freed_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request refused for its size frees what was parsed SLICE entries per step: unwinding
    half a million parsed items at once held the event loop 137 ms in a CI run."""
    monkeypatch.setattr(wire, "MAX_ITEMS", 8 * ctl.SLICE)
    parsers: list[ctl._Parser] = []

    class Recorded(ctl._Parser):
        def __init__(self, text: str) -> None:
            super().__init__(text)
            parsers.append(self)

    monkeypatch.setattr(ctl, "_Parser", Recorded)
    data = json.dumps({"op": "need", "items": [["a", 0, None]] * (8 * ctl.SLICE + 1)}).encode()
    steps = ctl.parse_steps(data)
    kept: list[list] = []
    longest = 0
    yields_while_freeing = 0
    with pytest.raises(HintError, match="MAX_ITEMS"):
        while True:
            next(steps)
            if parsers and parsers[0].big and not kept:
                kept = list(parsers[0].big)  # the items list, once it is long
            if kept and len(kept[0]) < longest:
                yields_while_freeing += 1
            longest = max(longest, len(kept[0]) if kept else 0)
    assert kept and all(len(lst) == 0 for lst in kept)
    assert yields_while_freeing >= 8  # a pause per SLICE entries freed


async def test_encoder_slices_long_lists() -> None:
    reply = {"ok": True, "missing": [f"p{i}" for i in range(3 * ctl.SLICE + 5)], "files": [], "id": "n1"}
    assert json.loads(await ctl.encode_reply(reply)) == reply
    only = {"missing": [str(i) for i in range(ctl.SLICE + 1)]}
    assert json.loads(await ctl.encode_reply(only)) == only


def test_user_text_escapes_and_truncates() -> None:
    assert logevents.user_text("a\nb\x1b[31m") == "a\\nb\\x1b[31m"
    long = logevents.user_text("x" * 10_000)
    assert len(long) < 250 and long.endswith("...[10000 chars]")
    assert "\n" not in logevents.user_text(b"a\nb\xff" * 100) and logevents.user_text(None) == "None"
    assert "\u2028" not in logevents.user_text("a\u2028b")  # a line separator is escaped too


def test_every_log_message_is_one_bounded_line() -> None:
    """Behind user_text: whatever a module logs (a file name with a newline), the handler's
    filter writes it as one line of bounded length."""
    f = logevents.SafeMessages()
    r = logging.LogRecord("tierfs.x", logging.INFO, __file__, 1, "backing file changed: %s", ("a\nFORGED\r\x1b[2J",), None)
    assert f.filter(r) and r.getMessage() == "backing file changed: a\\x0aFORGED\\x0d\\x1b[2J"
    r = logging.LogRecord("tierfs.x", logging.INFO, __file__, 1, "%s", ("y" * 10**6,), None)
    f.filter(r)
    assert len(r.getMessage()) < logevents.MAX_MESSAGE_CHARS + 50
    r = logging.LogRecord("tierfs.x", logging.INFO, __file__, 1, "plain %d", (5,), None)
    f.filter(r)
    assert r.getMessage() == "plain 5" and r.args == (5,)
