"""infra/images/Dockerfile and the images and runner settings that infra/ refers to.

No container engine runs here (the docker client has no daemon, and base images could not be
pulled), so the Dockerfile is parsed: its build targets, what it copies, how it pins packages; every
edgehaul image named in infra/ must be one of its targets at the project's version; and the pools that
should run tasks on Dask carry settings that edgehaul.platform.runners accepts and that point at the cluster
defined next to them.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import re
import shlex
import tomllib
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect.client.schemas.objects import FlowRun
from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

from edgehaul.platform.runners import RunnerConfig

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
DOCKERFILE = INFRA / "images" / "Dockerfile"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
OUR_IMAGE = re.compile(r"^ghcr\.io/edgehaul/edgehaul-(?P<target>[a-z0-9-]+):(?P<tag>[^\s:]+)$")
PINNED = re.compile(r"^[a-z0-9.-]+(/[a-z0-9._-]+)+:(?!latest$)[A-Za-z0-9][A-Za-z0-9._-]*\d[A-Za-z0-9._-]*$")


@dataclass
class Stage:
    name: str
    base: str
    lines: list[str] = field(default_factory=list)


@dataclass
class Dockerfile:
    args: dict[str, str]
    stages: dict[str, Stage]

    def instructions(self, stage: str, op: str) -> list[str]:
        return [line[len(op):].strip() for line in self.stages[stage].lines if line.upper().startswith(op + " ")]


def parse_dockerfile(text: str) -> Dockerfile:
    """Logical lines (continuations joined, comments dropped), global ARGs and FROM ... AS stages."""
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append((buf + line).strip())
        buf = ""
    assert not buf, "Dockerfile ends inside a continued line"
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in logical:
        op = line.split(None, 1)[0].upper()
        if op == "FROM":
            m = re.fullmatch(r"FROM\s+(?:--platform=\S+\s+)?(\S+)\s+AS\s+([a-z0-9_-]+)", line, re.I)
            assert m, f"every FROM names its stage: {line!r}"
            assert m.group(2) not in stages, f"stage {m.group(2)} defined twice"
            current = stages[m.group(2)] = Stage(m.group(2), m.group(1))
        elif current is None:
            assert op == "ARG", f"only ARG may precede the first FROM: {line!r}"
            name, _, default = line.split(None, 1)[1].partition("=")
            args[name] = default
        else:
            current.lines.append(line)
    return Dockerfile(args, stages)


def dockerignore_allows(patterns: list[str], rel: str) -> bool:
    """Docker's rule: the last pattern that matches a path (or one of its parents) decides."""
    allowed = True
    parts = rel.strip("/").split("/")
    for pat in patterns:
        neg = pat.startswith("!")
        p = pat[1:] if neg else pat
        p = p.strip("/")
        for i in range(1, len(parts) + 1):
            if fnmatch.fnmatchcase("/".join(parts[:i]), p):
                allowed = neg
                break
    return allowed


@pytest.fixture(scope="module")
def df() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE.read_text())


