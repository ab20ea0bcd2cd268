"""The garbage collector against a real S3 server (and a memory store with a fake clock for a property test).

S3 `last_modified` is the server's real clock, so tests move GC's `now=` forward instead of sleeping.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvstore import gc as gc_module
from kvstore.access import encode_batch, read_access_records
from kvstore.gc import LISTING_RESOLUTION_S, GCReport, list_reports, run_gc
from kvstore.layout import ACCESS_PREFIX, GC_REPORT_PREFIX
from kvstore.lease import Lease, LeaseHeld, LeaseLost, read_lease
from kvstore.stores import MemoryStore, ObjectStore
from tests.helpers import FakeClock, listed_older_than

pytestmark = pytest.mark.integration


def chunk(i: int) -> str:
    h = hashlib.sha256(str(i).encode()).hexdigest()[:32]
    return f"ns_abc_r0/{h[:3]}/{h[3:5]}_g0/{h}.bin"


def write_chunks(store: ObjectStore, keys: list[str], size: int = 16) -> None:
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: store.put(k, b"x" * size), keys))


_record_seq = iter(range(1_000_000))


def record_access(store: ObjectStore, keys: list[str], ts: float) -> None:
    store.put(f"{ACCESS_PREFIX}2026010100/test-{next(_record_seq):06d}.json.zst", encode_batch(keys, ts))


def present(store: ObjectStore) -> set[str]:
    return {info.key for info in store.list()}


def server_time(store: ObjectStore) -> float:
    """The newest last_modified in the store: the server's clock at the last write."""
    return max(info.last_modified for info in store.list())


def test_ttl_deletes_only_idle_unpinned(s3_store: Any) -> None:
    keys = [chunk(i) for i in range(8)]
    write_chunks(s3_store, keys)
    s3_store.put("ns_abc/config.json", b"{}")
    s3_store.put("_meta/pins/p.json", b"{}")
    s3_store.put("ns_abc_r0/notes.txt", b"not a chunk")
    t0 = server_time(s3_store)
    record_access(s3_store, keys[:2], t0 + 5000)
    record_access(s3_store, keys[1:3], t0 + 100)  # older record for keys[1]: the newest one counts
    removed: list[list[str]] = []
    report = run_gc(
        s3_store,
        ttl_seconds=3000,
        grace_seconds=600,
        pinned={keys[3]},
        now=t0 + 6000,
        on_removed=removed.append,
    )
    survivors = {keys[0], keys[1], keys[3]}
    expected_gone = set(keys) - survivors
    after = present(s3_store)
    assert survivors <= after and not (expected_gone & after)
    assert {"ns_abc/config.json", "_meta/pins/p.json", "ns_abc_r0/notes.txt"} <= after
    assert sorted(k for batch in removed for k in batch) == sorted(expected_gone)
    assert report.objects == 8 and report.deleted == 5 and report.deleted_ttl == 5
    assert report.bytes_freed == 5 * 16 and report.remaining_bytes == 3 * 16 and report.remaining_objects == 3
    assert report.kept_pinned == 1 and report.kept_young == 0 and not report.dry_run
    assert report.access_records == 2 and report.records_compacted == 2
    # Compaction kept the surviving keys' access times (keys[0] and keys[1] stay alive at the same clock).
    merged = {k: ts for _, ts, ks in read_access_records(s3_store) for k in ks}
    assert set(merged) == {keys[0], keys[1]} and merged[keys[0]] >= t0 + 5000
    again = run_gc(s3_store, ttl_seconds=3000, grace_seconds=600, pinned={keys[3]}, now=t0 + 6000)
    assert again.deleted == 0 and survivors <= present(s3_store)


