"""Attacks on secrets: an attacker holds one edge node's S3 keys and reaches the
central Prefect API and the local stack's ports over the network, without the API auth string.

Each test but one fails on main at 8a307c0, where the API was open (the block filter with `include_secrets`
answered 200 with every identity's keys), the node blocks held their keys, the filer served every bucket over
HTTP, the master handed out volume JWTs to anyone, `prefect.db` was 0644 and ObjectStore had no credentials
file. `test_a_node_cannot_mint_other_credentials_from_the_s3_port` passes there too: it guards the S3 port's
STS/IAM answers, which SeaweedFS already refused. docs/SECURITY.md names these tests under the claims they back.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from hypothesis import given, settings
from hypothesis import strategies as st

from edgehaul.blocks import ObjectStore
from edgehaul.blocks.object_store import CredentialsFileError, read_credentials_file, write_credentials_file
from edgehaul.platform.roles import node_store
from edgehaul_dev import configure, localstack

NODES = ("node-a", "node-b")


def _node_s3(state: localstack.StackState, node: str) -> Any:
    c = state.identities[node]
    return boto3.client("s3", endpoint_url=state.s3_endpoint, region_name="us-east-1",
                        aws_access_key_id=c.access_key_id, aws_secret_access_key=c.secret_access_key,
                        config=Config(retries={"max_attempts": 1}))


def _all_secrets(state: localstack.StackState) -> dict[str, str]:
    """Every S3 secret key of the stack, by identity (what an attacker must not read)."""
    return {name: c.secret_access_key for name, c in state.identities.items()}


@pytest.fixture(scope="module")
def blocks_saved(stack: localstack.StackState) -> localstack.StackState:
    configure.save_blocks(stack)  # what `make deploy` saves: role blocks, node blocks, result storage
    return stack


# --- the Prefect API -----------------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("auth", [None, ("edgehaul", "wrong"), ("", "")], ids=["none", "wrong", "empty"])
def test_block_secrets_over_the_api_need_the_auth_string(blocks_saved: localstack.StackState,
                                                         auth: tuple[str, str] | None) -> None:
    """With a node's S3 keys and network access to the API but not its auth string, no block is read."""
    api = blocks_saved.prefect_api_url
    r = httpx.post(f"{api}/block_documents/filter", json={"include_secrets": True}, auth=auth, timeout=10)
    assert r.status_code == 401, r.text[:300]
    for secret in _all_secrets(blocks_saved).values():
        assert secret not in r.text
    # nor by another route to the same documents, nor the variables or the flow runs' parameters
    by_name = "/block_types/slug/edgehaul-object-store/block_documents/name/ingest?include_secrets=true"
    for method, path, body in (("GET", by_name, None), ("POST", "/variables/filter", {}),
                               ("POST", "/flow_runs/filter", {}), ("POST", "/block_documents/count", {})):
        r = httpx.request(method, f"{api}{path}", json=body, auth=auth, timeout=10)
        assert r.status_code == 401, (path, r.status_code)
    # the probes stay open (a liveness check needs no secret) and hold nothing
    h = httpx.get(f"{api}/health", timeout=10)
    assert h.status_code == 200 and h.json() is True


@pytest.mark.integration
def test_with_the_api_the_edge_blocks_still_hold_no_key(blocks_saved: localstack.StackState) -> None:
    """An edge worker has the auth string: every block it can read holds no node's key (they live in a 0600
    file on the node), and the node block still works, from that file."""
    from tests.conftest import api_auth

    api = blocks_saved.prefect_api_url
    r = httpx.post(f"{api}/block_documents/filter", json={"include_secrets": True, "limit": 200},
                   auth=api_auth(), timeout=30)
    assert r.status_code == 200, r.text[:300]
    docs = r.json()
    dump = json.dumps(docs)
    for node in NODES:
        secret = blocks_saved.identities[node].secret_access_key
        assert secret not in dump, f"{node}'s secret key is in a block document"
        assert blocks_saved.identities[node].access_key_id not in dump
        doc = next(d for d in docs if d["name"] == node_store(node) and d["block_type"]["slug"] == "edgehaul-object-store")
        data = doc["data"]
        assert data.get("access_key_id") is None and data.get("secret_access_key") is None, data
        path = Path(data["credentials_file"])
        assert path == blocks_saved.node_credentials_file(node) and data["profile"] == node
        assert stat.S_IMODE(path.stat().st_mode) == 0o600

    store = ObjectStore.load(node_store("node-a"))
    s3 = store.client()
    key = store.key("landing", f"node-a/attack-{uuid.uuid4().hex[:8]}.txt")
    s3.put_object(Bucket=store.bucket("landing"), Key=key, Body=b"own prefix")
    with pytest.raises(ClientError) as e:
        s3.put_object(Bucket=store.bucket("landing"), Key=store.key("landing", "node-b/forged.txt"), Body=b"x")
    assert e.value.response["Error"]["Code"] == "AccessDenied"


