"""Least privilege: the AWS IAM documents in infra/iam/ and the real identities of the local S3 server.

1. A tiny IAM evaluator (Allow/Deny, wildcards, `${aws:username}`, String(Not)Equals/Like, Null, Bool, and
   which request carries which condition key) proves the documents confine each role, and that they grant
   what the SeaweedFS identities of `edgehaul_dev.localstack.identities_config` plus the landing bucket
   policy grant, S3 action by S3 action (the two must not drift apart). tests/security/test_iam_policies.py runs the
   same documents under moto's AWS policy engine; this evaluator keeps what moto does not evaluate: policy
   variables and conditions.
2. Real requests against the session's SeaweedFS with each identity's own keys.
3. Last: no configured secret appears in the stack's logs or in the session's Prefect artifacts/logs.
"""

from __future__ import annotations

import fnmatch
import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError
from hypothesis import given
from hypothesis import strategies as st

from edgehaul_dev import localstack
from tests.conftest import store_for

IAM = Path(__file__).resolve().parents[2] / "infra" / "iam"
ROLE_DOC = {**{r: r for r in localstack.ROLES if r != "admin"}, "node-a": "edge-node", "node-b": "edge-node"}


def load_policy(role: str) -> dict[str, Any]:
    return json.loads((IAM / f"{ROLE_DOC[role]}.json").read_text())


def _subst(pattern: str, ctx: dict[str, str]) -> str | None:
    missing = False

    def rep(m: re.Match[str]) -> str:
        nonlocal missing
        if m.group(1) not in ctx:
            missing = True
            return ""
        return ctx[m.group(1)]

    out = re.sub(r"\$\{([^}]+)\}", rep, pattern)
    return None if missing else out


def _list(v: str | list[str]) -> list[str]:
    return [v] if isinstance(v, str) else v


def _matches(st_: dict[str, Any], action: str, resource: str, ctx: dict[str, str]) -> bool:
    if not any(fnmatch.fnmatchcase(action.lower(), a.lower()) for a in _list(st_["Action"])):
        return False
    resources = [_subst(r, ctx) for r in _list(st_["Resource"])]
    if not any(r is not None and fnmatch.fnmatchcase(resource, r) for r in resources):
        return False
    for op, conds in st_.get("Condition", {}).items():
        for key, want in conds.items():
            if op not in ("StringLike", "StringEquals"):
                if not _condition_holds(op, ctx.get(key), [str(w) for w in _list(want)]):
                    return False
                continue
            have = ctx.get(key)
            pats = [p for p in (_subst(w, ctx) for w in _list(want)) if p is not None]
            if have is None or not pats:
                return False
            if op == "StringLike" and not any(fnmatch.fnmatchcase(have, p) for p in pats):
                return False
            if op == "StringEquals" and have not in pats:
                return False
            if op not in ("StringLike", "StringEquals"):
                raise AssertionError(f"evaluator does not know condition operator {op}")
    return True


def _condition_holds(op: str, have: str | None, want: list[str]) -> bool:
    """AWS semantics for the operators the documents use; a negated operator holds when the key is absent."""
    if op == "Null":
        return (have is None) == (want == ["true"])
    if have is None:
        return op.startswith("StringNot")
    if op == "StringNotEquals":
        return have not in want
    if op == "StringNotLike":
        return not any(fnmatch.fnmatchcase(have, p) for p in want)
    if op == "Bool":
        return have.lower() in [w.lower() for w in want]
    raise AssertionError(f"evaluator does not know condition operator {op}")


# Request condition keys and the only actions whose requests carry them (AWS Service Authorization
# Reference for S3): a condition on a key the request lacks does not match, e.g. s3:prefix on
# ListBucketMultipartUploads, which another S3 server duly refused.
REQUEST_KEYS = {"s3:prefix": {"s3:listbucket", "s3:listbucketversions"},
                "s3:if-none-match": {"s3:putobject"}, "s3:ObjectCreationOperation": {"s3:putobject"}}


def allowed(policy: dict[str, Any], action: str, resource: str, ctx: dict[str, str] | None = None) -> bool:
    """IAM evaluation for one identity policy: explicit Deny wins, otherwise any Allow, else implicit deny."""
    ctx = {k: v for k, v in (ctx or {}).items() if action.lower() in REQUEST_KEYS.get(k, {action.lower()})}
    hits = [s["Effect"] for s in policy["Statement"] if _matches(s, action, resource, ctx)]
    return "Allow" in hits and "Deny" not in hits