def referenced_images() -> list[tuple[str, str, dict[str, Any] | None]]:
    """(where, image, compose build section) for every container image that infra/ names."""
    out: list[tuple[str, str, dict[str, Any] | None]] = []
    for path in sorted((INFRA / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in [*spec.get("containers", []), *spec.get("initContainers", [])]:
                out.append((f"{path.name}/{doc['metadata']['name']}/{c['name']}", c["image"], None))
    for path in sorted((INFRA / "k8s" / "work-pools").glob("*.json")):
        out.append((path.name, json.loads(path.read_text())["variables"]["properties"]["image"]["default"], None))
    compose = yaml.safe_load((INFRA / "compose" / "compose.yaml").read_text())
    for name, svc in compose["services"].items():
        out.append((f"compose/{name}", svc["image"], svc.get("build")))
    return out


def test_dockerfile_has_the_three_role_targets_on_a_pinned_base(df: Dockerfile) -> None:
    assert {"edge", "core", "train"} <= set(df.stages)
    for name, stage in df.stages.items():
        base = re.sub(r"\$\{?(\w+)\}?", lambda m: df.args[m.group(1)], stage.base)
        assert base == "scratch" or base in df.stages or PINNED.match(base), f"{name}: base {base} not pinned"
        for src in re.findall(r"--from=(\S+)", " ".join(df.instructions(name, "COPY"))):
            assert src in df.stages and list(df.stages).index(src) < list(df.stages).index(name), (name, src)
    for target in ("edge", "core", "train"):
        assert df.instructions(target, "USER") == ["10001:10001"], target  # the k8s securityContext's uid
        assert df.instructions(target, "COPY") == ["--from=source /opt/edgehaul /opt/edgehaul"], target


def test_every_copied_path_exists_and_reaches_the_build_context(df: Dockerfile) -> None:
    ignore = [line.strip() for line in (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    copied = []
    for stage in df.stages:
        for args in df.instructions(stage, "COPY"):
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            if "--from=" in args:
                continue
            copied += words[:-1]
    need = {"pyproject.toml", "requirements.lock", "edgehaul/"}
    assert need <= set(copied)
    for src in copied:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
        assert dockerignore_allows(ignore, src), f"COPY {src}: excluded by Dockerfile.dockerignore"
    # the ignore file really filters: the venv and tests never reach the build context
    assert not dockerignore_allows(ignore, ".venv") and not dockerignore_allows(ignore, "tests/system/test_infra.py")
    assert not dockerignore_allows(ignore, "edgehaul/__pycache__/x.pyc")
    # every package that pyproject installs is copied
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.split(".")[0] + "/" for p in packages} <= set(copied)
    # the wheel installs the product package alone, no generic top-level flows/tasks/blocks
    assert packages == ["edgehaul", "edgehaul.*"]


def test_packages_come_from_the_lock_with_its_torch_pin(df: Dockerfile) -> None:
    lock = dict(line.split("==", 1) for line in (ROOT / "requirements.lock").read_text().splitlines() if "==" in line)
    makefile = (ROOT / "Makefile").read_text()
    for stage in df.stages:
        for run in df.instructions(stage, "RUN"):
            for cmd in run.split("&&"):
                words = shlex.split(cmd)
                if words[:2] != ["pip", "install"]:
                    continue
                if "--no-deps" in words:  # our own code (-e) or an exact pin the lock cannot hold
                    pins = [w for w in words[2:] if not w.startswith("-") and w != "/opt/edgehaul"]
                    assert all("==" in w for w in pins), (stage, cmd)
                    for w in pins:
                        assert w in makefile, f"{stage}: {w} differs from the Makefile's pin"
                    continue
                assert "-c" in words and words[words.index("-c") + 1] == "requirements.lock", (stage, cmd)
                for w in words:
                    if w.startswith("torch=="):
                        assert w.split("==")[1].split("+")[0] == lock["torch"], (stage, w)
    edge = " ".join(df.instructions("edge", "RUN"))
    train = " ".join(df.instructions("train", "RUN"))
    core = " ".join(df.instructions("core", "RUN"))
    assert f'"torch=={lock["torch"]}+cpu"' in edge and f'"torch=={lock["torch"]}"' in train
    assert "torch" not in core and "prefect-kubernetes" in core and "prefect-kubernetes" in lock


def test_every_edgehaul_image_in_infra_is_a_build_target_at_the_project_version(df: Dockerfile) -> None:
    seen = set()
    for where, image, build in referenced_images():
        assert PINNED.match(image), f"{where}: {image} not pinned"
        m = OUR_IMAGE.match(image)
        if not m:
            assert "edgehaul" not in image, f"{where}: {image} looks like ours but is not ghcr.io/edgehaul/edgehaul-<target>"
            continue
        assert m["target"] in df.stages, f"{where}: no build target {m['target']!r} in {DOCKERFILE.name}"
        assert m["tag"] == VERSION, f"{where}: tag {m['tag']} != project version {VERSION}"
        seen.add(m["target"])
        if build is not None:  # compose builds it: same target, from this Dockerfile, repository root context
            assert build["target"] == m["target"], where
            context = (INFRA / "compose" / build["context"]).resolve()
            assert context == ROOT and (context / build["dockerfile"]).resolve() == DOCKERFILE, where
    assert seen == {"edge", "core", "train"}
    pools = {p.stem: json.loads(p.read_text()) for p in (INFRA / "k8s" / "work-pools").glob("*.json")}
    assert OUR_IMAGE.match(pools["central-gpu"]["variables"]["properties"]["image"]["default"])["target"] == "train"  # type: ignore[index]
    assert OUR_IMAGE.match(pools["central"]["variables"]["properties"]["image"]["default"])["target"] == "core"  # type: ignore[index]
    assert OUR_IMAGE.match(pools["edge"]["variables"]["properties"]["image"]["default"])["target"] == "edge"  # type: ignore[index]


def _dask_scheduler_service() -> tuple[str, int]:
    for doc in yaml.safe_load_all((INFRA / "k8s" / "dask.yaml").read_text()):
        if doc["kind"] == "Service" and doc["metadata"]["name"] == "dask-scheduler":
            return f"{doc['metadata']['name']}.{doc['metadata']['namespace']}.svc", doc["spec"]["ports"][0]["port"]
    raise AssertionError("no dask-scheduler Service in infra/k8s/dask.yaml")


def _job_env(pool: str, deployment_env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The env a Kubernetes worker gives a flow-run Job of `pool` (Prefect's own merge), and its manifest's env."""
    tpl = json.loads((INFRA / "k8s" / "work-pools" / f"{pool}.json").read_text())
    values: dict[str, Any] = {"env": deployment_env}
    if pool == "edge":
        values["edge_node"] = "node-a"
    # no block or variable placeholders in these templates: the client is never used
    cfg = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(tpl, values, client=object()))
    cfg.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="x"))
    container = cfg.job_manifest["spec"]["template"]["spec"]["containers"][0]
    return cfg.env, {e["name"]: e.get("value") for e in container["env"]}  # type: ignore[return-value]


def test_central_pool_runs_tasks_on_the_cluster_dask_yaml_defines() -> None:
    env, manifest_env = _job_env("central", {"EDGEHAUL_DASK_WORKERS": "4", "FOO": "1"})
    cfg = RunnerConfig.from_env({k: v or "" for k, v in manifest_env.items()})
    assert cfg.kind == "dask" and manifest_env["FOO"] == "1"  # a deployment's env is merged, not replacing
    host, port = _dask_scheduler_service()
    assert cfg.dask_address == f"tcp://{host}:{port}"
    scheduler = next(d for d in yaml.safe_load_all((INFRA / "k8s" / "dask.yaml").read_text())
                     if d["kind"] == "Deployment" and d["metadata"]["name"] == "dask-scheduler")
    assert str(port) in scheduler["spec"]["template"]["spec"]["containers"][0]["command"]
    workers = next(d for d in yaml.safe_load_all((INFRA / "k8s" / "dask.yaml").read_text())
                   if d["kind"] == "Deployment" and d["metadata"]["name"] == "dask-worker")
    assert cfg.dask_address in workers["spec"]["template"]["spec"]["containers"][0]["command"]
    # a deployment can still opt out
    _, opted_out = _job_env("central", {"EDGEHAUL_TASK_RUNNER": "thread"})
    assert RunnerConfig.from_env({k: v or "" for k, v in opted_out.items()}).kind == "thread"
    assert "EDGEHAUL_TASK_RUNNER" in env
    # training submits no tasks: its pool does not depend on the Dask cluster being up
    _, training = _job_env("central-gpu", {})
    assert RunnerConfig.from_env({k: v or "" for k, v in training.items()}).kind == "thread"


def test_edge_pool_and_edge_node_keep_tasks_on_the_node() -> None:
    _, manifest_env = _job_env("edge", {})
    assert RunnerConfig.from_env({k: v or "" for k, v in manifest_env.items()}).kind == "thread"
    services = yaml.safe_load((INFRA / "compose" / "compose.yaml").read_text())["services"]
    edge_env = {k: str(v) for k, v in services["node-a"]["environment"].items()}
    assert RunnerConfig.from_env(edge_env).kind == "thread"


def test_compose_central_worker_uses_the_compose_dask_cluster() -> None:
    services = yaml.safe_load((INFRA / "compose" / "compose.yaml").read_text())["services"]
    env = {k: str(v) for k, v in services["worker-central"]["environment"].items()}
    cfg = RunnerConfig.from_env(env)
    assert cfg.kind == "dask" and cfg.dask_address
    host, port = cfg.dask_address.removeprefix("tcp://").split(":")
    assert host in services and port in services[host]["command"]
    assert services["worker-central"]["depends_on"][host]["condition"] == "service_healthy"
    assert cfg.dask_address in services["dask-worker"]["command"]
    # Dask workers report task runs to the same Prefect API as the flow runs
    assert services["dask-worker"]["environment"]["PREFECT_API_URL"] == env["PREFECT_API_URL"]
