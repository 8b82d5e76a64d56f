"""Train a small byte-level language model on WebDataset-style tar shards in any directory.

The script only reads files, so ``--data`` can be a tierfs mount or the slow directory behind it:
the training code is the same either way ("change the path, that's it").

Data pipeline (plain PyTorch + the stdlib ``tarfile`` module, nothing tierfs-specific):

* :class:`ShardStream` is an ``IterableDataset``. Every epoch it shuffles the shard order with
  ``seed + epoch``, gives DataLoader worker ``i`` of ``n`` the shards ``i, i+n, i+2n, ...`` of that
  order, streams each shard front to back (sequential reads, which any file system serves well)
  and shuffles samples within a small buffer.
* A sample is the ``<key>.txt`` member of the shard: a paragraph of Python source as UTF-8 bytes,
  16 to 1024 bytes long. A random window of at most ``--max-len`` bytes is kept.
* ``tierfs_hints.collate.pad_collate`` pads the ragged byte sequences of a batch to ``[B, T]``
  (``labels`` with -100, which the loss ignores).

The model is an embedding of the 256 byte values, a 2-layer GRU and a linear head predicting the
next byte. Loss is reported in nats per byte and bits per byte.

Per epoch the script prints samples/s and the *data-wait fraction*: the time the training loop
spent blocked waiting for the next batch (creating the DataLoader iterator and every
``next(iterator)``) divided by the epoch's wall time. Near 0 means the GPU/CPU never waited for
storage; near 1 means training was starved by I/O.

Example::

    python examples/train.py --data /mnt/tierfs/dataset --epochs 2 --workers 2
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from tierfs_hints.collate import pad_collate

Sample = dict[str, bytes]  # extension -> member payload, plus "__key__"


def iter_tar_samples(path: Path) -> Iterator[Sample]:
    """Stream the samples of one WebDataset-style tar shard, front to back.

    Consecutive members ``<key>.<ext>`` with the same key form one sample
    ``{"__key__": key, ext: payload, ...}`` (the key is the member name up to the first dot of
    its base name). The shard is read sequentially in one pass (``tarfile`` mode ``r|``).
    """
    sample: Sample = {}
    key: str | None = None
    with tarfile.open(path, mode="r|") as tar:
        for member in tar:
            if not member.isfile():
                continue
            base = member.name.rsplit("/", 1)[-1]
            k, dot, ext = base.partition(".")
            if not dot:
                continue
            if k != key:
                if sample:
                    yield sample
                key, sample = k, {"__key__": k.encode()}
            f = tar.extractfile(member)
            assert f is not None
            sample[ext] = f.read()
    if sample:
        yield sample


def shuffled(items: Iterator[Sample], buffer_size: int, rng: random.Random) -> Iterator[Sample]:
    """Shuffle a stream within a buffer of ``buffer_size`` samples (1 = no shuffling)."""
    buf: list[Sample] = []
    for item in items:
        if len(buf) < buffer_size:
            buf.append(item)
            continue
        i = rng.randrange(buffer_size)
        yield buf[i]
        buf[i] = item
    rng.shuffle(buf)
    yield from buf


class ShardStream(IterableDataset[dict[str, torch.Tensor]]):
    """Byte sequences from tar shards, split across DataLoader workers by shard.

    Args:
        shards: the tar shards (any order; they are sorted, then shuffled per epoch).
        seed: base seed of the shard order and of the per-worker sample shuffling.
        buffer_size: shuffle buffer per worker, samples.
        max_len: longest sequence kept, bytes (a longer sample is cut to a random window).
        ext: member extension holding the text.
    """

    def __init__(
        self, shards: list[Path], *, seed: int, buffer_size: int, max_len: int, ext: str = "txt"
    ) -> None:
        super().__init__()
        self.shards = sorted(shards)
        self.seed = seed
        self.buffer_size = buffer_size
        self.max_len = max_len
        self.ext = ext
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (shard order and shuffling); call before iterating the DataLoader."""
        self.epoch = epoch

    def shards_for_worker(self, worker: int, num_workers: int) -> list[Path]:
        """This epoch's shards for DataLoader worker ``worker`` of ``num_workers``."""
        order = list(self.shards)
        random.Random(f"shards-{self.seed}-{self.epoch}").shuffle(order)
        return order[worker::num_workers]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rng = random.Random(f"samples-{self.seed}-{self.epoch}-{worker}")
        mine = self.shards_for_worker(worker, num_workers)
        samples = (s for shard in mine for s in iter_tar_samples(shard))
        for sample in shuffled(samples, self.buffer_size, rng):
            data = sample.get(self.ext)
            if data is None or len(data) < 2:
                continue
            if len(data) > self.max_len:
                start = rng.randrange(len(data) - self.max_len + 1)
                data = data[start : start + self.max_len]
            ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
            yield {"input_ids": ids, "labels": ids}


