"""docs/STORAGE.md works for a user who has an S3 endpoint and keys and nothing else: its setup YAML,
`edgehaul blocks apply`, `edgehaul store check` and its first-dataset snippet, taken from the document
word for word (only the endpoint, keys and spool folder replaced), reach a first dataset version on a fresh
stack whose Prefect server holds no block but those the document created."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from edgehaul.services.block_setup import SetupError, load
from edgehaul_dev import localstack

DOC = Path(__file__).resolve().parents[2] / "docs" / "STORAGE.md"
BIN = Path(sys.executable).parent


def _fenced(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def _setup_yaml() -> dict:
    (doc,) = [b for b in _fenced("yaml") if "identities:" in b]
    return yaml.safe_load(doc)


def test_the_documented_setup_file_is_valid_and_a_missing_identity_is_named(tmp_path: Path) -> None:
    f = tmp_path / "setup.yaml"
    f.write_text(yaml.safe_dump(_setup_yaml()))
    assert [n.node_id for n in load(f).nodes] == ["node-a"]
    missing = _setup_yaml()
    del missing["identities"]["trainer"]
    typo = _setup_yaml()
    typo["store"]["endpont_url"] = "typo"
    for broken, named in ((missing, "identities.trainer"), (typo, "store.endpont_url")):
        f.write_text(yaml.safe_dump(broken))
        with pytest.raises(SetupError, match=re.escape(named)):
            load(f)


@pytest.mark.integration
def test_a_user_with_only_an_endpoint_and_keys_reaches_a_first_dataset_version(tmp_path: Path) -> None:
    root = tmp_path / "fresh-stack"
    try:
        state = localstack.up(root, fixed_ports=False)
        ids = {("central" if role == "admin" else role): c for role, c in state.identities.items()}
        setup = _setup_yaml()
        setup["store"]["endpoint_url"] = state.s3_endpoint
        for name in setup["identities"]:
            setup["identities"][name] = {"access_key_id": ids[name].access_key_id,
                                         "secret_access_key": ids[name].secret_access_key}
        for node in setup["nodes"]:
            node["spool_dir"] = str(tmp_path / "spool" / node["node_id"])
        work = tmp_path / "user"
        work.mkdir()
        (work / "setup.yaml").write_text(yaml.safe_dump(setup))

        # the user's shell: the Prefect API address, no keys, no edgehaul settings, not in the checkout
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "EDGEHAUL_", "PREFECT_"))}
        env |= {"PREFECT_API_URL": state.prefect_api_url, "PREFECT_API_AUTH_STRING": state.api_auth_string or ""}

        def run(*cmd: str) -> str:
            p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
            assert p.returncode == 0, f"{cmd[:3]}: {p.stdout[-2000:]}\n{p.stderr[-3000:]}"
            return p.stdout

        saved = run(str(BIN / "edgehaul"), "blocks", "apply", "setup.yaml")
        assert "ObjectStore: central, ingest, trainer, lifecycle, node-a" in saved, saved
        probe = run(str(BIN / "edgehaul"), "store", "check", "central")
        assert "put-if-none-match" in probe
        (snippet,) = [b for b in _fenced("python") if "core_ingest(" in b]
        out = run(str(BIN / "python"), "-c", snippet)
        assert out.strip().splitlines()[-1] == "{'landsat_patch': 1}", out[-2000:]  # v0: the empty table
    finally:
        localstack.down(root)
