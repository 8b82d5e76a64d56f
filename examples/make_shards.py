"""Build a WebDataset-style dataset of tar shards from real data shipped with installed packages.

A shard is a plain, uncompressed tar file. Each sample is one or more consecutive members that
share a key: ``<key>.<ext>``. Nothing is downloaded (see ``examples/corpus.py``):

* ``text-NNNNN.tar``: paragraphs of Python's standard-library source (member ``<key>.txt``,
  raw UTF-8 bytes). One pass over the corpus is ~41.8k samples, 11 MB of text and ~46 MB of tar
  (every member costs a 512-byte header plus padding to 512 bytes, as in any WebDataset).
  ``--size`` larger than one pass repeats the corpus; every copy is shuffled with its own seed,
  so the repeats are the same paragraphs in a different order, not new data.
* ``digits-NNNNN.tar`` (with ``--digits``): scikit-learn's 8x8 handwritten digits, members
  ``<key>.pgm`` (an 8x8 8-bit binary PGM image) and ``<key>.cls`` (the label, ASCII).

A ``manifest.json`` records what was built; a second run with the same arguments finds it and
reuses the shards (the output is deterministic: same bytes on every run).

Usage::

    python examples/make_shards.py --out demo-data/backing --size 48MiB --shard-size 4MiB
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import re
import sys
import tarfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402  (examples/corpus.py, next to this file)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
BLOCK = 512  # tar block size, bytes
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)

Sample = tuple[str, list[tuple[str, bytes]]]  # (key, [(extension, payload), ...])


def parse_size(text: str) -> int:
    """``"4MiB"``, ``"4M"``, ``"512k"`` or ``"4096"`` -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 4MiB, 512k or 4096, got {text!r}")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


def member_bytes(payload_len: int) -> int:
    """Bytes a member of ``payload_len`` bytes takes in a tar: header block plus padded data."""
    return BLOCK + math.ceil(payload_len / BLOCK) * BLOCK


@dataclass
class Shard:
    """One written shard: file name (relative to the dataset dir), samples, size in bytes."""

    name: str
    samples: int
    bytes: int


def text_stream(target_bytes: int, seed: int) -> Iterator[Sample]:
    """Samples ``t<copy>_<index>`` with member ``.txt``, repeating the corpus until the tar
    bytes reach ``target_bytes``. Copy ``c`` is the whole corpus shuffled with ``seed + c``.
    """
    paragraphs = list(corpus.text_samples())
    written = 0
    for copy in range(10_000):
        order = list(range(len(paragraphs)))
        random.Random(seed + copy).shuffle(order)
        for i in order:
            if written >= target_bytes:
                return
            payload = paragraphs[i]
            written += member_bytes(len(payload))
            yield f"t{copy:02d}_{i:06d}", [("txt", payload)]
    raise AssertionError("unreachable")  # pragma: no cover


def digits_stream(seed: int) -> Iterator[Sample]:
    """scikit-learn's 1797 digits, shuffled once: ``<key>.pgm`` (8x8 PGM) and ``<key>.cls``."""
    images, labels = corpus.digits()
    order = list(range(len(images)))
    random.Random(seed).shuffle(order)
    for i in order:
        pgm = b"P5\n8 8\n255\n" + images[i]
        yield f"d_{i:05d}", [("pgm", pgm), ("cls", str(labels[i]).encode())]


def write_shards(
    out: Path, prefix: str, samples: Iterable[Sample], shard_size: int
) -> list[Shard]:
    """Write ``samples`` to ``out/<prefix>-NNNNN.tar`` files of about ``shard_size`` bytes each
    (at most that plus the 10 KiB tar record padding; a shard holds at least one sample and a
    sample never spans two shards).

    Members get fixed metadata (mtime 0, uid/gid 0, mode 0444) so the bytes are reproducible.
    Each shard is written under a temporary name and renamed when complete.
    """
    shards: list[Shard] = []
    tar: tarfile.TarFile | None = None
    tmp = out / f".{prefix}.partial"
    count = 0

    def close() -> None:
        nonlocal tar
        if tar is None:
            return
        tar.close()  # end-of-archive blocks, padded to a 10 KiB tar record
        name = f"{prefix}-{len(shards):05d}.tar"
        os.replace(tmp, out / name)
        shards.append(Shard(name, count, (out / name).stat().st_size))
        tar = None

    for key, members in samples:
        size = sum(member_bytes(len(p)) for _, p in members)
        if tar is not None and tar.offset + size + 2 * BLOCK > shard_size:
            close()
        if tar is None:
            tar = tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT)
            count = 0
        for ext, payload in members:
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(payload)
            info.mode = 0o444
            info.mtime = 0
            tar.addfile(info, io.BytesIO(payload))
        count += 1
    close()
    return shards