class CachePinCounts:
    """A node cache's pin counts, as GC asks for them (`kvstore.gc.CachePins`)."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def pinned(self, key: str) -> int:
        return self.counts.get(key, 0)


def test_bucket_pins_and_the_node_caches_pins_both_keep_chunks(s3_store: Any) -> None:
    from kvstore.keys import Namespace, make_offload_key
    from kvstore.pins import create_pin

    ns = Namespace(model_name="org/tiny", tokens_per_hash=16, dtype="bf16")
    keys = [ns.chunk_key(make_offload_key(i.to_bytes(32, "big"))) for i in range(4)]
    write_chunks(s3_store, keys)
    create_pin(s3_store, "sys", ns, [keys[0]])
    t0 = server_time(s3_store)
    cache = CachePinCounts({keys[1]: 2, keys[2]: 0})  # a count of 0 is no pin
    report = run_gc(s3_store, ttl_seconds=10, grace_seconds=0, cache=cache, now=t0 + 100)
    assert report.kept_pinned == 2 and report.deleted == 2 and report.pin_manifests == 1
    assert {keys[0], keys[1]} <= present(s3_store) and not {keys[2], keys[3]} & present(s3_store)


def test_grace_protects_young_objects(s3_store: Any) -> None:
    keys = [chunk(i) for i in range(5)]
    write_chunks(s3_store, keys)
    t0 = server_time(s3_store)
    young = run_gc(s3_store, ttl_seconds=1, grace_seconds=600, now=t0 + 100)
    assert young.deleted == 0 and young.kept_young == 5
    assert set(keys) <= present(s3_store)
    old = run_gc(s3_store, ttl_seconds=1, grace_seconds=600, now=t0 + 700)
    assert old.deleted == 5 and not set(keys) & present(s3_store)


def _budget_setup(store: ObjectStore, spacing: float) -> tuple[list[str], float]:
    """Ten chunks of growing size, last accessed oldest (index 0) to newest (index 9) `spacing` apart."""
    keys = [chunk(100 + i) for i in range(10)]
    with ThreadPoolExecutor(10) as pool:
        list(pool.map(lambda i: store.put(keys[i], b"y" * (10 + i)), range(10)))
    t0 = server_time(store)
    for i, key in enumerate(keys):
        record_access(store, [key], t0 + 1000 + spacing * i)
    return keys, t0


@pytest.mark.parametrize("spacing", [500.0, 0.5], ids=["spread-ages", "one-age-bucket"])
def test_max_bytes_deletes_oldest_first(s3_store: Any, spacing: float) -> None:
    keys, t0 = _budget_setup(s3_store, spacing)
    sizes = [10 + i for i in range(10)]
    budget = sum(sizes[6:]) + 5  # room for the 4 newest and a bit: the 6 oldest must go
    removed: list[str] = []
    report = run_gc(
        s3_store,
        ttl_seconds=1e9,
        max_bytes=budget,
        grace_seconds=0,
        pinned={keys[0]},  # the oldest is pinned: it stays, so one more newer chunk goes instead
        now=t0 + 20_000,
        on_removed=removed.extend,
    )
    # keys[0] pinned (10 bytes) + newest ones must fit: keys[7..9] = 17+18+19 = 54, plus 10 = 64 <= 69;
    # adding keys[6] (16) gives 80 > 69, so keys[1..6] go.
    assert sorted(removed) == sorted(keys[1:7])
    assert report.deleted_budget == 6 and report.deleted_ttl == 0
    assert report.remaining_bytes == 10 + 17 + 18 + 19 <= budget and not report.over_budget
    assert set(keys[7:]) | {keys[0]} <= present(s3_store)


def test_max_bytes_cannot_touch_pinned_or_young(s3_store: Any) -> None:
    keys = [chunk(200 + i) for i in range(4)]
    write_chunks(s3_store, keys, size=100)
    t0 = server_time(s3_store)
    report = run_gc(s3_store, ttl_seconds=1e9, max_bytes=50, grace_seconds=600, pinned={keys[0]}, now=t0 + 10)
    assert report.deleted == 0 and report.over_budget and report.remaining_bytes == 400
    assert report.kept_pinned == 1 and report.kept_young == 3


def test_dry_run_deletes_nothing_and_reports_the_same(s3_store: Any) -> None:
    _, t0 = _budget_setup(s3_store, 500.0)
    extra = [chunk(300 + i) for i in range(3)]
    write_chunks(s3_store, extra)
    before = present(s3_store)
    args: dict[str, Any] = {"ttl_seconds": 17_000, "max_bytes": 80, "grace_seconds": 0, "now": t0 + 20_000}
    removed: list[str] = []
    dry = run_gc(s3_store, dry_run=True, on_removed=removed.extend, **args)
    assert removed == [] and dry.dry_run and dry.records_compacted == 0
    assert present(s3_store) == before | {dry.report_key}
    real = run_gc(s3_store, **args)
    same = ("objects", "deleted", "deleted_ttl", "deleted_budget", "bytes_freed", "remaining_bytes")
    assert {f: getattr(dry, f) for f in same} == {f: getattr(real, f) for f in same}
    assert dry.deleted > 0 and dry.deleted_budget > 0 and dry.deleted_ttl > 0


@pytest.mark.slow
def test_listing_past_one_page(s3_store: Any) -> None:
    keys = [chunk(1000 + i) for i in range(1150)]
    write_chunks(s3_store, keys, size=4)
    pins = set(keys[::23])
    t0 = server_time(s3_store)
    removed: list[list[str]] = []
    report = run_gc(
        s3_store, ttl_seconds=10, grace_seconds=0, pinned=pins, now=t0 + 100, on_removed=removed.append
    )
    assert report.objects == 1150 and report.kept_pinned == len(pins)
    assert report.deleted == 1150 - len(pins)
    assert max(len(b) for b in removed) <= 1000 and len(removed) == 2
    assert {k for k in present(s3_store) if k.endswith(".bin")} == pins


def test_report_written_and_listed(s3_store: Any) -> None:
    write_chunks(s3_store, [chunk(1)])
    first = run_gc(s3_store, ttl_seconds=1e6, grace_seconds=0, dry_run=True)
    time.sleep(0.01)
    second = run_gc(s3_store, ttl_seconds=1e6, grace_seconds=0)
    assert isinstance(second, GCReport)
    reports = list_reports(s3_store, 10)
    assert [r["id"] for r in reports] == [second.id, first.id]
    assert reports[0] == second.as_dict()
    assert list_reports(s3_store, 1) == [second.as_dict()]
    assert second.report_key.startswith(GC_REPORT_PREFIX)
    for field in ("objects", "deleted", "bytes_freed", "kept_pinned", "kept_young", "remaining_bytes"):
        assert field in reports[0]
    assert {"dry_run", "duration_s", "started_at"} <= set(reports[0])


def test_two_gc_runs_at_once_only_one_runs(s3_store: Any) -> None:
    keys = [chunk(i) for i in range(20)]
    write_chunks(s3_store, keys)
    t0 = server_time(s3_store)
    loser_done = threading.Event()
    results: list[GCReport | Exception] = []
    barrier = threading.Barrier(2)

    def hold(_: list[str]) -> None:
        loser_done.wait(20)  # the winner keeps the lease until the other has tried

    def one() -> None:
        barrier.wait()
        try:
            results.append(run_gc(s3_store, ttl_seconds=10, grace_seconds=0, now=t0 + 100, on_removed=hold))
        except LeaseHeld as exc:
            results.append(exc)
            loser_done.set()

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(type(r).__name__ for r in results) == ["GCReport", "LeaseHeld"]
    report = next(r for r in results if isinstance(r, GCReport))
    assert report.deleted == 20
    # The lease was released: the next run goes ahead.
    assert run_gc(s3_store, ttl_seconds=10, grace_seconds=0, now=t0 + 100).deleted == 0


def test_a_gc_whose_lease_is_taken_over_stops_before_its_next_delete_batch(
    s3_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GC stalled past its lease's expiry (a long pause, a frozen VM) may find another GC has taken over:
    from then on it must delete nothing, nor remove the new holder's lease on its way out."""
    monkeypatch.setattr(gc_module, "DELETE_BATCH", 5)
    keys = [chunk(9000 + i) for i in range(20)]
    write_chunks(s3_store, keys)
    t0 = server_time(s3_store)
    taker = Lease(s3_store, "gc", ttl_s=600, holder="taker", clock=lambda: time.time() + 10_000)
    batches: list[list[str]] = []

    def first_batch_then_taken_over(batch: list[str]) -> None:
        batches.append(batch)
        if len(batches) == 1:
            taker.acquire()  # by the taker's clock our lease expired long ago: a real takeover

    with pytest.raises(LeaseLost):
        run_gc(
            s3_store, ttl_seconds=10, grace_seconds=0, now=t0 + 100, on_removed=first_batch_then_taken_over
        )
    assert len(batches) == 1 and len(present(s3_store) & set(keys)) == 15, "deleted after losing the lease"
    holder = read_lease(s3_store, "gc")
    assert holder is not None and holder.token == taker.token, "the old GC removed the new holder's lease"
    assert list_reports(s3_store) == []
    taker.release()


