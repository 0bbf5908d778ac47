"""Cold-tier lifecycle: cost rules, crash-safe moves, Delta versions kept readable, lifecycle config round trip."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgehaul.blocks import ObjectStore, RetentionPolicy, RetentionRule
from edgehaul.ops import lifecycle as lc
from edgehaul.ops import store_probe
from edgehaul.ops.lifecycle_config import apply_configuration, lifecycle_configuration
from edgehaul.ops.storage_classes import BELOW_MIN_SIZE, CLASSES, check_delete, check_move
from tests.builders import processed_rows
from tests.conftest import store_for

KiB = 1024
T0 = datetime(2026, 1, 1, tzinfo=UTC)


class SimulatedCrash(RuntimeError):
    """Raised by a test hook to stop a batch between two steps."""


# ------------------------------------------------------------------------------------ unit: rules


@given(
    size=st.integers(0, 1 << 30), cls=st.sampled_from(sorted(CLASSES)), target=st.sampled_from(sorted(CLASSES)),
    held=st.floats(0, 400), force=st.sampled_from([None, "legal hold lifted"]),
)
def test_move_rules_never_pay_for_a_mistake(size: int, cls: str, target: str, held: float, force: str | None) -> None:
    v = check_move(size, cls, T0, target, T0 + timedelta(days=held), force)
    if size < CLASSES[target].min_billable_bytes:
        assert not v.allowed and v.reason == BELOW_MIN_SIZE  # not even forced: merge first
    elif held < CLASSES[cls].min_duration_days:
        assert v.allowed == (force is not None) and v.forced == (force is not None)
        assert (force in v.reason) if force else "minimum storage duration" in v.reason
    else:
        assert v.allowed and not v.forced
    d = check_delete(cls, T0, T0 + timedelta(days=held), force)
    assert d.allowed == (held >= CLASSES[cls].min_duration_days or force is not None)


def test_classify_follows_the_key_layout() -> None:
    s = ObjectStore(prefix="p")
    cases = {
        (s.bucket("landing"), "p/node-a/2026-01-01/b1.parquet"): "raw",
        (s.bucket("curated"), "p/quarantine/node-a/b1.parquet"): "raw",
        (s.bucket("curated"), "p/datasets/landsat_patch/part-0.parquet"): "features",
        (s.bucket("curated"), "p/datasets/landsat_patch/_delta_log/00000000000000000000.json"): None,
        (s.bucket("models"), "p/models/landcover/m1/model.pt"): "model_weights",
        (s.bucket("checkpoints"), "p/run1/100/state.pt"): "checkpoints",
        (s.bucket("ops"), "p/logs/x.log"): "logs",
        (s.bucket("ops"), "p/reports/costs/2026-01/report.parquet"): "reports",
        (s.bucket("ops"), "p/lifecycle/journal/x.json"): None,
        (s.bucket("landing"), "other/node-a/x.parquet"): None,
    }
    for (bucket, key), want in cases.items():
        assert lc.classify(s, bucket, key) == want, key
    ck = lc.cold_key(s, s.bucket("landing"), "p/node-a/2026-01-01/b1.parquet")
    assert ck == "p/edgehaul-landing/node-a/2026-01-01/b1.parquet"
    assert lc.origin_of(s, ck) == (s.bucket("landing"), "p/node-a/2026-01-01/b1.parquet")


def test_generated_lifecycle_configuration_keeps_cost_rules() -> None:
    s = ObjectStore(prefix="p")
    policy = RetentionPolicy(rules=[
        RetentionRule(data_class="raw", cold_after_days=7, expire_after_days=20),
        RetentionRule(data_class="features", cold_after_days=60, cold_storage_class="GLACIER", expire_after_days=400),
        RetentionRule(data_class="model_weights", cold_after_days=90, cold_storage_class="GLACIER_IR",
                      cold_if_unused_days=30),
        RetentionRule(data_class="checkpoints", cold_after_days=30),
    ])
    cfg = lifecycle_configuration(s, policy)
    landing = {r["ID"]: r for r in cfg[s.bucket("landing")].rules}
    cold = landing["edgehaul:p/:raw:cold"]
    assert cold["Transitions"] == [{"Days": 30, "StorageClass": "STANDARD_IA"}]  # raised from 7: IA minimum
    assert cold["Filter"]["And"] == {"Prefix": "p/", "ObjectSizeGreaterThan": 128 * KiB - 1}
    assert landing["edgehaul:p/:raw:expire"]["Expiration"] == {"Days": 60}  # 30 + 30 days in IA
    curated = cfg[s.bucket("curated")]
    assert not any("datasets/" in json.dumps(r) for r in curated.rules)  # GLACIER breaks Delta reads; no expiry
    assert any("breaks Delta reads" in n for n in curated.notes)
    notes = " ".join(cfg[s.bucket("checkpoints")].notes)
    assert "not expressible" in notes and "no prefix isolates" in notes


# ----------------------------------------------------------------------------- integration helpers


def _fresh_store(stack: object, role: str = "admin") -> ObjectStore:
    return store_for(stack, role, prefix=f"t-{uuid.uuid4().hex[:10]}")  # type: ignore[arg-type]


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _as_landing_writer(stack: object, store: ObjectStore) -> ObjectStore:
    """Landing data is written by nodes (and the operator), never by the lifecycle identity (write-once landing):
    test objects under `store`'s prefix come from the operator's identity."""
    return store_for(stack, prefix=store.prefix)  # type: ignore[arg-type]


def _put_raw(store: ObjectStore, n: int, size: int = 140 * KiB) -> dict[str, str]:
    s3 = store.client()
    out = {}
    for i in range(n):
        body = os.urandom(size)
        key = store.key("landing", f"node-a/2026-01-01/b{i:03d}.parquet")
        s3.put_object(Bucket=store.bucket("landing"), Key=key, Body=body)
        out[key] = _sha(body)
    return out


def _places(store: ObjectStore, key: str) -> list[str]:
    s3 = store.client()
    found = []
    cold = lc.cold_key(store, store.bucket("landing"), key)
    for bucket, k in ((store.bucket("landing"), key), (store.bucket("cold"), cold)):
        if lc._head(s3, bucket, k) is not None:
            found.append(bucket)
    return found


def _finish(store: ObjectStore, policy: RetentionPolicy, now: datetime) -> None:
    """What a rerun of the flow does: plan, finish journalled batches (sparing referenced files), run the plan."""
    p = lc.plan(store, policy, now)
    for _bid, (at, actions) in lc.pending_batches(store).items():
        assert not lc.run_batch(store, actions, at, protected=p.protected_keys).errors
    for batch in p.batches(2):
        assert not lc.run_batch(store, batch, now).errors


RAW_POLICY = RetentionPolicy(rules=[RetentionRule(data_class="raw", cold_after_days=30)])


# ------------------------------------------------------------------------------ integration tests


@pytest.mark.integration
def test_interrupted_move_leaves_one_authoritative_copy_and_rerun_finishes(stack: object) -> None:
    now = datetime.now(UTC) + timedelta(days=31)
    n = 3
    for crash_at in range(2 * n + 1):  # every point between copy, verify, delete of every object, and none
        store = _fresh_store(stack, "lifecycle")
        want = _put_raw(_as_landing_writer(stack, store), n)
        calls = []

        def hook(step: str, a: lc.Action, crash_at: int = crash_at, calls: list = calls) -> None:
            calls.append(step)
            if len(calls) == crash_at:
                raise SimulatedCrash(f"crash after {step} of {a.src_key}")

        p = lc.plan(store, RAW_POLICY, now)
        assert p.counts() == {"move": n}
        try:
            for batch in p.batches(2):
                lc.run_batch(store, batch, now, hook=hook)
        except SimulatedCrash:
            pass
        for key, sha in want.items():  # mid-way: readable, identical, in one authoritative place
            assert 1 <= len(_places(store, key)) <= 2
            assert _sha(lc.read_object(store, store.bucket("landing"), key)) == sha
        assert bool(lc.pending_batches(store)) == (crash_at != 0)
        _finish(store, RAW_POLICY, now)
        for key, sha in want.items():
            assert _places(store, key) == [store.bucket("cold")], (crash_at, key)
            loc = lc.resolve(store, store.bucket("landing"), key)
            assert (loc.tier, loc.storage_class) == ("cold", "STANDARD_IA")
            assert _sha(lc.read_object(store, store.bucket("landing"), key)) == sha
        assert not lc.pending_batches(store)
        assert lc.plan(store, RAW_POLICY, now).actions == []  # nothing left: idempotent


@pytest.mark.integration
def test_large_objects_move_by_multipart_copy(stack: object) -> None:
    store = _fresh_store(stack)
    body = os.urandom(11 * 1024 * KiB)
    key = store.key("landing", "node-b/2026-01-02/big.parquet")
    store.client().put_object(Bucket=store.bucket("landing"), Key=key, Body=body)
    now = datetime.now(UTC) + timedelta(days=40)
    p = lc.plan(store, RAW_POLICY, now)
    res = lc.run_batch(store, p.actions, now, multipart_threshold=6 * 1024 * KiB, part_bytes=5 * 1024 * KiB)
    assert res.done == {"moved": 1} and res.bytes_moved == len(body)
    loc = lc.resolve(store, store.bucket("landing"), key)
    head = store.client().head_object(Bucket=loc.bucket, Key=loc.key)
    assert head["ETag"].strip('"').endswith("-3")  # three copied parts, no bytes through the client
    assert _sha(lc.read_object(store, store.bucket("landing"), key)) == _sha(body)


@pytest.mark.integration
def test_minimum_size_and_duration_rules_with_injected_time(stack: object) -> None:
    store = _fresh_store(stack)
    s3 = store.client()
    big = _put_raw(_as_landing_writer(stack, store), 1)
    small_key = store.key("landing", "node-a/2026-01-01/small.parquet")
    s3.put_object(Bucket=store.bucket("landing"), Key=small_key, Body=os.urandom(20 * KiB))
    policy = RetentionPolicy(rules=[RetentionRule(data_class="raw", cold_after_days=30, expire_after_days=35)])
    t_move = datetime.now(UTC) + timedelta(days=31)
    p = lc.plan(store, policy, t_move)
    assert [a.src_key for a in p.actions] == list(big)
    assert p.skipped_keys[small_key] == BELOW_MIN_SIZE and p.skipped[BELOW_MIN_SIZE] == 1
    assert not lc.run_batch(store, p.actions, t_move).errors
    (key,) = big
    # day 41 of the data, day 10 in STANDARD_IA: expired by age, but IA bills 30 days: not deleted
    t_early = t_move + timedelta(days=10)
    p = lc.plan(store, policy, t_early)
    cold = lc.cold_key(store, store.bucket("landing"), key)
    assert "minimum storage duration of STANDARD_IA not reached" in p.skipped_keys[cold]
    assert all(a.src_key != cold for a in p.actions)
    # the small object is old enough to expire in place (STANDARD has no minimum duration)
    assert [a.src_key for a in p.actions if a.kind == "delete"] == [small_key]
    forced = lc.plan(store, policy, t_early, force_reason="GDPR erasure request 42")
    (a,) = [a for a in forced.actions if a.src_key == cold]
    assert a.kind == "delete" and "forced: GDPR erasure request 42" in a.reason
    # without force, 30 days after the move it goes
    p = lc.plan(store, policy, t_move + timedelta(days=30))
    assert {a.src_key for a in p.actions if a.kind == "delete"} == {cold, small_key}
    assert not lc.run_batch(store, p.actions, t_move + timedelta(days=30)).errors
    assert _places(store, key) == [] and _places(store, small_key) == []


@pytest.mark.integration
def test_last_use_keeps_recently_read_objects_hot(stack: object) -> None:
    store = _fresh_store(stack)
    keys = list(_put_raw(_as_landing_writer(stack, store), 2))
    policy = RetentionPolicy(rules=[RetentionRule(data_class="raw", cold_after_days=None, cold_if_unused_days=14)])
    now = datetime.now(UTC) + timedelta(days=20)
    lc.record_access(store, at=now - timedelta(days=3), reader="eval-run-7", bucket=store.bucket("landing"),
                     prefix=keys[0])
    p = lc.plan(store, policy, now)
    assert [a.src_key for a in p.actions] == [keys[1]] and "unused 20d" in p.actions[0].reason
    assert [a.src_key for a in lc.plan(store, policy, now + timedelta(days=12)).actions] == keys


def _write_table(store: ObjectStore, rows: pa.Table, mode: str) -> None:
    from deltalake import write_deltalake

    write_deltalake(store.uri("curated", "landsat_patch"), rows, mode=mode,  # type: ignore[arg-type]
                    storage_options=store.storage_options())


def _version_sha(store: ObjectStore, v: int) -> str:
    from deltalake import DeltaTable

    t = DeltaTable(store.uri("curated", "landsat_patch"), version=v, storage_options=store.storage_options())
    tab = t.to_pyarrow_table().sort_by("sample_id")
    return hashlib.sha256(b"".join(str(x).encode() for x in tab.column("content_sha256").to_pylist())
                          + str(tab.column("value").to_pylist()).encode()).hexdigest()


@pytest.mark.integration
def test_referenced_dataset_versions_read_identically_after_lifecycle(stack: object) -> None:
    store = _fresh_store(stack)
    uri = store.uri("curated", "landsat_patch")
    # v0, v1 appends; v2 overwrites (v0/v1 files now only read by old versions); v3 appends
    for i, mode in enumerate(["append", "append", "overwrite", "append"]):
        _write_table(store, processed_rows(250, seed=i, start_seq=i * 1000), mode)
    s3 = store.client()
    files = [o for o in lc.list_objects(s3, store.bucket("curated"), store.key("curated")) if o.key.endswith(".parquet")]
    assert len(files) == 4 and min(o.size for o in files) >= 128 * KiB  # big enough for STANDARD_IA
    lineage = {"team": "geo", "accelerator_hours": 1.5, "dataset_uri": uri, "dataset_version": 0}
    s3.put_object(Bucket=store.bucket("models"), Key=store.key("models", "landcover/m0/lineage.json"),
                  Body=json.dumps(lineage).encode())
    before = {v: _version_sha(store, v) for v in range(4)}
    policy = RetentionPolicy(rules=[RetentionRule(data_class="features", cold_after_days=10, expire_after_days=90)],
                             keep_latest_versions=1)
    now = datetime.now(UTC) + timedelta(days=40)
    p = lc.plan(store, policy, now)
    assert p.protected_versions[uri] == {0: "model m0", 3: "latest 1"}
    moved = [a.src_key for a in p.actions]
    assert len(moved) == 1 and p.counts() == {"move": 1}  # only v1's file: not read by v0, v3
    assert not lc.run_batch(store, p.actions, now).errors
    assert {v: _version_sha(store, v) for v in (0, 2, 3)} == {v: before[v] for v in (0, 2, 3)}
    # a pin makes v1 referenced again: its file is restored into the table, read identically
    pinned = policy.model_copy(update={"pinned_versions": [1]})
    p = lc.plan(store, pinned, now + timedelta(days=1))
    assert p.counts() == {"restore": 1} and p.actions[0].dst_key == moved[0]
    assert not lc.run_batch(store, p.actions, now + timedelta(days=1)).errors
    assert _version_sha(store, 1) == before[1]
    # far later: expired, but only files no protected version reads are deleted
    late = now + timedelta(days=200)
    p = lc.plan(store, policy, late)
    deleted = {a.src_key for a in p.actions if a.kind == "delete"}
    assert deleted == {moved[0]}
    assert not lc.run_batch(store, p.actions, late).errors
    assert {v: _version_sha(store, v) for v in (0, 3)} == {v: before[v] for v in (0, 3)}
    # a move journalled before v3 was referenced, interrupted after the copy: the rerun spares v3's file
    v3_file = next(k for k in lc._version_keys(store, uri, 3) if lc._head(s3, store.bucket("curated"), k))
    h = s3.head_object(Bucket=store.bucket("curated"), Key=v3_file)
    stale = lc.Action("move", store.bucket("curated"), v3_file, store.bucket("cold"),
                      lc.cold_key(store, store.bucket("curated"), v3_file), h["ContentLength"], h["ETag"].strip('"'),
                      "STANDARD_IA", "features", late.isoformat(), "planned when v3 was not referenced")

    def crash(step: str, a: lc.Action) -> None:
        raise SimulatedCrash(step)

    with pytest.raises(SimulatedCrash):
        lc.run_batch(store, [stale], late, hook=crash)
    _finish(store, policy, late)
    assert lc._head(s3, store.bucket("cold"), stale.dst_key) is None  # redundant copy dropped
    assert not lc.pending_batches(store) and _version_sha(store, 3) == before[3]


@pytest.mark.integration
def test_generated_lifecycle_configuration_round_trips_through_the_server(stack: object) -> None:
    admin = store_for(stack)  # type: ignore[arg-type]
    bucket = f"eh-lc-{uuid.uuid4().hex[:10]}"
    admin.client().create_bucket(Bucket=bucket)
    store = ObjectStore(**{**admin.model_dump(), "landing_bucket": bucket, "ops_bucket": bucket, "prefix": "t1"})
    s3 = store.client()
    foreign = {"ID": "someone-else", "Status": "Enabled", "Filter": {"Prefix": "other/"}, "Expiration": {"Days": 3}}
    s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [foreign]})
    policy = RetentionPolicy(rules=[
        RetentionRule(data_class="raw", cold_after_days=30, expire_after_days=365),
        RetentionRule(data_class="logs", cold_after_days=None, expire_after_days=14),
    ])
    probed = {c.feature: c for c in store_probe.probe(store, classes=False)}
    caps = {f: c.present for f, c in probed.items()}
    (res,) = [r for r in apply_configuration(store, policy) if r.bucket == bucket]
    ids = {r["ID"] for r in res.emitted}
    assert ids == {"edgehaul:t1/:raw:cold", "edgehaul:t1/:raw:expire", "edgehaul:t1/:logs:expire"}
    if caps["lifecycle-transition-rules"]:
        assert not res.refused
    else:  # e.g. SeaweedFS's 501: refused by name with the server's answer, the rest applied
        assert set(res.refused) == {"edgehaul:t1/:raw:cold"}
        code = probed["lifecycle-transition-rules"].detail.split()[-1]  # the server's code, e.g. NotImplemented
        assert code in res.refused["edgehaul:t1/:raw:cold"], (code, res.refused)
    assert {r["ID"] for r in res.applied} == ids - set(res.refused)
    # a transition rule applied without its size filter is withdrawn; everything else reads back equal
    dropped = bool(caps["lifecycle-transition-rules"]) and not caps["lifecycle-size-filter"]
    assert res.withdrawn == (["edgehaul:t1/:raw:cold"] if dropped else []) and res.round_trip_ok != dropped
    got = s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
    assert any(r["ID"] == "someone-else" for r in got)  # other owners' rules kept
    # applying again is idempotent
    (again,) = [r for r in apply_configuration(store, policy) if r.bucket == bucket]
    kept = 1 + len(ids) - len(res.refused) - len(res.withdrawn)
    assert again.round_trip_ok != dropped and len(s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]) == kept


@pytest.mark.integration
def test_lifecycle_flow_dry_run_then_moves_and_meters_its_requests(stack: object) -> None:
    from edgehaul.flows.lifecycle_moves import LifecycleParams, lifecycle_moves
    from edgehaul.ops.costs import usage_records

    store = _fresh_store(stack, "lifecycle")
    want = _put_raw(_as_landing_writer(stack, store), 3)
    name = f"t-{uuid.uuid4().hex[:10]}"
    store.save(name)  # the lifecycle identity: its grants suffice (incl. the ops bucket)
    RAW_POLICY.save(name)
    now = datetime.now(UTC) + timedelta(days=31)
    dry = lifecycle_moves(LifecycleParams(store_block=name, policy_block=name, now=now, dry_run=True, batch_size=2))
    assert dry["planned"] == {"move": 3} and dry["done"] == {}
    assert all(_places(store, k) == [store.bucket("landing")] for k in want)
    out = lifecycle_moves(LifecycleParams(store_block=name, policy_block=name, now=now, batch_size=2))
    assert out["done"] == {"moved": 3} and out["errors"] == [] and out["requests"] > 0
    assert all(_places(store, k) == [store.bucket("cold")] for k in want)
    recs = usage_records(store.client(), store, now - timedelta(minutes=1), now + timedelta(minutes=1))
    assert [(r.source, r.quantity) for r in recs] == [("lifecycle_moves", out["requests"])]
    assert out["pruned_batches"] == 0 and lc.pending_batches(store) == {}  # finished batches kept for audit
    again = lifecycle_moves(LifecycleParams(store_block=name, policy_block=name, now=now, journal_keep_days=0))
    assert again["planned"] == {} and again["pruned_batches"] == 2  # idempotent; 3 objects were 2 batches
    with pytest.raises(ValueError, match="timezone-aware"):
        LifecycleParams(now=datetime(2026, 1, 1))


@pytest.mark.integration
def test_object_rewritten_after_plan_is_left_alone_and_batch_closes(stack: object) -> None:
    store = _fresh_store(stack, "lifecycle")
    (key, _), (gone, _) = _put_raw(_as_landing_writer(stack, store), 2).items()
    now = datetime.now(UTC) + timedelta(days=31)
    p = lc.plan(store, RAW_POLICY, now)
    new = os.urandom(150 * KiB)
    operator = _as_landing_writer(stack, store).client()  # someone else changes landing after the plan
    operator.put_object(Bucket=store.bucket("landing"), Key=key, Body=new)
    operator.delete_object(Bucket=store.bucket("landing"), Key=gone)
    res = lc.run_batch(store, p.actions, now)
    assert res.done == {"skipped: changed since planned": 1, "skipped: source gone": 1} and not res.errors
    assert not lc.pending_batches(store)
    assert _places(store, key) == [store.bucket("landing")] and _places(store, gone) == []
    assert lc.read_object(store, store.bucket("landing"), key) == new
    with pytest.raises(FileNotFoundError, match=gone):
        lc.resolve(store, store.bucket("landing"), gone)


@pytest.mark.integration
def test_published_model_stays_hot_while_old_models_go_cold(stack: object) -> None:
    store = _fresh_store(stack, "lifecycle")
    s3 = store.client()
    for mid in ("m1", "m2", "m3"):
        s3.put_object(Bucket=store.bucket("models"), Key=store.key("models", f"landcover/{mid}/model.pt"),
                      Body=os.urandom(200 * KiB))
        s3.put_object(Bucket=store.bucket("models"), Key=store.key("models", f"landcover/{mid}/lineage.json"),
                      Body=json.dumps({"team": "geo", "accelerator_hours": 1.0}).encode())
    s3.put_object(Bucket=store.bucket("models"), Key=store.key("models", "landcover/latest.json"),
                  Body=json.dumps({"model_id": "m3", "previous": "m2"}).encode())
    policy = RetentionPolicy(rules=[RetentionRule(data_class="model_weights", cold_after_days=180,
                                                  cold_storage_class="GLACIER_IR", expire_after_days=181)])
    now = datetime.now(UTC) + timedelta(days=180)
    p = lc.plan(store, policy, now)
    assert [(a.kind, a.src_key) for a in p.actions] == [("move", store.key("models", "landcover/m1/model.pt"))]
    assert p.skipped_keys[store.key("models", "landcover/m3/model.pt")] == "referenced: published model m3"
    assert "metadata object stays hot" in p.skipped_keys[store.key("models", "landcover/m1/lineage.json")]
    assert not lc.run_batch(store, p.actions, now).errors
    # a day later everything is past expiry; the pointer, the published model and its rollback target stay
    later = lc.plan(store, policy, now + timedelta(days=1), force_reason="test: expire the rest")
    gone = {a.src_key for a in later.actions if a.kind == "delete"}
    assert store.key("models", "landcover/latest.json") not in gone
    assert not any("/m2/model.pt" in k or "/m3/model.pt" in k for k in gone)


@pytest.mark.integration
def test_plans_obey_cost_rules_for_any_policy_and_time(stack: object) -> None:
    """Property: whatever the policy, time and force, a plan never moves an object below the target's
    minimum billable size, never moves to a class no colder, and never deletes a cold copy before its
    class's minimum duration without a recorded force reason."""
    from hypothesis import HealthCheck, settings

    store = _fresh_store(stack)
    s3 = store.client()
    for i, size in enumerate((10 * KiB, 128 * KiB - 1, 128 * KiB, 300 * KiB)):
        s3.put_object(Bucket=store.bucket("landing"), Key=store.key("landing", f"node-a/2026-01-01/s{i}.parquet"),
                      Body=os.urandom(size))
    t_move = datetime.now(UTC) + timedelta(days=30)
    first = lc.plan(store, RAW_POLICY, t_move)
    assert len(first.actions) == 2 and not lc.run_batch(store, first.actions, t_move).errors  # 2 big ones go cold
    since = {lc.cold_key(store, a.src_bucket, a.src_key): t_move for a in first.actions}

    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        cold_after=st.one_of(st.none(), st.integers(0, 400)), expire=st.one_of(st.none(), st.integers(0, 400)),
        target=st.sampled_from(sorted(set(CLASSES) - {"STANDARD"})), days=st.integers(0, 500),
        force=st.sampled_from([None, "audit 7"]),
    )
    def check(cold_after: int | None, expire: int | None, target: str, days: int, force: str | None) -> None:
        policy = RetentionPolicy(rules=[RetentionRule(data_class="raw", cold_after_days=cold_after,
                                                      expire_after_days=expire, cold_storage_class=target)])
        now = t_move + timedelta(days=days)
        p = lc.plan(store, policy, now, force_reason=force)
        for a in p.actions:
            if a.kind == "move":
                assert a.size >= CLASSES[target].min_billable_bytes and CLASSES[a.storage_class].rank >= 1
            if a.kind == "delete" and a.src_key in since:
                held = now - since[a.src_key]
                assert held >= timedelta(days=30) or (force is not None and f"forced: {force}" in a.reason)
        assert all(a.kind != "restore" for a in p.actions)

    check()


