"""The hostile-node drill: a node holding its own landing key lands objects shaped to break the core (manifests
nested 100,000 deep, 5,000-digit numbers, not JSON, a contract named by path; bundles that unpack a few KB
to gigabytes, truncated or garbled zstd pages, wrong magic, rows weighted by inclusion_p 1e-40, rows naming
another node) beside honest nodes' bundles. Every honest sample must reach the dataset exactly once, every
hostile object must be quarantined with a reason, and no core ingest run may fail.

`land_attack` is shared with tests/security/test_attacks_bytes.py (its hypothesis property feeds the same attacks in
random mixes); what checks the bytes is the product's (`edgehaul.core.ingest`, through `pipeline`).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import random
import uuid
from dataclasses import asdict, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from edgehaul.blocks import ObjectStore
from edgehaul.bundles import BundleManifest, write_bundle
from edgehaul.contracts import load_contract
from edgehaul.core import quarantine
from edgehaul_dev.drills.accounting import account
from edgehaul_dev.drills.env import DrillEnv, PoolBundle, ids_of, spool_all
from edgehaul_dev.drills.pipeline import KIND, drain, ingest_landed, open_spool
from edgehaul_dev.drills.report import TrialResult

HOSTILE_NODE = "node-x"
DAY = "2026-12-05"

# attack -> the reasons its quarantine record may carry
ATTACKS: dict[str, tuple[str, ...]] = {
    "deep_json": ("unreadable",),  # a manifest 100,000 brackets deep (200 KB)
    "huge_number": ("unreadable",),  # a 5,000-digit row count
    "long_float": ("unreadable",),  # a 5,000-digit fraction
    "not_json": ("unreadable",),  # random bytes where the manifest goes
    "wrong_types": ("unreadable",),  # a list where a count goes
    "contract_path": ("bad_id",),  # the contract named by a path to a real contract file
    "dict_bomb": ("too_large",),  # ~60 KB of Parquet: one 10 MB dictionary value repeated over 160 rows (1.6 GB)
    "expand_bomb": ("too_large",),  # a 1 MB dictionary value repeated over 3,000 rows: built, not decompressed
    "page_bomb": ("too_large",),  # pages declaring far more than the contract's rows can hold
    "truncated": ("unreadable",),  # the file cut short (its manifest's checksum matches the cut bytes)
    "bad_zstd": ("unreadable", "checksum"),  # a zstd page garbled inside
    "wrong_magic": ("unreadable",),  # not Parquet at all
    "inclusion_p": ("inclusion_p",),  # one row weighted 1/1e-40
    "other_node_rows": ("wrong_node",),  # rows that name another node
}


def _template_rows(template: bytes, n: int | None = None) -> pa.Table:
    t = pq.read_table(io.BytesIO(template))
    return t.slice(0, n) if n is not None else t


def _as_hostile(t: pa.Table, rng: random.Random, node: str) -> pa.Table:
    """The rows as the hostile node's own (its node id, fresh sample ids)."""
    base = rng.randrange(10**12)
    t = t.set_column(t.schema.get_field_index("node_id"), "node_id", pa.array([node] * t.num_rows, pa.string()))
    return t.set_column(t.schema.get_field_index("sample_id"), "sample_id",
                        pa.array([f"{node}-x{base + i}" for i in range(t.num_rows)], pa.string()))


def _manifest_for(data: bytes, t: pa.Table | None, template: BundleManifest, bundle_id: str) -> BundleManifest:
    ids = [str(i) for i in t.column("sample_id").to_pylist()] if t is not None else template.sample_ids
    return replace(template, bundle_id=bundle_id, sha256=hashlib.sha256(data).hexdigest(),
                   nbytes=len(data), row_count=len(ids), sample_ids=ids, min_capture_time=f"{DAY}T00:00:00+00:00")


def _written(t: pa.Table, dictionary: list[str] | None = None) -> bytes:
    """Parquet as a hostile writer makes it: the bundle's columns, the contract named, any dictionary it likes."""
    sink = io.BytesIO()
    pq.write_table(t, sink, compression="zstd", compression_level=3, use_dictionary=dictionary or False,
                   store_schema=False)
    return sink.getvalue()