def test_gc_racing_with_reads_gives_clean_misses(s3_store: Any) -> None:
    keys = [chunk(5000 + i) for i in range(300)]
    write_chunks(s3_store, keys, size=64)
    t0 = server_time(s3_store)
    stop = threading.Event()
    errors: list[BaseException] = []
    seen: list[bytes | None] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                got = s3_store.get(rng.choice(keys))
                # A miss (deleted already) or the whole object; an assert in this thread would be lost.
                if got is not None and got != b"x" * 64:
                    raise AssertionError(f"a read during GC returned {len(got)} wrong bytes")
            except BaseException as exc:  # any exception at all is a failure
                errors.append(exc)
                return
            seen.append(got)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        report = run_gc(s3_store, ttl_seconds=10, grace_seconds=0, now=t0 + 100)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert errors == [] and report.deleted == 300
    assert all(s3_store.get(k) is None for k in keys[:20])
    assert seen


# -- property: pinned and young always survive; idle, unpinned, old ones are gone --------------------------


@pytest.fixture
def fake_memory_clock() -> Iterator[FakeClock]:
    clock = FakeClock(1_700_000_000.0)
    with mock.patch("kvstore.stores.memory.time", clock):
        yield clock


def check_gc_invariants(
    store: ObjectStore,
    *,
    now: float,
    ttl: float,
    grace: float,
    pins: set[str],
    max_bytes: int | None,
) -> GCReport:
    """Run GC and check the invariants against what the store and the records said just before."""
    before = {i.key: i for i in store.list() if i.key.endswith(".bin")}
    last = {k: i.last_modified for k, i in before.items()}
    for _, ts, keys in read_access_records(store):
        for k in keys:
            if k in last:
                last[k] = max(last[k], ts)
    report = run_gc(store, ttl_seconds=ttl, grace_seconds=grace, pinned=pins, now=now, max_bytes=max_bytes)
    after = {i.key for i in store.list() if i.key.endswith(".bin")}
    # Young by the stretched grace period: listings truncate `last_modified` to whole seconds.
    young = grace + LISTING_RESOLUTION_S
    protected = {k for k, i in before.items() if k in pins or now - i.last_modified < young}
    assert protected <= after, "a pinned or young chunk was deleted"
    idle = {k for k in before if k not in protected and now - last[k] > ttl}
    assert not idle & after, "an idle unpinned chunk survived"
    assert after <= set(before)
    budget_gone = set(before) - idle - after
    kept = sum(before[k].size for k in after)
    assert report.remaining_bytes == kept and report.remaining_objects == len(after)
    assert report.deleted_ttl == len(idle) and report.deleted_budget == len(budget_gone)
    if max_bytes is None:
        assert after == set(before) - idle and not report.over_budget
        return report
    eligible_left = after - protected
    # Within budget, unless only pinned and young chunks are left (then the flag says so).
    assert report.over_budget == (kept > max_bytes)
    if kept > max_bytes:
        assert not eligible_left, "over budget with deletable chunks left"
    # Oldest first: every budget-deleted chunk is at least as old as every surviving eligible one.
    if budget_gone and eligible_left:
        assert max(last[k] for k in budget_gone) <= min(last[k] for k in eligible_left)
    # No more than needed: sparing the newest budget-deleted chunk would have left the bucket over budget.
    if budget_gone:
        excess = kept + sum(before[k].size for k in budget_gone) - max_bytes
        newest = max(budget_gone, key=lambda k: (last[k], before[k].size))
        assert sum(before[k].size for k in budget_gone) - before[newest].size < excess, "deleted too much"
    return report


