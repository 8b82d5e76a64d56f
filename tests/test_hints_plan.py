"""The hint plan and the policy that consults it (pure logic, hypothesis), the daemon's
HintService on trio's mock clock (deadline projection and misses), and the policy simulator."""

from __future__ import annotations

import gc
import json
import logging
import math
from array import array
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs import sim
from tierfs.cache.manager import Cache
from tierfs.cache.plan import HintPlan, Need, PlannedFile
from tierfs.cache.policy import FrequencyTable, Policy, Residency
from tierfs.cache.tier import Tier
from tierfs.io import Device
from tierfs.predict.hints import HintService
from tierfs.sched.scheduler import TransactionScheduler

CS = 64 * 1024


def make_need(plan: HintPlan, chunks: list[tuple[str, int]], deadline: float = math.inf, priority: int = 0,
              source: str = "", label: str = "need") -> Need:
    sizes = array("q", [CS] * len(chunks))
    files = [PlannedFile(b"/x", "k", CS * len(chunks), 0, len(chunks))]
    return Need(plan.new_id(), label, source, list(chunks), sizes, files, deadline, priority, created=0.0)


def test_next_use_follows_edf_rank_and_consumption() -> None:
    plan = HintPlan()
    a = plan.add(make_need(plan, [("f", 0), ("f", 1), ("f", 2)]))  # no deadline
    b = plan.add(make_need(plan, [("g", 0), ("f", 2)], deadline=10.0))
    # the deadline need ranks first, so f/2's next use is its place in b
    assert plan.next_use(("f", 2)) == b.rank(1)
    assert plan.next_use(("f", 0)) == a.rank(0) and plan.next_use(("f", 0)) > plan.next_use(("f", 2))
    assert plan.next_use(("nope", 0)) is None
    assert plan.consume(("f", 2))  # the earliest occurrence (in b) is used up first
    assert plan.next_use(("f", 2)) == a.rank(2)
    assert plan.consume(("f", 2)) and plan.next_use(("f", 2)) is None  # never needed again
    assert not plan.consume(("f", 2))
    assert plan.consume(("f", 0)) and a.cursor == 1


def test_epoch_order_of_a_source_replaces_the_last_one() -> None:
    plan = HintPlan()
    e1 = plan.add(make_need(plan, [("f", 0)], source="job"), replaces_source_kind="epoch")
    other = plan.add(make_need(plan, [("h", 0)], source="other"), replaces_source_kind="epoch")
    e2 = plan.add(make_need(plan, [("g", 0)], source="job"), replaces_source_kind="epoch")
    assert set(plan.needs) == {other.id, e2.id}
    assert plan.next_use(("f", 0)) is None and plan.next_use(("g", 0)) is not None
    assert plan.recent[e1.id] is e1  # still answers progress queries


def test_release_and_cancel() -> None:
    plan = HintPlan()
    n = plan.add(make_need(plan, [("f", 0), ("f", 1)]))
    plan.release([("f", 0)])
    assert plan.is_released(("f", 0)) and plan.next_use(("f", 0)) is None
    plan.add(make_need(plan, [("f", 0)]))  # needed again: no longer released
    assert not plan.is_released(("f", 0))
    assert plan.cancel(n.id) and n.cancelled and n.id not in plan.needs
    assert not plan.cancel("n999")


def test_deadline_miss_is_counted_once() -> None:
    plan = HintPlan()
    n = plan.add(make_need(plan, [("f", 0), ("f", 1)], deadline=5.0))
    resident = {("f", 0)}
    assert plan.check_deadlines(4.0, resident.__contains__) == []
    assert plan.check_deadlines(6.0, resident.__contains__) == [n]
    assert plan.check_deadlines(7.0, resident.__contains__) == []
    assert plan.deadline_misses == 1 and plan.missed_bytes == CS
    done = plan.add(make_need(plan, [("g", 0)], deadline=5.0))
    plan.check_deadlines(1.0, {("g", 0)}.__contains__)
    assert done.finished_at == 1.0 and not done.missed


