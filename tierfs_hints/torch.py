"""PyTorch glue: announce each epoch's read order to tierfs, automatically.

Two lines to adopt in an existing training script, for a map-style dataset whose
``path_of(index)`` says which file holds a sample::

    from tierfs_hints.torch import HintedSampler                          # line 1
    sampler = HintedSampler(DistributedSampler(ds), ds.path_of)           # line 2 (was: DistributedSampler(ds))
    loader = DataLoader(ds, sampler=sampler, num_workers=8, ...)          # unchanged
    for epoch in range(epochs):
        sampler.set_epoch(epoch)                                          # unchanged
        for batch in loader: ...

and for WebDataset-style shard lists, one stage in the pipeline (after the shard shuffle and
split, before the shards are opened)::

    from tierfs_hints.torch import hinted_shards                          # line 1
    ds = wds.DataPipeline(wds.SimpleShardList(urls), wds.shuffle(100), wds.split_by_node,
                          wds.split_by_worker,
                          hinted_shards,                                  # line 2
                          wds.tarfile_to_samples(), ...)

Neither changes what is read or in which order: the sampler yields exactly what the wrapped
sampler yields, the stage yields exactly the shards it receives. On paths that are not on a
tierfs mount both just iterate (one :class:`~tierfs_hints.TierfsHintWarning` per process).
Errors of the hint itself (a path escaping its mount, a daemon that stopped answering,
``FileNotFoundError`` for files that do not exist) propagate: they point at a real problem.

Importing this module imports torch; ``import tierfs_hints`` does not import this module.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch.utils.data import Sampler, get_worker_info

from tierfs_hints import client as _client
from tierfs_hints.client import Client, NeedHandle

__all__ = ["HintedSampler", "files_of", "hinted_shards", "worker_source"]

#: Default cap on the shards :func:`hinted_shards` announces per pass (a resampled shard stream
#: is endless; what lies beyond the cap is yielded without being announced).
SHARD_LIMIT = 100_000


def _lookup(path_of: Any, who: str) -> Callable[[Any], Any]:
    if callable(path_of):
        return path_of  # type: ignore[no-any-return]
    if isinstance(path_of, Sequence) and not isinstance(path_of, str | bytes):
        return path_of.__getitem__
    raise ValueError(f"{who}: path_of must be a callable index -> path, or a sequence of paths "
                     f"indexed by sample, got {type(path_of).__name__}")


def _join(base: str | None, f: Any) -> Any:
    if base is None:
        return f
    if isinstance(f, tuple):
        return (os.path.join(base, os.fspath(f[0])), *f[1:])
    return os.path.join(base, os.fspath(f))


def files_of(order: Iterable[Any], path_of: Callable[[Any], Any], base: str | None = None) -> list[Any]:
    """The files read by a sampler's ``order``, in order, consecutive repeats merged.

    ``order`` holds indices (ints) or batches of them (lists, tuples, 1-D tensors, as a batch
    sampler yields). ``path_of(index)`` returns a path, a ``(path, offset, length)`` range, or
    None (the sample is in no file: skipped). Relative paths are joined to ``base``.
    Cost: one ``path_of`` call per index."""
    out: list[Any] = []
    last: Any = None
    for item in order:
        if isinstance(item, int):
            batch: Iterable[Any] = (item,)
        elif isinstance(item, torch.Tensor):
            batch = item.reshape(-1).tolist()
        elif isinstance(item, list | tuple):
            batch = item
        else:
            batch = (item,)
        for index in batch:
            f = path_of(index)
            if f is None or f == last:
                continue
            last = f
            out.append(f)
    if base is not None:
        out = [_join(base, f) for f in out]
    return out


class HintedSampler(Sampler):  # type: ignore[type-arg]
    """Wraps a sampler; at the start of each epoch announces the files it will read, in order.

    Works with any sampler or batch sampler of a map-style dataset: ``RandomSampler``,
    ``SequentialSampler``, ``DistributedSampler`` (each rank announces its own share, under its
    own source ``host:pid``), ``BatchSampler`` (pass it as ``batch_sampler=``), or a custom one.
    The DataLoader iterates samplers in the main process, so worker processes change nothing.

    Each ``iter()`` materializes the wrapped sampler's order for the epoch (``list(sampler)``:
    one Python int per index, ~36 bytes; 1 M samples ~ 36 MB for the epoch), maps it to files
    with ``path_of`` (consecutive repeats merged: a shard holding 1000 consecutive samples is
    announced once per run), calls :func:`tierfs_hints.epoch` (which replaces the previous
    epoch's order) and then yields exactly the same indices. This happens at the first
    ``next()``, not at ``iter()`` (the DataLoader makes and drops an unused iterator each
    epoch), and draws the same random numbers as iterating the wrapped sampler lazily would, so
    the order is unchanged.

    Args:
        sampler: the sampler to wrap (yields indices, or lists of indices).
        path_of: ``index -> path``, ``(path, offset, length)`` or None (no file), e.g. a
            dataset's method; or a sequence of paths indexed by sample.
        lookahead_epochs: also announce the orders of this many following epochs after this
            one's (so data reused across the epoch boundary is kept). Needs a sampler whose
            order is a function of its epoch (``set_epoch``, like ``DistributedSampler``);
            costs that many more materialized orders per epoch.
        by: deadline of each epoch's order, seconds (or a timedelta) from the start of each
            epoch; None: prefetch in order, without a deadline.
        mount: directory that relative paths from ``path_of`` are relative to (the mount point
            or the dataset root); default the current directory.
        client: the :class:`~tierfs_hints.Client` to use (default: the shared one).

    Attributes:
        sampler: the wrapped sampler.
        handle: the :class:`~tierfs_hints.NeedHandle` of the latest announcement (None before).

    Raises:
        ValueError: bad arguments (at construction), a bad path from ``path_of`` (at ``iter``).
    """

    def __init__(self, sampler: Iterable[Any], path_of: Any, *, lookahead_epochs: int = 0,
                 by: float | timedelta | None = None, mount: Any = None,
                 client: Client | None = None) -> None:
        super().__init__()
        who = "HintedSampler"
        if not isinstance(sampler, Iterable):
            raise ValueError(f"{who}: sampler must be iterable, got {type(sampler).__name__}")
        self.sampler = sampler
        self.path_of = _lookup(path_of, who)
        self.lookahead_epochs = _client._int(lookahead_epochs, who, "lookahead_epochs", 0)
        if self.lookahead_epochs and not callable(getattr(sampler, "set_epoch", None)):
            raise ValueError(
                f"{who}: lookahead_epochs needs a sampler whose order depends only on its epoch "
                f"(one with set_epoch, like DistributedSampler); {type(sampler).__name__} has none")
        if by is not None:
            _client._seconds(by, who, "by", past_ok=False, dates=False)
        self.by = by
        self.mount = None if mount is None else os.path.abspath(_client._fspath(mount, who, "mount", None))
        self.client = client
        self.handle: NeedHandle | None = None
        self._epoch = 0

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped sampler, if it has ``set_epoch``."""
        self._epoch = epoch
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]

    def _current_epoch(self) -> int:
        e = getattr(self.sampler, "epoch", self._epoch)
        return e if isinstance(e, int) else self._epoch

    def _order_of(self, epoch: int) -> list[Any]:
        """The wrapped sampler's order at ``epoch``, leaving its epoch as it was."""
        current = self._current_epoch()
        self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        try:
            return list(self.sampler)
        finally:
            self.sampler.set_epoch(current)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:
        # A generator on purpose: the work starts at the first next(). The DataLoader calls
        # iter() on its sampler twice per epoch and drops the first iterator unused; an eager
        # __iter__ would announce twice and draw the wrapped sampler's random numbers twice.
        order = list(self.sampler)
        files = files_of(order, self.path_of, self.mount)
        if self.lookahead_epochs:
            e = self._current_epoch()
            for j in range(1, self.lookahead_epochs + 1):
                files += files_of(self._order_of(e + j), self.path_of, self.mount)
        c = self.client or _client.default_client()
        self.handle = c.epoch(files, by=self.by)
        yield from order