@pytest.mark.integration
def test_a_rule_the_server_changed_is_withdrawn_and_fails_the_run(stack: object) -> None:
    # moto (5.2) stores a Transition rule without its ObjectSizeGreaterThan filter, as another S3 server does
    # (it then moves small manifests to an infrequent-access class): the run fails naming the rule.
    import logging
    import urllib.request

    import boto3
    from moto.server import ThreadedMotoServer
    from pydantic import SecretStr

    from edgehaul.flows.lifecycle_moves import LifecycleMovesFailed, LifecycleParams, lifecycle_moves

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        # moto keeps one backend per process: another test's moto buckets (test_iam_policies writes empty
        # lineage.json objects) would be this run's store too
        urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST"),
                               timeout=10).close()
        store = ObjectStore(endpoint_url=f"http://{host}:{port}", access_key_id=SecretStr("moto"),
                            secret_access_key=SecretStr("moto"))
        s3 = boto3.client("s3", endpoint_url=store.endpoint_url, aws_access_key_id="moto",
                          aws_secret_access_key="moto", region_name="us-east-1")
        for zone in ("landing", "curated", "cold", "checkpoints", "ops"):
            s3.create_bucket(Bucket=store.bucket(zone))
        name = f"t-{uuid.uuid4().hex[:10]}"
        store.save(name)
        policy = RetentionPolicy(rules=[RetentionRule(data_class="raw", cold_after_days=30, expire_after_days=365)])
        policy.save(name)
        with pytest.raises(LifecycleMovesFailed, match=r"edgehaul-landing: edgehaul:/:raw:cold.*apply_store_lifecycle"):
            lifecycle_moves(LifecycleParams(store_block=name, policy_block=name, apply_store_lifecycle=True))
        ids = {r["ID"] for r in s3.get_bucket_lifecycle_configuration(Bucket=store.bucket("landing"))["Rules"]}
        assert ids == {"edgehaul:/:raw:expire"}  # the changed transition taken off, the faithful rule kept
        (res,) = [r for r in apply_configuration(store, policy) if r.bucket == store.bucket("landing")]
        assert res.withdrawn == ["edgehaul:/:raw:cold"] and not res.round_trip_ok
    finally:
        server.stop()


