"""The IAM documents of infra/iam/ under an AWS policy engine: moto's IAM + S3 server, in-process.

One IAM user per role (and per node) with the repository's documents attached as managed policies; the
product's own uplink and plain boto3 calls then run with each identity's keys, and the server decides.

What moto (5.2) evaluates: Action and Resource of identity policies (wildcards), explicit Deny, the
signature. What it does not, so tests/security/test_access.py's hand-written evaluator keeps those checks (and
`test_the_limits_of_the_engine_are_known` below fails the day moto learns them, to move them here):
- policy variables: `${aws:username}` never matches, so a node's user gets `edge-node.json` rendered with
  its name spelled out (`node_policy`), as on a server without policy variables;
- Condition blocks: an identity policy's conditions are not evaluated (`s3:prefix` does not confine
  ListBucket to a node's prefix);
- HEAD of a missing key answers 404 whatever the ListBucket grant (AWS answers 403 without it);
- the source of a CopyObject is not authorised (AWS needs s3:GetObject on it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto.server import ThreadedMotoServer
from pydantic import SecretStr

from edgehaul.blocks import LinkProfile, ObjectStore
from edgehaul.uplink.link import Link, SimulatedLink
from edgehaul.uplink.transfer import Uplink, UplinkError
from tests.builders import bundle

IAM = Path(__file__).resolve().parents[2] / "infra" / "iam"
BUCKETS = ("edgehaul-landing", "edgehaul-curated", "edgehaul-cold", "edgehaul-checkpoints", "edgehaul-ops")
ROLES = ("ingest", "trainer", "lifecycle")
NODES = ("node-a", "node-b")
MiB = 1024 * 1024
# the central operator identity (block `central`, user `admin` here) has infra/iam/central.json
ADMIN_DOC = json.loads((IAM / "central.json").read_text())


def node_policy(node: str) -> str:
    """edge-node.json with the user name spelled out: the form for engines without policy variables."""
    return (IAM / "edge-node.json").read_text().replace("${aws:username}", node)


@dataclass
class Engine:
    endpoint: str
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)
    _clients: dict[str, Any] = field(default_factory=dict)

    def store(self, identity: str) -> ObjectStore:
        key_id, secret = self.keys[identity]
        return ObjectStore(endpoint_url=self.endpoint, access_key_id=SecretStr(key_id),
                           secret_access_key=SecretStr(secret))

    def client(self, identity: str) -> Any:
        """One client per identity (a boto3 client costs more to build than the calls made with it)."""
        if identity not in self._clients:
            self._clients[identity] = self.store(identity).client(retries={"total_max_attempts": 1, "mode": "standard"})
        return self._clients[identity]


def _auth_after(endpoint: str, requests: float) -> str:
    """Moto's switch: authorise every request after `requests` more (inf: never). Returns the previous value."""
    req = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=str(requests).encode(), method="POST",
                                 headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(json.loads(resp.read())["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"])


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    eng = Engine(f"http://{host}:{port}")
    boot = boto3.session.Session(aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap",
                                 region_name="us-east-1")
    iam, s3 = boot.client("iam", endpoint_url=eng.endpoint), boot.client("s3", endpoint_url=eng.endpoint)
    previous = "inf"
    try:
        for b in BUCKETS:
            s3.create_bucket(Bucket=b)
        docs = {"admin": json.dumps(ADMIN_DOC), "node-v": (IAM / "edge-node.json").read_text(),
                **{r: (IAM / f"{r}.json").read_text() for r in ROLES}, **{n: node_policy(n) for n in NODES}}
        for user, doc in docs.items():
            iam.create_user(UserName=user)
            arn = iam.create_policy(PolicyName=f"edgehaul-{user}", PolicyDocument=doc)["Policy"]["Arn"]
            iam.attach_user_policy(UserName=user, PolicyArn=arn)
            k = iam.create_access_key(UserName=user)["AccessKey"]
            eng.keys[user] = (k["AccessKeyId"], k["SecretAccessKey"])
        previous = _auth_after(eng.endpoint, 0)  # from here on, every request is signed and authorised
        yield eng
    finally:
        _auth_after(eng.endpoint, float(previous))
        # moto's backend outlives the server in this process: leave no buckets for the next moto user
        urllib.request.urlopen(urllib.request.Request(f"{eng.endpoint}/moto-api/reset", method="POST"),
                               timeout=10).close()
        server.stop()