def obj(bucket: str, key: str) -> str:
    return f"arn:aws:s3:::{bucket}/{key}"


@pytest.mark.parametrize("name", sorted(p.name for p in IAM.glob("*.json")))
def test_iam_documents_are_well_formed_and_scoped(name: str) -> None:
    doc = json.loads((IAM / name).read_text())
    assert doc["Version"] == "2012-10-17" and doc["Statement"]
    for s in doc["Statement"]:
        assert s["Effect"] in ("Allow", "Deny") and s.get("Sid")
        assert all(a.startswith("s3:") and "*" not in a for a in _list(s["Action"])), s["Action"]
        for r in _list(s["Resource"]):
            # every resource names one of our buckets: never "*" or another account's data
            assert re.fullmatch(r"arn:aws:s3:::edgehaul-[a-z]+(/.+)?", r), r
        assert "NotAction" not in s and "NotResource" not in s


def test_node_policy_cannot_write_another_nodes_prefix() -> None:
    p = load_policy("node-a")
    a = {"aws:username": "node-a"}
    assert allowed(p, "s3:PutObject", obj("edgehaul-landing", "node-a/2026-12-03/b.parquet"), a)
    assert allowed(p, "s3:ListBucket", "arn:aws:s3:::edgehaul-landing", {**a, "s3:prefix": "node-a/2026"})
    assert not allowed(p, "s3:PutObject", obj("edgehaul-landing", "node-b/2026-12-03/b.parquet"), a)
    assert not allowed(p, "s3:ListBucket", "arn:aws:s3:::edgehaul-landing", {**a, "s3:prefix": "node-b/"})
    assert not allowed(p, "s3:ListBucket", "arn:aws:s3:::edgehaul-landing", a)  # no prefix: whole bucket
    assert not allowed(p, "s3:GetObject", obj("edgehaul-curated", "datasets/landsat_patch/part-0.parquet"), a)
    assert not allowed(p, "s3:DeleteObject", obj("edgehaul-landing", "node-a/x"), a)
    # abort_orphans lists its unfinished uploads with Prefix=node-a/, but that request has no s3:prefix key
    landing = "arn:aws:s3:::edgehaul-landing"
    assert allowed(p, "s3:ListBucketMultipartUploads", landing, {**a, "s3:prefix": "node-a/"})
    assert not allowed(p, "s3:AbortMultipartUpload", obj("edgehaul-landing", "node-b/x.parquet"), a)
    assert not allowed(p, "s3:ListMultipartUploadParts", obj("edgehaul-landing", "node-b/x.parquet"), a)
    assert allowed(p, "s3:ListMultipartUploadParts", obj("edgehaul-landing", "node-a/x.parquet"), a)
    # without a principal name the variable does not resolve and nothing is granted
    assert not allowed(p, "s3:PutObject", obj("edgehaul-landing", "node-a/x"))


@given(
    writer=st.from_regex(r"node-[a-z0-9]{1,6}", fullmatch=True),
    owner=st.from_regex(r"node-[a-z0-9]{1,6}", fullmatch=True),
    rest=st.from_regex(r"[a-z0-9/._-]{1,30}", fullmatch=True),
)
def test_a_node_writes_exactly_its_own_prefix(writer: str, owner: str, rest: str) -> None:
    p = load_policy("node-a")
    ok = allowed(p, "s3:PutObject", obj("edgehaul-landing", f"{owner}/{rest}"), {"aws:username": writer})
    assert ok == (writer == owner)