def _with_payload(t: pa.Table, value: bytes) -> pa.Table:
    """Every row's pixels the same `value`, as a dictionary column (one stored copy, however many rows)."""
    col = pa.DictionaryArray.from_arrays(pa.array(np.zeros(t.num_rows, dtype=np.int32)), pa.array([value], pa.binary()))
    return t.set_column(t.schema.get_field_index("pixels"), "pixels", col)


@functools.lru_cache(maxsize=4)
def _bomb(template: bytes, rows: int, value_bytes: int, node: str) -> tuple[bytes, tuple[str, ...]]:
    """A dictionary bomb built once per shape (a 10 MB value, not 1.6 GB, is what it costs to write)."""
    rng = random.Random(rows * 31 + value_bytes)
    base = _as_hostile(_template_rows(template, 1), rng, node)
    t = pa.concat_tables([base] * rows)
    t = t.set_column(t.schema.get_field_index("sample_id"), "sample_id",
                     pa.array([f"{node}-bomb-{value_bytes}-{i}" for i in range(rows)], pa.string()))
    t = _with_payload(t, bytes(value_bytes))
    t = t.replace_schema_metadata({b"edgehaul.contract": load_contract(KIND).id.encode()})
    return _written(t, dictionary=["pixels"]), tuple(str(i) for i in t.column("sample_id").to_pylist())


def make_attack(name: str, rng: random.Random, template: bytes, template_manifest: BundleManifest,
                node: str = HOSTILE_NODE) -> tuple[bytes, bytes]:
    """(data, manifest bytes) of one attack by `node`, built from an honest bundle's rows; the bundle id is
    filled in by `land_attack`."""
    bid = "{bundle_id}"
    m0 = replace(template_manifest, node_id=node)
    if name in ("deep_json", "huge_number", "long_float", "not_json", "wrong_types", "contract_path"):
        t = _as_hostile(_template_rows(template, rng.randint(2, 12)), rng, node)
        data = write_bundle(t, load_contract(KIND), tier="normal")[0]
        doc = asdict(_manifest_for(data, t, m0, bid))
        body = {
            "deep_json": lambda: b"[" * 100_000 + b"]" * 100_000,
            "huge_number": lambda: json.dumps({**doc, "row_count": 0}).replace('"row_count": 0',
                                                                              '"row_count": ' + "9" * 5000).encode(),
            "long_float": lambda: json.dumps({**doc, "value_sum": 0.5}).replace('"value_sum": 0.5',
                                                                             '"value_sum": 0.' + "3" * 5000).encode(),
            "not_json": lambda: bytes(rng.randrange(256) for _ in range(rng.randint(1, 400))),
            "wrong_types": lambda: json.dumps({**doc, "row_count": [1, 2]}).encode(),
            "contract_path": lambda: json.dumps({**doc, "contract": "../data_contracts/landsat_patch.v1"}).encode(),
        }[name]()
        return data, body
    if name in ("dict_bomb", "expand_bomb"):
        rows, size = (160, 10 * 2**20) if name == "dict_bomb" else (3000, 2**20)
        data, ids = _bomb(template, rows, size, node)
        m = replace(m0, bundle_id=bid, sha256=hashlib.sha256(data).hexdigest(), nbytes=len(data), row_count=rows,
                    sample_ids=list(ids),
                    min_capture_time=f"{DAY}T00:00:00+00:00")
        return data, json.dumps(asdict(m)).encode()
    t = _as_hostile(_template_rows(template, rng.randint(3, 20)), rng, node)
    contract = load_contract(KIND)
    if name == "page_bomb":  # plain pages of 1 MiB pixels each: honest page headers, far over the rows' budget
        t = t.set_column(t.schema.get_field_index("pixels"), "pixels",
                         pa.array([bytes(2**20)] * t.num_rows, pa.binary()))
        data = _written(t.replace_schema_metadata({b"edgehaul.contract": contract.id.encode()}))
    elif name == "inclusion_p":
        p = t.column("inclusion_p").to_pylist()
        p[rng.randrange(len(p))] = 1e-40
        data = write_bundle(t.set_column(t.schema.get_field_index("inclusion_p"), "inclusion_p",
                                         pa.array(p, pa.float32())), contract, tier="normal")[0]
    elif name == "other_node_rows":
        nodes = [node] * t.num_rows
        nodes[rng.randrange(len(nodes))] = "node-b" if node == "node-a" else "node-a"
        sink = io.BytesIO()  # written by hand: the product's writer refuses rows of two nodes
        t2 = t.set_column(t.schema.get_field_index("node_id"), "node_id", pa.array(nodes, pa.string()))
        pq.write_table(t2, sink, compression="zstd")
        data = sink.getvalue()
    else:
        good = write_bundle(t, contract, tier="normal")[0]
        if name == "truncated":
            data = good[: rng.randrange(8, len(good) - 8)]
        elif name == "bad_zstd":  # the first page's zstd frame garbled, the footer intact
            i = good.index(b"\x28\xb5\x2f\xfd")
            data = good[:i] + bytes(rng.randrange(1, 256) for _ in range(4)) + good[i + 4:]
        else:  # wrong_magic, at both ends
            magic = rng.choice([b"\x89PNG", b"PK\x03\x04", b"\x28\xb5\x2f\xfd", b"\x00\x00\x00\x00"])
            data = magic + good[4:-4] + magic
    return data, json.dumps(asdict(_manifest_for(data, t, m0, bid))).encode()


