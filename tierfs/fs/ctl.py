"""The commands of ``<mnt>/.tierfs/ctl``: one JSON request in, one JSON reply out (the format
is :mod:`tierfs_hints.wire`), acted on with the credentials of whoever opened the file.

:meth:`tierfs.fs.control.ControlPlane.write` collects a request line (capped at
``wire.MAX_REQUEST_BYTES``) and calls :class:`ControlCommands` with it and the opener's
:class:`~tierfs.access.Caller`. Here the request is parsed on the event loop by an incremental
parser in small steps, paced by :class:`tierfs.io.Pacer` (:func:`parse_request`: one JSON value
at a time; a whole ``json.loads`` of a 64 MiB request held the loop for seconds, and in a worker
thread it holds the interpreter lock against the loop just the same: measured 90-170 ms FUSE
stalls); the item cap is enforced while parsing, so a request of a million items is
refused before it is built. It is then dispatched (hint operations to
:class:`~tierfs.predict.hints.HintService`, ``flush`` to the write-back), and the reply encoded
in slices the same way. Errors become ``{"ok": false, "kind": ...}``: "value" (bad
input, over a cap), "perm" (the caller may not), "timeout", "os"; a control request never
harms the daemon.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from collections.abc import Generator
from typing import Any, TypeVar

import trio

from tierfs import logevents
from tierfs.access import R_OK, Caller, Resolver
from tierfs.backing_tree import BackingTree
from tierfs.errors import HintDenied, HintError, NotDurableYet
from tierfs.io import Device, Pacer, free_in_slices
from tierfs.predict.hints import (
    MAX_WAIT_S,
    EncodedList,
    HintService,
    check_rel,
    request_paths,
    seconds,
)
from tierfs.writeback.manager import DirtyFile, WriteBack
from tierfs_hints import wire

log = logging.getLogger("tierfs.ctl")

MAX_DEPTH = 8  # nesting of JSON arrays/objects in a request (items are [path, offset, length])
MAX_VALUES = 4 * wire.MAX_ITEMS + 1000  # JSON values in one request (an item is 4)
MAX_STRING_CHARS = 6 * wire.MAX_PATH_BYTES + 64  # a JSON string as sent (\uXXXX escapes: 6 per byte)
MAX_WS = 4096  # whitespace between two tokens
MAX_ERROR_CHARS = 2000  # of an error message in a reply
PARSERS = 2  # requests parsed at once (each holds its request text and parsed values in memory)
SLICE = 1024  # list entries encoded between two chances to pause (~0.3 ms)
DECODE_PIECE = 1 << 20  # bytes decoded from UTF-8 at a time (~1 ms)
YIELD_EVERY = 500  # JSON values parsed between two chances to pause (~0.3 ms)

_DEC = json.JSONDecoder()
_WS = re.compile(rf"[ \t\n\r]{{0,{MAX_WS}}}")


# -- parsing ------------------------------------------------------------------------------------
class _Parser:
    """JSON, one value at a time, as generators that pause every :data:`YIELD_EVERY` values
    (see :func:`parse_request`). Raises HintError naming the cap a request is over,
    ValueError for malformed JSON."""

    def __init__(self, text: str) -> None:
        self.s = text
        self.values = 0
        # lists longer than SLICE, kept so a refused request's values can be freed in slices
        # (unwinding dropped half a million items at once: one 137 ms step on a 2-core CI run)
        self.big: list[list[Any]] = []

    def ws(self, pos: int) -> int:
        m = _WS.match(self.s, pos)
        assert m is not None
        pos = m.end()
        if pos < len(self.s) and self.s[pos] in " \t\n\r":
            raise ValueError(f"more than {MAX_WS} whitespace characters in a row")
        return pos

    def count(self) -> bool:
        """Count a value; True when it is time to pause."""
        self.values += 1
        if self.values > MAX_VALUES:
            raise HintError(f"request has more than {MAX_VALUES} JSON values (MAX_ITEMS is {wire.MAX_ITEMS})")
        return self.values % YIELD_EVERY == 0

    def scalar(self, pos: int) -> tuple[Any, int]:
        """A string, number, true/false/null at ``pos`` (after whitespace)."""
        if self.s[pos:pos + 1] == '"':
            self.string_end(pos)
        return _DEC.raw_decode(self.s, pos)

    def value(self, pos: int, depth: int) -> Generator[None, None, tuple[Any, int]]:
        if self.count():
            yield
        pos = self.ws(pos)
        c = self.s[pos:pos + 1]
        if c == "{":
            return (yield from self.obj(pos + 1, depth + 1))
        if c == "[":
            return (yield from self.arr(pos + 1, depth + 1))
        return self.scalar(pos)

    def string_end(self, pos: int) -> int:
        """Index of the closing quote of the string opening at ``pos``, looked for no further
        than MAX_STRING_CHARS (a 60 MB string would be decoded in one call)."""
        s = self.s
        limit = min(len(s), pos + 1 + MAX_STRING_CHARS)
        i = pos + 1
        while True:
            j = s.find('"', i, limit)
            if j < 0:
                if limit < len(s):
                    raise HintError(f"a string in the request is longer than MAX_PATH_BYTES "
                                    f"({wire.MAX_PATH_BYTES} bytes)")
                raise ValueError("unterminated string")
            k = j - 1
            while s[k] == "\\":
                k -= 1
            if (j - 1 - k) % 2 == 0:
                return j
            i = j + 1

    def arr(self, pos: int, depth: int) -> Generator[None, None, tuple[list[Any] | tuple[Any, ...], int]]:
        if depth > MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH}")
        out: list[Any] = []
        s = self.s
        pos = self.ws(pos)
        if s[pos:pos + 1] == "]":
            return out, pos + 1
        while True:
            pos = self.ws(pos)
            if s[pos:pos + 1] in ("[", "{"):
                v, pos = yield from self.value(pos, depth)
            else:  # the common case (paths, numbers) without a generator per value
                if self.count():
                    yield
                v, pos = self.scalar(pos)
            out.append(v)
            if len(out) == SLICE + 1:
                self.big.append(out)
            if len(out) > wire.MAX_ITEMS:
                raise HintError(f"a list of more than MAX_ITEMS ({wire.MAX_ITEMS}) entries; send fewer per request")
            pos = self.ws(pos)
            c = s[pos:pos + 1]
            if c == ",":
                pos += 1
            elif c == "]":
                # Arrays inside the request's lists (items: [path, offset, length]) become
                # tuples: the collector untracks a tuple of strings and numbers at its first
                # pass, while half a million lists stay tracked and made full collections of
                # 0.1-0.7 s during the parse (measured)
                return (tuple(out) if depth >= 3 else out), pos + 1
            else:
                raise ValueError(f"expected ',' or ']' at char {pos}")

    def obj(self, pos: int, depth: int) -> Generator[None, None, tuple[dict[str, Any], int]]:
        if depth > MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH}")
        out: dict[str, Any] = {}
        pos = self.ws(pos)
        if self.s[pos:pos + 1] == "}":
            return out, pos + 1
        while True:
            pos = self.ws(pos)
            if self.s[pos:pos + 1] != '"':
                raise ValueError(f"expected a key at char {pos}")
            self.string_end(pos)
            key, pos = _DEC.raw_decode(self.s, pos)
            pos = self.ws(pos)
            if self.s[pos:pos + 1] != ":":
                raise ValueError(f"expected ':' at char {pos}")
            out[key], pos = yield from self.value(pos + 1, depth)
            if len(out) > 64:
                raise ValueError("more than 64 keys in an object")
            pos = self.ws(pos)
            c = self.s[pos:pos + 1]
            if c == ",":
                pos += 1
            elif c == "}":
                return out, pos + 1
            else:
                raise ValueError(f"expected ',' or '}}' at char {pos}")


def parse_steps(data: bytes) -> Generator[None, None, dict[str, Any]]:
    """One request line as a dict, parsed in steps: the generator pauses every
    :data:`YIELD_EVERY` JSON values and every :data:`DECODE_PIECE` bytes decoded (each step
    ~1 ms), so the event loop can drive it between other work (:func:`parse_request`; a
    worker thread would hold the interpreter lock against the loop). Raises HintError for a
    request over a cap (naming it), ValueError for anything else malformed."""
    dec = codecs.getincrementaldecoder("utf-8")()
    pieces = []
    try:
        for i in range(0, len(data), DECODE_PIECE):
            pieces.append(dec.decode(data[i:i + DECODE_PIECE]))
            yield
        pieces.append(dec.decode(b"", final=True))
    except UnicodeDecodeError:
        raise ValueError("a request is UTF-8 JSON") from None
    text = "".join(pieces)
    del pieces
    p = _Parser(text)
    try:
        req, pos = yield from p.value(0, 0)
        if p.ws(pos) != len(text):
            raise ValueError("extra data after the request object")
    except Exception:
        del text
        p.s = ""
        yield from _free_steps(p.big)
        raise
    p.big.clear()
    if not isinstance(req, dict):
        raise ValueError("a request is a JSON object")
    return req


def _free_steps(lists: list[list[Any]]) -> Generator[None, None, None]:
    """Empty ``lists`` :data:`SLICE` entries at a time, pausing between slices: freeing half a
    million parsed items at once held the event loop over 100 ms."""
    for lst in lists:
        while lst:
            del lst[-SLICE:]
            yield
    lists.clear()


_T = TypeVar("_T")


async def drive(steps: Generator[None, None, _T], pacer: Pacer | None = None) -> _T:
    """Run a step generator (``parse_steps``, ``encode_steps``) to its value on the event loop,
    paced (:class:`tierfs.io.Pacer`)."""
    pacer = pacer or Pacer()
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await pacer.step()


def run_now(steps: Generator[None, None, _T]) -> _T:
    """A step generator run to its value at once (tests, tools)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