def test_role_policies_follow_the_zones() -> None:
    ingest, trainer, life = load_policy("ingest"), load_policy("trainer"), load_policy("lifecycle")
    assert allowed(ingest, "s3:GetObject", obj("edgehaul-landing", "node-a/x.parquet"))
    assert allowed(ingest, "s3:PutObject", obj("edgehaul-curated", "datasets/landsat_patch/_delta_log/1.json"))
    assert allowed(ingest, "s3:PutObject", obj("edgehaul-curated", "quarantine/node-a/b.parquet"))
    assert not allowed(ingest, "s3:PutObject", obj("edgehaul-checkpoints", "run/1/model.pt"))
    assert not allowed(ingest, "s3:PutObject", obj("edgehaul-landing", "node-a/forged.parquet"))
    assert allowed(trainer, "s3:GetObject", obj("edgehaul-curated", "datasets/x"))
    assert not allowed(trainer, "s3:PutObject", obj("edgehaul-curated", "datasets/x"))
    assert allowed(trainer, "s3:PutObject", obj("edgehaul-checkpoints", "models/m/1/model.pt"))
    assert not allowed(trainer, "s3:GetObject", obj("edgehaul-landing", "node-a/x"))
    for src, dst in (("edgehaul-curated", "edgehaul-cold"), ("edgehaul-cold", "edgehaul-curated")):
        assert allowed(life, "s3:GetObject", obj(src, "k")) and allowed(life, "s3:PutObject", obj(dst, "k"))
        assert allowed(life, "s3:DeleteObject", obj(src, "k"))
    assert not allowed(trainer, "s3:GetObject", obj("edgehaul-ops", "ledger"))
    # publish_model runs as trainer and gates on the probe's record (a 403 there reads as "never probed")
    assert allowed(trainer, "s3:GetObject", obj("edgehaul-ops", "capabilities/store.json"))
    assert not allowed(trainer, "s3:PutObject", obj("edgehaul-ops", "capabilities/store.json"))


LANDING_POLICY = json.loads((IAM / "landing-bucket-policy.json").read_text())


def denied_by(bucket_policy: dict[str, Any], action: str, resource: str, ctx: dict[str, str]) -> bool:
    """Whether a bucket policy's explicit Deny applies to the request (its Allows are not used)."""
    ctx = {k: v for k, v in ctx.items() if action.lower() in REQUEST_KEYS.get(k, {action.lower()})}
    return any(s["Effect"] == "Deny" and _matches(s, action, resource, ctx) for s in bucket_policy["Statement"])


def aws_allows(role: str, action: str, bucket: str, key: str, ctx: dict[str, str]) -> bool:
    """The role's identity policy, then the landing bucket policy's Deny statements."""
    r = obj(bucket, key)
    return allowed(load_policy(role), action, r, ctx) and not (
        bucket == "edgehaul-landing" and denied_by(LANDING_POLICY, action, r, ctx))


def _seaweed_grants(role: str, verb: str, bucket: str, key: str) -> bool:
    cfg = localstack.identities_config(
        {r: localstack.Credentials("k", "s") for r in [*localstack.ROLES, "node-a", "node-b"]}, ["node-a", "node-b"]
    )
    actions = next(i["actions"] for i in cfg["identities"] if i["name"] == role)  # type: ignore[index]
    for a in actions:
        v, _, target = a.partition(":")
        if v != verb:
            continue
        if target == bucket or (target.endswith("/*") and f"{bucket}/{key}".startswith(target[:-1])):
            return True
    return False


# S3 action -> the SeaweedFS identity action that grants it (its Write grants PUT and DELETE alike)
SEAWEED_VERB = {"s3:GetObject": "Read", "s3:PutObject": "Write", "s3:DeleteObject": "Write",
                "s3:PutObjectTagging": "Tagging"}


def seaweed_allows(role: str, action: str, bucket: str, key: str, ctx: dict[str, str]) -> bool:
    """The local identity's grant, then the landing bucket policy as the local stack installs it."""
    return _seaweed_grants(role, SEAWEED_VERB[action], bucket, key) and not (
        bucket == "edgehaul-landing" and denied_by(localstack.landing_bucket_policy(), action, obj(bucket, key), ctx))


# requests compared: a create as the product sends it (If-None-Match: *) and a plain PUT over an object
REQUESTS = (("get", "s3:GetObject", {}),
            ("create", "s3:PutObject", {"s3:if-none-match": "*", "s3:ObjectCreationOperation": "true"}),
            ("overwrite", "s3:PutObject", {"s3:ObjectCreationOperation": "true"}),
            ("delete", "s3:DeleteObject", {}),
            ("tag", "s3:PutObjectTagging", {}))
KEYS = ("node-a/2026-12-03/b.parquet", "node-b/b.parquet", "datasets/k/part.parquet", "prefect-results/r",
        "capabilities/store.json", "downlink/node-a/update.json", "downlink/node-b/update.json")
# The one difference, on purpose: SeaweedFS 4.48 sets no `s3:if-none-match` condition key, so it cannot
# refuse a node's plain PUT over its own landed object; AWS does (LandingIsCreateOnly). The core detects
# such a rewrite (tests/security/test_attacks_core.py::test_a_landed_bundle_rewritten_by_its_node_is_never_taken_twice).
KNOWN_GAPS = {("node-a", "overwrite", "edgehaul-landing", "node-a/2026-12-03/b.parquet")}