def denied(call: Callable[..., Any], **kw: Any) -> None:
    with pytest.raises(ClientError) as e:
        call(**kw)
    assert e.value.response["Error"]["Code"] in ("AccessDenied", "403"), e.value.response["Error"]


def body(client: Any, bucket: str, key: str) -> bytes:
    data: bytes = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return data


def profile(**kw: Any) -> LinkProfile:
    return LinkProfile(bandwidth_bps=400 * MiB * 8, chunk_bytes=1 * MiB, **kw)


# ---- the uplink, with a node's own identity ----------------------------------------------------

def test_uplink_lands_and_re_sends_a_bundle_as_its_node(engine: Engine, tmp_path: Path) -> None:
    d, m = bundle(40, "node-a", seed=101, start_seq=101_000)
    up = Uplink(engine.store("node-a"), Link(profile(), emit_events=False), tmp_path / "state")
    # a normal-tier bundle starts with HEAD of its own (missing) key: 404 under the node's policy
    first = up.send(d, m)
    assert (first.already_present, first.multipart, first.verified_by) == (False, False, "etag-md5")
    again = up.send(d, m)  # HEAD of its own landed key, then the same proof: nothing sent twice
    assert again.already_present and again.manifest_nbytes == 0
    admin = engine.client("admin")
    assert hashlib.sha256(body(admin, "edgehaul-landing", first.key)).hexdigest() == m.sha256
    assert json.loads(body(admin, "edgehaul-landing", first.manifest_key))["bundle_id"] == m.bundle_id
    # another node's identity cannot land this node's bundle: its HEAD and its PUT are both refused
    with pytest.raises(ClientError) as e:
        Uplink(engine.store("node-b"), Link(profile(), emit_events=False), tmp_path / "b").send(
            *bundle(10, "node-a", seed=102, start_seq=102_000))
    assert e.value.response["Error"]["Code"] == "AccessDenied"


def test_uplink_multipart_resumes_with_list_parts_as_its_node(engine: Engine, tmp_path: Path) -> None:
    d, m = bundle(8000, "node-a", seed=103, start_seq=103_000)  # ~10.6 MB: 3 parts of 5 MiB
    mp = profile(multipart_threshold_bytes=5 * MiB, part_bytes=5 * MiB)
    store = engine.store("node-a")
    # every chunk after part 1 is corrupted and no re-send is allowed: the upload stops after part 1
    broken = SimulatedLink(mp, corrupt_chunks=list(range(6, 12)), emit_events=False)
    with pytest.raises(UplinkError, match="part 2: checksum rejected"):
        Uplink(store, broken, tmp_path / "state", max_digest_resends=0).send(d, m)
    # the next drain resumes: ListMultipartUploadParts on its own key, part 1 skipped
    link = Link(mp, emit_events=False)
    r = Uplink(store, link, tmp_path / "state").send(d, m)
    assert (r.multipart, r.parts_total, r.parts_skipped, r.parts_sent) == (True, 3, 1, 2)
    assert r.verified_by == "etag-multipart"
    admin = engine.client("admin")
    assert hashlib.sha256(body(admin, "edgehaul-landing", r.key)).hexdigest() == m.sha256
    assert admin.list_multipart_uploads(Bucket="edgehaul-landing", Prefix=r.key).get("Uploads", []) == []