def evict_page_cache(paths: list[Path]) -> int:
    """Drop ``paths`` from the kernel page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``,
    as if they had been pushed out by a dataset larger than RAM. Returns the bytes evicted."""
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


class ByteGRU(nn.Module):
    """Causal byte-level language model: embedding(256, width) -> GRU x layers -> linear(256)."""

    def __init__(self, width: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.rnn = nn.GRU(width, width, num_layers=layers, batch_first=True)
        self.head = nn.Linear(width, 256)

    def forward(
        self, input_ids: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T]`` byte ids -> (``[B, T, 256]`` next-byte logits, final GRU state)."""
        out, state = self.rnn(self.embed(input_ids), state)
        return self.head(out), state


def next_byte_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats per byte) of predicting byte ``t+1`` from bytes ``..t``;
    positions labelled -100 (padding) are ignored."""
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


@torch.no_grad()
def generate(model: ByteGRU, prompt: bytes, n: int, temperature: float, seed: int) -> bytes:
    """Sample ``n`` bytes after ``prompt`` (seeded, so the output is reproducible)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    x = torch.tensor([list(prompt)])
    logits, state = model(x)
    out = bytearray()
    for _ in range(n):
        probs = torch.softmax(logits[0, -1] / temperature, dim=-1)
        nxt = int(torch.multinomial(probs, 1, generator=gen))
        out.append(nxt)
        logits, state = model(torch.tensor([[nxt]]), state)
    model.train()
    return bytes(out)


@dataclass
class EpochStats:
    """Figures of one epoch. Times in seconds; ``data_wait_fraction`` = ``data_wait_s / wall_s``."""

    epoch: int
    steps: int
    samples: int
    tokens: int
    wall_s: float
    data_wait_s: float
    loss: float  # mean training loss, nats per byte
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    data_wait_fraction: float = 0.0
    first_batch_s: float = 0.0  # from creating the iterator to the first batch

    def __post_init__(self) -> None:
        self.samples_per_s = self.samples / self.wall_s if self.wall_s else 0.0
        self.tokens_per_s = self.tokens / self.wall_s if self.wall_s else 0.0
        self.data_wait_fraction = self.data_wait_s / self.wall_s if self.wall_s else 0.0


def run_epoch(
    model: ByteGRU,
    opt: torch.optim.Optimizer,
    loader: DataLoader[dict[str, torch.Tensor]],
    epoch: int,
    max_steps: int | None,
    log_every: int,
) -> EpochStats:
    """Train one epoch (or ``max_steps`` steps), timing how long each ``next()`` blocks."""
    t0 = time.perf_counter()
    it = iter(loader)  # starts the workers: counted as waiting for data
    wait = time.perf_counter() - t0
    first_batch = 0.0
    steps = samples = tokens = 0
    loss_sum = 0.0
    while max_steps is None or steps < max_steps:
        t = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            wait += time.perf_counter() - t
            break
        wait += time.perf_counter() - t
        if steps == 0:
            first_batch = time.perf_counter() - t0

        logits, _ = model(batch["input_ids"])
        loss = next_byte_loss(logits, batch["labels"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        steps += 1
        samples += int(batch["input_ids"].shape[0])
        tokens += int(batch["lengths"].sum())
        loss_sum += loss.item()
        if log_every and steps % log_every == 0:
            el = time.perf_counter() - t0
            print(f"  epoch {epoch} step {steps:4d}  loss {loss_sum / steps:.3f}  "
                  f"{samples / el:6.1f} samples/s  data-wait {wait / el:6.1%}", flush=True)
    wall = time.perf_counter() - t0
    del it  # shuts the workers down (not counted: the epoch's work is done)
    return EpochStats(epoch, steps, samples, tokens, wall, wait,
                      loss_sum / steps if steps else math.nan, first_batch_s=first_batch)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True,
                   help="directory with text-*.tar shards (a tierfs mount or any directory)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--max-steps-per-epoch", type=int, default=None,
                   help="end an epoch after this many steps (default: a full pass)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step")
    p.add_argument("--max-len", type=int, default=128, help="longest sequence, bytes")
    p.add_argument("--shuffle-buffer", type=int, default=1000, help="samples per worker")
    p.add_argument("--width", type=int, default=128, help="embedding and GRU width")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50, help="steps between progress lines")
    p.add_argument("--sample-bytes", type=int, default=160,
                   help="bytes of text to generate after training (0: none)")
    p.add_argument("--evict-page-cache", action="store_true",
                   help="drop the shards from the kernel page cache before each epoch, as if the "
                        "dataset were larger than RAM (a small one is otherwise re-read from the "
                        "page cache and never reaches the file system again)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = p.parse_args(argv)

    shards = sorted(args.data.glob("text-*.tar"))
    if not shards:
        p.error(f"no text-*.tar shards in {args.data} (build them: python examples/make_shards.py)")
    size = sum(s.stat().st_size for s in shards)
    if args.workers > len(shards):
        print(f"note: {args.workers} workers but {len(shards)} shards; some workers stay idle")

    torch.manual_seed(args.seed)
    torch.set_num_threads(os.cpu_count() or 1)
    dataset = ShardStream(shards, seed=args.seed, buffer_size=args.shuffle_buffer,
                          max_len=args.max_len)
    loader = DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers,
                        collate_fn=functools.partial(pad_collate, pad_value=0))
    model = ByteGRU(args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"data: {args.data} ({len(shards)} shards, {size / 2**20:.1f} MiB)  "
          f"model: byte GRU, {n_params / 1e3:.0f}k parameters  "
          f"batch {args.batch_size}, {args.workers} workers, torch threads {torch.get_num_threads()}",
          flush=True)

    results: list[EpochStats] = []
    for epoch in range(1, args.epochs + 1):
        dataset.set_epoch(epoch)
        if args.evict_page_cache:  # not timed: it stands in for a dataset larger than RAM
            n = evict_page_cache(shards)
            print(f"epoch {epoch}: evicted {n / 2**20:.1f} MiB of shards from the page cache")
        st = run_epoch(model, opt, loader, epoch, args.max_steps_per_epoch, args.log_every)
        results.append(st)
        print(f"epoch {epoch}: {st.steps} steps, {st.samples} samples in {st.wall_s:.1f} s  "
              f"samples/s {st.samples_per_s:.1f}  data-wait fraction {st.data_wait_fraction:.1%}  "
              f"(first batch after {st.first_batch_s:.2f} s)  "
              f"loss {st.loss:.3f} nats/byte = {st.loss / math.log(2):.2f} bits/byte", flush=True)

    if args.sample_bytes:
        prompt = b"def "
        text = prompt + generate(model, prompt, args.sample_bytes, 0.7, args.seed)
        shown = text.decode("utf-8", errors="replace")
        print("sample from the model (temperature 0.7):\n    " + shown.replace("\n", "\n    "))
    if args.json:
        print(json.dumps({"data": str(args.data), "shards": len(shards), "bytes": size,
                          "workers": args.workers, "batch_size": args.batch_size,
                          "evict_page_cache": args.evict_page_cache,
                          "epochs": [asdict(r) for r in results]}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