@pytest.mark.parametrize("role", [*(r for r in localstack.ROLES if r != "admin"), "node-a"])
def test_iam_documents_mirror_the_local_identities(role: str) -> None:
    """Action by action (GET, create, overwrite, DELETE, tagging): main compared "Read" and "Write" (PUT or
    DELETE), so ingest's landing Write and a node's DELETE drifted unseen."""
    drift, gaps = [], set()
    for bucket in localstack.BUCKETS:
        for key in KEYS:
            for name, action, extra in REQUESTS:
                ctx = {"aws:username": role, **extra}
                aws, local = aws_allows(role, action, bucket, key, ctx), seaweed_allows(role, action, bucket, key, ctx)
                if aws == local:
                    continue
                if (role, name, bucket, key) in KNOWN_GAPS and local:
                    gaps.add((role, name, bucket, key))
                else:
                    drift.append(f"{name} ({action}) s3://{bucket}/{key}: {'AWS only' if aws else 'local only'}")
    assert not drift, f"{role}: infra/iam and the local stack differ:\n" + "\n".join(drift)
    assert gaps == {g for g in KNOWN_GAPS if g[0] == role}  # a fixed gap fails here: drop it from KNOWN_GAPS


def test_landing_is_write_once_in_the_aws_documents() -> None:
    landing = "edgehaul-landing"
    create = {"s3:if-none-match": "*", "s3:ObjectCreationOperation": "true"}
    for node in ("node-a", "node-b"):
        own = f"{node}/2026-12-03/b.parquet"
        assert aws_allows(node, "s3:PutObject", landing, own, {"aws:username": node, **create})
        # a plain PUT (an overwrite) and a DELETE of its own landed object are refused
        assert not aws_allows(node, "s3:PutObject", landing, own, {"aws:username": node,
                                                                     "s3:ObjectCreationOperation": "true"})
        assert not aws_allows(node, "s3:DeleteObject", landing, own, {"aws:username": node})
        # multipart: CreateMultipartUpload and UploadPart carry no If-None-Match (ObjectCreationOperation false)
        assert aws_allows(node, "s3:PutObject", landing, own, {"aws:username": node,
                                                                "s3:ObjectCreationOperation": "false"})
    for role in ("ingest", "trainer", "lifecycle"):
        for action, extra in (("s3:PutObject", create), ("s3:DeleteObject", {}), ("s3:PutObjectTagging", {})):
            ok = aws_allows(role, action, landing, "node-a/2026-12-03/b.parquet", {"aws:username": role, **extra})
            assert ok == (role == "lifecycle" and action == "s3:DeleteObject"), (role, action)
    # the janitor's delete is allowed by the bucket policy only for its own name
    assert not denied_by(LANDING_POLICY, "s3:DeleteObject", obj(landing, "node-a/x"), {"aws:username": "lifecycle"})
    assert denied_by(LANDING_POLICY, "s3:DeleteObject", obj(landing, "node-a/x"), {"aws:username": "lifecyclex"})


@given(
    user=st.from_regex(r"node-[a-z0-9]{1,6}", fullmatch=True),
    owner=st.from_regex(r"node-[a-z0-9]{1,6}", fullmatch=True),
    conditional=st.booleans(),
    action=st.sampled_from(("s3:PutObject", "s3:DeleteObject")),
)
def test_a_node_only_ever_creates_in_its_own_landing_prefix(user: str, owner: str, conditional: bool,
                                                            action: str) -> None:
    """edge-node.json + the landing bucket policy on AWS: a PUT lands only create-only and only under the
    node's own prefix; a DELETE never does."""
    doc = json.loads((IAM / "edge-node.json").read_text())
    ctx = {"aws:username": user, "s3:ObjectCreationOperation": "true", **({"s3:if-none-match": "*"} if conditional else {})}
    r = obj("edgehaul-landing", f"{owner}/2026-12-03/b.parquet")
    ok = allowed(doc, action, r, ctx) and not denied_by(LANDING_POLICY, action, r, ctx)
    assert ok == (action == "s3:PutObject" and conditional and user == owner)


# ---- real requests against the local S3 server -------------------------------------------------

