"""The product ships as a wheel: `pip install .` (not editable) into a fresh venv gives a working
`edgehaul` command, the flows, the contracts and `prefect.yaml` as package data, the blocks through
the `prefect.collections` entry point, and no generic top-level `flows` / `tasks` / `blocks` packages.

The fresh venv borrows the third-party dependencies from the test venv through a path line (a full
dependency install is 1 GB and 90 s of PyPI); the product itself is built from a copy of the source
and installed for real, and every check runs outside the checkout so nothing resolves from it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from edgehaul_dev import localstack

ROOT = Path(__file__).resolve().parents[2]


def _source_copy(dst: Path) -> Path:
    """The files git would ship (tracked and untracked-not-ignored), links kept as links."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src, out = ROOT / name, dst / name
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            out.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, out)
    return dst


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp / "src")
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "_borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-build-isolation",
         str(src)], capture_output=True, text=True, timeout=600, cwd=tmp)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return env_dir


def _run(env_dir: Path, code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EDGEHAUL_CONTRACTS_DIR")}
    return subprocess.run([str(env_dir / "bin" / "python"), "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**clean, **env})


@pytest.mark.integration
def test_the_wheel_holds_the_product_and_nothing_generic(wheel_venv: Path, tmp_path: Path) -> None:
    cli = subprocess.run([str(wheel_venv / "bin" / "edgehaul"), "--help"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert cli.returncode == 0 and "settings" in cli.stdout and "python -m edgehaul_dev" in cli.stdout, cli.stderr
    probe = _run(wheel_venv, """
import importlib.util, json
from importlib.metadata import entry_points
from importlib.resources import files
import edgehaul, edgehaul.flows.edge_ingest, edgehaul.flows.train_model
from edgehaul.contracts import contract_by_id
ep = [e for e in entry_points(group="prefect.collections") if e.name == "edgehaul"]
print(json.dumps({
    "edgehaul": edgehaul.__file__,
    "generic": {n: importlib.util.find_spec(n) is not None for n in ("flows", "tasks", "blocks", "edgehaul_dev")},
    "contract": contract_by_id("landsat_patch.v1").id,
    "prefect_yaml": files("edgehaul").joinpath("deployments/prefect.yaml").is_file(),
    "typed": files("edgehaul").joinpath("py.typed").is_file(),
    "blocks": sorted({e.load().__name__ for e in ep}),
}))
""", tmp_path)
    assert probe.returncode == 0, probe.stderr[-3000:]
    got = json.loads(probe.stdout.strip().splitlines()[-1])
    assert str(wheel_venv) in got["edgehaul"], got  # installed, not the checkout
    assert got["generic"] == {"flows": False, "tasks": False, "blocks": False, "edgehaul_dev": False}, got
    assert got["contract"] == "landsat_patch.v1" and got["prefect_yaml"] and got["typed"], got
    assert got["blocks"] == ["edgehaul.blocks"], got


@pytest.mark.integration
def test_a_flow_of_the_installed_wheel_runs_against_the_stack(
    wheel_venv: Path, stack: localstack.StackState, tmp_path: Path,
) -> None:
    code = f"""
import json
from edgehaul.flows.edge_ingest import EdgeIngestParams, edge_ingest
out = edge_ingest(EdgeIngestParams(edge_node=None, node_id="wheel-node", spool_dir={str(tmp_path / "spool")!r},
                                   n_samples=400, batch_size=400, result_storage=None))
print(json.dumps({{"samples_in": out["samples_in"], "bundles": out["bundles"]}}))
"""
    run = _run(wheel_venv, code, tmp_path, PREFECT_API_URL=stack.prefect_api_url)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["samples_in"] == 400 and got["bundles"] >= 1, got