def test_policy_with_plan_never_evicts_what_is_needed_sooner() -> None:
    plan = HintPlan()
    pol = Policy("nothrash", window=100, plan=plan)
    plan.add(make_need(plan, [("soon", 0), ("mid", 0), ("late", 0)], deadline=10.0))
    plan.release([("gone", 0)])
    assert pol.admits(0, ("late", 0), ("soon", 0))
    assert not pol.admits(0, ("soon", 0), ("late", 0))
    assert pol.admits(0, ("gone", 0), ("late", 0))  # released goes first, even for the latest
    assert pol.admits(0, ("cold", 0), ("late", 0))  # unplanned victim
    assert not pol.admits(99, ("late", 0), ("cold", 0))  # unplanned newcomer: never over a planned one
    assert pol.promotes(("soon", 0), ("late", 0)) and not pol.promotes(("late", 0), ("soon", 0))
    # without a plan entry for either, the policy's own rule decides
    assert pol.admits(2, ("a", 0), ("b", 0)) == (2 > pol.freq.get(("a", 0)))


@settings(max_examples=60, deadline=None)
@given(residents=st.lists(st.integers(0, 30), min_size=1, max_size=25, unique=True),
       planned=st.lists(st.integers(0, 30), max_size=30), released=st.lists(st.integers(0, 30), max_size=5))
def test_victim_order_is_released_then_unplanned_then_furthest_next_use(residents, planned, released) -> None:  # type: ignore[no-untyped-def]
    plan = HintPlan()
    freq = FrequencyTable(1000)
    res = Residency(freq, use_counts=True, plan=plan)
    for r in residents:
        res.add(("c", r))
    if planned:
        plan.add(make_need(plan, [("c", p) for p in planned]))
    if released:
        plan.release([("c", r) for r in released])
    order = list(res.victims(lambda cid: False))
    assert sorted(order) == sorted(("c", r) for r in residents)  # each resident once
    kinds = [0 if plan.is_released(c) else (1 if plan.next_use(c) is None else 2) for c in order]
    assert kinds == sorted(kinds)
    ranks = [plan.next_use(c) for c, k in zip(order, kinds, strict=True) if k == 2]
    assert ranks == sorted(ranks, reverse=True)  # furthest next use first (Belady)


class SlowBacking:
    async def read(self, f, offset: int, length: int) -> bytes:  # type: ignore[no-untyped-def]
        await trio.sleep(0.1)  # 64 KiB per 0.1 s: 0.65 MB/s
        return bytes(length)



def _hint_service(tmp_path: Path, backing: Path, **kw):  # type: ignore[no-untyped-def]
    """A plan, a slow backing store's scheduler, a one-tier cache and a HintService on them."""
    plan = HintPlan()
    sched = TransactionScheduler(SlowBacking().read, chunk_size=CS, slice_size=CS)
    dev = Device("t", 1, inline_under=math.inf)
    cache = Cache([Tier("ram", str(tmp_path / "ram"), 64 * CS, inline=True)], [dev],
                  Policy("nothrash", 1000, plan=plan), sched, chunk_size=CS, staging_bytes=4 * CS)
    hints = HintService(cache=cache, scheduler=sched, backing_root=str(backing).encode(), meta=dev,
                        chunk_size=CS, write_tier=0, **kw)
    return plan, sched, cache, hints

async def test_a_need_that_cannot_make_it_is_reported_early_and_counted(tmp_path: Path, autojump_clock, caplog) -> None:  # type: ignore[no-untyped-def]
    backing = tmp_path / "back"
    backing.mkdir()
    (backing / "big").write_bytes(bytes(40 * CS))
    (backing / "small").write_bytes(bytes(2 * CS))
    plan, sched, cache, hints = _hint_service(tmp_path, backing, budget=4 * CS)
    caplog.set_level(logging.INFO, logger="tierfs.hints")
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        await n.start(hints.run)
        ok = await hints.handle({"op": "need", "items": [["small", 0, None]], "deadline_s": 5})
        late = await hints.handle({"op": "need", "items": [["big", 0, None]], "deadline_s": 2})
        await trio.sleep(0.5)
        # 40 chunks at 0.1 s each cannot be resident within 2 s: reported before the deadline
        assert any("projected to miss" in r.message and late["id"] in r.message for r in caplog.records)
        prog = await hints.handle({"op": "progress", "id": late["id"]})
        assert prog["projected_s"] is not None and prog["deadline_in_s"] < prog["projected_s"]
        # EDF: the earlier deadline is served first, so the small need is not starved by order
        waited = await hints.handle({"op": "wait", "id": late["id"], "timeout": 10})
        assert waited["missed"] and hints.plan.deadline_misses >= 1
        assert any("missed its deadline" in r.message for r in caplog.records)
        small = await hints.handle({"op": "wait", "id": ok["id"], "timeout": 10})
        assert small["done"] and not small["missed"]
        stats = hints.statistics()
        assert stats["deadline_misses"] == 1 and stats["declared_bytes"] == 42 * CS
        with pytest.raises(ValueError):
            await hints.handle({"op": "need", "items": [["../x", 0, None]]})
        n.cancel_scope.cancel()
    hints.close()
    cache.close()