# --- the S3 server's other ports -------------------------------------------------------------------------

def _http(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.request(method, url, content=body, headers=headers, timeout=10)


@pytest.mark.integration
def test_seaweedfs_ports_refuse_unauthenticated_reads_and_writes(stack: localstack.StackState,
                                                                 store: ObjectStore) -> None:
    """Only the S3 port serves data, and only to a signed request: the filer (every bucket as files), the
    master (hands out volume write/read JWTs on /dir/assign and /dir/lookup) and the volume server refuse."""
    s3 = store.client()
    bucket, key = store.bucket("ops"), store.key("ops", "secret.bin")
    s3.put_object(Bucket=bucket, Key=key, Body=b"s" * 300_000)  # large enough to live on a volume
    p = stack.weed_ports
    filer, master, volume = (f"http://127.0.0.1:{p[k]}" for k in ("filer", "master", "volume"))

    for method, url, body in (
        ("GET", f"{filer}/buckets/{bucket}/{key}", None),
        ("GET", f"{filer}/buckets/{bucket}/", None),
        ("GET", f"{filer}/buckets/{bucket}/{key}?metadata=true", None),
        ("PUT", f"{filer}/buckets/{bucket}/{store.key('ops', 'planted.txt')}", b"planted"),
        ("DELETE", f"{filer}/buckets/{bucket}/{key}", None),
        ("GET", f"{master}/dir/assign", None),
        ("GET", f"{master}/dir/lookup?volumeId=1&read=yes&fileId=1,01637037d6", None),
        ("GET", f"{volume}/1,01637037d6", None),
        ("PUT", f"{volume}/1,01637037d6", b"overwrite"),
    ):
        r = _http(method, url, body)
        assert r.status_code in (401, 403, 404, 405), (method, url, r.status_code, r.text[:200])
        assert "Authorization" not in r.headers, (url, "a JWT was handed out")
        assert b"sss" not in r.content

    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == b"s" * 300_000
    with pytest.raises(ClientError):
        s3.head_object(Bucket=bucket, Key=store.key("ops", "planted.txt"))


@pytest.mark.integration
def test_a_node_cannot_mint_other_credentials_from_the_s3_port(stack: localstack.StackState) -> None:
    """The S3 port's STS and IAM answers do not turn a node's keys into more: no AssumeRole, no new keys."""
    c = stack.identities["node-a"]
    kw: dict[str, Any] = {"endpoint_url": stack.s3_endpoint, "region_name": "us-east-1",
                          "aws_access_key_id": c.access_key_id, "aws_secret_access_key": c.secret_access_key,
                          "config": Config(retries={"max_attempts": 1})}
    sts, iam = boto3.client("sts", **kw), boto3.client("iam", **kw)
    attempts = [
        lambda: sts.assume_role(RoleArn="arn:aws:iam::000000000000:role/admin", RoleSessionName="attack",
                                Policy='{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"s3:*",'
                                       '"Resource":"*"}]}'),
        lambda: sts.get_session_token(),
        lambda: iam.create_access_key(UserName="admin"),
        lambda: iam.list_access_keys(UserName="admin"),
    ]
    for attempt in attempts:
        with pytest.raises(ClientError):
            attempt()
    s3 = _node_s3(stack, "node-a")
    with pytest.raises(ClientError):
        s3.list_objects_v2(Bucket="edgehaul-landing", Prefix="node-b/")


# --- files on the host -----------------------------------------------------------------------------------

@pytest.mark.integration
def test_secret_files_and_the_database_are_owner_only(stack: localstack.StackState, tmp_path: Path) -> None:
    root = Path(stack.root)
    private_files = [root / "state.json", root / "seaweedfs" / "s3.json",
                     *(stack.node_credentials_file(n) for n in NODES)]
    db = root / "prefect" / "prefect.db"
    if db.exists():  # absent only when EDGEHAUL_PREFECT_DB_URL points at another database
        private_files.append(db)
    for f in private_files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f"{f}: {stat.S_IMODE(f.stat().st_mode):04o}"
    # folders others cannot enter (SeaweedFS makes some data files 0644: its folder keeps them private)
    for d in (root, root / "prefect", root / "seaweedfs"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, f"{d}: {stat.S_IMODE(d.stat().st_mode):04o}"
    # nothing under the Prefect home (database, its WAL, the encryption key's table) is readable by others
    loose = [p for p in (root / "prefect").rglob("*") if not p.is_symlink() and stat.S_IMODE(p.stat().st_mode) & 0o077]
    assert not loose, loose[:5]
    # the servers hold the API auth string and the JWT keys in their environment, not in a file others read
    assert stack.api_auth_string and len(stack.weed_jwt) == 4
    for secret in (stack.api_auth_string, *stack.weed_jwt.values()):
        for f in root.rglob("*"):
            if f.is_file() and f.name != "state.json" and f.stat().st_size < 5_000_000:
                assert secret not in f.read_text(errors="replace"), f

    # `make up` writes the exports (admin key, auth string) with `--env-file`: 0600, even over a 0644 file
    env_file = tmp_path / "stack.env"
    env_file.write_text("old")
    env_file.chmod(0o644)
    assert localstack.main(["env", "--root", str(root), "--env-file", str(env_file)]) == 0
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    assert f"export PREFECT_API_AUTH_STRING={stack.api_auth_string}" in env_file.read_text()


# --- the credentials file of an ObjectStore ----------------------------------------------------------------

def _ini(path: Path, mode: int) -> Path:
    write_credentials_file(path, "node-a", "AKEXAMPLE", "SKEXAMPLE")
    path.chmod(mode)
    return path


def test_a_group_readable_credentials_file_is_refused_with_its_name_and_mode(tmp_path: Path) -> None:
    path = _ini(tmp_path / "s3-credentials", 0o640)
    store = ObjectStore(endpoint_url="http://127.0.0.1:9", credentials_file=str(path), profile="node-a")
    with pytest.raises(CredentialsFileError) as e:
        store.client()
    assert str(path) in str(e.value) and "0640" in str(e.value)
    with pytest.raises(CredentialsFileError, match="0640"):
        store.storage_options()
    path.chmod(0o600)
    assert store.storage_options()["AWS_ACCESS_KEY_ID"] == "AKEXAMPLE"


@settings(max_examples=60, deadline=None)
@given(mode=st.integers(min_value=0o400, max_value=0o777))
def test_only_an_owner_only_file_is_accepted(tmp_path_factory: pytest.TempPathFactory, mode: int) -> None:
    path = _ini(tmp_path_factory.mktemp("mode") / "creds", mode)
    try:
        if mode & 0o077:
            with pytest.raises(CredentialsFileError, match=f"{mode:04o}"):
                read_credentials_file(path, "node-a")
        else:
            assert read_credentials_file(path, "node-a")["aws_secret_access_key"] == "SKEXAMPLE"
    finally:
        path.chmod(0o600)


def test_credentials_file_formats_and_errors_name_what_is_wrong(tmp_path: Path) -> None:
    sts = tmp_path / "sts.json"  # `aws sts assume-role ... > sts.json`: a short-lived session credential
    sts.write_text(json.dumps({"Credentials": {"AccessKeyId": "ASIA1", "SecretAccessKey": "S1",
                                               "SessionToken": "T1", "Expiration": "2030-01-01T00:00:00Z"}}))
    sts.chmod(0o600)
    store = ObjectStore(credentials_file=str(sts))
    assert store.storage_options()["AWS_SESSION_TOKEN"] == "T1"
    assert store.client()._request_signer._credentials.token == "T1"

    ini = _ini(tmp_path / "ini", 0o600)
    with pytest.raises(CredentialsFileError, match=r"no profile \[node-b\]"):
        read_credentials_file(ini, "node-b")
    write_credentials_file(ini, "node-b", "AK2", "SK2")  # a second node's profile keeps the first one
    assert read_credentials_file(ini, "node-a")["aws_access_key_id"] == "AKEXAMPLE"
    assert read_credentials_file(ini, "node-b")["aws_access_key_id"] == "AK2"
    assert stat.S_IMODE(ini.stat().st_mode) == 0o600

    half = tmp_path / "half"
    half.write_text("[default]\naws_access_key_id = AK\n")
    half.chmod(0o600)
    with pytest.raises(CredentialsFileError, match="missing aws_secret_access_key"):
        read_credentials_file(half, "default")
    with pytest.raises(CredentialsFileError, match="cannot read"):
        read_credentials_file(tmp_path / "absent", "default")
    with pytest.raises(ValueError, match="either credentials_file or access_key_id"):
        ObjectStore(credentials_file=str(ini), access_key_id="AK", secret_access_key="SK")  # type: ignore[arg-type]
    assert os.access(ini, os.R_OK)


def test_blocks_apply_puts_a_nodes_keys_in_its_file_never_in_its_block(tmp_path: Path) -> None:
    from edgehaul.services.block_setup import Setup, node_store_for, write_node_credentials

    keys = {"access_key_id": "AK", "secret_access_key": "SK"}
    setup = Setup.model_validate({
        "store": {"endpoint_url": "http://127.0.0.1:9"},
        "identities": {**{r: keys for r in ("central", "ingest", "trainer", "lifecycle")},
                       "node-a": {"access_key_id": "AKA", "secret_access_key": "SKA"},
                       "node-b": {"access_key_id": "AKB", "secret_access_key": "SKB"}},
        "nodes": [{"node_id": "node-a", "spool_dir": str(tmp_path / "spool" / "node-a")},  # both share a file
                  {"node_id": "node-b", "spool_dir": str(tmp_path / "spool" / "node-b")},
                  {"node_id": "node-k8s", "spool_dir": "/var/lib/edgehaul/spool", "credentials_from_environment": True}],
    })
    blocks = {n.node_id: node_store_for(setup, n) for n in setup.nodes}
    for block in blocks.values():
        assert block.access_key_id is None and block.secret_access_key is None
    assert blocks["node-k8s"].credentials_file is None  # boto3's default chain: env / workload identity
    shared = tmp_path / "spool" / "s3-credentials"
    assert write_node_credentials(setup) == [shared, shared]
    assert stat.S_IMODE(shared.stat().st_mode) == 0o600
    assert blocks["node-a"].credentials_file == str(shared) and blocks["node-a"].profile == "node-a"
    assert blocks["node-a"].storage_options()["AWS_SECRET_ACCESS_KEY"] == "SKA"
    assert blocks["node-b"].storage_options()["AWS_SECRET_ACCESS_KEY"] == "SKB"
    assert "SKA" not in blocks["node-a"].model_dump_json() and "SKA" not in repr(blocks["node-a"])
    with pytest.raises(ValueError, match="node-z: neither a role nor a node"):
        Setup.model_validate({**setup.model_dump(mode="json"), "identities": {
            **{r: keys for r in ("central", "ingest", "trainer", "lifecycle")}, "node-z": keys}})


def _every_block_document(api: str) -> list[dict[str, Any]]:
    """Every block document on the server, named and anonymous, with secrets: what an edge worker can read."""
    from tests.conftest import api_auth

    docs: list[dict[str, Any]] = []
    for anonymous in (False, True):
        offset = 0
        while True:
            r = httpx.post(f"{api}/block_documents/filter", auth=api_auth(), timeout=30, json={
                "include_secrets": True, "block_documents": {"is_anonymous": {"eq_": anonymous}},
                "offset": offset, "limit": 200})
            assert r.status_code == 200, r.text[:300]
            docs += r.json()
            if len(r.json()) < 200:
                break
            offset += 200
    return docs


@pytest.mark.integration
def test_with_the_api_no_block_holds_any_s3_key_or_the_gateway_secret(blocks_saved: localstack.StackState) -> None:
    """An edge worker (auth string in hand) dumps every block document with `include_secrets`: no identity's
    S3 secret key (central roles included) and no gateway secret is in any of them. The central blocks still
    work: from the 0600 central credentials file (roles) and the `ingest` profile (cached results)."""
    from prefect_aws import S3Bucket

    from edgehaul.platform.caching import CORE_RESULTS_BLOCK
    from edgehaul.platform.roles import StoreBlock
    from edgehaul.services import gateway

    localstack.start_gateway(blocks_saved)  # --create-secret: the gateway's own secret exists from here on
    gateway_secret = gateway.load_secret(Path(blocks_saved.root) / "gateway")
    docs = _every_block_document(blocks_saved.prefect_api_url)
    slugs = {d["block_type"]["slug"] for d in docs}
    assert {"edgehaul-object-store", "s3-bucket"} <= slugs, slugs  # the dump is not empty
    assert "secret" not in slugs  # no Prefect Secret block: the gateway's secret is a file
    dump = json.dumps(docs)
    leaked = [name for name, secret in _all_secrets(blocks_saved).items() if secret in dump]
    assert not leaked, f"S3 secret keys of {leaked} are in block documents"
    assert gateway_secret not in dump
    central = blocks_saved.central_credentials_file()
    assert stat.S_IMODE(central.stat().st_mode) == 0o600
    assert stat.S_IMODE(gateway.secret_path(Path(blocks_saved.root) / "gateway").stat().st_mode) == 0o600
    for role in StoreBlock:
        data = next(d for d in docs if d["name"] == role.value and d["block_type"]["slug"] == "edgehaul-object-store")
        assert (data["data"]["credentials_file"], data["data"]["profile"]) == (str(central), role.value)

    # the role blocks reach S3 as their own identity, from the file
    ingest = ObjectStore.load(StoreBlock.INGEST.value)
    s3 = ingest.client()
    key = ingest.key("ops", f"attack-{uuid.uuid4().hex[:8]}.txt")
    s3.put_object(Bucket=ingest.bucket("ops"), Key=key, Body=b"central")
    assert s3.get_object(Bucket=ingest.bucket("ops"), Key=key)["Body"].read() == b"central"
    with pytest.raises(ClientError) as e:  # trainer may not write landing: its block is the trainer's key
        trainer = ObjectStore.load(StoreBlock.TRAINER.value)
        trainer.client().put_object(Bucket=trainer.bucket("landing"), Key=trainer.key("landing", "x"), Body=b"x")
    assert e.value.response["Error"]["Code"] == "AccessDenied"
    # the results block names the ingest profile, no key; boto3 resolves it as ingest, not the shell's admin env
    results = S3Bucket.load(CORE_RESULTS_BLOCK)
    assert results.credentials.aws_access_key_id is None and results.credentials.aws_secret_access_key is None
    assert results.credentials.profile_name == StoreBlock.INGEST.value
    session = results.credentials.get_boto3_session()
    assert session.get_credentials().access_key == blocks_saved.identities["ingest"].access_key_id
    path = f"attack-{uuid.uuid4().hex[:8]}"
    results.write_path(path, b"cached")
    assert results.read_path(path) == b"cached"


def test_blocks_apply_puts_central_keys_in_one_file_never_in_a_block(tmp_path: Path) -> None:
    from edgehaul.platform.caching import core_result_storage_block
    from edgehaul.services.block_setup import Setup, store_for, write_central_credentials

    roles = ("central", "ingest", "trainer", "lifecycle")
    central = tmp_path / "central" / "s3-credentials"
    setup = Setup.model_validate({
        "store": {"endpoint_url": "http://127.0.0.1:9"}, "central_credentials_file": str(central),
        "identities": {r: {"access_key_id": f"AK{r}", "secret_access_key": f"SK{r}"} for r in roles},
        "nodes": [{"node_id": "node-a", "spool_dir": str(tmp_path / "spool")}],
    })
    assert write_central_credentials(setup) == central
    assert stat.S_IMODE(central.stat().st_mode) == 0o600
    for role in roles:
        block = store_for(setup, role)
        assert block.access_key_id is None and block.secret_access_key is None
        assert (block.credentials_file, block.profile) == (str(central), role)
        assert block.storage_options()["AWS_SECRET_ACCESS_KEY"] == f"SK{role}"  # from the file, per role
    results = core_result_storage_block(store_for(setup, "ingest"))
    assert results.credentials.profile_name == "ingest" and results.credentials.aws_secret_access_key is None
    assert "SKingest" not in results.model_dump_json()
    with pytest.raises(ValueError, match="the store holds keys"):
        core_result_storage_block(ObjectStore(access_key_id="AK", secret_access_key="SK"))  # type: ignore[arg-type]
    # Kubernetes: keys from the environment, so no role identity is needed and no file is written
    env = Setup.model_validate({"store": {}, "central_credentials_from_environment": True, "identities": {},
                                "nodes": [{"node_id": "node-a", "spool_dir": str(tmp_path / "s2")}]})
    assert write_central_credentials(env) is None
    block = store_for(env, "ingest")
    assert block.credentials_file is None and block.access_key_id is None
    assert core_result_storage_block(block).credentials.profile_name is None
    default = Setup.model_validate({**{"store": {}, "nodes": [{"node_id": "node-a", "spool_dir": "/s"}]},
                                    "identities": setup.model_dump()["identities"]})
    assert default.central_credentials_path() == Path.home() / ".config" / "edgehaul" / "s3-credentials"


def test_the_gateway_secret_is_an_owner_only_file(tmp_path: Path) -> None:
    from edgehaul.services import gateway

    with pytest.raises(RuntimeError, match="cannot read"):
        gateway.load_secret(tmp_path)
    path = gateway.ensure_secret_file(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.parent == tmp_path
    first = gateway.load_secret(tmp_path)
    assert len(first) >= 32 and gateway.ensure_secret_file(tmp_path) == path and gateway.load_secret(tmp_path) == first
    path.chmod(0o640)
    with pytest.raises(RuntimeError, match=r"gateway-secret: mode 0640"):
        gateway.load_secret(tmp_path)
