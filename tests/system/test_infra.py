"""infra/ has no cluster to run on here: every file is parsed and its structure validated.

- work pool base job templates: Prefect's own server-side check (WorkPoolCreate), JSON-schema-valid
  variables, placeholders that reference declared variables, then rendered with their defaults and
  loaded as prefect-kubernetes' KubernetesWorkerJobConfiguration (which checks the Job manifest);
- Kubernetes manifests: kind/apiVersion/metadata, pinned images, probes, resources, secrets by reference;
- the compose file: services, healthchecks, pinned images, no inline secrets.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prefect.server.schemas.actions import WorkPoolCreate
from prefect.utilities.templating import apply_values, find_placeholders
from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

INFRA = Path(__file__).resolve().parents[2] / "infra"
POOLS = sorted((INFRA / "k8s" / "work-pools").glob("*.json"))
MANIFESTS = sorted((INFRA / "k8s").glob("*.yaml"))
SECRET_NAME = re.compile(r"(PASSWORD|SECRET|AUTH_STRING|TOKEN|_KEY$|CONNECTION_URL)", re.I)
PINNED = re.compile(r"^[a-z0-9.-]+(/[a-z0-9._-]+)+:(?!latest$)[A-Za-z0-9][A-Za-z0-9._-]*\d[A-Za-z0-9._-]*$")


def load_pool(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def render(tpl: dict[str, Any], **values: Any) -> dict[str, Any]:
    props = tpl["variables"]["properties"]
    vals = {k: p["default"] for k, p in props.items() if "default" in p}
    vals.update(values)
    jsonschema.validate(vals, tpl["variables"])
    return apply_values(tpl["job_configuration"], vals)  # type: ignore[no-any-return]


def pod_spec(job_config: dict[str, Any]) -> dict[str, Any]:
    return job_config["job_manifest"]["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def test_every_pool_template_exists() -> None:
    assert {p.stem for p in POOLS} == {"central", "central-gpu", "edge"}


def _served(command: list[str]) -> tuple[str, str | None]:
    """(pool, work queue or None) of a `prefect worker start` command."""
    opts = dict(zip(command[3::2], command[4::2], strict=False))
    return opts["--pool"], opts.get("--work-queue")


def test_every_pool_the_deployments_use_has_a_template_and_workers() -> None:
    """prefect.yaml, the pool creation commands of infra/README.md, k8s/workers.yaml and the compose
    file name the same pools; the example edge node's worker serves its own queue of its group's pool,
    and every edge deployment names its node for the edge template."""
    from edgehaul_dev import deploy

    spec = deploy.load_spec()
    pools = set(deploy.pools_of(spec))
    assert pools == {"central", "central-gpu", "edge-default", "ops"}
    created = dict(re.findall(r"prefect work-pool create (\S+) --type kubernetes --base-job-template (\S+)",
                              (INFRA / "README.md").read_text()))
    assert pools <= set(created), created
    assert all((INFRA.parent / path).is_file() for path in created.values()), created
    k8s = {_served(_containers(d)[0]["command"]) for _, d in _docs()
           if d.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/name") == "prefect-worker"}
    services = yaml.safe_load((INFRA / "compose" / "compose.yaml").read_text())["services"]
    compose = {_served(s["command"]) for name, s in services.items() if name.startswith("worker-")}
    # an edge site runs the node-local runtime (`edgehaul node run`), never a worker of a central pool
    for served in (k8s, compose):
        assert pools - {"edge-default"} == {p for p, _ in served}, served
    node = services["node-a"]
    assert "edgehaul node run" in " ".join(node["command"]), node["command"]
    assert not any(k.startswith("PREFECT_") for k in node.get("environment") or {}), "an edge host holds no API string"
    edge_tpl = load_pool(INFRA / created["edge-default"].removeprefix("infra/"))
    for d in spec["deployments"]:
        pool = d["work_pool"]
        if pool["name"].startswith("edge-"):
            assert pool["job_variables"]["edge_node"] == pool["work_queue_name"], d["name"]
            pod_spec(render(edge_tpl, **pool["job_variables"]))  # the edge template takes them as they are


@pytest.mark.parametrize("path", POOLS, ids=lambda p: p.stem)
def test_pool_template_passes_prefects_validation(path: Path) -> None:
    tpl = load_pool(path)
    assert set(tpl) == {"job_configuration", "variables"}
    WorkPoolCreate(name=f"eh-{path.stem}", type="kubernetes", base_job_template=tpl)  # server-side check
    jsonschema.Draft202012Validator.check_schema(tpl["variables"])
    used = {p.name for p in find_placeholders(json.dumps(tpl["job_configuration"]))}
    declared = set(tpl["variables"]["properties"])
    assert used <= declared, f"undeclared placeholders {used - declared}"
    # every job_configuration field of the Kubernetes worker is present, as in Prefect's default template
    assert set(KubernetesWorker.get_default_base_job_template()["job_configuration"]) <= set(tpl["job_configuration"])


def test_prefects_check_rejects_an_undeclared_placeholder() -> None:
    tpl = load_pool(INFRA / "k8s" / "work-pools" / "edge.json")
    pod_spec(tpl["job_configuration"])["priorityClassName"] = "{{ priority_class }}"
    with pytest.raises(ValueError, match="priority_class"):
        WorkPoolCreate(name="bad", type="kubernetes", base_job_template=tpl)


def test_central_gpu_template_renders_a_guaranteed_gpu_job() -> None:
    tpl = load_pool(INFRA / "k8s" / "work-pools" / "central-gpu.json")
    cfg = render(tpl, gpu_count=4, accelerator="NVIDIA-A100-SXM4-80GB", image="ghcr.io/edgehaul/edgehaul-train:0.1.0")
    KubernetesWorkerJobConfiguration(**cfg)  # prefect-kubernetes validates the Job manifest
    spec = pod_spec(cfg)
    res = spec["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 4 and res["requests"] == res["limits"]
    assert spec["nodeSelector"] == {"edgehaul.io/pool": "central-gpu", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    with pytest.raises(jsonschema.ValidationError):
        render(tpl, gpu_count=0)


def test_central_template_renders_a_guaranteed_cpu_job() -> None:
    tpl = load_pool(INFRA / "k8s" / "work-pools" / "central.json")
    cfg = render(tpl, cpu="8", memory="32Gi")
    KubernetesWorkerJobConfiguration(**cfg)
    spec = pod_spec(cfg)
    res = spec["containers"][0]["resources"]
    assert res["requests"] == res["limits"] == {"cpu": "8", "memory": "32Gi"}  # no accelerator asked for
    assert spec["nodeSelector"] == {"edgehaul.io/pool": "central"} and "tolerations" not in spec


def test_edge_template_pins_the_node_and_is_guaranteed() -> None:
    tpl = load_pool(INFRA / "k8s" / "work-pools" / "edge.json")
    with pytest.raises(jsonschema.ValidationError, match="edge_node"):
        render(tpl)  # the node is required: an edge job never floats to another site
    with pytest.raises(jsonschema.ValidationError):
        render(tpl, edge_node="Node_A")
    cfg = render(tpl, edge_node="node-a", cpu="1500m", memory="2Gi")
    KubernetesWorkerJobConfiguration(**cfg)
    spec = pod_spec(cfg)
    res = spec["containers"][0]["resources"]
    # inference and preprocessing pods: requests equal limits (Guaranteed QoS), so inference latency stays steady
    assert res["requests"] == res["limits"] == {"cpu": "1500m", "memory": "2Gi"}
    assert spec["nodeSelector"] == {"edgehaul.io/pool": "edge", "edgehaul.io/node": "node-a"}
    assert spec["volumes"][0]["hostPath"]["path"] == "/var/lib/edgehaul/spool"
    assert "nvidia.com/gpu" not in json.dumps(spec)


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("containers", []), *spec.get("initContainers", [])]


def test_manifests_have_kind_api_version_and_names() -> None:
    docs = _docs()
    kinds = {d["kind"] for _, d in docs}
    assert {"Namespace", "Deployment", "StatefulSet", "Service", "NetworkPolicy", "Role"} <= kinds
    api = {"Deployment": "apps/v1", "StatefulSet": "apps/v1", "Service": "v1", "Namespace": "v1", "ConfigMap": "v1",
           "ServiceAccount": "v1", "NetworkPolicy": "networking.k8s.io/v1",
           "Role": "rbac.authorization.k8s.io/v1", "RoleBinding": "rbac.authorization.k8s.io/v1",
           "Kustomization": "kustomize.config.k8s.io/v1beta1"}
    for name, d in docs:
        assert d["apiVersion"] == api[d["kind"]], (name, d["kind"])
        if d["kind"] != "Kustomization":
            assert d["metadata"]["name"], name
            if d["kind"] != "Namespace":
                assert d["metadata"]["namespace"] == "edgehaul", (name, d["metadata"]["name"])
    listed = set(yaml.safe_load((INFRA / "k8s" / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in MANIFESTS} - {"kustomization.yaml"}


def test_workloads_are_pinned_probed_sized_and_take_secrets_by_reference() -> None:
    workloads = [(n, d) for n, d in _docs() if d["kind"] in ("Deployment", "StatefulSet")]
    names = {d["metadata"]["name"] for _, d in workloads}
    assert {"postgres", "prefect-server", "webhook-gateway", "worker-central", "worker-central-gpu", "worker-ops"} <= names
    for name, d in workloads:
        sel = d["spec"]["selector"]["matchLabels"]
        assert sel.items() <= d["spec"]["template"]["metadata"]["labels"].items(), name
        for c in _containers(d):
            where = f"{name}/{d['metadata']['name']}/{c['name']}"
            assert PINNED.match(c["image"]), f"{where}: image {c['image']} not pinned to a version"
            assert c.get("readinessProbe") and c.get("livenessProbe"), f"{where}: probes"
            assert c["resources"]["requests"] == c["resources"]["limits"], f"{where}: requests != limits"
            for e in c.get("env", []):
                if SECRET_NAME.search(e["name"]):
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], f"{where}: {e['name']} inlined"
    assert not [d for _, d in _docs() if d["kind"] == "Secret"], "Secrets are created out of band, not committed"


def test_prefect_server_runs_on_postgres_with_auth() -> None:
    server = next(
        d for _, d in _docs() if d.get("metadata", {}).get("name") == "prefect-server" and d["kind"] == "Deployment"
    )
    env = {e["name"]: e for e in _containers(server)[0]["env"]}
    assert env["PREFECT_API_DATABASE_CONNECTION_URL"]["valueFrom"]["secretKeyRef"]["name"] == "edgehaul-prefect-db"
    assert "PREFECT_SERVER_API_AUTH_STRING" in env
    workers = [
        d for _, d in _docs() if d.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/name") == "prefect-worker"
    ]
    served = {_containers(w)[0]["command"][4] for w in workers}
    assert {"central", "central-gpu", "ops"} == served, served  # edge sites: the node-local runtime
    for w in workers:
        cmd = _containers(w)[0]["command"]
        assert cmd[:3] == ["prefect", "worker", "start"] and "--pool" in cmd
        assert w["spec"]["template"]["spec"]["serviceAccountName"] == "edgehaul-worker"


def test_compose_file_is_complete_and_keeps_secrets_out() -> None:
    text = (INFRA / "compose" / "compose.yaml").read_text()
    doc = yaml.safe_load(text)
    services = doc["services"]
    want = {"postgres", "prefect-server", "minio", "minio-init", "worker-central", "worker-central-gpu", "worker-ops",
            "node-a", "gateway"}
    assert want <= set(services)
    for name, svc in services.items():
        assert PINNED.match(svc["image"]), f"{name}: image {svc['image']} not pinned"
        if name != "minio-init":
            assert svc["healthcheck"]["test"][0] == "CMD", name
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in services and cond["condition"] in ("service_healthy", "service_completed_successfully")
        for key, value in (svc.get("environment") or {}).items():
            if SECRET_NAME.search(key) and key != "AWS_ACCESS_KEY_ID":
                # only a reference to .env, e.g. ${POSTGRES_PASSWORD:?...}, never a literal
                assert re.search(r"\$\{[A-Z_]+:\?", str(value)), f"{name}: {key} is not taken from .env"
    assert "PREFECT_API_DATABASE_CONNECTION_URL" in services["prefect-server"]["environment"]
    assert services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://")
    # the init job installs exactly the IAM documents of infra/iam/
    init = "\n".join(services["minio-init"]["command"])
    for p in re.findall(r"for p in ([a-z -]+); do", init)[0].split():
        assert (INFRA / "iam" / f"{p}.json").exists(), p
    example = (INFRA / "compose" / "env.example").read_text()
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    needed = set(re.findall(r"\$\{([A-Z_]+):\?", body))
    assert {"POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "NODE_A_SECRET_KEY"} <= needed
    assert needed <= {line.split("=")[0] for line in example.splitlines() if "=" in line and not line.startswith("#")}
    assert all(line.endswith("=") or line.endswith(":") or "USER" in line
               for line in example.splitlines() if "=" in line and not line.startswith("#")), "env.example holds values"


def test_rotate_and_stack_scripts_are_executable() -> None:
    for name in ("up.sh", "down.sh", "health.sh", "rotate_key.sh"):
        p = INFRA / "local" / name
        assert p.stat().st_mode & 0o111 and p.read_text().startswith("#!/usr/bin/env bash"), name