def _optimal_hits(refs: list[int], capacity: int) -> int:
    """Exhaustive search: the most hits any cache of ``capacity`` (with bypass) gets."""
    from functools import cache

    @cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(refs):
            return 0
        r = refs[i]
        if r in cache:
            return 1 + best(i + 1, cache)
        options = [best(i + 1, cache)]  # bypass
        if len(cache) < capacity:
            options.append(best(i + 1, cache | {r}))
        else:
            options.extend(best(i + 1, (cache - {v}) | {r}) for v in cache)
        return max(options)

    return best(0, frozenset())


@settings(max_examples=40, deadline=None)
@given(refs=st.lists(st.integers(0, 5), min_size=1, max_size=14), capacity=st.integers(1, 3))
def test_belady_matches_an_exhaustive_optimum(refs: list[int], capacity: int) -> None:
    trace = sim.Trace("t", "", {"f": 8}, [sim.Job("j", [sim.Read("f", r) for r in refs])], ram_chunks=capacity,
                      staging_chunks=0)
    r = sim.belady(trace, capacity)
    assert round(r["hit_ratio"] * len(refs)) == _optimal_hits(refs, capacity)


def test_simulator_meets_the_targets_and_is_deterministic() -> None:
    a = sim.run()
    b = sim.run(["train-eval"])
    assert a["train-eval"] == b["train-eval"]
    assert sim.check_targets(a) == []
    for name, per in a.items():
        assert set(per) == set(sim.POLICIES), name
        for pol, m in per.items():
            assert {"hit_ratio", "backing_bytes", "deadline_misses"} <= set(m), (name, pol)
            assert "invariant_violations" not in m, (name, pol, m)
        # hints beat the baselines users have, and their eviction alone approaches MIN
        assert per["tierfs+hints"]["hit_ratio"] > per["lru"]["hit_ratio"]
        assert per["hints-evict-only"]["hit_ratio"] >= 0.9 * per["belady"]["hit_ratio"]
        assert per["tierfs"]["hit_ratio"] >= per["minio"]["hit_ratio"]
    assert a["train-eval"]["tierfs+hints"]["deadline_misses"] == 0
    assert a["train-eval"]["lru"]["deadline_misses"] > 0  # the trace can fail: a test of the test


