"""The core does not trust the shape of a node's bytes: a node holding its own landing key (`store_for(stack,
"node-a")`: it writes only under `node-a/`) lands manifests and bundles shaped to break the core, beside
honest bundles, on the real stack (SeaweedFS, Great Expectations, Delta, the `core_ingest` flow).

On main at e80770e: a manifest nested 100,000 deep or holding a 5,000-digit number failed every core_ingest run
and discovery sweep that read it (the other node's batch committed 0 of 20); a 66 KB bundle unpacked to 1.6 GB
inside the validator (peak 3.5 GB); a file payload with the PNG signature and junk bytes was committed and
failed every training run of its kind; a row with inclusion_p 1e-40 was committed.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgehaul.bundles import BundleManifest, write_bundle
from edgehaul.contracts import DEFAULT_MIN_INCLUSION_P, load_contract
from edgehaul.core import datasets
from edgehaul.core.quarantine import read_record
from edgehaul.flows.core_ingest import CoreIngestParams, core_ingest
from edgehaul_dev import localstack
from edgehaul_dev.drills.hostile import ATTACKS, attack_verdicts, land_attack
from edgehaul_dev.drills.pipeline import ingest_landed
from tests.builders import bundle, land, processed_rows
from tests.conftest import store_for

CONTRACT = load_contract("landsat_patch")
KIND = CONTRACT.kind


def _seq() -> int:
    return random.randrange(10**9, 10**11) * 1000


@pytest.fixture(scope="module")
def ingest_block(stack: localstack.StackState) -> str:
    name = f"bytes-ingest-{uuid.uuid4().hex[:8]}"
    store_for(stack, "ingest").save(name, overwrite=True)
    return name


@pytest.fixture(scope="module")
def template() -> tuple[bytes, BundleManifest]:
    """An honest bundle whose rows the attacks reshape."""
    return bundle(30, "node-a", seed=11, start_seq=_seq())


def _run(**params: Any) -> tuple[Any, Any]:
    state = core_ingest(CoreIngestParams(**params), return_state=True)
    return state.result(raise_on_failure=False), state


def _dataset_ids(stack: localstack.StackState, kind: str = KIND) -> Counter[str]:
    t = datasets.read_version(store_for(stack, "ingest"), kind, columns=["sample_id"])
    return Counter(t.column("sample_id").to_pylist())


# ------------------------------------------------------------------------------------------ finding 1


@pytest.mark.integration
def test_hostile_manifests_fail_no_run_and_are_quarantined_with_their_reason(
        stack: localstack.StackState, ingest_block: str, template: tuple[bytes, BundleManifest]) -> None:
    """Manifests nested 100,000 deep, holding a 5,000-digit number or fraction, not JSON, of the wrong types, or
    naming a contract by path are each quarantined with the reason; node-b's bundles in the same run and in a
    discovery sweep commit, and no run fails."""
    node_a, node_b = store_for(stack, "node-a"), store_for(stack, "node-b")
    s3 = node_a.client()
    rng = random.Random(1)
    names = ["deep_json", "huge_number", "long_float", "not_json", "wrong_types", "contract_path"]
    attacks = {land_attack(node_a, s3, n, rng, *template, node="node-a"): n for n in names}
    honest = [bundle(12, "node-b", seed=i, start_seq=_seq()) for i in range(3)]
    honest_keys = [land(node_b, d, m) for d, m in honest]

    summary, state = _run(store_block=ingest_block, bundle_keys=[*attacks, *honest_keys])
    assert state.is_completed(), state.message
    assert not summary["errors"]
    assert attack_verdicts(store_for(stack, "ingest"), store_for(stack, "ingest").client(), attacks) == []
    rec = read_record(store_for(stack, "ingest"), "node-a", next(k for k, n in attacks.items()
                                                                  if n == "deep_json").rsplit("/", 1)[1][:-8])
    assert "nested 100000 deep" in rec.error
    ids = _dataset_ids(stack)
    assert all(ids[i] == 1 for _, m in honest for i in m.sample_ids)

    more = bundle(9, "node-b", seed=7, start_seq=_seq())
    land(node_b, *more)
    sweep, state = _run(store_block=ingest_block, prefix="node-b/")  # a discovery sweep beside the attacks
    assert state.is_completed() and not sweep["errors"], state.message
    everything, state = _run(store_block=ingest_block, prefix="node-a/")  # and over the attacker's own prefix
    assert state.is_completed(), state.message
    assert {str(k) for k in attacks} <= set(everything["already_quarantined"])
    assert all(_dataset_ids(stack)[i] == 1 for i in more[1].sample_ids)


def test_manifest_parsing_is_bounded_before_python_builds_anything() -> None:
    """Depth and number length are refused as BundleError (never RecursionError or ValueError), and an
    honest manifest of the largest size parses unchanged."""
    from edgehaul.bundles import BundleError

    _, m = bundle(3, "node-a", seed=1)
    for body, said in ((b"[" * 100_000, "nested 100000 deep"), (b'{"a": {"b": {"c": {"d": [1]}}}}', "nested 5 deep"),
                       (b'{"row_count": ' + b"7" * 5000 + b"}", "5000 characters"),
                       (b'{"value_sum": 0.' + b"3" * 5000 + b"}", "5002 characters"),
                       (b'["a"' + b',"a"' * 10 + b"]", "malformed"), (b"\xff\xfe\x00", "malformed")):
        with pytest.raises(BundleError, match=said):
            BundleManifest.from_json(body)
    big = json.loads(m.to_json())
    big["sample_ids"] = [f"node-a-{i}" for i in range(300_000)]
    big["row_count"] = 300_000
    assert BundleManifest.from_json(json.dumps(big).encode()).sample_ids == big["sample_ids"]


@settings(max_examples=80, deadline=None)
@given(ids=st.lists(st.text(min_size=0, max_size=40), min_size=0, max_size=60),
       prefix=st.sampled_from(["", "node-a-", "kd-54fdb498-hive-"]))
def test_a_manifest_round_trips_whatever_its_ids_and_packs_them_only_where_shorter(ids: list[str],
                                                                                   prefix: str) -> None:
    """Packed or plain (an id with a newline, or a list the packing does not shorten, stays a JSON list), a
    manifest parses back to itself."""
    _, m = bundle(3, "node-a", seed=1)
    m2 = BundleManifest(**{**m.__dict__, "sample_ids": [prefix + i for i in ids], "row_count": len(ids)})
    body = m2.to_json()
    assert BundleManifest.from_json(body) == m2
    plain = json.dumps({**json.loads(body), "sample_ids": m2.sample_ids}).encode()
    assert len(body) <= len(plain) + 40  # never longer than the list, but for the packed field's name


def test_packed_sample_ids_are_a_fraction_of_the_list_and_a_bomb_is_refused() -> None:
    """A node's ids share a prefix and count up: packed, a 400-row manifest carries its ids in a few hundred bytes
    (as JSON strings they were a third of a small-row kind's wire). Packed ids that claim or unpack past the
    bound are refused before they are held, a frame that says its size and one that does not."""
    import base64

    import zstandard

    from edgehaul.bundles import MAX_UNPACKED_IDS_BYTES, PACKED_IDS, BundleError

    _, m = bundle(3, "node-a", seed=1)
    ids = [f"node-a-{i}" for i in range(10_000, 10_400)]
    packed = BundleManifest(**{**m.__dict__, "sample_ids": ids, "row_count": 400})
    body = packed.to_json()
    assert PACKED_IDS in json.loads(body) and len(body) < len(json.dumps(ids)) / 4
    doc = json.loads(body)
    for sized in (True, False):
        frame = zstandard.ZstdCompressor(level=19, write_content_size=sized).compress(
            b"node-a-1\n" * (MAX_UNPACKED_IDS_BYTES // 9 + 1000))
        bomb = json.dumps({**doc, PACKED_IDS: base64.b64encode(frame).decode()}).encode()
        assert len(bomb) < 100_000
        with pytest.raises(BundleError, match=r"claims|unpacks past"):
            BundleManifest.from_json(bomb)
    for bad, said in (("not base64!", "not base64 zstd"), (base64.b64encode(b"junk").decode(), "not base64 zstd"),
                      (123, "expected str")):
        with pytest.raises(BundleError, match=said):
            BundleManifest.from_json(json.dumps({**doc, PACKED_IDS: bad}))
    with pytest.raises(BundleError, match="both"):
        BundleManifest.from_json(json.dumps({**doc, "sample_ids": ids}))


# ------------------------------------------------------------------------------------------ finding 3

_PEAK = """
import random, resource
from tests.builders import bundle
from edgehaul.bundles import BundleManifest
from edgehaul.core.validation import validate_bundles
from edgehaul_dev.drills.hostile import make_attack

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024

tmpl, tm = bundle(30, seed=3)
validate_bundles([bundle(8, seed=4)], full_tables=False)  # imports, the GE suite: before any figure
made = {what: make_attack(what, random.Random(2), tmpl, tm, "node-a") for what in ("dict_bomb", "expand_bomb",
                                                                                  "page_bomb")}
before = peak()
(_, res), = validate_bundles([bundle(160, seed=5)], full_tables=False)
print("normal", res.reason, 0, peak() - before)
for what, (data, body) in made.items():
    before = peak()
    (_, res), = validate_bundles([(data, BundleManifest.from_json(body.replace(b"{bundle_id}", b"b1")))],
                                 full_tables=False)
    print(what, res.reason, len(data), peak() - before)
"""


def test_a_decompression_bomb_is_refused_before_its_rows_are_built() -> None:
    """A ~5 KB bundle whose 160 rows unpack to 1.6 GB, one whose 1 MB value expands over 3,000 rows, and one
    whose pages declare far more than its rows may hold are refused as `too_large`, and validating them raises
    the process's peak memory by no more than 64 MiB past a normal 160-row bundle's (ru_maxrss, one fresh
    process: on main the first one alone took it past 3 GB)."""
    out = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True, check=True, timeout=300,
                         cwd=Path(__file__).parents[2])
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines() if line.strip()}
    assert rows["normal"][0] == "ok"
    for what in ("dict_bomb", "expand_bomb", "page_bomb"):
        reason, size, mib = rows[what]
        assert reason == "too_large" and int(size) < 70_000, (what, rows[what])
        assert int(mib) <= 64, (what, rows)


@pytest.mark.integration
def test_a_bomb_landed_by_a_node_is_quarantined_by_core_ingest(
        stack: localstack.StackState, ingest_block: str, template: tuple[bytes, BundleManifest]) -> None:
    node_a = store_for(stack, "node-a")
    rng = random.Random(3)
    attacks = {land_attack(node_a, node_a.client(), n, rng, *template, node="node-a"): n
               for n in ("dict_bomb", "page_bomb", "truncated", "bad_zstd", "wrong_magic")}
    d_ok, m_ok = bundle(14, "node-a", seed=4, start_seq=_seq())
    ok_key = land(node_a, d_ok, m_ok)
    summary, state = _run(store_block=ingest_block, bundle_keys=[*attacks, ok_key])
    assert state.is_completed() and not summary["errors"], state.message
    ingest = store_for(stack, "ingest")
    assert attack_verdicts(ingest, ingest.client(), attacks) == []
    bomb = next(k for k, n in attacks.items() if n == "dict_bomb")
    rec = read_record(ingest, "node-a", bomb.rsplit("/", 1)[1][:-8])
    assert "unpack" in rec.error and len(rec.sample_ids) == 160  # every sample id the manifest named
    assert all(_dataset_ids(stack)[i] == 1 for i in m_ok.sample_ids)


# ------------------------------------------------------------------------------------------ finding 4


def _digits_rows(n: int, start: int) -> pa.Table:
    from tests.core.test_validation_kinds import DIGITS, _rows

    t = _rows(DIGITS, n)
    ids = [f"node-a-d{start + i}" for i in range(t.num_rows)]
    return t.set_column(t.schema.get_field_index("sample_id"), "sample_id", pa.array(ids, pa.string()))


@pytest.mark.integration
def test_a_file_payload_that_does_not_decode_is_quarantined_with_its_bundle(
        stack: localstack.StackState, ingest_block: str) -> None:
    """A PNG signature followed by junk passes the media-type check but not the decoder training runs: the
    core decodes every full row's file before a commit and quarantines the bundle (a bundle is committed or
    quarantined whole), naming the sample; the record holds every sample id of the bundle."""
    digits = load_contract("digits_png")
    node_a = store_for(stack, "node-a")
    t = _digits_rows(30, _seq())
    images = t.column("image").to_pylist()
    bad = next(i for i, v in enumerate(images) if v is not None)
    images[bad] = b"\x89PNG\r\n\x1a\n" + np.random.default_rng(0).bytes(300)
    junk = t.set_column(t.schema.get_field_index("image"), "image", pa.array(images, pa.binary()))
    d, m = write_bundle(junk, digits, tier="normal")
    key = land(node_a, d, m)
    summary, state = _run(store_block=ingest_block, bundle_keys=[key])
    assert state.is_completed(), state.message
    assert [q["reason"] for q in summary["quarantined"]] == ["file_invalid"]
    rec = read_record(store_for(stack, "ingest"), "node-a", m.bundle_id)
    sample = t.column("sample_id")[bad].as_py()
    assert "do not decode" in rec.error and sample in rec.error
    assert sorted(rec.sample_ids) == sorted(m.sample_ids)


# ------------------------------------------------------------------------------------------ finding 5


@pytest.mark.integration
def test_inclusion_p_below_the_contracts_floor_is_refused_naming_the_sample(
        stack: localstack.StackState, ingest_block: str) -> None:
    """One row weighted 1/1e-40 (a node outweighing the dataset) is refused; rows at exactly the floor
    (`limits.min_inclusion_p`, 1e-4 by default) commit."""
    assert CONTRACT.min_inclusion_p == DEFAULT_MIN_INCLUSION_P == 1e-4
    node_a = store_for(stack, "node-a")
    keys, ms = [], {}
    for name, p in (("tiny", 1e-40), ("floor", 1e-4)):
        t = processed_rows(8, "node-a", seed=random.randrange(10**6), start_seq=_seq())
        ps = t.column("inclusion_p").to_pylist()
        ps[3] = p
        t = t.set_column(t.schema.get_field_index("inclusion_p"), "inclusion_p", pa.array(ps, pa.float32()))
        d, m = write_bundle(t, CONTRACT, tier="normal")
        keys.append(land(node_a, d, m))
        ms[name] = (m, t.column("sample_id")[3].as_py())
    summary, state = _run(store_block=ingest_block, bundle_keys=keys)
    assert state.is_completed(), state.message
    assert [(q["bundle_id"], q["reason"]) for q in summary["quarantined"]] == [(ms["tiny"][0].bundle_id, "inclusion_p")]
    rec = read_record(store_for(stack, "ingest"), "node-a", ms["tiny"][0].bundle_id)
    assert ms["tiny"][1] in rec.error and "min_inclusion_p" in rec.error
    assert all(_dataset_ids(stack)[i] == 1 for i in ms["floor"][0].sample_ids)


# ------------------------------------------------------------------------------------------ the property


@pytest.mark.integration
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(attacks=st.lists(st.sampled_from(sorted(ATTACKS)), min_size=1, max_size=5),
       honest=st.integers(1, 3), seed=st.integers(0, 2**32))
def test_property_hostile_objects_among_good_bundles(stack: localstack.StackState, attacks: list[str], honest: int,
                                                     seed: int) -> None:
    """Random mixes of every attack beside good bundles, through core ingest's steps (`edgehaul.core.ingest`:
    read manifests, validate, quarantine, commit) on SeaweedFS with GE: every good sample commits exactly once,
    every attack is quarantined with its reason, and no step raises (a second pass included)."""
    rng = random.Random(seed)
    store = store_for(stack, prefix=f"t-hostile-{uuid.uuid4().hex[:10]}")
    s3 = store.client()
    good = [bundle(rng.randint(4, 16), "node-a", seed=rng.randrange(10**6), start_seq=_seq()) for _ in range(honest)]
    for d, m in good:
        land(store, d, m)
    tmpl = good[0]
    keys = {land_attack(store, s3, a, rng, *tmpl, node=rng.choice(["node-a", "node-x"])): a for a in attacks}
    ingest_landed(store, s3)
    ingest_landed(store, s3)
    assert attack_verdicts(store, s3, keys) == []
    ids = Counter(datasets.read_version(store, KIND, columns=["sample_id"]).column("sample_id").to_pylist())
    want = [i for _, m in good for i in m.sample_ids]
    assert all(ids[i] == 1 for i in want) and sum(ids.values()) == len(want)