@pytest.mark.integration
def test_the_documented_outside_readers_read_one_version_over_plain_http(stack: object) -> None:
    import re
    from pathlib import Path

    from deltalake import write_deltalake

    admin = store_for(stack, prefix=f"t-{uuid.uuid4().hex[:10]}")  # type: ignore[arg-type]
    uri = admin.uri("curated", "datasets/doc_kind")
    for v in range(4):  # versions 0..3, one more row-batch each
        write_deltalake(uri, pa.table({"sample_id": [f"s{v}-{i}" for i in range(5)], "v": [v] * 5}),
                        mode="append", storage_options=admin.storage_options())
    trainer = stack.identities["trainer"]  # type: ignore[attr-defined]
    doc = (Path(__file__).resolve().parents[2] / "docs" / "STORAGE.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if "by_polars" in b]
    first, second, rest = block.split("\n", 2)
    assert first.startswith("endpoint, key_id, secret =") and second.startswith("uri, version =")
    assert admin.endpoint_url and admin.endpoint_url.startswith("http://")  # the point: plain http
    ns: dict[str, object] = {}
    exec(f"endpoint, key_id, secret = {admin.endpoint_url!r}, {trainer.access_key_id!r}, "
         f"{trainer.secret_access_key!r}\nuri, version = {uri!r}, 2\n{rest}", ns)
    want = sorted(f"s{v}-{i}" for v in range(3) for i in range(5))
    assert sorted(ns["by_deltalake"].column("sample_id").to_pylist()) == want  # type: ignore[attr-defined]
    assert sorted(ns["by_polars"]["sample_id"].to_list()) == want  # type: ignore[index]
    assert sorted(ns["by_pyarrow"].column("sample_id").to_pylist()) == want  # type: ignore[attr-defined]
    assert ns["rows_by_duckdb"] == len(want)


@pytest.mark.integration
def test_a_wrong_copy_left_by_an_interrupted_move_is_never_taken_for_the_planned_one(stack: object) -> None:
    # A crash between a copy the server made of other bytes (CopySourceIfMatch ignored) and its check leaves a
    # cold object that records the planned ETag: the rerun must not delete the source on its word.
    from edgehaul.platform import s3compat

    store = _fresh_store(stack)
    s3 = store.client()
    bucket = store.bucket("landing")
    key, moved = store.key("landing", "node-a/2026-01-01/w.parquet"), store.key("landing", "node-a/2026-01-01/x.parquet")
    planned = {k: s3compat.unquoted(s3.put_object(Bucket=bucket, Key=k, Body=b"v1" * 600)["ETag"]) for k in (key, moved)}
    acts = {k: lc.Action("move", bucket, k, store.bucket("cold"), lc.cold_key(store, bucket, k), 1200, planned[k],
                         "STANDARD_IA", "raw", T0.isoformat(), "test") for k in (key, moved)}
    for a in acts.values():  # the wrong copies: same size, other bytes, the planned ETag recorded
        s3.put_object(Bucket=a.dst_bucket, Key=a.dst_key, Body=b"v2" * 600, Metadata={"eh-source-etag": a.etag})
    s3.put_object(Bucket=bucket, Key=key, Body=b"v3" * 600)  # one source changed since; the other did not
    res = lc.run_batch(store, list(acts.values()), T0)
    assert res.done == {"skipped: changed since planned": 1, "moved": 1} and not res.errors, (res.done, res.errors)
    assert lc._head(s3, acts[key].dst_bucket, acts[key].dst_key) is None  # the wrong copy removed
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == b"v3" * 600
    # the unchanged source was copied again, not trusted: its cold copy holds its bytes
    assert s3.get_object(Bucket=acts[moved].dst_bucket, Key=acts[moved].dst_key)["Body"].read() == b"v1" * 600
    assert lc._head(s3, bucket, moved) is None