def land_attack(store: ObjectStore, s3: Any, name: str, rng: random.Random, template: bytes,
                template_manifest: BundleManifest, node: str = HOSTILE_NODE) -> str:
    """Land one attack under `node`'s prefix as its own identity can (data, then manifest); its key."""
    data, body = make_attack(name, rng, template, template_manifest, node)
    bundle_id = uuid.UUID(int=rng.getrandbits(128)).hex
    key = store.key("landing", f"{node}/{DAY}/{bundle_id}.parquet")
    s3.put_object(Bucket=store.bucket("landing"), Key=key, Body=data)
    s3.put_object(Bucket=store.bucket("landing"), Key=quarantine.manifest_key_for(key),
                  Body=body.replace(b"{bundle_id}", bundle_id.encode()))
    return key


def attack_verdicts(store: ObjectStore, s3: Any, keys: dict[str, str]) -> list[str]:
    """Problems with the attacks' ends: each key (-> attack name) must have a quarantine record with an allowed
    reason and a non-empty error."""
    problems = []
    for key, name in keys.items():
        node, bundle = quarantine.ids_from_key(key)
        try:
            rec = quarantine.read_record(store, node, bundle, s3=s3)
        except Exception as e:  # no record: the attack was not refused
            problems.append(f"{name}: no quarantine record ({type(e).__name__})")
            continue
        if rec.reason not in ATTACKS[name] or not rec.error:
            problems.append(f"{name}: quarantined as {rec.reason!r} ({rec.error[:120]}), expected {ATTACKS[name]}")
    return problems


def drill_hostile_node(env: DrillEnv, rng: random.Random) -> TrialResult:
    """Honest node-a bundles go through spool and uplink while node-x lands 2-5 attacks beside them; one core
    ingest pass (the next runs' included) must commit every honest sample once, quarantine every attack with its
    reason, and never raise."""
    d, store = env.trial_dir("hostile"), env.store("hostile")
    s3 = env.s3
    picks: list[PoolBundle] = rng.sample(env.small, rng.randint(1, 4))
    sp = open_spool(d / "spool")
    spool_all(sp, picks)
    drain(store, sp, d / "uplink")
    template = rng.choice(env.small)
    names = [rng.choice(sorted(ATTACKS)) for _ in range(rng.randint(2, 5))]
    attacks = {land_attack(store, s3, n, rng, template.data(), template.manifest): n for n in names}
    problems = []
    try:
        ingest_landed(store, s3)
        ingest_landed(store, s3)  # the next run: nothing left, nothing fails
    except Exception as e:
        problems.append(f"core ingest failed: {type(e).__name__}: {str(e)[:200]}")
    problems += attack_verdicts(store, s3, attacks)
    a = account(store, ids_of(picks), [sp], s3)
    sp.close()
    result = a.result(True, problems)
    result.counts = {"attacks": len(attacks), "runs_failed": sum(p.startswith("core ingest failed") for p in problems)}
    return result