def build(out: Path, size: int, shard_size: int, digits: bool, seed: int) -> dict[str, object]:
    """Build the dataset in ``out`` unless a matching ``manifest.json`` is already there.

    Args:
        out: dataset directory (created if missing).
        size: target size of the text shards together, bytes (approximate: whole samples).
        shard_size: size of one shard, bytes (see :func:`write_shards`).
        digits: also write the digits shard(s).
        seed: shuffle seed of the corpus copies.

    Returns:
        The manifest (also written to ``out/manifest.json``).
    """
    params = {"format": FORMAT_VERSION, "size": size, "shard_size": shard_size,
              "digits": digits, "seed": seed}
    manifest_path = out / MANIFEST
    if manifest_path.exists():
        try:
            old = json.loads(manifest_path.read_text())
            complete = all(
                (out / s["name"]).is_file() and (out / s["name"]).stat().st_size == s["bytes"]
                for s in old["text"] + old["digits"]
            )
            if old.get("params") == params and complete:
                old["reused"] = True
                return old
        except (OSError, ValueError, KeyError, TypeError):
            pass
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("text-*.tar"), *out.glob("digits-*.tar"), manifest_path]:
        stale.unlink(missing_ok=True)

    one_pass = sum(member_bytes(len(p)) for p in corpus.text_samples())
    text = write_shards(out, "text", text_stream(size, seed), shard_size)
    dig = write_shards(out, "digits", digits_stream(seed), shard_size) if digits else []
    manifest: dict[str, object] = {
        "params": params,
        "source": "paragraphs of the Python standard library's .py files (UTF-8 bytes)"
        + (" and scikit-learn's 8x8 digits" if digits else ""),
        "text_copies": round(sum(s.bytes for s in text) / one_pass, 2),
        "text": [asdict(s) for s in text],
        "digits": [asdict(s) for s in dig],
    }
    tmp = out / f".{MANIFEST}.partial"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, manifest_path)
    manifest["reused"] = False
    return manifest


def summary(manifest: dict[str, object]) -> str:
    """One human-readable line about the dataset in ``manifest``."""
    text = manifest["text"]
    dig = manifest["digits"]
    assert isinstance(text, list) and isinstance(dig, list)
    n = sum(s["samples"] for s in text)
    b = sum(s["bytes"] for s in text)
    line = (f"{len(text)} text shards, {n:,} samples, {b / 2**20:.1f} MiB "
            f"({manifest['text_copies']}x one pass over the corpus)")
    if dig:
        line += (f"; {len(dig)} digits shard(s), {sum(s['samples'] for s in dig):,} samples, "
                 f"{sum(s['bytes'] for s in dig) / 2**20:.1f} MiB")
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("demo-data/backing"),
                   help="dataset directory (default: demo-data/backing)")
    p.add_argument("--size", type=parse_size, default=parse_size("48MiB"),
                   help="total size of the text shards, e.g. 48MiB (default); more than ~44MiB "
                        "repeats the corpus in a new shuffled order per copy")
    p.add_argument("--shard-size", type=parse_size, default=parse_size("4MiB"),
                   help="size of one shard (default 4MiB)")
    p.add_argument("--digits", action="store_true", help="also write the 8x8 digits shard")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    manifest = build(args.out, args.size, args.shard_size, args.digits, args.seed)
    verb = "reused" if manifest["reused"] else "built"
    print(f"{verb} {args.out}: {summary(manifest)} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