KEYS = 40
ops = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, KEYS - 1), st.integers(1, 50)),
        st.tuples(st.just("read"), st.integers(0, KEYS - 1), st.just(0)),
        st.tuples(st.just("pin"), st.integers(0, KEYS - 1), st.just(0)),
        st.tuples(st.just("advance"), st.integers(0, KEYS - 1), st.integers(1, 2000)),
    ),
    min_size=10,
    max_size=120,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=ops,
    ttl=st.integers(1, 20_000),
    grace=st.integers(0, 2000),
    tail=st.integers(0, 4000),
    max_bytes=st.one_of(st.none(), st.integers(0, 100), st.integers(0, 400)),
)
def test_property_gc_invariants(
    fake_memory_clock: FakeClock,
    steps: list[tuple[str, int, int]],
    ttl: int,
    grace: int,
    tail: int,
    max_bytes: int | None,
) -> None:
    clock = fake_memory_clock
    store = MemoryStore("prop")
    pins: set[str] = set()
    for op, i, arg in steps:
        if op == "write":
            store.put(chunk(i), b"z" * arg)
        elif op == "read":
            record_access(store, [chunk(i)], clock.now)
        elif op == "pin":
            pins.add(chunk(i))
        else:
            clock.now += arg
    first = check_gc_invariants(
        store, now=clock.now + tail, ttl=ttl, grace=grace, pins=pins, max_bytes=max_bytes
    )
    # Make sure the examples reach every rule (see --hypothesis-show-statistics).
    event("budget deletions" if first.deleted_budget else "no budget deletions")
    event("TTL deletions" if first.deleted_ttl else "no TTL deletions")
    event("over budget" if first.over_budget else "within budget")
    # Compaction must not change the decisions of the next run at the same clock.
    again = check_gc_invariants(
        store, now=clock.now + tail, ttl=ttl, grace=grace, pins=pins, max_bytes=max_bytes
    )
    assert again.deleted == 0


