"""Cold vs warm: the demo's data path run twice on a fresh local stack.

edge_ingest (2 nodes) -> uplink_drain -> core_ingest, first on an empty cache, then again with the
same inputs: the second run should find every cacheable task Cached, write no new objects and take
a fraction of the time. Training is left out: it is not a pure function of its inputs (it is
resumed from checkpoints instead of cached).

    python -m benchmarks cache          # EDGEHAUL_BENCH_QUICK=1: fewer samples
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _count_objects(store: Any) -> int:
    s3 = store.client()
    total = 0
    for zone in ("landing", "curated", "ops"):
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=store.bucket(zone)):
            total += page.get("KeyCount", 0)
    return total


def _cached_share(flow_run_ids: list[Any]) -> tuple[int, int]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter

    with get_client(sync_client=True) as c:
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=flow_run_ids)),
                                task_run_filter=TaskRunFilter())
    return sum(1 for r in runs if r.state and r.state.name == "Cached"), len(runs)


def _pipeline(samples: int) -> tuple[float, list[Any]]:
    from edgehaul.flows.core_ingest import CoreIngestParams, core_ingest
    from edgehaul.flows.edge_ingest import EdgeIngestParams, edge_ingest
    from edgehaul.flows.uplink_drain import UplinkDrainParams, uplink_drain
    from edgehaul.platform.roles import DEFAULT_POLICY, StoreBlock, node_store

    ids = []
    t0 = time.perf_counter()
    for i, node in enumerate(("node-a", "node-b")):
        st = edge_ingest(EdgeIngestParams(edge_node=node, tiering_policy=DEFAULT_POLICY, n_samples=samples,
                                          batch_size=min(20_000, samples), seed=i, start_seq=0), return_state=True)
        ids.append(st.state_details.flow_run_id)
        st = uplink_drain(UplinkDrainParams(edge_node=node, link_profile=DEFAULT_POLICY,
                                            object_store=node_store(node), simulate=True),
                          return_state=True)
        ids.append(st.state_details.flow_run_id)
    st = core_ingest(CoreIngestParams(store_block=StoreBlock.INGEST), return_state=True)
    ids.append(st.state_details.flow_run_id)
    return time.perf_counter() - t0, ids


def main() -> None:
    quick = os.environ.get("EDGEHAUL_BENCH_QUICK") == "1" or "--quick" in sys.argv
    samples = 5_000 if quick else 20_000
    from edgehaul_dev import configure, localstack

    with tempfile.TemporaryDirectory(prefix="eh-bench-cache-") as tmp:
        root = Path(tmp)
        state = localstack.up(root, fixed_ports=False)
        try:
            os.environ.update(state.env())
            from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

            with temporary_settings(updates={PREFECT_API_URL: state.prefect_api_url,
                                             PREFECT_API_AUTH_STRING: state.api_auth_string}):
                configure.register_block_types()
                configure.save_blocks(state)
                admin = state.store("admin")
                cold_s, cold_ids = _pipeline(samples)
                objects_after_cold = _count_objects(admin)
                warm_s, warm_ids = _pipeline(samples)
                objects_after_warm = _count_objects(admin)
                time.sleep(3)  # let the server record the last task runs
                cold_cached, cold_total = _cached_share(cold_ids)
                warm_cached, warm_total = _cached_share(warm_ids)
        finally:
            localstack.down(root)
    print(f"\ncold vs warm, {samples} samples x 2 nodes: edge_ingest -> uplink_drain -> core_ingest")
    print(f"{'run':<6}{'wall s':>10}{'task runs':>12}{'Cached':>10}{'objects after':>16}")
    print(f"{'cold':<6}{cold_s:>10.1f}{cold_total:>12}{cold_cached:>10}{objects_after_cold:>16}")
    print(f"{'warm':<6}{warm_s:>10.1f}{warm_total:>12}{warm_cached:>10}{objects_after_warm:>16}")
    print(f"warm/cold wall time: {warm_s / cold_s:.2f}  (new objects on the warm run: "
          f"{objects_after_warm - objects_after_cold})")


if __name__ == "__main__":
    main()