def _denied(call: Any, **kw: Any) -> None:
    with pytest.raises(ClientError) as e:
        call(**kw)
    assert e.value.response["Error"]["Code"] in ("AccessDenied", "403"), e.value.response["Error"]


@pytest.mark.integration
def test_real_node_identity_is_confined(stack: localstack.StackState) -> None:
    tag = uuid.uuid4().hex[:8]
    admin = store_for(stack).client()
    admin.put_object(Bucket="edgehaul-landing", Key=f"node-b/{tag}/theirs", Body=b"b")
    admin.put_object(Bucket="edgehaul-curated", Key=f"datasets/{tag}/part", Body=b"c")
    node = store_for(stack, "node-a").client()
    node.put_object(Bucket="edgehaul-landing", Key=f"node-a/{tag}/mine", Body=b"a")
    assert node.get_object(Bucket="edgehaul-landing", Key=f"node-a/{tag}/mine")["Body"].read() == b"a"
    _denied(node.put_object, Bucket="edgehaul-landing", Key=f"node-b/{tag}/forged", Body=b"x")
    _denied(node.get_object, Bucket="edgehaul-landing", Key=f"node-b/{tag}/theirs")
    _denied(node.get_object, Bucket="edgehaul-curated", Key=f"datasets/{tag}/part")
    _denied(node.put_object, Bucket="edgehaul-checkpoints", Key=f"{tag}/x", Body=b"x")
    _denied(node.delete_object, Bucket="edgehaul-landing", Key=f"node-b/{tag}/theirs")
    assert admin.get_object(Bucket="edgehaul-landing", Key=f"node-b/{tag}/theirs")["Body"].read() == b"b"


@pytest.mark.integration
def test_real_ingest_trainer_and_lifecycle_identities(stack: localstack.StackState) -> None:
    tag = uuid.uuid4().hex[:8]
    store_for(stack, "node-a").client().put_object(Bucket="edgehaul-landing", Key=f"node-a/{tag}/b", Body=b"bundle")
    ingest = store_for(stack, "ingest").client()
    assert ingest.get_object(Bucket="edgehaul-landing", Key=f"node-a/{tag}/b")["Body"].read() == b"bundle"
    ingest.put_object(Bucket="edgehaul-curated", Key=f"datasets/{tag}/part", Body=b"rows")
    _denied(ingest.put_object, Bucket="edgehaul-checkpoints", Key=f"{tag}/ckpt", Body=b"x")

    trainer = store_for(stack, "trainer").client()
    assert trainer.get_object(Bucket="edgehaul-curated", Key=f"datasets/{tag}/part")["Body"].read() == b"rows"
    trainer.put_object(Bucket="edgehaul-checkpoints", Key=f"{tag}/1/model.pt", Body=b"w")
    _denied(ingest.get_object, Bucket="edgehaul-checkpoints", Key=f"{tag}/1/model.pt")  # exists, not readable
    _denied(trainer.put_object, Bucket="edgehaul-curated", Key=f"datasets/{tag}/evil", Body=b"x")
    _denied(trainer.get_object, Bucket="edgehaul-landing", Key=f"node-a/{tag}/b")

    life = store_for(stack, "lifecycle").client()
    life.copy_object(
        Bucket="edgehaul-cold", Key=f"{tag}/part", CopySource={"Bucket": "edgehaul-curated", "Key": f"datasets/{tag}/part"}
    )
    life.delete_object(Bucket="edgehaul-curated", Key=f"datasets/{tag}/part")
    assert life.get_object(Bucket="edgehaul-cold", Key=f"{tag}/part")["Body"].read() == b"rows"
    with pytest.raises(ClientError) as gone:  # moved: no longer in the hot tier
        trainer.get_object(Bucket="edgehaul-curated", Key=f"datasets/{tag}/part")
    assert gone.value.response["Error"]["Code"] == "NoSuchKey"
    _denied(trainer.get_object, Bucket="edgehaul-ops", Key="_health/ping")


