"""Every block the flows load, created from one small YAML file: `edgehaul blocks apply setup.yaml`.

For a user who has an S3 endpoint and keys and nothing else (docs/STORAGE.md, section 3). The names
are the roles' (`edgehaul.platform.roles`); each role and each node gets its own identity's keys.

    store: {endpoint_url: https://s3.example.net, region: us-east-1, path_style: true}
    central_credentials_file: ~/.config/edgehaul/s3-credentials  # default; or central_credentials_from_environment: true
    identities:                 # one per central role; nodes optional (see below)
      central: {access_key_id: AK.., secret_access_key: SK..}
      ingest: {...}
      trainer: {...}
      lifecycle: {...}
      node-a: {...}             # optional: written to node-a's credentials_file, never into a block
    nodes: [{node_id: node-a, team: geo, spool_dir: /var/lib/edgehaul/spool}]
    teams: [{team: geo, accelerator_hours_per_month: 100, storage_bytes: 5497558138880}]
    link: {bandwidth_bps: 50000000}

A node's ObjectStore block holds no key, only the path of a 0600 credentials file on the node
(`credentials_file`, default `<spool_dir>/../s3-credentials`, profile = the node id), or nothing with
`credentials_from_environment: true` (keys in the run's environment, e.g. a Kubernetes Secret, or workload
identity): any client of the Prefect API can read a block's secrets, and every edge worker is such a
client (docs/SECURITY.md). When
the node runs on this host (a single-machine setup, the local stack) give its keys under `identities`
and they are written to that file (0600); otherwise provision the file on the node and leave them out.

The central role blocks (`central`, `ingest`, `trainer`, `lifecycle`) hold no key either: the same
mechanism, one 0600 file on the central host with one profile per role (`central_credentials_file`,
default `~/.config/edgehaul/s3-credentials`, written here from `identities`), or nothing with
`central_credentials_from_environment: true` (Kubernetes Secret per role as env, workload identity).

Cached task results of the central flows go to the S3Bucket block `edgehaul-core-results` (ops
bucket, `prefect-results/core/`), saved here with AwsCredentials that name the `ingest` profile and no
key (the central workers' environment sets AWS_SHARED_CREDENTIALS_FILE to the central file, or gives the
ingest keys as env): the one place result storage is created (flows never save blocks; edge nodes cache
on their own disk).

The file holds keys: keep it out of version control and readable by its owner only. Errors name the
field (`identities.trainer: missing`), and nothing is saved until the whole file is valid.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, SecretStr, ValidationError, model_validator

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
from edgehaul.blocks.logos import clear_unreachable_logos
from edgehaul.blocks.object_store import write_credentials_file
from edgehaul.platform.caching import CORE_RESULTS_BLOCK, core_result_storage_block
from edgehaul.platform.fields import Name, Strict
from edgehaul.platform.roles import DEFAULT_POLICY, DEFAULT_TEAM, StoreBlock, node_store


class SetupError(ValueError):
    """The setup file is unreadable or invalid; the message names the field."""


class StoreSpec(Strict):
    """Where the central store is: the setup file's `store:` and an edge node's config (`edgehaul node init`)."""

    endpoint_url: str | None = Field(default=None, description="S3 endpoint; None for AWS S3 itself.")
    region: str = "us-east-1"
    path_style: bool = True
    prefix: str = ""
    landing_bucket: str | None = None
    curated_bucket: str | None = None
    cold_bucket: str | None = None
    checkpoints_bucket: str | None = None
    ops_bucket: str | None = None


class Keys(Strict):
    access_key_id: SecretStr
    secret_access_key: SecretStr


class NodeSpec(Strict):
    node_id: Name
    team: str = DEFAULT_TEAM
    node_group: str = "edge-default"
    spool_dir: str
    spool_cap_bytes: int = Field(default=2 * 1024**3, gt=0)
    credentials_file: str | None = Field(
        default=None, description="0600 S3 credentials file on the node; None: <spool_dir>/../s3-credentials.")
    profile: str | None = Field(default=None, description="Profile in credentials_file; None: the node id.")
    credentials_from_environment: bool = Field(
        default=False, description="The node's runs get their keys from their environment or workload identity "
        "(boto3's default chain, e.g. a Kubernetes Secret as env): the block names no file either.")

    def credentials_path(self) -> Path:
        return Path(self.credentials_file) if self.credentials_file else Path(self.spool_dir).parent / "s3-credentials"

    def edge_fields(self) -> dict[str, Any]:
        """The EdgeNode block's fields (where the node's keys live belongs to its ObjectStore block)."""
        return self.model_dump(exclude={"credentials_file", "profile", "credentials_from_environment"})


class TeamSpec(Strict):
    team: str
    accelerator_hours_per_month: float = Field(gt=0)
    storage_bytes: int = Field(gt=0)


DEFAULT_CENTRAL_CREDENTIALS = "~/.config/edgehaul/s3-credentials"


class Setup(Strict):
    store: StoreSpec
    central_credentials_file: str = Field(
        default=DEFAULT_CENTRAL_CREDENTIALS,
        description="0600 S3 credentials file on the central host, one profile per role (its block name).")
    central_credentials_from_environment: bool = Field(
        default=False, description="Central runs get their keys from their environment or workload identity: the "
        "role blocks name no file, and the results block no profile.")
    identities: dict[str, Keys]
    nodes: list[NodeSpec] = Field(min_length=1)
    teams: list[TeamSpec] = Field(default_factory=list)
    link: dict[str, Any] = Field(default_factory=lambda: {"bandwidth_bps": 50e6})
    tiering: dict[str, Any] = Field(default_factory=dict, description="TieringPolicy fields; empty: its defaults.")
    retention: dict[str, Any] = Field(default_factory=dict,
                                      description="RetentionPolicy fields besides the rules (e.g. keep_latest_versions).")
    retention_rules: list[RetentionRule] | None = Field(
        default=None, description="None: raw data cold after 30 days in STANDARD_IA (check the probe's classes).")

    def central_credentials_path(self) -> Path:
        return Path(self.central_credentials_file).expanduser()

    @model_validator(mode="after")
    def _every_identity(self) -> Setup:
        need = [] if self.central_credentials_from_environment else [r.value for r in StoreBlock]
        missing = [f"identities.{n}" for n in need if n not in self.identities]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (one identity per central role)")
        known = {r.value for r in StoreBlock} | {n.node_id for n in self.nodes}
        if unknown := sorted(set(self.identities) - known):
            raise ValueError(f"identities {', '.join(unknown)}: neither a role nor a node of `nodes`")
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


def _store_fields(setup: Setup) -> dict[str, Any]:
    return {k: v for k, v in setup.store.model_dump().items() if v is not None}


def store_for(setup: Setup, role: str) -> ObjectStore:
    """A central role's ObjectStore block: no key, the central credentials file and the role's profile (or
    nothing: the environment's)."""
    if setup.central_credentials_from_environment:
        return ObjectStore(**_store_fields(setup))
    return ObjectStore(**_store_fields(setup), credentials_file=str(setup.central_credentials_path()), profile=role)


def write_central_credentials(setup: Setup) -> Path | None:
    """Write every central role's keys into the central credentials file (0600), one profile per role."""
    if setup.central_credentials_from_environment:
        return None
    path = setup.central_credentials_path()
    for role in StoreBlock:
        keys = setup.identities[role.value]  # every role: checked by Setup
        write_credentials_file(path, role.value, keys.access_key_id.get_secret_value(),
                               keys.secret_access_key.get_secret_value())
    return path


def node_store_for(setup: Setup, node: NodeSpec) -> ObjectStore:
    """A node's ObjectStore block: no key, the path of the node's own credentials file (or nothing: the
    environment's)."""
    if node.credentials_from_environment:
        return ObjectStore(**_store_fields(setup))
    return ObjectStore(**_store_fields(setup), credentials_file=str(node.credentials_path()),
                       profile=node.profile or node.node_id)


def write_node_credentials(setup: Setup) -> list[Path]:
    """Write the keys `identities` gives for a node into that node's credentials file (0600)."""
    written = []
    for node in setup.nodes:
        if (keys := setup.identities.get(node.node_id)) and not node.credentials_from_environment:
            written.append(write_credentials_file(
                node.credentials_path(), node.profile or node.node_id,
                keys.access_key_id.get_secret_value(), keys.secret_access_key.get_secret_value()))
    return written


def apply(setup: Setup) -> dict[str, list[str]]:
    """Create or overwrite the blocks; returns block type -> names saved."""
    saved: dict[str, list[str]] = {}

    def save(block: Any, name: str) -> None:
        block.save(name, overwrite=True)
        saved.setdefault(type(block).__name__, []).append(name)

    # keys first: a block that names the file is only useful once the file holds its profile
    if central := write_central_credentials(setup):
        saved.setdefault("credentials file", []).append(str(central))
    for role in StoreBlock:
        save(store_for(setup, role.value), role.value)
    # central cached results, written by the ingest identity: no node holds keys that reach them
    save(core_result_storage_block(store_for(setup, StoreBlock.INGEST.value)), CORE_RESULTS_BLOCK)
    for path in write_node_credentials(setup):
        saved.setdefault("credentials file", []).append(str(path))
    for node in setup.nodes:
        save(node_store_for(setup, node), node_store(node.node_id))
        save(EdgeNode(**node.edge_fields()), node.node_id)
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
    clear_unreachable_logos()  # after the saves: saving the results block put its type's internet logo back
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
