"""The stats document: aggregates the ``statistics()`` records of each component.

Versioned (``version``, :data:`tierfs_hints.wire.STATS_VERSION`); a field is only ever added.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from tierfs import io, tasks
from tierfs.cache.manager import Cache
from tierfs.sched.scheduler import TransactionScheduler
from tierfs.writeback.manager import WriteBack
from tierfs_hints.wire import STATS_VERSION


def build(
    *, cache: Cache, scheduler: TransactionScheduler, writeback: WriteBack, started: float, backing: str,
    mountpoint: str, chunk_size: int, open_files: int, inodes: int,
    fuse_reads: tuple[int, int, int] = (0, 0, 0), fuse_writes: tuple[int, int] = (0, 0), devices: list[Any] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    cs = cache.statistics()
    ss = scheduler.statistics()
    tiers = []
    for t in cache.tiers:
        d = dataclasses.asdict(t.statistics())
        lookups = d["hits"] + d["misses"]
        d["hit_ratio"] = d["hits"] / lookups if lookups else 0.0
        tiers.append(d)
    served_tiers = sum(t["bytes_served"] for t in tiers)
    served_total = served_tiers + cs.staging_bytes_served + cs.backing_bytes_served
    ws = dataclasses.asdict(writeback.statistics())
    return {
        "version": STATS_VERSION,
        "writeback": ws,
        "uptime_s": time.monotonic() - started,
        # background steps that raised and were logged instead of ending the daemon, by kind
        "background_task_failures": dict(tasks.failures),
        "backing": backing,
        "mountpoint": mountpoint,
        "chunk_size": chunk_size,
        "open_files": open_files,
        "inodes": inodes,
        "fuse": {
            "read_requests": fuse_reads[0],
            "read_request_bytes": fuse_reads[1],
            "mean_read_request_bytes": fuse_reads[1] / fuse_reads[0] if fuse_reads[0] else 0,
            "max_read_request_bytes": fuse_reads[2],
            "write_requests": fuse_writes[0],
            "write_request_bytes": fuse_writes[1],
            "mean_write_request_bytes": fuse_writes[1] / fuse_writes[0] if fuse_writes[0] else 0,
        },
        "tiers": tiers,
        # how each device's blocking calls ran: inline on the event loop while measured cheap,
        # else in its worker threads (tierfs.io.Device)
        "devices": {d.name: {"inline_calls": d.inline_calls, "thread_calls": d.thread_calls,
                             "slow_inline_calls": d.slow_inline_calls} for d in devices},
        "staging": {
            "used_bytes": cs.staging_bytes,
            "capacity_bytes": cs.staging_capacity_bytes,
            "hits": cs.staging_hits,
            "bytes_served": cs.staging_bytes_served,
        },
        "cache": {
            "policy": cs.policy,
            "bytes_served_from_tiers": served_tiers,
            "bytes_served_from_staging": cs.staging_bytes_served,
            "bytes_served_from_backing": cs.backing_bytes_served,
            "tier_byte_ratio": served_tiers / served_total if served_total else 0.0,
            "placements": cs.placements,
            "bypassed": cs.bypassed,
            "checksum_failures": cs.checksum_failures,
            "partial_fetches": cs.partial_fetches,
            # misses copied backing -> tier file in the kernel, and by which method
            "direct_fetches": cs.direct_fetches,
            "kernel_copies": dict(io.copy_stats.calls),
            # passthrough (tiers[].passthrough_*): reads the kernel serves from a tier file never
            # reach the daemon and are in none of the hit or byte counts above
            "leased_files": cs.leased_files,
            "passthrough_refusals": cs.passthrough_refusals,
        },
        "scheduler": {
            "queued": ss.queued,
            "in_flight": ss.in_flight,
            "depth": ss.depth,
            "slice_bytes": ss.slice_bytes,
            "backing_bytes_read": ss.backing_bytes_read,
            "backing_reads": ss.backing_reads,
            "chunks_fetched": ss.chunks_fetched,
            "coalesced_chunks": ss.coalesced_chunks,
            "mean_transfer_bytes": ss.backing_bytes_read / ss.backing_reads if ss.backing_reads else 0,
            "busy_seconds": ss.busy_seconds,
            "busy_fraction": ss.busy_fraction,
            "demand_waits": ss.demand_waits,
            "demand_wait_mean_s": ss.demand_wait_mean_s,
            "demand_wait_p99_s": ss.demand_wait_p99_s,
            "deadline_escalations": ss.deadline_escalations,
            "prefetch_used_bytes": cs.prefetch_used_bytes,
            "prefetch_wasted_bytes": cs.prefetch_wasted_bytes,
            "io_tasks": ss.io_tasks,
            "backing_bytes_written": ss.bytes_written,
        },
    }
