"""Real data shipped inside installed packages, so the demo and the benchmarks need no download.

* text: the ``.py`` files of Python's standard library, split into paragraphs at blank lines and
  tokenized as UTF-8 bytes (vocabulary 256). Lengths are naturally ragged (a few bytes to many KiB),
  which is what the ragged collators are for.
* digits: scikit-learn's bundled 8x8 handwritten digits (1797 images, ``sklearn.datasets.load_digits``).
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator

MIN_TOKENS = 16


def stdlib_sources() -> list[str]:
    """Paths of the standard library's ``.py`` files, sorted (deterministic across runs)."""
    root = sysconfig.get_paths()["stdlib"]
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "test", "tests", "idlelib"))
        out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return out


def text_samples(max_tokens: int = 1024, limit: int | None = None) -> Iterator[bytes]:
    """Yield paragraphs of stdlib source as UTF-8 bytes, each ``MIN_TOKENS..max_tokens`` long.

    A paragraph longer than ``max_tokens`` is cut into ``max_tokens`` pieces (the last piece kept
    if it is at least ``MIN_TOKENS``). Deterministic order.
    """
    n = 0
    for path in stdlib_sources():
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        for para in data.split(b"\n\n"):
            para = para.strip(b"\n")
            for i in range(0, len(para), max_tokens):
                piece = para[i : i + max_tokens]
                if len(piece) < MIN_TOKENS:
                    continue
                yield piece
                n += 1
                if limit is not None and n >= limit:
                    return


def text_lengths(max_tokens: int = 1024, limit: int | None = None) -> list[int]:
    """Token counts of :func:`text_samples` (for collation benchmarks)."""
    return [len(s) for s in text_samples(max_tokens, limit)]


def digits() -> tuple[list[bytes], list[int]]:
    """scikit-learn's 8x8 digits as 8-bit grayscale images (raw bytes, 64 per image) and labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = [(img * 255.0 / 16.0).astype("uint8").tobytes() for img in d.images]
    return images, [int(t) for t in d.target]