async def parse_request(data: bytes, pacer: Pacer | None = None) -> dict[str, Any]:
    """:func:`parse_steps` driven on the event loop, paced."""
    return await drive(parse_steps(data), pacer)


def parse_now(data: bytes) -> dict[str, Any]:
    """:func:`parse_steps` run to the end at once (tests, tools)."""
    return run_now(parse_steps(data))


def encode_steps(reply: dict[str, Any]) -> Generator[None, None, bytes]:
    """The reply line; long top-level lists (``missing``, ``files``, ``waited``) encoded
    :data:`SLICE` entries at a time, and an :class:`~tierfs.predict.hints.EncodedList` (JSON
    text already) joined as it is, pausing between slices. The line is built as bytes piece by
    piece and joined once: joining and encoding the 33 MB text of a 500,000-path ``where`` in
    one step held the event loop for hundreds of milliseconds."""
    big = {k: v for k, v in reply.items()
           if isinstance(v, EncodedList) or (isinstance(v, list) and len(v) > SLICE)}
    if not big:
        return json.dumps(reply).encode() + b"\n"
    small = {k: v for k, v in reply.items() if k not in big}
    out = [json.dumps(small)[:-1].encode()]
    first = not small
    for k, v in big.items():
        out.append((("" if first else ", ") + json.dumps(k) + ": [").encode())
        first = False
        for lo in range(0, len(v), SLICE):
            if lo:
                out.append(b", ")
            piece = v[lo:lo + SLICE]
            out.append((", ".join(piece) if isinstance(v, EncodedList) else json.dumps(piece)[1:-1]).encode())
            yield
        out.append(b"]")
    out.append(b"}\n")
    return b"".join(out)


