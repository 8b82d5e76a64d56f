"""Train a small CNN on a folder of real PNG images, the way ``torchvision.datasets.ImageFolder``
reads them, through a tierfs mount or straight from the directory behind it.

The images are scikit-learn's bundled handwritten digits (1,797 8x8 images, ``load_digits``),
written as PNG files into one directory per class (``0/``..``9/``), scaled up (``--px``) with a
little noise and shifted by a pixel or two per copy (``--copies``), so a dataset of several
thousand small files of a few KiB to ~100 KiB each comes out, as image datasets are laid out.
Nothing is downloaded.

:class:`ImageFolder` is a dozen lines of what torchvision's does (torchvision is not needed):
classes are the sorted subdirectory names, a sample is ``(path, class index)``, and
``__getitem__`` opens the file, decodes it with PIL and converts it to a ``[1, 32, 32]`` float
tensor. A ``DataLoader`` with ``--workers`` processes and ``shuffle=True`` reads it, one
``open``/``read``/``close`` per image, in a new random order each epoch.

Per epoch it prints samples/s and the *data-wait fraction*: the time the training loop waited
for the next batch (``iter(loader)`` and every ``next``) over the epoch's wall time.

    python examples/imagefolder.py make DIR [--copies 5 --px 96]
    python examples/imagefolder.py train --data DIR_OR_MOUNT [--epochs 2 --workers 4]
    sudo python examples/imagefolder.py compare --backing DIR [--ram 1GiB]   # both, one table

``compare`` trains on the backing directory, then mounts tierfs over it (a temporary mountpoint,
always unmounted) and trains through the mount. Before epoch 1 of each run every image is dropped
from the page cache (``posix_fadvise(DONTNEED)`` on the backing files and, for tierfs, on the
mount: not timed), so epoch 1 is cold (tierfs: every file a miss) and epoch 2 warm.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# -- the dataset ------------------------------------------------------------------------------
def make(out: Path, copies: int, px: int, seed: int = 0) -> int:
    """Write the digits as ``out/<class>/<n>.png``; returns the number of files."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    n = 0
    for c in range(10):
        (out / str(c)).mkdir(parents=True, exist_ok=True)
    for k in range(copies):
        for i, (img, label) in enumerate(zip(digits.images, digits.target, strict=True)):
            a = np.kron(img / 16.0, np.ones((px // 8, px // 8)))  # nearest-neighbour scale-up
            a = np.roll(a, (rng.integers(-2, 3), rng.integers(-2, 3)), axis=(0, 1))
            a = np.clip(a * 255 + rng.normal(0, 12, a.shape), 0, 255).astype(np.uint8)
            rgb = np.stack([a, np.roll(a, 1, axis=0), np.roll(a, 1, axis=1)], axis=-1)
            Image.fromarray(rgb).save(out / str(label) / f"{k:02d}-{i:05d}.png")
            n += 1
    return n


class ImageFolder:
    """torchvision's ImageFolder, reduced: ``root/<class>/<file>``; items are
    ``(tensor [1, 32, 32] in [0, 1], class index)``."""

    def __init__(self, root: str) -> None:
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.samples = [(os.path.join(root, c, f), i) for i, c in enumerate(self.classes)
                        for f in sorted(os.listdir(os.path.join(root, c)))]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        import numpy as np
        import torch
        from PIL import Image

        path, label = self.samples[i]
        # unbuffered: the whole file in one read, and no isatty() ioctl (a request to a FUSE
        # daemon per file, which Python's default buffered open() asks; docs/user-guide.md)
        with open(path, "rb", buffering=0) as f:
            img = Image.open(io.BytesIO(f.read())).convert("L").resize((32, 32))
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)[None]
        return x, label


# -- training -----------------------------------------------------------------------------------
def drop_page_cache(root: Path) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def train(data: str, epochs: int, workers: int, batch: int, seed: int,
          evict: list[Path] | None = None) -> list[dict]:
    """Per epoch: samples/s, data-wait fraction, loss, accuracy on the epoch's batches."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    ds = ImageFolder(data)
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(32 * 8 * 8, len(ds.classes)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    out = []
    for epoch in range(epochs):
        if epoch == 0 and evict:
            for root in evict:
                drop_page_cache(root)
        g = torch.Generator().manual_seed(seed + epoch)
        loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                                             generator=g, persistent_workers=False)
        t0 = time.perf_counter()
        wait = 0.0
        n = correct = 0
        loss_sum = 0.0
        t = time.perf_counter()
        it = iter(loader)
        wait += time.perf_counter() - t
        while True:
            t = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                wait += time.perf_counter() - t
                break
            wait += time.perf_counter() - t
            logits = model(x)
            loss = nn.functional.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            n += len(y)
            loss_sum += loss.item() * len(y)
            correct += int((logits.argmax(1) == y).sum())
        wall = time.perf_counter() - t0
        out.append({"epoch": epoch + 1, "samples": n, "seconds": wall, "samples_per_s": n / wall,
                    "data_wait_fraction": wait / wall, "loss": loss_sum / n, "accuracy": correct / n})
        print(f"epoch {epoch + 1}: {n} images in {wall:.1f} s ({n / wall:,.0f}/s), data wait "
              f"{wait / wall:.0%}, loss {loss_sum / n:.3f}, accuracy {correct / n:.1%}", flush=True)
    return out


# -- compare: backing directory vs tierfs --------------------------------------------------------
def is_mounted(path: Path) -> bool:
    with open("/proc/mounts") as f:
        return any(len(line.split()) > 1 and line.split()[1] == str(path) for line in f)


def compare(args: argparse.Namespace) -> int:
    backing = Path(args.backing).resolve()
    rows = {"backing directory": train(str(backing), args.epochs, args.workers, args.batch, args.seed,
                                       evict=[backing])}
    mnt = Path(tempfile.mkdtemp(prefix="imagefolder-mnt-"))
    try:
        subprocess.run([sys.executable, "-m", "tierfs", "mount", str(backing), str(mnt), "--ram", args.ram,
                        *args.extra], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        rows[" ".join(["tierfs", *args.extra])] = train(str(mnt), args.epochs, args.workers, args.batch, args.seed,
                               evict=[backing, mnt])
        stats = json.loads((mnt / ".tierfs" / "stats.json").read_text())
        ram = next((t for t in stats["tiers"] if t["name"] == "ram"), None)
        if ram is not None:
            print(f"tierfs RAM tier: hit ratio {ram['hit_ratio']:.2f}")
    finally:
        if is_mounted(mnt):
            subprocess.run([sys.executable, "-m", "tierfs", "umount", str(mnt)], cwd=REPO,
                           capture_output=True, timeout=300)
        for cmd in (["fusermount3", "-u", str(mnt)], ["umount", "-l", str(mnt)]):
            if is_mounted(mnt):
                subprocess.run(cmd, capture_output=True)
        try:
            mnt.rmdir()
        except OSError:
            pass
    print("\n| read from | epoch | images/s | data-wait fraction |\n|---|---|---:|---:|")
    for name, eps in rows.items():
        for e in eps:
            kind = "cold" if e["epoch"] == 1 else "warm"
            print(f"| {name} | {e['epoch']} ({kind}) | {e['samples_per_s']:,.0f} | {e['data_wait_fraction']:.2f} |")
    if args.json:
        print(json.dumps(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write the PNG image folder")
    m.add_argument("out")
    m.add_argument("--copies", type=int, default=5, help="copies of the 1,797 digits (shifted, noisy)")
    m.add_argument("--px", type=int, default=96, help="image side in pixels (a multiple of 8)")
    for name in ("train", "compare"):
        t = sub.add_parser(name)
        if name == "train":
            t.add_argument("--data", required=True)
            t.add_argument("--evict-page-cache", action="store_true", help="drop --data's files from the page cache before epoch 1")
        else:
            t.add_argument("--backing", required=True, help="the image folder (made by `make`)")
            t.add_argument("--ram", default="1GiB")
            t.add_argument("--tierfs-arg", dest="extra", action="append", default=[],
                           help="extra argument for tierfs mount (repeatable): --tierfs-arg=-o --tierfs-arg=ro")
            t.add_argument("--json", action="store_true")
        t.add_argument("--epochs", type=int, default=2)
        t.add_argument("--workers", type=int, default=4)
        t.add_argument("--batch", type=int, default=64)
        t.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.cmd == "make":
        t = time.perf_counter()
        n = make(Path(args.out), args.copies, args.px)
        size = sum(f.stat().st_size for f in Path(args.out).rglob("*.png"))
        print(f"{n} PNG files, {size / n / 1024:.1f} KiB each on average, in {time.perf_counter() - t:.1f} s")
        return 0
    if args.cmd == "train":
        train(args.data, args.epochs, args.workers, args.batch, args.seed,
              evict=[Path(args.data)] if args.evict_page_cache else None)
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