def test_property_example_on_s3(s3_store: Any) -> None:
    rng = random.Random(7)
    keys = [chunk(7000 + i) for i in range(30)]
    write_chunks(s3_store, keys, size=20)
    t0 = server_time(s3_store)
    for _ in range(10):
        record_access(s3_store, rng.sample(keys, 5), t0 + rng.uniform(0, 4000))
    pins = set(rng.sample(keys, 4))
    check_gc_invariants(s3_store, now=t0 + 4500, ttl=2000, grace=100, pins=pins, max_bytes=None)
    check_gc_invariants(s3_store, now=t0 + 4500, ttl=2000, grace=100, pins=pins, max_bytes=200)


# A GC in a process of its own that stops inside its first deleted batch until `gate` exists (or forever,
# to be killed there): the lease is held and part of the work is done.
_GC_PROCESS = """
import json, pathlib, sys, time
import kvstore.gc as gc
from kvstore.stores.s3 import S3Store
cfg = json.loads(sys.argv[1])
gc.DELETE_BATCH = cfg["batch"]
gate = pathlib.Path(cfg["gate"])
def hold(keys):
    (gate.parent / "deleting").write_text(str(len(keys)))
    while not gate.exists():
        time.sleep(0.05)
store = S3Store(cfg["bucket"], cfg["prefix"], endpoint=cfg["endpoint"], access_key=cfg["access_key"],
                secret_key=cfg["secret_key"])
report = gc.run_gc(store, ttl_seconds=10, grace_seconds=0, now=cfg["now"], on_removed=hold,
                   lease_ttl_s=cfg["lease_ttl_s"], holder="gc-process")
print(json.dumps(report.as_dict()))
"""