def worker_source() -> str:
    """The ``source`` of an epoch order announced here: ``host:pid`` in the main process,
    ``host:ppid:wN`` in DataLoader worker N. Stable across epochs even when the DataLoader
    starts new workers each epoch, so each worker's new order replaces its previous one."""
    info = get_worker_info()
    if info is None:
        return _client.default_source()
    return f"{_client.default_source().rsplit(':', 1)[0]}:{os.getppid()}:w{info.id}"


def _shard_path(item: Any) -> Any:
    """The local file of a shard list item, or None (a remote or ``pipe:`` URL)."""
    if isinstance(item, dict):
        item = item.get("url")
        if item is None:
            return None
    if isinstance(item, str):
        if item.startswith("file://"):
            return item[len("file://"):]
        if item.startswith("file:"):
            return item[len("file:"):]
        if "://" in item or item.startswith("pipe:"):
            return None
        return item
    if isinstance(item, os.PathLike):
        return item
    return None


def hinted_shards(shards: Iterable[Any], *, path_of: Callable[[Any], Any] | None = None,
                  by: float | timedelta | None = None, limit: int = SHARD_LIMIT,
                  client: Client | None = None) -> Iterator[Any]:
    """Yield ``shards`` unchanged, announcing them first as the coming epoch's order.

    A generator, so it is a WebDataset pipeline stage as it is (``f(source) -> iterator``),
    and wraps any per-epoch shard list in a plain ``IterableDataset``::

        def __iter__(self):
            for shard in hinted_shards(my_split_of(self.shards)):
                yield from read_samples(shard)

    When the first shard is requested, up to ``limit`` shards are taken from ``shards``,
    announced with :func:`tierfs_hints.epoch` under :func:`worker_source` and then yielded, the
    rest (an endless resampled stream) without announcement. Place it after the shard shuffle
    and the node/worker split, so that the order announced is the order read: in a DataLoader
    each worker then announces its own split, and the daemon knows what every worker reads
    next. (The fixed pipeline of the ``wds.WebDataset`` class opens no slot there; build the
    same pipeline with ``wds.DataPipeline``, as in the module docstring.)

    Args:
        shards: paths, ``file:`` URLs, or WebDataset items ``{"url": ...}``; other URLs (http,
            ``pipe:``...) are yielded but not announced, unless ``path_of`` maps them.
        path_of: ``item -> path`` (or None) for items the defaults do not understand, e.g.
            ``lambda url: url.split()[-1]`` for ``pipe:cat /mnt/data/x.tar``.
        by: deadline of the order, seconds (or a timedelta) from the start of the pass.
        limit: most shards announced per pass.
        client: the :class:`~tierfs_hints.Client` (default: the shared one).

    Raises:
        ValueError: bad arguments or shard paths (when the first shard is requested).
    """
    who = "hinted_shards"
    limit = _client._int(limit, who, "limit", 1)
    if by is not None:
        _client._seconds(by, who, "by", past_ok=False, dates=False)
    it = iter(shards)
    head = list(itertools.islice(it, limit))
    mapper = path_of or _shard_path
    files = [p for p in map(mapper, head) if p is not None]
    if files:
        source = worker_source() if get_worker_info() is not None else None  # None: the client's
        (client or _client.default_client()).epoch(files, source=source, by=by)
    yield from head
    yield from it
