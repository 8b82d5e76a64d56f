"""Prometheus metrics: `tierfs stats --prometheus` and the daemon's HTTP endpoint say what
`tierfs stats --json` says, under Prometheus names."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import needs_fuse, tierfs_cmd, write_random
from tierfs import metrics

MiB = 1 << 20


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def leaves(doc: dict, prefix: str = "") -> dict[str, float]:
    """Numeric fields of the stats document by path (``tiers.ram.used_bytes``)."""
    out: dict[str, float] = {}
    for k, v in doc.items():
        if isinstance(v, dict):
            out.update(leaves(v, f"{prefix}{k}."))
        elif isinstance(v, list):
            for item in v:
                out.update(leaves({kk: vv for kk, vv in item.items() if kk != "name"},
                                  f"{prefix}{k}.{item['name']}."))
        elif isinstance(v, int | float) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
    return out


def expected(doc: dict) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What the exposition must hold for ``doc``, written out from the mapping tables."""
    want: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def put(specs: list, section: dict, labels: tuple = ()) -> None:
        for key, name, kind, _ in specs:
            if section.get(key) is not None:
                suffix = "_total" if kind == "counter" else ""
                want[(f"tierfs_{name}{suffix}", labels)] = float(section[key])

    put(metrics.TOP, doc)
    put(metrics.FUSE, doc["fuse"])
    for t in doc["tiers"]:
        put(metrics.TIER, t, (("tier", t["name"]),))
    put(metrics.STAGING, doc["staging"])
    put(metrics.CACHE, doc["cache"])
    put(metrics.SCHED, doc["scheduler"])
    put(metrics.WRITEBACK, doc["writeback"])
    for dev, calls in doc["devices"].items():
        put(metrics.DEVICE, calls, (("device", dev),))
    for key, source in metrics.SERVED_FROM.items():
        want[("tierfs_served_bytes_total", (("source", source),))] = float(doc["cache"][key])
    for klass, n in doc["scheduler"]["queued"].items():
        want[("tierfs_scheduler_queued_requests", (("class", klass),))] = float(n)
    s = doc["scheduler"]
    want[("tierfs_scheduler_demand_wait_seconds_count", ())] = float(s["demand_waits"])
    want[("tierfs_scheduler_demand_wait_seconds", (("quantile", "0.99"),))] = s["demand_wait_p99_s"]
    return want


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory, transport: str) -> dict:
    """A real stats document, after reads and a write."""
    from tests.conftest import module_mount

    gen = module_mount(tmp_path_factory, "metrics")
    m = next(gen)
    try:
        for i in range(3):
            write_random(m.backing / f"f{i}", 5 * MiB + i, seed=i)
        for i in range(3):
            (m.mnt / f"f{i}").read_bytes()
        (m.mnt / "w").write_bytes(b"x" * 100_000)
        yield m.stats()
    finally:
        gen.close()


@needs_fuse
def test_every_field_is_exported_with_its_value(doc: dict) -> None:
    got = samples(metrics.render(doc))
    for key, value in expected(doc).items():
        assert got.get(key) == pytest.approx(value), key
    # the tables name real fields (a typo would leave a field to the generic fallback)
    for specs, section in ((metrics.TOP, doc), (metrics.FUSE, doc["fuse"]), (metrics.TIER, doc["tiers"][0]),
                           (metrics.STAGING, doc["staging"]), (metrics.CACHE, doc["cache"]),
                           (metrics.SCHED, doc["scheduler"]), (metrics.WRITEBACK, doc["writeback"]),
                           (metrics.DEVICE, next(iter(doc["devices"].values())))):
        assert {spec[0] for spec in specs} <= set(section)
    # written out by hand, as a dashboard would query them
    ram = next(t for t in doc["tiers"] if t["name"] == "ram")
    assert got[("tierfs_tier_used_bytes", (("tier", "ram"),))] == ram["used_bytes"] > 0
    assert got[("tierfs_tier_hits_total", (("tier", "ram"),))] == ram["hits"]
    assert got[("tierfs_backing_read_bytes_total", ())] == doc["scheduler"]["backing_bytes_read"] > 0
    assert got[("tierfs_writeback_written_files_total", ())] == doc["writeback"]["written_files"]
    # every numeric field of the document is a sample, or a documented derived value
    values = set(got.values())
    for path, value in leaves(doc).items():
        parts = path.split(".")
        if parts[0] in ("tiers", "devices"):
            del parts[1]  # the tier or device name: a label
        if path.endswith("_ms"):
            value = value / 1e3  # exported in seconds (base units)
        if ".".join(parts) not in metrics.DERIVED:
            assert value in values, f"{path} = {value} is not exported"


