"""Prometheus metrics: the stats document (:mod:`tierfs.stats`) in the Prometheus text format.

One mapping serves both ways out: ``tierfs stats MNT --prometheus`` (the CLI renders the
document it read from ``.tierfs/stats.json``) and the daemon's HTTP endpoint (``metrics_port``,
served by ``prometheus_client`` in its own thread; the collector takes each document from the
event loop with ``trio.from_thread``, since cache state is only ever touched there).

Names follow the Prometheus conventions: ``tierfs_`` prefix, base units in the name
(``_bytes``, ``_seconds``), counters end in ``_total``, tiers and devices are labels
(``tierfs_tier_used_bytes{tier="ram"}``). Fields that are ratios or means of other exported
series (:data:`DERIVED`) are left out: compute them in PromQL from the counters. A numeric field
the mapping does not know yet (a newer stats document) is exported as a gauge named after its
path, so nothing is silently dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from tierfs.errors import MountError

G, C = "gauge", "counter"
Spec = tuple[str, str, str, str]  # field of the section, metric name (no prefix), type, help

TOP: list[Spec] = [
    ("uptime_s", "uptime_seconds", G, "Seconds since the mount."),
    ("chunk_size", "chunk_size_bytes", G, "Unit of caching, fetch and eviction."),
    ("open_files", "open_files", G, "Files open through the mount."),
    ("inodes", "inodes", G, "Inodes the daemon keeps for the kernel."),
]
FUSE: list[Spec] = [
    ("read_requests", "fuse_read_requests", C, "FUSE read requests."),
    ("read_request_bytes", "fuse_read_bytes", C, "Bytes asked for by FUSE read requests."),
    ("max_read_request_bytes", "fuse_max_read_request_bytes", G, "Largest FUSE read request."),
    ("write_requests", "fuse_write_requests", C, "FUSE write requests."),
    ("write_request_bytes", "fuse_write_bytes", C, "Bytes of FUSE write requests."),
]
TIER: list[Spec] = [
    ("capacity_bytes", "tier_capacity_bytes", G, "Configured capacity of the tier."),
    ("effective_capacity_bytes", "tier_effective_capacity_bytes", G,
     "Capacity in effect: lower than configured while the tier's filesystem is full."),
    ("used_bytes", "tier_used_bytes", G, "Cached (clean) bytes in the tier."),
    ("dirty_bytes", "tier_dirty_bytes", G, "Bytes of written files not yet on the backing store."),
    ("chunks", "tier_chunks", G, "Chunks resident in the tier."),
    ("hits", "tier_hits", C, "Chunk accesses served by the tier."),
    ("misses", "tier_misses", C, "Chunk accesses the tier could not serve."),
    ("bytes_served", "tier_served_bytes", C, "Bytes read from the tier."),
    ("promotions", "tier_promotions", C, "Chunks promoted into the tier."),
    ("demotions", "tier_demotions", C, "Chunks demoted out of the tier."),
    ("evictions", "tier_evictions", C, "Chunks evicted from the tier."),
    ("errors", "tier_errors", C, "I/O errors of the tier's device."),
    ("full_events", "tier_full_events", C, "Times the tier had no room for a chunk."),
    ("passthrough_opens", "tier_passthrough_opens", C,
     "Opens the kernel reads straight from the tier file (passthrough; not in hits)."),
    ("passthrough_bytes", "tier_passthrough_bytes", C, "Bytes made available by passthrough opens."),
    ("leased_files", "tier_leased_files", G, "Files held by passthrough opens now (pinned)."),
    ("leased_bytes", "tier_leased_bytes", G, "Bytes of those files."),
]
STAGING: list[Spec] = [
    ("used_bytes", "staging_used_bytes", G, "Daemon memory holding fetched chunks not in a tier."),
    ("capacity_bytes", "staging_capacity_bytes", G, "Limit of the staging memory."),
    ("hits", "staging_hits", C, "Chunk accesses served from staging."),
    ("bytes_served", "staging_served_bytes", C, "Bytes read from staging."),
]
CACHE: list[Spec] = [
    ("placements", "cache_placements", C, "Chunks placed in a tier."),
    ("bypassed", "cache_bypassed", C, "Chunks no tier admitted."),
    ("checksum_failures", "cache_checksum_failures", C, "SSD tier chunks dropped on a checksum mismatch."),
    ("partial_fetches", "cache_partial_fetches", C, "Fetches that read less than a chunk."),
    ("passthrough_refusals", "cache_passthrough_refusals", C,
     "Read-only opens not passed through (the file was not whole in one tier)."),
]
SERVED_FROM = {"bytes_served_from_tiers": "tiers", "bytes_served_from_staging": "staging",
               "bytes_served_from_backing": "backing"}
SCHED: list[Spec] = [
    ("in_flight", "scheduler_in_flight_requests", G, "Backing-store transfers in flight."),
    ("depth", "scheduler_depth", G, "Backing-store transfers allowed in flight (depth)."),
    ("slice_bytes", "scheduler_slice_bytes", G, "Longest single backing-store transfer."),
    ("backing_bytes_read", "backing_read_bytes", C, "Bytes read from the backing store."),
    ("backing_reads", "backing_reads", C, "Read transfers from the backing store."),
    ("chunks_fetched", "scheduler_chunks_fetched", C, "Chunks fetched from the backing store."),
    ("coalesced_chunks", "scheduler_coalesced_chunks", C, "Chunks fetched as part of a longer run."),
    ("busy_seconds", "backing_busy_seconds", C, "Seconds the backing store was busy."),
    ("deadline_escalations", "scheduler_deadline_escalations", C, "Deadline work escalated."),
    ("prefetch_used_bytes", "prefetch_used_bytes", C, "Prefetched bytes that were read."),
    ("prefetch_wasted_bytes", "prefetch_wasted_bytes", C, "Prefetched bytes dropped unread."),
    ("io_tasks", "backing_io_tasks", C, "Other backing-store transactions (write-back)."),
    ("backing_bytes_written", "backing_written_bytes", C, "Bytes written to the backing store."),
]
WRITEBACK: list[Spec] = [
    ("dirty_files", "writeback_dirty_files", G, "Written files not yet on the backing store."),
    ("dirty_bytes", "writeback_dirty_bytes", G, "Bytes of those files."),
    ("oldest_dirty_age_s", "writeback_oldest_dirty_age_seconds", G, "Age of the oldest dirty file."),
    ("writing", "writeback_writing_files", G, "Files being written back now."),
    ("written_files", "writeback_written_files", C, "Files written back."),
    ("written_bytes", "writeback_written_bytes", C, "Bytes written back."),
    ("writeback_seconds", "writeback_seconds", C, "Seconds spent writing back."),
    ("eta_s", "writeback_eta_seconds", G, "Time until every dirty byte is durable (absent: unknown)."),
    ("through_files", "writeback_through_files", G, "Files written through (the write tier was full)."),
    ("failures", "writeback_failures", C, "Failed write-backs (retried)."),
    ("next_deadline_s", "writeback_next_deadline_seconds", G, "Slack of the nearest write-back deadline."),
    ("late_files", "writeback_late_files", G, "Closed files still dirty past writeback_deadline."),
    ("holding", "writeback_holding", G, "1 while a burst of writes holds write-back until it ends."),
    ("hold_seconds", "writeback_hold_seconds", C, "Seconds write-back waited for bursts of writes to end."),
    ("quarantined", "writeback_quarantined_files", G, "Journal entries crash recovery could not honour (kept)."),
    ("journal_errors", "writeback_journal_errors", C, "Journal writes that failed (disk full)."),
    ("copied_up_in_kernel", "writeback_copied_up_in_kernel_bytes", C,
     "Bytes copy-ups copied from the backing store in the kernel."),
    ("passthrough_opens", "writeback_passthrough_opens", C, "Opens of dirty files passed through to their data file."),
    ("passthrough_writable_opens", "writeback_passthrough_writable_opens", C, "Of which open for writing."),
    ("passthrough_refusals", "writeback_passthrough_refusals", C, "Opens of dirty files not passed through."),
    ("passthrough_changes", "writeback_passthrough_changes", C, "Times a data file was found written behind the daemon."),
    ("passthrough_overrun_bytes", "writeback_passthrough_overrun_bytes", C,
     "Bytes passthrough writers put past the write tier's capacity."),
    ("in_place_opens", "writeback_in_place_opens", C,
     "Opens for writing passed through to the tier copy its readers read (written in place)."),
    ("in_place_takes", "writeback_in_place_takes", C, "Times in-place writes were taken in as a dirty copy."),
    ("redirtied", "writeback_redirtied", C, "Clean files still open made dirty again in their data file."),
    ("leased_files", "writeback_leased_files", G, "Dirty files held by passthrough opens now."),
]
DEVICE: list[Spec] = [
    ("inline_calls", "device_inline_calls", C, "Blocking calls run inline on the event loop."),
    ("thread_calls", "device_thread_calls", C, "Blocking calls run in the device's threads."),
    ("slow_inline_calls", "device_slow_inline_calls", C, "Inline calls that took too long."),
]
# ratios and means of exported series, and fields that are labels of tierfs_mount_info
DERIVED = frozenset({
    "version", "backing", "mountpoint", "tiers.name", "tiers.path", "tiers.hit_ratio",
    "fuse.mean_read_request_bytes", "fuse.mean_write_request_bytes", "cache.policy",
    "cache.tier_byte_ratio", "scheduler.mean_transfer_bytes", "scheduler.busy_fraction",
    "writeback.throughput_bytes_per_s", "writeback.write_tier",
    # exported as the summary tierfs_scheduler_demand_wait_seconds
    "scheduler.demand_waits", "scheduler.demand_wait_mean_s", "scheduler.demand_wait_p99_s",
})


@dataclass
class _Family:
    type: str
    help: str
    samples: list[tuple[dict[str, str], float]]


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _generic_name(path: str) -> str:
    name = re.sub(r"_per_s$", "_per_second", re.sub(r"_s$", "_seconds", path.replace(".", "_")))
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


class _Builder:
    def __init__(self) -> None:
        self.families: dict[str, _Family] = {}

    def add(self, name: str, kind: str, help: str, value: Any, labels: dict[str, str] | None = None) -> None:
        if value is None:
            return  # unknown yet (eta_s, next_deadline_s): absent, not 0
        fam = self.families.setdefault(name, _Family(kind, help, []))
        fam.samples.append((labels or {}, float(value)))

    def section(self, doc: dict[str, Any], specs: list[Spec], prefix: str,
                labels: dict[str, str] | None = None) -> None:
        known = {s[0] for s in specs}
        for key, name, kind, help in specs:
            if key in doc:
                self.add(name, kind, help, doc[key], labels)
        for key, value in doc.items():
            if key not in known and f"{prefix}{key}" not in DERIVED:
                self.generic(f"{prefix}{key}", value, labels)

    def generic(self, path: str, value: Any, labels: dict[str, str] | None = None) -> None:
        """A field the mapping does not know: a gauge named after its path."""
        if isinstance(value, dict):
            for k, v in value.items():
                self.generic(f"{path}.{k}", v, labels)
        elif _number(value) or isinstance(value, bool):
            if path.endswith("_ms"):  # Prometheus wants base units: milliseconds become seconds
                path, value = path[:-3] + "_s", value / 1e3
            self.add(_generic_name(path), G, f"stats field {path}", float(value), labels)


def _metrics(doc: dict[str, Any]) -> Iterator[Metric]:
    b = _Builder()
    b.section({k: v for k, v in doc.items() if not isinstance(v, dict | list)}, TOP, "")
    b.section(doc.get("fuse", {}), FUSE, "fuse.")
    for tier in doc.get("tiers", []):
        b.section(tier, TIER, "tiers.", {"tier": str(tier.get("name"))})
    b.section(doc.get("staging", {}), STAGING, "staging.")
    cache = dict(doc.get("cache", {}))
    for key, source in SERVED_FROM.items():
        b.add("served_bytes", C, "Bytes served to readers, by where they came from.",
              cache.pop(key, None), {"source": source})
    b.section(cache, CACHE, "cache.")
    sched = dict(doc.get("scheduler", {}))
    for klass, n in (sched.pop("queued", None) or {}).items():
        b.add("scheduler_queued_requests", G, "Requests queued for the backing store, by class.",
              n, {"class": klass})
    b.section(sched, SCHED, "scheduler.")
    b.section(doc.get("writeback") or {}, WRITEBACK, "writeback.")
    for device, calls in (doc.get("devices") or {}).items():
        b.section(calls, DEVICE, "devices.", {"device": device})
    handled = {"fuse", "tiers", "staging", "cache", "scheduler", "writeback", "devices"}
    for key, value in doc.items():
        if isinstance(value, dict) and key not in handled:
            b.generic(key, value)

    info = InfoMetricFamily("tierfs_mount", "The mount this daemon serves.")
    info.add_metric([], {"backing": str(doc.get("backing", "")), "mountpoint": str(doc.get("mountpoint", "")),
                         "policy": str(doc.get("cache", {}).get("policy", "")),
                         "write_tier": str((doc.get("writeback") or {}).get("write_tier", "")),
                         "stats_version": str(doc.get("version", ""))})
    yield info
    for name, fam in sorted(b.families.items()):
        m = Metric(f"tierfs_{name}", fam.help, fam.type)
        sample = f"tierfs_{name}_total" if fam.type == C else f"tierfs_{name}"
        for labels, value in fam.samples:
            m.add_sample(sample, labels, value)
        yield m
    s = doc.get("scheduler", {})
    if "demand_waits" in s:
        waits = Metric("tierfs_scheduler_demand_wait_seconds",
                       "How long demand reads waited for the backing store (p99 of recent waits).",
                       "summary")
        waits.add_sample("tierfs_scheduler_demand_wait_seconds", {"quantile": "0.99"},
                         float(s.get("demand_wait_p99_s", 0.0)))
        waits.add_sample("tierfs_scheduler_demand_wait_seconds_count", {}, float(s["demand_waits"]))
        waits.add_sample("tierfs_scheduler_demand_wait_seconds_sum", {},
                         float(s["demand_waits"]) * float(s.get("demand_wait_mean_s", 0.0)))
        yield waits


class StatsCollector(Collector):
    """A ``prometheus_client`` collector over the stats document ``get_doc()`` returns."""

    def __init__(self, get_doc: Callable[[], dict[str, Any]]) -> None:
        self.get_doc = get_doc

    def collect(self) -> Iterator[Metric]:
        yield from _metrics(self.get_doc())


def render(doc: dict[str, Any]) -> str:
    """The stats document ``doc`` in the Prometheus text exposition format (version 0.0.4)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(lambda: doc))
    return generate_latest(registry).decode()


class Exporter:
    """The daemon's HTTP endpoint: ``http://ADDR:PORT/metrics``, served by ``prometheus_client``
    in a daemon thread. ``doc_on_loop`` must run on the trio event loop (it reads cache state);
    each scrape calls it there through ``trio.from_thread``."""

    def __init__(self, addr: str, port: int, doc_on_loop: Callable[[], dict[str, Any]]) -> None:
        import trio

        token = trio.lowlevel.current_trio_token()

        def get_doc() -> dict[str, Any]:
            return trio.from_thread.run_sync(doc_on_loop, trio_token=token)

        registry = CollectorRegistry(auto_describe=False)
        registry.register(StatsCollector(get_doc))
        try:
            self.server, self.thread = start_http_server(port, addr=addr, registry=registry)
        except OSError as e:
            raise MountError(f"metrics endpoint {addr}:{port} (metrics_addr, metrics_port): "
                             f"{e.strerror or e}") from None
        self.address = self.server.server_address

    def close(self) -> None:
        """Stop serving (blocks up to the server's 0.5 s poll interval)."""
        self.server.shutdown()
        self.server.server_close()