def start_gc_process(
    s3_server: Any, store: Any, tmp_path: Path, now: float, *, batch: int = 1000, lease_ttl_s: float = 300
) -> subprocess.Popen[str]:
    cfg = {
        "bucket": store.bucket,
        "prefix": store.prefix,
        "endpoint": s3_server.endpoint,
        "access_key": s3_server.access_key,
        "secret_key": s3_server.secret_key,
        "now": now,
        "batch": batch,
        "lease_ttl_s": lease_ttl_s,
        "gate": str(tmp_path / "gate"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", _GC_PROCESS, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "deleting").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the GC process never started deleting"
        time.sleep(0.05)
    return proc


@pytest.mark.slow
def test_two_gc_processes_at_once_only_one_runs(s3_server: Any, s3_store: Any, tmp_path: Path) -> None:
    keys = [chunk(7000 + i) for i in range(20)]
    write_chunks(s3_store, keys)
    t0 = server_time(s3_store)
    first = start_gc_process(s3_server, s3_store, tmp_path, t0 + 100)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "AWS_"))}
        env.update(
            KVSTORE_STORE_URL=f"s3://{s3_store.bucket}/{s3_store.prefix}",
            KVSTORE_S3_ENDPOINT=s3_server.endpoint,
            AWS_ACCESS_KEY_ID=s3_server.access_key,
            AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
            XDG_DATA_HOME=str(tmp_path / "data"),
        )
        second = subprocess.run(
            [sys.executable, "-m", "kvstore.admin.cli", "gc", "--ttl-seconds", "10", "--grace-seconds", "0"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert second.returncode == 4 and "gc-process" in second.stderr, second.stdout + second.stderr
    finally:
        (tmp_path / "gate").touch()
        out, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert json.loads(out)["deleted"] == 20 and not present(s3_store) & set(keys)
    assert len(list_reports(s3_store)) == 1  # the refused run wrote nothing


def test_gc_resumes_at_once_after_a_kill_on_this_machine(
    s3_server: Any, s3_store: Any, tmp_path: Path
) -> None:
    keys = [chunk(8000 + i) for i in range(12)]
    write_chunks(s3_store, keys)
    t0 = server_time(s3_store)
    crashed = start_gc_process(s3_server, s3_store, tmp_path, t0 + 100, batch=5, lease_ttl_s=300)
    crashed.send_signal(signal.SIGKILL)  # inside its first batch: 5 deleted, the lease held, no report
    crashed.communicate(timeout=30)
    left = present(s3_store) & set(keys)
    assert len(left) == 7 and list_reports(s3_store) == []
    lease = read_lease(s3_store, "gc")
    assert lease is not None and lease.holder == "gc-process" and lease.live(time.time())
    # Its lease runs for minutes more, but names a process of this machine that is gone: taken over at once.
    report = run_gc(s3_store, ttl_seconds=10, grace_seconds=0, now=t0 + 100)
    assert report.deleted == 7 and report.objects == 7
    assert not present(s3_store) & set(keys) and len(list_reports(s3_store)) == 1


def test_grace_counts_from_the_real_write_not_the_truncated_listing_time(s3_store: Any) -> None:
    """Listings truncate `last_modified` to whole seconds: an object written at x.9 s is listed as x.0 s, so
    without a margin GC would judge it up to a second older than it is and delete it inside its grace."""
    grace = 30.0
    for _ in range(5):
        while time.time() % 1 < 0.8:  # write late in a second: the truncation is then ~0.8-1 s
            time.sleep(0.01)
        written = time.time()
        s3_store.put(chunk(900), b"x" * 16)
        listed = next(info for info in s3_store.list() if info.key == chunk(900)).last_modified
        if listed == int(written):  # the server's clock is this machine's, and the write stayed in its second
            break
    else:
        pytest.skip("the server's clock does not agree with ours to the second")
    # Still inside the grace period by the real write time; past it by the truncated listing time.
    now = written + grace - 0.1
    assert now - listed >= grace
    report = run_gc(s3_store, ttl_seconds=0, grace_seconds=grace, now=now)
    assert report.deleted == 0 and report.kept_young == 1 and s3_store.get(chunk(900)) is not None


def test_a_chunk_key_too_long_for_the_node_cache_does_not_stop_gc(s3_store: Any, tmp_path: Path) -> None:
    from kvstore.cache.nvme import NVMeCache
    from kvstore.cache.records import MAX_KEY_BYTES

    h = hashlib.sha256(b"long").hexdigest()
    long = f"{'m' * 200}_0123456789ab_r0/{'d' * 220}/{h[3:5]}_g0/{h}.bin"
    assert len(long.encode()) > MAX_KEY_BYTES
    keys = [chunk(600), long]
    write_chunks(s3_store, keys)
    t0 = server_time(s3_store)
    with NVMeCache(tmp_path / "nvme", 1 << 20) as cache:
        cache.pin([keys[0]])
        report = run_gc(s3_store, ttl_seconds=10, grace_seconds=0, cache=cache, now=t0 + 100)
    assert report.kept_pinned == 1 and report.deleted == 1
    assert present(s3_store) & set(keys) == {keys[0]}


class SkewedTime:
    """The `time` module of a host whose clock is `skew` seconds off the store's (everything else as is)."""

    def __init__(self, skew: float) -> None:
        self.skew = skew

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def time(self) -> float:
        return time.time() + self.skew


def test_a_gc_host_an_hour_ahead_deletes_nothing_uploaded_seconds_ago(s3_store: Any) -> None:
    keys = [chunk(9500 + i) for i in range(10)]
    write_chunks(s3_store, keys)
    with mock.patch.object(gc_module, "time", SkewedTime(3600)):
        report = run_gc(s3_store, ttl_seconds=60, grace_seconds=600)
    assert report.deleted == 0 and report.kept_young == 10, report
    assert set(keys) <= present(s3_store)
    assert report.clock_offset_s > 3500  # this host's clock ahead of the store's, as the report says


@pytest.mark.slow
def test_a_gc_host_an_hour_behind_still_deletes_what_is_idle(s3_store: Any) -> None:
    keys = [chunk(9600 + i) for i in range(5)]
    write_chunks(s3_store, keys)
    listed_older_than(s3_store, keys, 2.5)  # past the grace period of 0 s and its one-second margin
    with mock.patch.object(gc_module, "time", SkewedTime(-3600)):
        report = run_gc(s3_store, ttl_seconds=0, grace_seconds=0)
    assert report.deleted == 5 and report.kept_young == 0, report
    assert not set(keys) & present(s3_store)
    assert report.clock_offset_s < -3500