@needs_fuse
def test_names_follow_prometheus_conventions(doc: dict) -> None:
    text = metrics.render(doc)
    fams = list(text_string_to_metric_families(text))
    assert {f.name for f in fams} >= {"tierfs_tier_used_bytes", "tierfs_tier_hits", "tierfs_mount_info"}
    for fam in fams:
        assert re.fullmatch(r"tierfs_[a-z0-9_]+", fam.name), fam.name
        assert fam.documentation, fam.name
        assert not re.search(r"_(s|ms|kb|mib)$", fam.name), f"{fam.name}: base units only"
        for s in fam.samples:
            if fam.type == "counter":
                assert s.name == fam.name + "_total", s.name
    assert "# TYPE tierfs_tier_hits_total counter" in text
    assert '# TYPE tierfs_tier_used_bytes gauge' in text
    assert re.search(r'^tierfs_tier_used_bytes\{tier="ram"\} ', text, re.M)
    info = samples(text)[("tierfs_mount_info", tuple(sorted({
        "backing": doc["backing"], "mountpoint": doc["mountpoint"], "policy": "nothrash",
        "write_tier": "ssd", "stats_version": "1"}.items())))]
    assert info == 1.0


def test_a_field_the_mapping_does_not_know_is_still_exported() -> None:
    doc = {"version": 1, "uptime_s": 5.0, "tiers": [], "hints": {"plans": 3, "late_s": 1.5,
                                                                  "nested": {"x_bytes": 7}}}
    got = samples(metrics.render(doc))
    assert got[("tierfs_hints_plans", ())] == 3
    assert got[("tierfs_hints_late_seconds", ())] == 1.5
    assert got[("tierfs_hints_nested_x_bytes", ())] == 7
    assert got[("tierfs_uptime_seconds", ())] == 5.0
    assert ("tierfs_writeback_eta_seconds", ()) not in got  # unknown: absent, not 0


STABLE = re.compile(r"^tierfs_(tier_|staging_|served_|cache_|backing_read|writeback_(dirty|written))")


def stable(d: dict) -> dict:
    return {k: v for k, v in d.items() if STABLE.match(k[0])}


@needs_fuse
@pytest.mark.fuse
def test_stats_prometheus_agrees_with_stats_json(tiermount, tmp_path: Path) -> None:
    for i in range(4):
        write_random(tmp_path / "back" / f"f{i}", 3 * MiB, seed=i)
    m = tiermount(ram="64MiB")
    for i in range(4):
        (m.mnt / f"f{i}").read_bytes()
    doc = json.loads(tierfs_cmd("stats", str(m.mnt), "--json").stdout)
    text = tierfs_cmd("stats", str(m.mnt), "--prometheus").stdout
    got, want = samples(text), stable(expected(doc))
    assert want and {k: got.get(k) for k in want} == want
    assert got[("tierfs_tier_used_bytes", (("tier", "ram"),))] >= 12 * MiB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.rsplit(":", 1)
                if int(p, 16) == port and state == "0A":  # LISTEN
                    out.append(addr)
    return out


@needs_fuse
@pytest.mark.fuse
def test_metrics_endpoint_on_loopback(tiermount, tmp_path: Path) -> None:
    write_random(tmp_path / "back" / "f", 6 * MiB)
    port = free_port()
    m = tiermount(ram="64MiB", extra=("--metrics-port", str(port)))
    (m.mnt / "f").read_bytes()
    assert listening(port) == ["0100007F"]  # 127.0.0.1 only
    # /metrics and `tierfs stats` are two reads: the read's chunks may still move from staging
    # into the RAM tier between them (a loaded machine), so compare once both agree on a
    # settled daemon (the figures stop moving when the background placement is done)
    for _ in range(100):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
        doc = json.loads(tierfs_cmd("stats", str(m.mnt), "--json").stdout)
        got, want = samples(text), stable(expected(doc))
        if {k: got.get(k) for k in want} == want:
            break
        time.sleep(0.1)
    assert want and {k: got.get(k) for k in want} == want
    m.stop()
    assert listening(port) == []


@needs_fuse
@pytest.mark.fuse
def test_a_taken_metrics_port_fails_the_mount_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "back").mkdir()
    (tmp_path / "mnt").mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = tierfs_cmd("mount", str(tmp_path / "back"), str(tmp_path / "mnt"), "--ram", "16MiB",
                       "-o", f"metrics_port={s.getsockname()[1]}", check=False)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "metrics_port" in lines[0] and "in use" in lines[0], r.stderr
    from tests.conftest import is_mounted

    assert not is_mounted(tmp_path / "mnt")