def _big_lists(d: dict[str, Any]) -> list[list[Any]]:
    """The long top-level lists of a request or reply (:func:`tierfs.io.free_in_slices`)."""
    return [v for v in d.values() if isinstance(v, list) and len(v) > SLICE]


async def encode_reply(reply: dict[str, Any], pacer: Pacer | None = None) -> bytes:
    """:func:`encode_steps` driven on the event loop, paced."""
    return await drive(encode_steps(reply), pacer)


# -- the commands ---------------------------------------------------------------------------------
class ControlCommands:
    """The ``ctl`` command of a mount: ``await commands(request_bytes, caller) -> reply_bytes``.

    Args:
        hints: the hint service (every hint op). writeback: for ``flush``. tree, meta: the
            backing tree and its metadata device (flush resolves paths). mountpoint: bytes.
    """

    def __init__(self, *, hints: HintService, writeback: WriteBack, tree: BackingTree, meta: Device,
                 mountpoint: bytes = b"") -> None:
        self.hints = hints
        self.writeback = writeback
        self.tree = tree
        self.meta = meta
        self.mountpoint = mountpoint
        self.parsers = trio.CapacityLimiter(PARSERS)
        self.refused = {"value": 0, "perm": 0, "timeout": 0, "os": 0, "error": 0}
        self.requests = 0
        self.pauses = 0  # pauses made while parsing and encoding (tierfs.io.Pacer)

    def statistics(self) -> dict[str, Any]:
        """The ``control`` section of the stats document."""
        return {"requests": self.requests, "paced_pauses": self.pauses,
                "refused": dict(self.refused)}

    async def __call__(self, request: bytes, caller: Caller) -> bytes:
        kind = ""
        self.requests += 1
        pacer = Pacer()
        req: dict[str, Any] = {}
        try:
            async with self.parsers:
                req = await parse_request(request, pacer)
            del request
            op = req.get("op")
            if op == "flush":
                reply = await self._flush(req, caller)
            elif op in wire.HINT_OPS:
                reply = await self.hints.handle(req, caller)
            else:
                raise HintError(f"unknown op {logevents.user_text(str(op), 40)!r}; known: {', '.join(wire.HINT_OPS)}")
        except HintDenied as e:
            kind = "perm"
            reply = {"ok": False, "error": _bounded(str(e)), "kind": "perm"}
        except (ValueError, TypeError, RecursionError) as e:  # HintError is a ValueError
            kind = "value"
            reply = {"ok": False, "error": _bounded(f"bad request: {e}"), "kind": "value"}
        except TimeoutError:
            kind = "timeout"
            reply = {"ok": False, "error": "timed out", "kind": "timeout"}
        except OSError as e:
            kind = "os"
            reply = {"ok": False, "error": _bounded(str(e)), "kind": "os"}
        except Exception as e:  # noqa: BLE001 - a control request never harms the daemon
            kind = "error"
            log.exception("control request of uid %d failed", caller.uid)
            # an exception with no text (TooSlowError, AssertionError) still says what it was
            reply = {"ok": False, "error": _bounded(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)}
        if kind:
            self.refused[kind] += 1
            if kind != "timeout":
                # at most one line a minute per user: refused requests cannot flood the log
                logevents.event(log, logging.INFO, f"ctl-refused:{caller.uid}",
                                "control request of uid %d (pid %d) refused (%s): %s", caller.uid, caller.pid,
                                kind, logevents.user_text(reply["error"], 300))
        try:
            out = await encode_reply(reply, pacer)
            # after the reply is encoded: a reply may share a list with its request
            await free_in_slices(_big_lists(reply) + _big_lists(req), pacer)
            return out
        finally:
            self.pauses += pacer.pauses

    async def _flush(self, req: dict[str, Any], caller: Caller) -> dict[str, Any]:
        """Wait until the named (or all) dirty files are durable on the backing store. A
        non-root caller names only files it may read, and "all" means its own files."""
        raw = req.get("paths") or []
        paths = await request_paths(raw)
        timeout = seconds(req.get("timeout", 1e9), "timeout")
        files: list[DirtyFile] | None
        if paths:
            files = await self._named(paths, caller)
        elif caller.is_root:
            files = None
        else:
            files = []
            for df in list(self.writeback.files.values()):
                if df.path is not None and df.fd >= 0 and (await self.writeback.stat(df)).st_uid == caller.uid:
                    files.append(df)
        try:  # short waits (see tierfs.predict.hints.MAX_WAIT_S); clients loop
            waited = await self.writeback.wait_durable(files, min(timeout, MAX_WAIT_S))
            return {"waited": waited, "ok": True}
        except NotDurableYet as e:
            if timeout <= MAX_WAIT_S:
                raise
            # the files that got there during this request: the client's next request names
            # the rest (tierfs flush reports them all)
            return {"ok": True, "waited": e.durable, "timed_out": True}

    async def _named(self, paths: list[str], caller: Caller) -> list[DirtyFile]:
        resolver = Resolver(self.tree, caller, self.mountpoint)

        def resolve(batch: list[str]) -> list[tuple[str, bytes | None]]:
            out: list[tuple[str, bytes | None]] = []
            for p in batch:
                rel = check_rel(p)
                parent, _, name = rel.rpartition(b"/")
                try:
                    cparent = resolver.dir(parent)
                except HintDenied as e:
                    raise HintDenied(f"{logevents.user_text(p)!r}: {e}") from None
                except OSError:  # no such directory: nothing dirty there
                    out.append((p, None))
                    continue
                out.append((p, cparent + b"/" + name if cparent else name))
            return out

        files: list[DirtyFile] = []
        for lo in range(0, len(paths), 256):
            for p, canon in await self.meta.run(resolve, paths[lo:lo + 256]):
                df = self.writeback.get(canon) if canon is not None else None
                if df is None or df.fd < 0:
                    continue
                if not caller.may(await self.writeback.stat(df), R_OK):
                    raise HintDenied(f"{logevents.user_text(p)!r}: permission denied (read)")
                files.append(df)
        return files


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + f"...[{len(text)} chars]"
