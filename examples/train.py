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

Optional parts (off by default):

* ``--eval-every N``: every N training steps an eval pass (forward only) over held-out shards
  (``--eval-shards DIR``, or the last ``--eval-holdout`` shards of ``--data``). Per pass it
  records the share of the eval bytes tierfs held in a tier when the pass started (the mount's
  ``where`` request: an observation, nothing is fetched), and the pass's own data wait.
* ``--hints`` (``tierfs_hints``, see docs/hints.md): at the start of each epoch the main process
  announces the shards in the order the DataLoader reads them (the workers' lists interleaved)
  followed by the next epoch's order (``--hints-lookahead``; the order is a function of
  ``--seed`` and the epoch), with ``tierfs_hints.epoch``; and each eval pass, once it is
  estimated to start within ``--eval-lead`` seconds, with ``tierfs_hints.phase("eval0" or
  "eval1", at=..., needs=eval_shards)`` (see :class:`Evaluator`). What is read, in which order, and the model are the same with and
  without it. ``--hints-source workers`` has each DataLoader worker announce its own list
  instead, under its own source.

Example::

    python examples/train.py --data /mnt/tierfs/dataset --epochs 2 --workers 2
    python examples/train.py --data /mnt/tierfs/dataset --hints --eval-every 200
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
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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
        self, shards: list[Path], *, seed: int, buffer_size: int, max_len: int, ext: str = "txt",
        worker_hints_epochs: int = 0,
    ) -> None:
        super().__init__()
        self.shards = sorted(shards)
        self.seed = seed
        self.buffer_size = buffer_size
        self.max_len = max_len
        self.ext = ext
        self.epoch = 0
        # --hints-source workers: each worker announces its own shards of the epochs
        # [epoch, epoch + worker_hints_epochs) (0: no hints from the workers)
        self.worker_hints_epochs = worker_hints_epochs

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (shard order and shuffling); call before iterating the DataLoader."""
        self.epoch = epoch

    def shards_for_worker(self, worker: int, num_workers: int, epoch: int | None = None) -> list[Path]:
        """The shards DataLoader worker ``worker`` of ``num_workers`` reads in ``epoch``
        (default: the current one), in its read order."""
        order = list(self.shards)
        random.Random(f"shards-{self.seed}-{self.epoch if epoch is None else epoch}").shuffle(order)
        return order[worker::num_workers]

    def read_order(self, epoch: int, num_workers: int) -> list[Path]:
        """The shards of ``epoch`` in the order a DataLoader with ``num_workers`` workers reads
        them: the workers' lists interleaved (the DataLoader takes batches from its workers in
        turn, and the shards hold about as many samples each, so every worker is at about the
        same position of its list at any time)."""
        per = [self.shards_for_worker(w, max(1, num_workers), epoch) for w in range(max(1, num_workers))]
        return [p[k] for k in range(max(map(len, per))) for p in per if k < len(p)]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rng = random.Random(f"samples-{self.seed}-{self.epoch}-{worker}")
        mine = self.shards_for_worker(worker, num_workers)
        if self.worker_hints_epochs:
            # The worker's own read order (plus the next epochs'), under a source of its own
            # (host:ppid:wN) so that the workers do not replace each other's orders.
            import tierfs_hints
            from tierfs_hints.torch import worker_source

            order = [p for e in range(self.epoch, self.epoch + self.worker_hints_epochs)
                     for p in self.shards_for_worker(worker, num_workers, e)]
            tierfs_hints.epoch(order, source=worker_source() if info is not None else None)
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


def timed_next(it: Iterator[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor] | None, float]:
    """The next batch (None at the end) and the seconds spent waiting for it: the data wait."""
    t = time.perf_counter()
    try:
        batch = next(it)
    except StopIteration:
        batch = None
    return batch, time.perf_counter() - t


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


@dataclass
class EvalStats:
    """Figures of one eval pass. ``resident_*``: bytes of the eval shards in a tierfs tier (or
    the daemon's staging memory: a read would not wait for the backing store) when the pass
    started, from the mount's ``where`` request (None when the shards are on no tierfs mount).
    ``deadline_met`` is True when every byte was resident then (with or without a hint: the data
    was there when the eval needed it). ``hint_*``: the daemon's view of the ``phase`` hint at
    the start (None without ``--hints``)."""

    step: int  # global training step after which it ran
    epoch: int
    samples: int
    wall_s: float
    data_wait_s: float
    first_batch_s: float
    loss: float
    bytes: int
    resident_bytes: int | None
    resident_fraction: float | None
    deadline_met: bool | None  # every byte was resident when the pass started
    announced_lead_s: float | None = None  # seconds from the phase hint to the start
    announced_at_s: float | None = None  # the `at` given to tierfs_hints.phase (estimated start)
    hint_done: bool | None = None  # the daemon had the phase's data resident
    hint_missed: bool | None = None  # the daemon counted the phase's deadline as missed
    hint_deadline_in_s: float | None = None  # negative: the eval started after the `at` estimate


def residency_probe(paths: list[Path]) -> Callable[[], int] | None:
    """A function returning the bytes of ``paths`` held in the tiers (or staging) of the tierfs
    mount they are on, through the mount's ``where`` request; None if they are on no mount.
    Only an observation: it moves no data and changes no cache decision."""
    from tierfs_hints import wire
    from tierfs_hints.client import MountFinder

    real = [os.path.realpath(p) for p in paths]
    root = MountFinder().root_of(os.path.dirname(real[0]))
    if root is None or any(not r.startswith(root + "/") for r in real):
        return None
    rels = [os.path.relpath(r, root) for r in real]

    def resident() -> int:
        reply = wire.request(root, {"op": "where", "paths": rels})
        return sum(min(int(f.get("size", 0)), sum((f.get("resident_bytes") or {}).values()))
                   for f in reply["files"])

    return resident


class Evaluator:
    """An eval pass over held-out shards every ``every`` training steps (global, across epochs).

    With ``hints``, each pass is announced with ``tierfs_hints.phase(name, at=..., needs=shards)``
    once the estimated time until it (steps to go x a moving average of the step time, plus the
    last pass's duration when announced from the pass before) is at most ``lead_s`` seconds.
    When the next pass is that close, it is announced at the start of the current one, before
    the current one reads: the eval shards then always have a declared next use, and tierfs
    keeps them instead of evicting them as each pass reads them and fetching them again for the
    next. The names alternate (``eval0``, ``eval1``): a phase replaces the earlier one of the
    same name, and the current pass's must stay. The next pass's deadline is put after the
    current pass's declared one (a read counts for the need with the earliest deadline). The pass reads its shards through a DataLoader
    like training does (same batch size and collation, ``min(workers, shards)`` workers, no
    shuffling) and is timed the same way; its time is left out of the epoch's figures.
    """

    def __init__(self, shards: list[Path], *, every: int, batch_size: int, workers: int, seed: int,
                 max_len: int, hints: bool, lead_s: float, evict_page_cache: bool) -> None:
        self.shards = sorted(shards)
        self.every = every
        self.hints = hints
        self.lead_s = lead_s
        self.evict_page_cache = evict_page_cache
        self.bytes = sum(p.stat().st_size for p in self.shards)
        dataset = ShardStream(self.shards, seed=seed, buffer_size=1, max_len=max_len)
        self.loader = DataLoader(dataset, batch_size=batch_size,
                                 num_workers=min(workers, len(self.shards)),
                                 collate_fn=functools.partial(pad_collate, pad_value=0))
        self.resident = residency_probe(self.shards)
        self.step = 0
        self.step_s: float | None = None  # moving average of the training step time
        self.last: float | None = None
        self.last_pass_s = 0.0
        # pass number (1, 2, ...) -> (handle, perf_counter when announced, the `at` given)
        self.announced: dict[int, tuple[Any, float, float]] = {}
        self.results: list[EvalStats] = []

    def start_epoch(self) -> None:
        self.last = None  # the first step of an epoch includes starting the workers

    def _announce(self, k: int, eta: float) -> None:
        """Announce pass ``k`` (1-based) if ``eta`` (seconds until it) is within the lead."""
        if not self.hints or k in self.announced or eta > self.lead_s:
            return
        import tierfs_hints

        h = tierfs_hints.phase(f"eval{k % 2}", at=eta, needs=self.shards)
        self.announced[k] = (h, time.perf_counter(), eta)

    def after_step(self, model: ByteGRU, epoch: int) -> float:
        """Call after every training step; runs the eval when it is due. Returns the seconds
        spent in it (0.0 when none ran)."""
        now = time.perf_counter()
        if self.last is not None:
            dt = now - self.last
            self.step_s = dt if self.step_s is None else 0.9 * self.step_s + 0.1 * dt
        self.last = now
        self.step += 1
        if self.step % self.every == 0:
            spent = self.run(model, epoch)
            self.last = time.perf_counter()
            return spent
        if self.step_s is not None:
            self._announce(self.step // self.every + 1, (self.every - self.step % self.every) * self.step_s)
        return 0.0

    @torch.no_grad()
    def run(self, model: ByteGRU, epoch: int) -> float:
        t_in = time.perf_counter()
        if self.evict_page_cache:  # as for the epochs: the mount's page cache would serve it
            evict_page_cache(self.shards)
        k = self.step // self.every  # this pass
        res = self.resident() if self.resident is not None else None
        mine = self.announced.pop(k, None)
        prog = mine[0].progress() if mine is not None else None
        if mine is not None and self.step_s is not None:  # the next pass, before this one reads
            # A read counts for the need with the earliest deadline that has it: the next pass's
            # deadline must come after this one's (an estimate made earlier, maybe still ahead),
            # or this pass's reads would count as the next one's.
            this_deadline = mine[1] + mine[2] - time.perf_counter()
            self._announce(k + 1, max(self.every * self.step_s, this_deadline + 1.0) + self.last_pass_s)
        t0 = time.perf_counter()
        model.eval()
        it = iter(self.loader)
        wait = time.perf_counter() - t0
        first_batch = 0.0
        samples = 0
        loss_sum = 0.0
        steps = 0
        while True:
            batch, waited = timed_next(it)
            wait += waited
            if batch is None:
                break
            if steps == 0:
                first_batch = time.perf_counter() - t0
            logits, _ = model(batch["input_ids"])
            loss_sum += next_byte_loss(logits, batch["labels"]).item()
            samples += int(batch["input_ids"].shape[0])
            steps += 1
        wall = time.perf_counter() - t0
        del it
        model.train()
        st = EvalStats(
            step=self.step, epoch=epoch, samples=samples, wall_s=wall, data_wait_s=wait,
            first_batch_s=first_batch, loss=loss_sum / steps if steps else math.nan,
            bytes=self.bytes, resident_bytes=res,
            resident_fraction=None if res is None else (res / self.bytes if self.bytes else 1.0),
            deadline_met=None if res is None else res >= self.bytes)
        if mine is not None and prog is not None:
            st.announced_lead_s = t0 - mine[1]
            st.announced_at_s = mine[2]
            st.hint_done, st.hint_missed = prog.done, prog.missed
            st.hint_deadline_in_s = prog.deadline_in_s
        self.results.append(st)
        self.last_pass_s = time.perf_counter() - t_in
        ready = "-" if st.resident_fraction is None else f"{st.resident_fraction:.0%}"
        print(f"  eval after step {self.step} (epoch {epoch}): {samples} samples in {wall:.1f} s, "
              f"data wait {wait:.2f} s (first batch {first_batch:.2f} s), eval data resident at "
              f"start {ready}, deadline met {st.deadline_met}, loss {st.loss:.3f} nats/byte",
              flush=True)
        return time.perf_counter() - t_in


def run_epoch(
    model: ByteGRU,
    opt: torch.optim.Optimizer,
    loader: DataLoader[dict[str, torch.Tensor]],
    epoch: int,
    max_steps: int | None,
    log_every: int,
    evaluator: Evaluator | None = None,
    announce: Callable[[], None] | None = None,
) -> EpochStats:
    """Train one epoch (or ``max_steps`` steps), timing how long each ``next()`` blocks.

    ``announce`` (the ``--hints`` announcement of the epoch's read order) runs first and counts
    as waiting for data. Eval passes (``evaluator``) are left out of the epoch's wall time."""
    t0 = time.perf_counter()
    if announce is not None:
        announce()
    it = iter(loader)  # starts the workers: counted as waiting for data
    wait = time.perf_counter() - t0
    paused = 0.0  # seconds spent in eval passes
    first_batch = 0.0
    steps = samples = tokens = 0
    loss_sum = 0.0
    if evaluator is not None:
        evaluator.start_epoch()
    while max_steps is None or steps < max_steps:
        batch, waited = timed_next(it)
        wait += waited
        if batch is None:
            break
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
        if evaluator is not None:
            paused += evaluator.after_step(model, epoch)
        if log_every and steps % log_every == 0:
            el = time.perf_counter() - t0 - paused
            print(f"  epoch {epoch} step {steps:4d}  loss {loss_sum / steps:.3f}  "
                  f"{samples / el:6.1f} samples/s  data-wait {wait / el:6.1%}", flush=True)
    wall = time.perf_counter() - t0 - paused
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
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the training process (default: one per CPU)")
    p.add_argument("--log-every", type=int, default=50, help="steps between progress lines")
    p.add_argument("--sample-bytes", type=int, default=160,
                   help="bytes of text to generate after training (0: none)")
    p.add_argument("--evict-page-cache", action="store_true",
                   help="drop the shards from the kernel page cache before each epoch (and the "
                        "eval shards before each eval), as if the dataset were larger than RAM "
                        "(a small one is otherwise re-read from the page cache and never reaches "
                        "the file system again)")
    p.add_argument("--hints", action="store_true",
                   help="tell tierfs what is read next (tierfs_hints): each epoch's shard order "
                        "and the next eval; no-ops with a warning off a tierfs mount")
    p.add_argument("--hints-source", choices=("loader", "workers"), default="loader",
                   help="loader (default): the main process announces the order the DataLoader "
                        "reads, the workers' shard lists interleaved, as one epoch order; "
                        "workers: each DataLoader worker announces its own list, under its own "
                        "source")
    p.add_argument("--hints-lookahead", type=int, default=1,
                   help="also announce the order of this many following epochs (the order is "
                        "a function of --seed and the epoch), default 1")
    p.add_argument("--eval-every", type=int, default=0,
                   help="run an eval pass every N training steps (default 0: none)")
    p.add_argument("--eval-shards", type=Path, default=None,
                   help="directory with the eval text-*.tar shards (default: hold out the last "
                        "--eval-holdout shards of --data)")
    p.add_argument("--eval-holdout", type=int, default=2,
                   help="shards of --data held out for eval when --eval-every is given without "
                        "--eval-shards, default 2")
    p.add_argument("--eval-lead", type=float, default=30.0,
                   help="with --hints: announce each eval pass (tierfs_hints.phase) once it is "
                        "estimated to start within this many seconds (from the start of the "
                        "pass before, if that is close enough), default 30")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = p.parse_args(argv)

    shards = sorted(args.data.glob("text-*.tar"))
    if not shards:
        p.error(f"no text-*.tar shards in {args.data} (build them: python examples/make_shards.py)")
    eval_shards: list[Path] = []
    if args.eval_every > 0:
        if args.eval_shards is not None:
            eval_shards = sorted(args.eval_shards.glob("text-*.tar"))
        elif 0 < args.eval_holdout < len(shards):
            shards, eval_shards = shards[:-args.eval_holdout], shards[-args.eval_holdout:]
        if not eval_shards:
            p.error("--eval-every needs eval shards: --eval-shards DIR, or --eval-holdout K "
                    "smaller than the number of shards")
    size = sum(s.stat().st_size for s in shards)
    if args.workers > len(shards):
        print(f"note: {args.workers} workers but {len(shards)} shards; some workers stay idle")

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    dataset = ShardStream(shards, seed=args.seed, buffer_size=args.shuffle_buffer,
                          max_len=args.max_len)
    loader = DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers,
                        collate_fn=functools.partial(pad_collate, pad_value=0))
    evaluator = None
    if eval_shards:
        evaluator = Evaluator(eval_shards, every=args.eval_every, batch_size=args.batch_size,
                              workers=args.workers, seed=args.seed, max_len=args.max_len,
                              hints=args.hints, lead_s=args.eval_lead,
                              evict_page_cache=args.evict_page_cache)
    model = ByteGRU(args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"data: {args.data} ({len(shards)} shards, {size / 2**20:.1f} MiB)  "
          f"model: byte GRU, {n_params / 1e3:.0f}k parameters  "
          f"batch {args.batch_size}, {args.workers} workers, torch threads {torch.get_num_threads()}"
          + (f"  eval: {len(eval_shards)} shards every {args.eval_every} steps" if eval_shards else "")
          + (f"  hints: on ({args.hints_source}, lookahead {args.hints_lookahead})" if args.hints else ""),
          flush=True)

    results: list[EpochStats] = []
    announced: list[dict[str, Any]] = []
    for epoch in range(1, args.epochs + 1):
        dataset.set_epoch(epoch)
        if args.evict_page_cache:  # not timed: it stands in for a dataset larger than RAM
            n = evict_page_cache(shards)
            print(f"epoch {epoch}: evicted {n / 2**20:.1f} MiB of shards from the page cache")
        announce = None
        if args.hints:
            epochs = range(epoch, min(args.epochs, epoch + args.hints_lookahead) + 1)
            if args.hints_source == "workers":
                dataset.worker_hints_epochs = len(epochs)
            else:
                def announce(epochs: range = epochs) -> None:
                    import tierfs_hints

                    order = [s for e in epochs for s in dataset.read_order(e, args.workers)]
                    h = tierfs_hints.epoch(order)
                    announced.append({"epoch": epochs[0], "epochs": list(epochs), "shards": len(order),
                                      "files": h.files, "bytes": h.nbytes})
        st = run_epoch(model, opt, loader, epoch, args.max_steps_per_epoch, args.log_every,
                       evaluator, announce)
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
        evals = [] if evaluator is None else [
            asdict(r) for r in evaluator.results]
        print(json.dumps({"data": str(args.data), "shards": len(shards), "bytes": size,
                          "workers": args.workers, "batch_size": args.batch_size,
                          "evict_page_cache": args.evict_page_cache, "hints": args.hints,
                          "hints_source": args.hints_source if args.hints else None,
                          "hints_lookahead": args.hints_lookahead if args.hints else None,
                          "announced": announced,
                          "eval_shards": [str(s) for s in eval_shards],
                          "epochs": [asdict(r) for r in results], "evals": evals}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