@pytest.mark.integration
def test_a_node_cannot_delete_or_conditionally_overwrite_its_landed_bundle(stack: localstack.StackState) -> None:
    """main: node-a deleted its own landed bundle (its SeaweedFS Write grants DELETE)."""
    landing, tag = "edgehaul-landing", uuid.uuid4().hex[:8]
    key = f"node-a/2026-12-03/{tag}.parquet"
    admin, node = store_for(stack).client(), store_for(stack, "node-a").client()
    node.put_object(Bucket=landing, Key=key, Body=b"landed", IfNoneMatch="*")  # as the uplink lands it
    with pytest.raises(ClientError) as again:
        node.put_object(Bucket=landing, Key=key, Body=b"forged", IfNoneMatch="*")
    assert again.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    _denied(node.delete_object, Bucket=landing, Key=key)
    multi = node.delete_objects(Bucket=landing, Delete={"Objects": [{"Key": key}]})
    assert not multi.get("Deleted") and [e["Code"] for e in multi["Errors"]] == ["AccessDenied"]
    assert admin.get_object(Bucket=landing, Key=key)["Body"].read() == b"landed"
    # a completed multipart upload is create-only too; the node still aborts its own unfinished uploads
    up = node.create_multipart_upload(Bucket=landing, Key=key)["UploadId"]
    part = node.upload_part(Bucket=landing, Key=key, UploadId=up, PartNumber=1, Body=b"forged")
    with pytest.raises(ClientError) as mpu:
        node.complete_multipart_upload(Bucket=landing, Key=key, UploadId=up, IfNoneMatch="*",
                                       MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})
    assert mpu.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    node.abort_multipart_upload(Bucket=landing, Key=key, UploadId=up)
    assert admin.get_object(Bucket=landing, Key=key)["Body"].read() == b"landed"
    # What SeaweedFS 4.48 cannot refuse (no s3:if-none-match condition key, see KNOWN_GAPS): a plain PUT
    # over it. Asserted so that the day it refuses, this fails and the gap is dropped.
    node.put_object(Bucket=landing, Key=key, Body=b"rewritten")
    assert admin.get_object(Bucket=landing, Key=key)["Body"].read() == b"rewritten"


@pytest.mark.integration
def test_no_central_identity_writes_or_deletes_landing(stack: localstack.StackState) -> None:
    """main: the ingest identity could write and delete anywhere in landing, and lifecycle could write."""
    landing, tag = "edgehaul-landing", uuid.uuid4().hex[:8]
    key = f"node-a/2026-12-03/{tag}.parquet"
    store_for(stack, "node-a").client().put_object(Bucket=landing, Key=key, Body=b"landed", IfNoneMatch="*")
    for role in ("ingest", "trainer", "lifecycle"):
        c = store_for(stack, role).client()
        _denied(c.put_object, Bucket=landing, Key=f"node-a/2026-12-03/{tag}-{role}.parquet", Body=b"x", IfNoneMatch="*")
        _denied(c.put_object, Bucket=landing, Key=key, Body=b"x")
        if role != "lifecycle":
            _denied(c.delete_object, Bucket=landing, Key=key)
    ingest = store_for(stack, "ingest").client()
    assert ingest.get_object(Bucket=landing, Key=key)["Body"].read() == b"landed"
    _denied(ingest.copy_object, Bucket=landing, Key=key, CopySource={"Bucket": landing, "Key": key},
            MetadataDirective="REPLACE", Metadata={"forged": "1"})
    # the janitor deletes (lifecycle_moves moves landing to cold), nothing else does
    life = store_for(stack, "lifecycle").client()
    life.delete_object(Bucket=landing, Key=key)
    with pytest.raises(ClientError) as gone:
        ingest.get_object(Bucket=landing, Key=key)
    assert gone.value.response["Error"]["Code"] == "NoSuchKey"


@pytest.mark.integration
def test_the_store_probe_says_which_landing_write_once_the_store_enforces(stack: localstack.StackState) -> None:
    from edgehaul.ops import store_probe

    node_a = store_for(stack, "node-a")
    checks = store_probe.probe_landing(node_a, "node-a")
    found = {c.feature: c for c in checks}
    assert found["landing-no-delete"].present is True and "AccessDenied" in found["landing-no-delete"].detail
    assert found["landing-no-overwrite"].present is False  # SeaweedFS 4.48, see KNOWN_GAPS
    assert store_probe.landing_verdict(checks).startswith("landing write-once: not enforced (no-overwrite)")
    # tried outside its own prefix, nothing can be said: named, not guessed
    elsewhere = store_probe.probe_landing(node_a, "node-b")
    assert all(c.present is None and "403" in c.detail for c in elsewhere)