def test_sim_cli_json(capsys) -> None:  # type: ignore[no-untyped-def]
    from tierfs.cli import main

    assert main(["sim", "--json", "--trace", "sequential-shards"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["targets_missed"] == [] and set(doc["traces"]) == {"sequential-shards"}
    assert main(["sim", "--trace", "nope"]) == 2


def test_next_file_predictor_learns_name_order_and_repetition_and_quiets_on_shuffles() -> None:
    from tierfs.predict.nextfile import NextFilePredictor

    names = [f"{i:03d}.tar".encode() for i in range(20)]
    p = NextFilePredictor()
    rel = [b"d/" + n for n in names]
    guesses = []
    for r in rel:  # epoch 1: name order
        p.opened(7, r, names)
        guesses.append(p.predict(7, r, names))
    assert guesses[0] is None and guesses[1] is None  # name order trusted after it was right twice
    assert guesses[5] == rel[6] and p.hits >= 10 and p.misses == 0
    p2 = NextFilePredictor()  # epoch repetition: a fixed non-name order seen once is replayed
    order = [rel[i] for i in (5, 2, 9, 1, 7)]
    for _ in range(2):
        for r in order:
            p2.opened(1, r, None)
            p2.predict(1, r, None)
    assert p2.hits == 4 and p2.successor[order[1]] == order[2]
    import random

    p3 = NextFilePredictor()  # shuffled epochs: mostly wrong -> it stops guessing
    rnd = random.Random(0)
    for _ in range(6):
        for r in rnd.sample(rel, len(rel)):
            p3.opened(1, r, None)
            p3.predict(1, r, None)
    assert not p3.confident() and p3.misses <= 40


def test_warmup_by_accepts_seconds_durations_and_clock_times() -> None:
    import datetime as dt

    from tierfs.cli import parse_by
    from tierfs.errors import ConfigError

    assert parse_by("90") == 90 and parse_by("30s") == 30 and parse_by("10m") == 600 and parse_by("2h") == 7200
    now = dt.datetime(2026, 11, 29, 14, 0, 0).timestamp()
    assert parse_by("14:05", now=now) == 300
    assert parse_by("13:59:30", now=now) == 24 * 3600 - 30  # past: tomorrow
    for bad in ("soon", "-5", "25:00", "nan", "10x", ""):
        with pytest.raises(ConfigError):
            parse_by(bad)



def test_orders_of_equal_deadline_interleave_by_distance_from_their_readers() -> None:
    """Two workers' epoch orders (no deadline): the 2nd chunk of the later-registered order
    ranks before the 3rd of the first, and a reader's progress moves its order forward."""
    plan = HintPlan()
    w0 = plan.add(make_need(plan, [("a", i) for i in range(4)], source="w0"), replaces_source_kind="epoch")
    w1 = plan.add(make_need(plan, [("b", i) for i in range(4)], source="w1"), replaces_source_kind="epoch")
    assert plan.next_use(("b", 1)) < plan.next_use(("a", 2))
    assert plan.next_use(("a", 1)) < plan.next_use(("b", 1))  # equal distance: registration order
    for i in range(3):
        plan.consume(("a", i))
    assert w0.cursor == 3
    assert plan.next_use(("a", 3)) < plan.next_use(("b", 1))  # w0's reader is further along
    assert w1.cursor == 0


async def test_a_large_plan_adds_no_objects_for_the_garbage_collector(tmp_path: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """A need of 20 000 hinted paths (20 files, each named 1000 times) and the same as an epoch
    order leave the collector's tracked objects almost where they were: a full collection runs
    on the event loop and visits each of them (100 000 paths made 400 000: 50-110 ms, over the
    loop bound, docs/concurrency.md). Counts objects, not time; fails with a record per path or
    per chunk occurrence (PlannedFile, (Need, index) tuples, lists per chunk)."""
    backing = tmp_path / "back"
    backing.mkdir()
    for i in range(20):
        (backing / f"f{i}").write_bytes(bytes(2 * CS))
    plan, sched, cache, hints = _hint_service(tmp_path, backing, budget=0, pace=False)
    order = [f"f{i % 20}" for i in range(20_000)]
    gc.collect()
    before = len(gc.get_objects())
    need = await hints.handle({"op": "need", "items": order})
    epoch = await hints.handle({"op": "epoch", "paths": order})
    gc.collect()
    added = len(gc.get_objects()) - before
    assert need["bytes"] == epoch["bytes"] == 20 * 2 * CS
    assert sum(len(n.chunks) for n in plan.needs.values()) == 2 * 40_000
    assert added < 1000, f"{added} more objects tracked by the garbage collector"
    hints.close()
    cache.close()


async def test_read_ends_queue_nothing_while_the_predictor_is_quiet(tmp_path: Path) -> None:
    """A read end is an event for the predictor only while it may predict: once most recent
    guesses were wrong (a shuffled epoch) it predicts nothing, and each file's event cost the
    loop for nothing. Opens are still learned."""
    backing = tmp_path / "back"
    backing.mkdir()
    plan, sched, cache, hints = _hint_service(tmp_path, backing, budget=0, pace=False, predict_bytes=CS)
    hints._nursery = object()  # type: ignore[assignment]  # events are queued, not drained
    hints._draining = True

    def queued() -> list[str]:
        return [fn.__name__ for fn, _, _ in hints._events]

    hints.file_read_end(7, b"d/a")
    assert queued() == ["_predict"]
    hints.predictor.outcomes.extend([False] * 8)  # guesses wrong: quiet
    assert not hints.predictor.confident()
    hints.file_read_end(7, b"d/b")
    hints.file_opened(7, b"d/c")
    assert queued() == ["_predict", "_opened"]
    hints._events.clear()
    hints._nursery = None
    hints.close()
    cache.close()


async def test_a_predicted_file_already_in_a_tier_registers_no_need(tmp_path: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """Next-file prediction of a file whose predicted part is already in a tier registers
    nothing (one lstat): a need and the prefetch rounds it kicked cost the loop a fifth of its
    time in a pass over resident files. A file not (wholly) there is still predicted, and so
    is a resident one when its tier is nearly full (the need keeps it from eviction)."""
    backing = tmp_path / "back"
    backing.mkdir()
    (backing / "a").write_bytes(bytes(2 * CS))
    (backing / "b").write_bytes(bytes(2 * CS))
    plan, sched, cache, hints = _hint_service(tmp_path, backing, budget=8 * CS, predict_bytes=2 * CS)
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        await n.start(hints.run)
        await hints.handle({"op": "need", "items": [["a", 0, None]], "deadline_s": 30})
        await hints.handle({"op": "wait", "id": next(iter(plan.needs))})
        assert all(cache.in_tier(c) for need in plan.needs.values() for c in need.chunks)
        predicted = {b"x": b"a", b"y": b"b"}
        hints.predictor.predict = lambda pid, rel, listing: predicted[rel]  # type: ignore[method-assign]
        labels = lambda: sorted(need.label for need in plan.needs.values())  # noqa: E731
        before = labels()
        await hints._predict(7, b"x")  # a: resident
        assert labels() == before and hints.predictions_resident == 1
        await hints._predict(7, b"y")  # b: not
        assert labels() == sorted([*before, "predicted"]) and hints.predictions_resident == 1
        assert hints.statistics()["next_file_predictions"]["already_resident"] == 1
        ram = cache.tiers[0]
        ram.keep_free = ram.effective_capacity  # no room left: eviction is near
        await hints._predict(8, b"x")  # a, resident: the need keeps it from eviction
        assert labels() == sorted([*before, "predicted", "predicted"]) and hints.predictions_resident == 1
        ram.keep_free = 0
        n.cancel_scope.cancel()
    hints.close()
    cache.close()


async def test_next_file_events_reach_the_predictor_in_request_order(tmp_path: Path) -> None:
    """Opens and read ends are learned and predicted in the order the requests came, by one
    task: in tasks of their own, a read end answered just before the next open (readahead under
    load) could be predicted after that open was learned and name the file just opened."""
    backing = tmp_path / "back"
    backing.mkdir()
    plan, sched, cache, hints = _hint_service(tmp_path, backing, budget=0, pace=False, predict_bytes=CS)
    seen: list[tuple[str, bytes]] = []

    async def opened(pid: int, rel: bytes) -> None:
        await trio.sleep(0.01 if rel.endswith(b"1") else 0)  # one learns slowly
        seen.append(("open", rel))

    async def predict(pid: int, rel: bytes) -> None:
        seen.append(("end", rel))

    hints._opened = opened  # type: ignore[method-assign]
    hints._predict = predict  # type: ignore[method-assign]
    async with trio.open_nursery() as n:
        hints._nursery = n
        for i in range(3):
            hints.file_opened(7, b"d/%d" % i)
            hints.file_read_end(7, b"d/%d" % i)
    # (the nursery closes once the one task has drained them all)
    assert not hints._events and seen == [(k, b"d/%d" % i) for i in range(3) for k in ("open", "end")]
    hints._nursery = None
    hints.close()
    cache.close()


async def test_an_open_is_learned_at_once_when_nothing_is_queued_and_its_listing_is_known(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The open of nearly every file of an epoch is learned with no task (a task per open cost
    ~8% of the loop's samples): when no event waits before it and its directory's listing is
    at hand. Else it is queued behind the others, in request order. A directory too large to
    list for name order is remembered as such, not listed again at each open."""
    backing = tmp_path / "back"
    (backing / "d").mkdir(parents=True)
    for n in ("a", "b", "c"):
        (backing / "d" / n).write_bytes(b"x")
    plan, sched, cache, hints = _hint_service(tmp_path, backing, budget=0, pace=False, predict_bytes=CS)
    async with trio.open_nursery() as n:
        hints._nursery = n
        hints.file_opened(7, b"d/a")  # no listing yet: a task lists the directory and learns it
        assert [fn.__name__ for fn, _, _ in hints._events] == ["_opened"]
    assert hints.predictor.last[(7, b"d")] == b"d/a" and b"d" in hints._listings
    spawned: list[str] = []
    monkeypatch.setattr("tierfs.tasks.spawn", lambda nursery, name, *a: spawned.append(name))
    hints._nursery = object()  # type: ignore[assignment]
    hints.file_opened(7, b"d/b")  # learned now: no task, no event
    assert not spawned and not hints._events and hints.predictor.successor[b"d/a"] == b"d/b"
    hints._draining = True  # an event still being handled (the queue empty): it waits its turn
    hints.file_opened(7, b"d/c")
    assert [fn.__name__ for fn, _, _ in hints._events] == ["_opened"]
    hints._events.clear()
    hints._events.append((hints._predict, 7, b"d/b"))  # something queued before it: likewise
    hints.file_opened(7, b"d/c")
    assert [fn.__name__ for fn, _, _ in hints._events] == ["_predict", "_opened"]
    hints._events.clear()
    hints._draining = False
    cancelled: list[object] = []  # a wrong guess learned at once is cancelled at once
    monkeypatch.setattr(hints.plan, "cancel", cancelled.append)
    hints.predictor.predicted[(7, b"d")] = b"d/a"
    hints._predicted[(7, b"d")] = 42
    hints.file_opened(7, b"d/c")
    assert cancelled == [42] and not spawned

    monkeypatch.setattr("tierfs.predict.hints.MAX_LISTING", 2)
    listed: list[bytes] = []
    real = hints.tree.listdir
    monkeypatch.setattr(hints.tree, "listdir", lambda d: listed.append(d) or real(d))
    hints._listings.clear()
    assert await hints._listing(b"d") is None and await hints._listing(b"d") is None
    assert listed == [b"d"]
    hints._nursery = None
    hints.close()
    cache.close()


async def test_where_of_many_paths_holds_no_object_per_path_for_the_collector(tmp_path: Path, autojump_clock) -> None:  # type: ignore[no-untyped-def]
    """A `where` of thousands of paths answers every path, and its reply keeps no object the
    garbage collector tracks per path (JSON text instead of a dict each): with 500,000 such
    dicts alive, each full collection held the daemon's event loop 100-280 ms."""
    from tierfs.fs import ctl
    from tierfs.predict.hints import EncodedList

    backing = tmp_path / "back"
    backing.mkdir()
    (backing / "a").write_bytes(bytes(3 * CS // 2))
    (backing / "b").write_bytes(b"xy")
    plan, sched, cache, hints = _hint_service(tmp_path, backing, budget=4 * CS)
    paths = ["a", "b", "nope"] * 1000
    async with trio.open_nursery() as n:
        cache.attach(n)
        await n.start(sched.run)
        reply = await hints.handle({"op": "where", "paths": paths})
        n.cancel_scope.cancel()
    hints.close()
    cache.close()
    files = reply["files"]
    assert isinstance(files, EncodedList)
    assert not any(gc.is_tracked(x) for x in files)
    got = json.loads(ctl.run_now(ctl.encode_steps(reply)))["files"]
    assert [g["path"] for g in got] == paths
    assert got[0]["size"] == 3 * CS // 2 and got[1]["size"] == 2 and got[2] == {"path": "nope", "missing": True}
    assert got[0]["resident_bytes"]["ram"] == 0 and got[0]["dirty_bytes"] == 0
