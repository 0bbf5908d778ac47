"""No central API string on any edge host: whoever holds PREFECT_API_AUTH_STRING may change any block,
deployment or automation and emit any event (Prefect OSS has one string and no per-client rights).

On main at e80770e the local stack's edge workers and the edge worker Deployment of infra/k8s/workers.yaml
held it, and node-a used it to re-point the `edgehaul-core-results` block into its own landing prefix
(tests/security/test_attacks_cache.py shows the core now refuses such a block).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from edgehaul_dev import deploy

K8S = Path(__file__).resolve().parents[2] / "infra" / "k8s"
CENTRAL_API = ("PREFECT_API_AUTH_STRING", "PREFECT_API_URL", "edgehaul-prefect-auth", "prefect-server.edgehaul")


def _workloads() -> list[dict[str, Any]]:
    return [d for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())
            if d and d.get("kind") in ("Deployment", "StatefulSet", "DaemonSet")]


def _on_edge(d: dict[str, Any]) -> bool:
    spec = d["spec"]["template"]["spec"]
    return spec.get("nodeSelector", {}).get("edgehaul.io/pool") == "edge" or \
        d["spec"]["template"]["metadata"]["labels"].get("edgehaul.io/plane") == "edge"


def test_no_kubernetes_workload_on_an_edge_host_holds_the_central_api_string() -> None:
    edge = [d for d in _workloads() if _on_edge(d)]
    assert [d["metadata"]["name"] for d in edge] == ["node-runtime-node-a"]
    for d in edge:
        text = json.dumps(d)
        assert not [s for s in CENTRAL_API if s in text], d["metadata"]["name"]
        (c,) = d["spec"]["template"]["spec"]["containers"]
        assert "edgehaul node run" in " ".join(c["command"])  # the node-local runtime
        assert d["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    # and no holder of the string is placed on an edge node
    holders = [d for d in _workloads() if "edgehaul-prefect-auth" in json.dumps(d)]
    assert holders and not [d["metadata"]["name"] for d in holders if _on_edge(d)]


def test_the_local_stack_starts_no_edge_worker_unless_asked_for_the_demo() -> None:
    pools = deploy.pools_of(deploy.load_spec())
    assert any(p.startswith("edge-") for p in pools)
    assert deploy.worker_pools(pools) == [p for p in pools if not p.startswith("edge-")]
    assert deploy.worker_pools(pools, edge_workers=True) == pools