@pytest.mark.integration
def test_rotate_key_command_switches_keys_and_keeps_the_spool(tmp_path: Path) -> None:
    """`infra/local/rotate_key.sh node-a` on a separately started S3 server (not the session's)."""
    import subprocess

    import boto3

    from edgehaul_dev.credentials import spool_digest
    from tests.builders import bundle

    root = tmp_path / "stack"
    root.mkdir()
    state = localstack.new_state(root, fixed_ports=False)
    state.save()
    spool = tmp_path / "spool"
    (spool / "queue").mkdir(parents=True)
    for i in range(3):
        data, manifest = bundle(20, "node-a", seed=i, start_seq=i * 20)
        (spool / "queue" / f"{manifest.bundle_id}.parquet").write_bytes(data)
        (spool / "queue" / f"{manifest.bundle_id}.manifest.json").write_bytes(manifest.to_json())
    before = spool_digest(spool)
    try:
        localstack.start_s3(state)
        old = state.identities["node-a"]

        def client(c: localstack.Credentials) -> Any:
            return boto3.client("s3", endpoint_url=state.s3_endpoint, region_name="us-east-1",
                                aws_access_key_id=c.access_key_id, aws_secret_access_key=c.secret_access_key)

        client(old).put_object(Bucket="edgehaul-landing", Key="node-a/before", Body=b"1")
        script = Path(__file__).resolve().parents[2] / "infra" / "local" / "rotate_key.sh"
        res = subprocess.run([str(script), "node-a", "--root", str(root), "--spool", str(spool)],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        new = localstack.StackState.load(root).identities["node-a"]  # type: ignore[union-attr]
        assert new.access_key_id != old.access_key_id and new.access_key_id in res.stdout
        assert new.secret_access_key not in res.stdout + res.stderr
        assert "spool untouched (6 files queued)" in res.stdout
        with pytest.raises(ClientError) as e:
            client(old).put_object(Bucket="edgehaul-landing", Key="node-a/after-old", Body=b"1")
        assert e.value.response["Error"]["Code"] == "InvalidAccessKeyId"
        # the queued bundles are intact and go up with the new key; the new key is as confined as the old
        assert spool_digest(spool) == before and len(before) == 6
        for name in sorted(before):
            client(new).put_object(Bucket="edgehaul-landing", Key=f"node-a/{name}", Body=(spool / name).read_bytes())
        _denied(client(new).put_object, Bucket="edgehaul-landing", Key="node-b/x", Body=b"x")
        other = state.identities["node-b"]
        client(other).put_object(Bucket="edgehaul-landing", Key="node-b/still-works", Body=b"1")
        assert (root / "seaweedfs" / "s3.json").stat().st_mode & 0o077 == 0
        bad = subprocess.run([str(script), "node-z", "--root", str(root)], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "unknown identity 'node-z'" in bad.stderr
    finally:
        localstack.down(root)


# ---- last in the file: no secret leaked into logs or artifacts so far --------------------------

def _secrets(stack: localstack.StackState) -> list[str]:
    out = [c.secret_access_key for c in stack.identities.values()]
    if stack.api_auth_string:
        out.append(stack.api_auth_string.partition(":")[2])
    return out


@pytest.mark.integration
def test_no_configured_secret_in_stack_logs_or_prefect_artifacts(stack: localstack.StackState) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import LogSort

    secrets_ = _secrets(stack)
    assert len(secrets_) >= 6 and all(len(s) >= 20 for s in secrets_)
    root = Path(stack.root)
    logs = [p for p in root.rglob("*") if p.is_file() and (p.suffix == ".log" or "logs" in p.parts)]
    assert any(p.name == "prefect.log" for p in logs) and any("seaweedfs" in p.parts for p in logs)
    texts = {str(p): p.read_text(errors="replace") for p in logs}
    with get_client(sync_client=True) as client:
        for a in client.read_artifacts(limit=200):
            texts[f"artifact {a.key or a.id}"] = json.dumps(a.model_dump(mode="json"))
        texts["prefect logs"] = "\n".join(
            log.message for log in client.read_logs(limit=200, sort=LogSort.TIMESTAMP_DESC)
        )
        texts["flow runs"] = "\n".join(
            json.dumps(r.parameters, default=str) for r in client.read_flow_runs(limit=200)
        )
    assert sum(len(t) for t in texts.values()) > 0
    leaks = [(where, s[:4] + "...") for where, t in texts.items() for s in secrets_ if s in t]
    assert not leaks, f"secret keys found in: {leaks}"
