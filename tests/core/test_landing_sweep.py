"""The scheduled sweep of landing (core_ingest `sweep`, deployment `core_ingest/landing-sweep`): it commits the
bundles no event announced, takes only bundles neither committed nor quarantined (so old bundles never crowd
new ones out of its bound), and reads nothing per bundle when nothing is new."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest

from edgehaul.blocks import ObjectStore
from edgehaul.core.datasets import committed_bundle_ids
from edgehaul.flows.core_ingest import CoreIngestParams, core_ingest
from edgehaul_dev import deploy
from tests.builders import bundle, land


@pytest.mark.integration
def test_the_sweep_commits_only_what_is_unsettled_within_its_bound(store: ObjectStore) -> None:
    block = f"sweep-{uuid.uuid4().hex[:10]}"
    store.save(block, overwrite=True)
    # before: committed by an announced run, and one quarantined (unknown contract)
    old = [bundle(10, "node-a", seed=i, start_seq=100 * i) for i in range(3)]
    old_keys = [land(store, d, m) for d, m in old]
    d, bad = bundle(10, "node-b", seed=9, start_seq=900)
    bad_key = land(store, d, replace(bad, contract="landsat_patch.v7"))
    first = core_ingest(CoreIngestParams(store_block=block, bundle_keys=[*old_keys, bad_key]))
    assert first["valid"] == 3 and [q["reason"] for q in first["quarantined"]] == ["unknown_contract"]

    # three bundles land that nobody announces; their keys sort after the settled ones (node-a, node-b < node-c)
    new = [bundle(12, "node-c", seed=20 + i, start_seq=2000 + 100 * i) for i in range(3)]
    new_keys = [land(store, d, m) for d, m in new]
    swept = core_ingest(CoreIngestParams(store_block=block, sweep=True, max_bundles=2))
    # the bound holds, and it is spent on new bundles only: nothing committed or quarantined is read again
    assert swept["bundles"] == 2 and swept["valid"] == 2 and not swept["already_committed"], swept
    assert not swept["already_quarantined"] and not swept["quarantined"]
    swept2 = core_ingest(CoreIngestParams(store_block=block, sweep=True, max_bundles=2))
    assert swept2["bundles"] == 1 and swept2["valid"] == 1, swept2
    refs = [(m.node_id, m.bundle_id) for _, m in new]  # a bundle id is unique per node
    assert committed_bundle_ids(store, "landsat_patch", refs) == set(refs)
    assert set(new_keys).isdisjoint(old_keys)

    # nothing new: the sweep takes no bundle at all (no manifest read, no validation, no commit)
    idle = core_ingest(CoreIngestParams(store_block=block, sweep=True))
    assert idle["bundles"] == 0 and idle["validation_tasks"] == 0 and not idle["commits"], idle


def test_the_sweep_is_a_scheduled_deployment_of_core_ingest() -> None:
    spec = deploy.load_spec()
    (sweep,) = [d for d in spec["deployments"] if d["name"] == "landing-sweep"]
    assert sweep["entrypoint"].endswith(":core_ingest") and sweep["parameters"]["params"]["sweep"] is True
    assert sweep["parameters"]["params"]["store_block"] == "ingest"
    assert sweep["schedules"][0]["interval"] <= 600 and sweep["concurrency_limit"]["limit"] == 1
    CoreIngestParams.model_validate(sweep["parameters"]["params"])
