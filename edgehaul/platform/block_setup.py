"""Every block the flows load, created from one small YAML file: `edgehaul blocks apply setup.yaml`.

For a user who has an S3 endpoint and keys and nothing else (docs/STORAGE.md, section 3). The names
are the roles' (`edgehaul.platform.roles`); each role and each node gets its own identity's keys.

    store: {endpoint_url: https://s3.example.net, region: us-east-1, path_style: true}
    identities:                 # one per role, and one per node (named as the node)
      central: {access_key_id: AK.., secret_access_key: SK..}
      ingest: {...}
      trainer: {...}
      lifecycle: {...}
      node-a: {...}
    nodes: [{node_id: node-a, team: geo, spool_dir: /var/lib/edgehaul/spool}]
    teams: [{team: geo, accelerator_hours_per_month: 100, storage_bytes: 5497558138880}]
    link: {bandwidth_bps: 50000000}

Cached task results of the central flows go to the S3Bucket block `edgehaul-core-results` (ops
bucket, `prefect-results/core/`), saved here with the ingest identity's keys: the one place result
storage is created (flows never save blocks; edge nodes cache on their own disk).

The file holds keys: keep it out of version control and readable by its owner only. Errors name the
field (`identities.trainer: missing`), and nothing is saved until the whole file is valid.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from edgehaul.blocks import (
    EdgeNode,
    LinkProfile,
    ObjectStore,
    PriceSheet,
    RetentionPolicy,
    RetentionRule,
    TeamQuota,
    TieringPolicy,
)
from edgehaul.platform.caching import CORE_RESULTS_BLOCK, core_result_storage_block
from edgehaul.platform.roles import DEFAULT_POLICY, DEFAULT_TEAM, StoreBlock, node_store


class SetupError(ValueError):
    """The setup file is unreadable or invalid; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StoreSpec(_Strict):
    endpoint_url: str | None = Field(default=None, description="S3 endpoint; None for AWS S3 itself.")
    region: str = "us-east-1"
    path_style: bool = True
    prefix: str = ""
    landing_bucket: str | None = None
    curated_bucket: str | None = None
    cold_bucket: str | None = None
    checkpoints_bucket: str | None = None
    ops_bucket: str | None = None


class Keys(_Strict):
    access_key_id: SecretStr
    secret_access_key: SecretStr


class NodeSpec(_Strict):
    node_id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    team: str = DEFAULT_TEAM
    node_group: str = "edge-default"
    spool_dir: str
    spool_cap_bytes: int = Field(default=2 * 1024**3, gt=0)


class TeamSpec(_Strict):
    team: str
    accelerator_hours_per_month: float = Field(gt=0)
    storage_bytes: int = Field(gt=0)


class Setup(_Strict):
    store: StoreSpec
    identities: dict[str, Keys]
    nodes: list[NodeSpec] = Field(min_length=1)
    teams: list[TeamSpec] = Field(default_factory=list)
    link: dict[str, Any] = Field(default_factory=lambda: {"bandwidth_bps": 50e6})
    tiering: dict[str, Any] = Field(default_factory=dict, description="TieringPolicy fields; empty: its defaults.")
    retention: dict[str, Any] = Field(default_factory=dict,
                                      description="RetentionPolicy fields besides the rules (e.g. keep_latest_versions).")
    retention_rules: list[RetentionRule] | None = Field(
        default=None, description="None: raw data cold after 30 days in STANDARD_IA (check the probe's classes).")

    @model_validator(mode="after")
    def _every_identity(self) -> Setup:
        need = [r.value for r in StoreBlock] + [n.node_id for n in self.nodes]
        missing = [f"identities.{n}" for n in need if n not in self.identities]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (one identity per role and per node)")
        return self


def load(path: Path) -> Setup:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SetupError(f"{path}: cannot read ({e})") from e
    try:
        return Setup.model_validate(raw)
    except ValidationError as e:
        where = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or '(file)'}: {err['msg']}" for err in e.errors())
        raise SetupError(f"{path}: {where}") from None


def store_for(setup: Setup, identity: str) -> ObjectStore:
    keys = setup.identities[identity]
    fields = {k: v for k, v in setup.store.model_dump().items() if v is not None}
    return ObjectStore(**fields, access_key_id=keys.access_key_id, secret_access_key=keys.secret_access_key)


def apply(setup: Setup) -> dict[str, list[str]]:
    """Create or overwrite the blocks; returns block type -> names saved."""
    saved: dict[str, list[str]] = {}

    def save(block: Any, name: str) -> None:
        block.save(name, overwrite=True)
        saved.setdefault(type(block).__name__, []).append(name)

    for role in StoreBlock:
        save(store_for(setup, role.value), role.value)
    # central cached results, written by the ingest identity: no node holds keys that reach them
    save(core_result_storage_block(store_for(setup, StoreBlock.INGEST.value)), CORE_RESULTS_BLOCK)
    for node in setup.nodes:
        save(store_for(setup, node.node_id), node_store(node.node_id))
        save(EdgeNode(**node.model_dump()), node.node_id)
    save(LinkProfile(**setup.link), DEFAULT_POLICY)
    save(TieringPolicy(**setup.tiering), DEFAULT_POLICY)
    rules = setup.retention_rules or [RetentionRule(data_class="raw", cold_after_days=30,
                                                    cold_storage_class="STANDARD_IA")]
    save(RetentionPolicy(rules=rules, **setup.retention), DEFAULT_POLICY)
    teams = {t.team: t for t in setup.teams}
    teams.setdefault(DEFAULT_TEAM, TeamSpec(team=DEFAULT_TEAM, accelerator_hours_per_month=10, storage_bytes=1024**4))
    for t in teams.values():
        save(TeamQuota(**t.model_dump()), t.team)
    save(PriceSheet(), DEFAULT_POLICY)
    return saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="edgehaul blocks apply", description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path, help="setup YAML (see docs/STORAGE.md, section 3)")
    ap.add_argument("--check", action="store_true", help="validate the file only; save nothing")
    a = ap.parse_args(argv)
    try:
        setup = load(a.file)
    except SetupError as e:
        print(f"edgehaul blocks apply: {e}", file=sys.stderr)
        return 2
    if a.check:
        print(f"{a.file}: valid ({len(setup.nodes)} nodes, {len(setup.identities)} identities)")
        return 0
    for kind, names in apply(setup).items():
        print(f"{kind}: {', '.join(names)}")
    return 0