def test_abort_orphans_lists_and_aborts_only_under_its_prefix(engine: Engine, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    a, b = engine.client("node-a"), engine.client("node-b")
    orphan = a.create_multipart_upload(Bucket="edgehaul-landing", Key=f"node-a/{tag}/orphan.parquet")["UploadId"]
    theirs = b.create_multipart_upload(Bucket="edgehaul-landing", Key=f"node-b/{tag}/x.parquet")["UploadId"]
    up = Uplink(engine.store("node-a"), Link(profile(), emit_events=False), tmp_path / "state")
    assert [u for _, u in up.abort_orphans("node-a", older_than_s=0)] == [orphan]
    # pointed at another node's prefix, the listing is not the guard (see the module doc): the abort is
    assert up.abort_orphans("node-b", older_than_s=0) == []
    denied(a.abort_multipart_upload, Bucket="edgehaul-landing", Key=f"node-b/{tag}/x.parquet", UploadId=theirs)
    left = engine.client("admin").list_multipart_uploads(Bucket="edgehaul-landing", Prefix=f"node-b/{tag}/")
    assert [u["UploadId"] for u in left.get("Uploads", [])] == [theirs]


# ---- what each identity may and may not do ---------------------------------------------------

def test_a_node_is_confined_to_its_own_landing_prefix(engine: Engine) -> None:
    tag = uuid.uuid4().hex[:8]
    admin, a = engine.client("admin"), engine.client("node-a")
    admin.put_object(Bucket="edgehaul-landing", Key=f"node-b/{tag}/theirs", Body=b"b")
    admin.put_object(Bucket="edgehaul-curated", Key=f"datasets/{tag}/part", Body=b"c")
    a.put_object(Bucket="edgehaul-landing", Key=f"node-a/{tag}/mine", Body=b"a")
    assert body(a, "edgehaul-landing", f"node-a/{tag}/mine") == b"a"
    denied(a.put_object, Bucket="edgehaul-landing", Key=f"node-b/{tag}/forged", Body=b"x")
    denied(a.get_object, Bucket="edgehaul-landing", Key=f"node-b/{tag}/theirs")
    denied(a.head_object, Bucket="edgehaul-landing", Key=f"node-b/{tag}/theirs")
    denied(a.delete_object, Bucket="edgehaul-landing", Key=f"node-b/{tag}/theirs")
    denied(a.delete_object, Bucket="edgehaul-landing", Key=f"node-a/{tag}/mine")  # write-once, even its own
    denied(a.get_object, Bucket="edgehaul-curated", Key=f"datasets/{tag}/part")
    denied(a.put_object, Bucket="edgehaul-curated", Key=f"datasets/{tag}/evil", Body=b"x")
    denied(a.list_objects_v2, Bucket="edgehaul-curated")
    denied(a.put_object, Bucket="edgehaul-checkpoints", Key=f"{tag}/x", Body=b"x")
    denied(a.put_object, Bucket="edgehaul-ops", Key=f"prefect-results/{tag}", Body=b"x")
    assert body(admin, "edgehaul-landing", f"node-b/{tag}/theirs") == b"b"
    assert body(admin, "edgehaul-landing", f"node-a/{tag}/mine") == b"a"


def test_ingest_reads_landing_and_writes_curated_quarantine_and_ops(engine: Engine) -> None:
    tag = uuid.uuid4().hex[:8]
    engine.client("node-a").put_object(Bucket="edgehaul-landing", Key=f"node-a/{tag}/b.parquet", Body=b"bundle")
    ingest = engine.client("ingest")
    listed = ingest.list_objects_v2(Bucket="edgehaul-landing", Prefix=f"node-a/{tag}/")
    assert [o["Key"] for o in listed["Contents"]] == [f"node-a/{tag}/b.parquet"]
    assert body(ingest, "edgehaul-landing", f"node-a/{tag}/b.parquet") == b"bundle"
    for bucket, key in (("edgehaul-curated", f"datasets/{tag}/_delta_log/00000000000000000000.json"),
                        ("edgehaul-curated", f"quarantine/node-a/{tag}/validation.json"),
                        ("edgehaul-curated", f"datasets/_claims/{tag}/b.json"),
                        ("edgehaul-ops", f"metering/usage/{tag}.jsonl")):
        ingest.put_object(Bucket=bucket, Key=key, Body=b"{}", IfNoneMatch="*")
        assert body(ingest, bucket, key) == b"{}"
    ingest.delete_object(Bucket="edgehaul-curated", Key=f"datasets/_claims/{tag}/b.json")
    # landing is write-once for the core: no PUT, DELETE or tagging there, not even create-only
    denied(ingest.delete_object, Bucket="edgehaul-landing", Key=f"node-a/{tag}/b.parquet")
    denied(ingest.put_object_tagging, Bucket="edgehaul-landing", Key=f"node-a/{tag}/b.parquet",
           Tagging={"TagSet": [{"Key": "k", "Value": "v"}]})
    denied(ingest.put_object, Bucket="edgehaul-landing", Key=f"node-a/{tag}/forged.parquet", Body=b"x", IfNoneMatch="*")
    denied(ingest.put_object, Bucket="edgehaul-landing", Key=f"node-a/{tag}/forged.parquet", Body=b"x")
    denied(ingest.put_object, Bucket="edgehaul-checkpoints", Key=f"{tag}/ckpt", Body=b"x")
    denied(ingest.put_object, Bucket="edgehaul-checkpoints", Key=f"models/m/{tag}/model.pt", Body=b"x")
    denied(ingest.get_object, Bucket="edgehaul-cold", Key=f"{tag}/x")
    denied(ingest.list_objects_v2, Bucket="edgehaul-checkpoints")


def test_trainer_reads_curated_and_writes_checkpoints_and_models(engine: Engine) -> None:
    tag = uuid.uuid4().hex[:8]
    admin, trainer = engine.client("admin"), engine.client("trainer")
    admin.put_object(Bucket="edgehaul-curated", Key=f"datasets/{tag}/part.parquet", Body=b"rows")
    admin.put_object(Bucket="edgehaul-landing", Key=f"node-a/{tag}/b.parquet", Body=b"raw")
    admin.put_object(Bucket="edgehaul-ops", Key=f"metering/usage/{tag}.jsonl", Body=b"{}")
    assert [o["Key"] for o in trainer.list_objects_v2(Bucket="edgehaul-curated", Prefix=f"datasets/{tag}/")["Contents"]] \
        == [f"datasets/{tag}/part.parquet"]
    assert body(trainer, "edgehaul-curated", f"datasets/{tag}/part.parquet") == b"rows"
    for key in (f"{tag}/000000000010/state-x.pt", f"{tag}/000000000010/COMMIT.json",
                f"models/m/{tag}/model.pt", f"models/m/{tag}/lineage.json"):
        trainer.put_object(Bucket="edgehaul-checkpoints", Key=key, Body=b"w", IfNoneMatch="*")
    trainer.delete_object(Bucket="edgehaul-checkpoints", Key=f"{tag}/000000000010/state-x.pt")  # retention
    # the model pointer swap (registry.publish): a conditional overwrite of models/<name>/latest.json
    etag = trainer.put_object(Bucket="edgehaul-checkpoints", Key=f"models/m{tag}/latest.json", Body=b"1")["ETag"]
    trainer.put_object(Bucket="edgehaul-checkpoints", Key=f"models/m{tag}/latest.json", Body=b"2", IfMatch=etag)
    denied(trainer.put_object, Bucket="edgehaul-curated", Key=f"datasets/{tag}/evil", Body=b"x")
    denied(trainer.delete_object, Bucket="edgehaul-curated", Key=f"datasets/{tag}/part.parquet")
    denied(trainer.get_object, Bucket="edgehaul-landing", Key=f"node-a/{tag}/b.parquet")
    denied(trainer.get_object, Bucket="edgehaul-ops", Key=f"metering/usage/{tag}.jsonl")
    denied(trainer.put_object, Bucket="edgehaul-ops", Key=f"metering/usage/{tag}-2.jsonl", Body=b"x")


def test_trainer_reads_the_store_capability_record(engine: Engine) -> None:
    """publish_model (trainer identity) gates on capabilities/store.json; a 403 there reads as 'never probed'
    (`store_probe.load`), which would silently skip the gate."""
    from edgehaul.ops import store_probe

    record = {"checks": [{"feature": "put-if-match-quoted", "present": False, "used_for": "x", "detail": "412",
                          "instead": "x"}, {"feature": "put-if-match-unquoted", "present": False, "used_for": "x",
                                            "detail": "412", "instead": "x"}]}
    engine.client("admin").put_object(Bucket="edgehaul-ops", Key=store_probe.RECORD_PATH, Body=json.dumps(record).encode())
    try:
        trainer = engine.store("trainer")
        assert store_probe.load(trainer) is not None
        with pytest.raises(store_probe.StoreCapabilityError, match="put-if-match-quoted"):
            store_probe.require(trainer, {"put-if-match-quoted|put-if-match-unquoted": "publish_model"})
        denied(engine.client("trainer").put_object, Bucket="edgehaul-ops", Key=store_probe.RECORD_PATH, Body=b"{}")
    finally:
        engine.client("admin").delete_object(Bucket="edgehaul-ops", Key=store_probe.RECORD_PATH)


def test_lifecycle_copies_between_tiers_and_journals_in_ops(engine: Engine) -> None:
    tag = uuid.uuid4().hex[:8]
    admin, life = engine.client("admin"), engine.client("lifecycle")
    admin.put_object(Bucket="edgehaul-curated", Key=f"datasets/{tag}/part.parquet", Body=b"rows")
    etag = life.head_object(Bucket="edgehaul-curated", Key=f"datasets/{tag}/part.parquet")["ETag"]
    life.put_object(Bucket="edgehaul-ops", Key=f"lifecycle/journal/{tag}.json", Body=b"[]", IfNoneMatch="*")
    cold_key = f"edgehaul-curated/datasets/{tag}/part.parquet"
    life.copy_object(Bucket="edgehaul-cold", Key=cold_key, StorageClass="STANDARD_IA", MetadataDirective="REPLACE",
                     Metadata={"eh-source": f"edgehaul-curated/datasets/{tag}/part.parquet"},
                     CopySource={"Bucket": "edgehaul-curated", "Key": f"datasets/{tag}/part.parquet"},
                     CopySourceIfMatch=etag)
    life.delete_object(Bucket="edgehaul-curated", Key=f"datasets/{tag}/part.parquet")
    assert body(life, "edgehaul-cold", cold_key) == b"rows"
    # and back (a restore), then the cold copy expires
    life.copy_object(Bucket="edgehaul-curated", Key=f"datasets/{tag}/part.parquet",
                     CopySource={"Bucket": "edgehaul-cold", "Key": cold_key})
    life.delete_object(Bucket="edgehaul-cold", Key=cold_key)
    assert body(admin, "edgehaul-curated", f"datasets/{tag}/part.parquet") == b"rows"
    for bucket in BUCKETS:
        life.list_objects_v2(Bucket=bucket, MaxKeys=1)
    life.put_object(Bucket="edgehaul-ops", Key=f"lifecycle/journal/{tag}.done", Body=b"", IfNoneMatch="*")
    # its own S3 lifecycle rules (apply_store_lifecycle), no other bucket administration: policies stay with
    # the operator
    life.put_bucket_lifecycle_configuration(
        Bucket="edgehaul-curated", LifecycleConfiguration={"Rules": [{"ID": "x", "Status": "Enabled",
                                                                      "Filter": {"Prefix": f"{tag}/"},
                                                                      "Expiration": {"Days": 1}}]})
    assert life.get_bucket_lifecycle_configuration(Bucket="edgehaul-curated")["Rules"][0]["ID"] == "x"
    life.delete_bucket_lifecycle(Bucket="edgehaul-curated")
    denied(life.put_bucket_policy, Bucket="edgehaul-cold", Policy=json.dumps(ADMIN_DOC))
    denied(life.delete_bucket, Bucket="edgehaul-cold")
    # landing: the janitor reads and deletes (moves to cold), never writes
    engine.client("node-a").put_object(Bucket="edgehaul-landing", Key=f"node-a/{tag}/b.parquet", Body=b"b",
                                       IfNoneMatch="*")
    denied(life.put_object, Bucket="edgehaul-landing", Key=f"node-a/{tag}/b.parquet", Body=b"x")
    denied(life.put_object, Bucket="edgehaul-landing", Key=f"node-a/{tag}/new.parquet", Body=b"x", IfNoneMatch="*")
    assert body(life, "edgehaul-landing", f"node-a/{tag}/b.parquet") == b"b"
    life.delete_object(Bucket="edgehaul-landing", Key=f"node-a/{tag}/b.parquet")


def test_apply_store_lifecycle_runs_as_the_lifecycle_identity(engine: Engine) -> None:
    from edgehaul.blocks import RetentionPolicy
    from edgehaul.blocks.policies import RetentionRule
    from edgehaul.ops.lifecycle_config import apply_configuration

    policy = RetentionPolicy(rules=[RetentionRule(data_class="raw", cold_after_days=30, expire_after_days=365),
                                    RetentionRule(data_class="logs", cold_after_days=None, expire_after_days=14)])
    try:
        results = apply_configuration(engine.store("lifecycle"), policy, s3=engine.client("lifecycle"))
        assert {r.bucket for r in results} == {"edgehaul-landing", "edgehaul-curated", "edgehaul-ops"}
        # permissions only: how moto stores a rule is not AWS's word (round trips are tested on real servers)
        assert all(r.applied == r.emitted and r.read_back for r in results), results
    finally:
        for b in ("edgehaul-landing", "edgehaul-curated", "edgehaul-ops"):
            engine.client("admin").delete_bucket_lifecycle(Bucket=b)


def test_the_central_identity_runs_the_probe_and_reads_what_every_identity_wrote(engine: Engine) -> None:
    from edgehaul.ops import store_probe

    tag = uuid.uuid4().hex[:8]
    engine.client("node-a").put_object(Bucket="edgehaul-landing", Key=f"node-a/{tag}/b.parquet", Body=b"n")
    engine.client("ingest").put_object(Bucket="edgehaul-curated", Key=f"datasets/{tag}/p.parquet", Body=b"i")
    engine.client("trainer").put_object(Bucket="edgehaul-checkpoints", Key=f"models/{tag}/m.pt", Body=b"t")
    central = engine.client("admin")
    for bucket, key, want in (("edgehaul-landing", f"node-a/{tag}/b.parquet", b"n"),
                              ("edgehaul-curated", f"datasets/{tag}/p.parquet", b"i"),
                              ("edgehaul-checkpoints", f"models/{tag}/m.pt", b"t")):
        assert body(central, bucket, key) == want
    checks = store_probe.probe(engine.store("admin"), s3=central)
    assert checks and not [c for c in checks if "AccessDenied" in c.detail], [c for c in checks if c.present is None]
    store_probe.record(engine.store("admin"), checks, s3=central)
    assert store_probe.load(engine.store("admin"), s3=central) is not None


def test_only_central_identities_reach_the_central_results(engine: Engine) -> None:
    # cached results the core deserialises (prefect-results/core/): written by ingest, never by a node
    tag = uuid.uuid4().hex[:8]
    key = f"prefect-results/core/{tag}"
    ingest = engine.client("ingest")
    ingest.put_object(Bucket="edgehaul-ops", Key=key, Body=b"r")
    assert body(ingest, "edgehaul-ops", key) == b"r"
    for node in NODES:
        c = engine.client(node)
        denied(c.put_object, Bucket="edgehaul-ops", Key=key, Body=b"forged")
        denied(c.put_object, Bucket="edgehaul-ops", Key=f"prefect-results/{tag}", Body=b"forged")
        denied(c.get_object, Bucket="edgehaul-ops", Key=key)
    denied(engine.client("trainer").put_object, Bucket="edgehaul-ops", Key=key, Body=b"x")
    assert body(ingest, "edgehaul-ops", key) == b"r"


def test_a_node_reads_only_its_own_downlink_and_writes_none(engine: Engine) -> None:
    tag = uuid.uuid4().hex[:8]
    for node in NODES:
        engine.client("ingest").put_object(Bucket="edgehaul-ops", Key=f"downlink/{node}/{tag}.json", Body=b"u")
    a, b = (engine.client(n) for n in NODES[:2])
    assert body(a, "edgehaul-ops", f"downlink/{NODES[0]}/{tag}.json") == b"u"
    denied(a.get_object, Bucket="edgehaul-ops", Key=f"downlink/{NODES[1]}/{tag}.json")
    denied(a.put_object, Bucket="edgehaul-ops", Key=f"downlink/{NODES[0]}/{tag}.json", Body=b"forged")
    denied(b.delete_object, Bucket="edgehaul-ops", Key=f"downlink/{NODES[1]}/{tag}.json")
    assert body(b, "edgehaul-ops", f"downlink/{NODES[1]}/{tag}.json") == b"u"


# ---- what this engine cannot say (kept in tests/security/test_access.py) --------------------------------

def test_the_limits_of_the_engine_are_known(engine: Engine) -> None:
    """Each assertion here states a gap of moto's evaluator; when one fails, moto learned it: make the
    matching check a real one above and drop it from tests/security/test_access.py's evaluator."""
    tag = uuid.uuid4().hex[:8]
    admin, a = engine.client("admin"), engine.client("node-a")
    admin.put_object(Bucket="edgehaul-landing", Key=f"node-b/{tag}/theirs", Body=b"b")
    # ${aws:username} is not substituted: edge-node.json as written grants its user nothing
    denied(engine.client("node-v").put_object, Bucket="edgehaul-landing", Key=f"node-v/{tag}/x", Body=b"x")
    # conditions are not evaluated: s3:prefix does not confine ListBucket (AWS refuses both listings)
    theirs = a.list_objects_v2(Bucket="edgehaul-landing", Prefix=f"node-b/{tag}/")
    assert [o["Key"] for o in theirs["Contents"]] == [f"node-b/{tag}/theirs"]
    assert a.list_objects_v2(Bucket="edgehaul-landing")["KeyCount"] >= 1
    # HEAD of a missing key is 404 for an identity whose ListBucket does not apply (AWS: 403)
    with pytest.raises(ClientError) as e:
        a.head_object(Bucket="edgehaul-landing", Key=f"node-a/{tag}/missing")
    assert e.value.response["Error"]["Code"] == "404"
    # the source of a copy is not authorised: trainer (no s3:GetObject on landing) copies from it
    engine.client("trainer").copy_object(Bucket="edgehaul-checkpoints", Key=f"{tag}/copied",
                                         CopySource={"Bucket": "edgehaul-landing", "Key": f"node-b/{tag}/theirs"})


def test_the_engine_ignores_the_conditions_of_a_bucket_policy(engine: Engine) -> None:
    """infra/iam/landing-bucket-policy.json under moto: its Deny statements apply without their Condition
    (`aws:username`, `s3:if-none-match`), so it refuses every PUT and DELETE in landing, the node's
    create-only PUT and the janitor's DELETE included. Its semantics are therefore checked by
    tests/security/test_access.py's evaluator (`test_landing_is_write_once_in_the_aws_documents`); when this fails,
    moto learned conditions: test the policy here for real."""
    tag = uuid.uuid4().hex[:8]
    admin, a, life = engine.client("admin"), engine.client("node-a"), engine.client("lifecycle")
    a.put_object(Bucket="edgehaul-landing", Key=f"node-a/{tag}/b", Body=b"b", IfNoneMatch="*")
    admin.put_bucket_policy(Bucket="edgehaul-landing", Policy=(IAM / "landing-bucket-policy.json").read_text())
    try:
        denied(a.put_object, Bucket="edgehaul-landing", Key=f"node-a/{tag}/new", Body=b"n", IfNoneMatch="*")
        denied(life.delete_object, Bucket="edgehaul-landing", Key=f"node-a/{tag}/b")
    finally:
        admin.delete_bucket_policy(Bucket="edgehaul-landing")
    assert body(admin, "edgehaul-landing", f"node-a/{tag}/b") == b"b"
