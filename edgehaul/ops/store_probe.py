"""Capability probe: test an S3 endpoint for every feature the product uses, and record what it found.

`probe(store)` runs small, self-cleaning experiments under `<ops prefix>/_probe/<uuid>/` in the ops
bucket (and the cold bucket for storage classes) and returns one `Check` per feature: how the product
uses it, whether the server has it, and what the product does when it does not. `record(store, checks)`
writes them to `<ops prefix>/capabilities/store.json`; flows read that record (`load`, `require`,
`missing_classes`) instead of guessing, and refuse with a message naming the missing feature.

`main(argv)` is the command line (`python -m edgehaul.ops.store_probe <ObjectStore block> [--no-record]`,
or `--endpoint URL` with AWS_* keys from the environment), meant to become `edgehaul store check <block>`.

A server's answer to a bad request is trusted only when it refuses: a 200 to a wrong checksum proves
the server ignores it, a 400 BadDigest proves it checks it. Nothing is inferred from the server's name.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import sys
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

from edgehaul.ops.storage_classes import CLASSES
from edgehaul.platform import s3compat

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from edgehaul.blocks.object_store import ObjectStore
    from edgehaul.blocks.policies import RetentionPolicy

RECORD_PATH = "capabilities/store.json"


class StoreCapabilityError(RuntimeError):
    """The store lacks a feature a flow needs; the message names the feature and what to do."""


@dataclass
class Check:
    feature: str
    present: bool | None  # None: could not be tested (denied, or not applicable)
    detail: str  # what the server answered
    used_for: str  # how the product uses it
    instead: str  # what the product does without it ("refuses: ..." when it cannot work)


# feature -> (how the product uses it, what it does without it)
FEATURES: dict[str, tuple[str, str]] = {
    "put-if-none-match": ("Delta commits, dataset claims, lineage.json, checkpoint COMMIT, manifests",
                          "refuses: no safe commit without create-if-absent"),
    "put-if-match-quoted": ("claim takeover, model pointer swap (If-Match as S3 returns the ETag)",
                            "uses the unquoted form (tried second, remembered per endpoint)"),
    "put-if-match-unquoted": ("claim takeover, model pointer swap (ETag without quotes)",
                              "uses the quoted form"),
    "mpu-complete-if-none-match": ("uplink: a duplicate sender does not complete a second time",
                                   "harmless: bundle keys are content-addressed, the rewrite has the same bytes"),
    "checksum-sha256-enforced": ("uplink proof 'server-sha256' when the ETag is not an MD5",
                                 "proof by ETag MD5, else read-back hash (metered)"),
    "content-md5-enforced": ("uplink: a corrupted PUT/part is refused at once (BadDigest) and re-sent",
                             "ETag comparison catches it after the write; object deleted and re-sent"),
    "etag-is-md5": ("uplink proof 'etag-md5' (single PUT), lifecycle copy verification",
                    "read-back hash of each bundle (metered); copies verified by re-reading the source ETag"),
    "etag-multipart-md5": ("uplink proof 'etag-multipart' (md5 of part MD5s + -N)", "read-back hash (metered)"),
    "copy-source-if-match": ("lifecycle moves copy exactly the planned version",
                             "copy verified afterwards (copy ETag or source ETag), a changed source's copy deleted"),
    "head-missing-404": ("uplink's HEAD before sending; lifecycle's HEAD of sources",
                         "403 treated as absent (the write is conditional); lifecycle asks the listing"),
    "lifecycle-expiration-rules": ("apply_store_lifecycle: server-side expiry", "the mover expires objects itself"),
    "lifecycle-size-filter": ("lifecycle rules skip objects below 128 KiB",
                              "a changed rule is withdrawn and `lifecycle_moves` fails, naming it"),
    "lifecycle-transition-rules": ("apply_store_lifecycle: server-side transitions",
                                   "the mover (lifecycle_moves) transitions objects itself"),
}
for _c in CLASSES:
    if _c != "STANDARD":
        FEATURES[f"storage-class {_c}"] = (f"lifecycle moves to {_c}",
                                           "refuses a retention policy that names it (class named)")
NEEDED = ("put-if-none-match",)  # without these no flow can run safely


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _fails(call: Callable[[], Any], *codes: str) -> tuple[bool | None, str]:
    """(True, code) if the call was refused with one of `codes` (or 412 / 400 by status), (False, "accepted")
    if it went through, (None, error) for any other refusal (denied, not implemented)."""
    try:
        call()
    except ClientError as e:
        code, status = s3compat.code(e), s3compat.status(e)
        if code in codes or (("412" in codes and status == 412) or ("400" in codes and status == 400)):
            return True, f"{status} {code}"
        return None, f"{status} {code}: {e.response.get('Error', {}).get('Message', '')}"[:160]
    return False, "accepted"


def probe(store: ObjectStore, *, classes: bool = True, lifecycle: bool = True,
          s3: S3Client | None = None) -> list[Check]:
    """Test every feature on `store`'s endpoint; every object it writes is deleted again."""
    s3 = s3 or store.client(retries={"total_max_attempts": 1, "mode": "standard"})
    bucket = store.bucket("ops")
    base = store.key("ops", f"_probe/{uuid.uuid4().hex[:12]}/")
    made: list[tuple[str, str]] = []
    out: dict[str, tuple[bool | None, str]] = {}
    body = b"edgehaul capability probe\n" * 64
    md5 = hashlib.md5(body).digest()

    def put(key: str, **kw: Any) -> dict[str, Any]:
        made.append((bucket, base + key))
        return dict(s3.put_object(Bucket=bucket, Key=base + key, Body=kw.pop("Body", body), **kw))

    try:
        first = put("a")
        etag = s3compat.unquoted(first.get("ETag"))
        out["etag-is-md5"] = (etag == md5.hex(), f"ETag {etag[:12]}... {'=' if etag == md5.hex() else '!='} MD5")
        ok, why = _fails(lambda: put("a", IfNoneMatch="*"), "PreconditionFailed", "412")
        out["put-if-none-match"] = (ok, why)
        for f in s3compat.FORMS:
            e = first.get("ETag", "")
            try:
                put("a", IfMatch=s3compat.form(e, f))
                held, why = True, "unchanged object: 200"
                def wrong(f: s3compat.EtagForm = f) -> Any:
                    return put("a", IfMatch=s3compat.form("0" * 32, f))

                refused, rwhy = _fails(wrong, "PreconditionFailed", "412")
                held = bool(refused)
                why += f"; wrong ETag: {rwhy}"
            except ClientError as err:
                held, why = False, f"unchanged object: {s3compat.status(err)} {s3compat.code(err)}"
            out[f"put-if-match-{f}"] = (held, why)
        wrong_sha = _b64(hashlib.sha256(b"not the body").digest())
        ok, why = _fails(lambda: put("b", ChecksumSHA256=wrong_sha), "BadDigest", "InvalidDigest",
                         "XAmzContentSHA256Mismatch", "400")
        out["checksum-sha256-enforced"] = (ok, why)
        ok, why = _fails(lambda: put("c", ContentMD5=_b64(hashlib.md5(b"not the body").digest())), "BadDigest",
                         "InvalidDigest", "400")
        out["content-md5-enforced"] = (ok, why)
        # multipart: one (last, so small) part; ETag and a conditional complete over an existing key
        made.append((bucket, base + "a"))
        up = s3.create_multipart_upload(Bucket=bucket, Key=base + "a")
        try:
            part = s3.upload_part(Bucket=bucket, Key=base + "a", UploadId=up["UploadId"], PartNumber=1, Body=body)
            parts = {"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]}
            ok, why = _fails(lambda: s3.complete_multipart_upload(
                Bucket=bucket, Key=base + "a", UploadId=up["UploadId"], MultipartUpload=parts,
                IfNoneMatch="*"), "PreconditionFailed", "412")
            out["mpu-complete-if-none-match"] = (ok, why)
            if not ok:  # it completed: its ETag is the multipart one
                got = s3compat.unquoted(s3.head_object(Bucket=bucket, Key=base + "a").get("ETag"))
            else:
                up2 = s3.create_multipart_upload(Bucket=bucket, Key=base + "m")
                made.append((bucket, base + "m"))
                p2 = s3.upload_part(Bucket=bucket, Key=base + "m", UploadId=up2["UploadId"], PartNumber=1, Body=body)
                got = s3compat.unquoted(s3.complete_multipart_upload(
                    Bucket=bucket, Key=base + "m", UploadId=up2["UploadId"],
                    MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": p2["ETag"]}]}).get("ETag"))
            want = s3compat.multipart_etag([md5])
            out["etag-multipart-md5"] = (got == want, f"ETag {got[:16]}... {'=' if got == want else '!='} md5(md5s)-1")
        finally:
            with contextlib.suppress(ClientError):
                s3.abort_multipart_upload(Bucket=bucket, Key=base + "a", UploadId=up["UploadId"])
        made.append((bucket, base + "copy"))
        ok, why = _fails(lambda: s3.copy_object(
            Bucket=bucket, Key=base + "copy", CopySource={"Bucket": bucket, "Key": base + "a"},
            CopySourceIfMatch='"' + "0" * 32 + '"'), "PreconditionFailed", "412")
        out["copy-source-if-match"] = (ok, why)
        try:
            s3.head_object(Bucket=bucket, Key=base + "missing")
            out["head-missing-404"] = (None, "HEAD of a missing key answered 200")
        except ClientError as e:
            out["head-missing-404"] = (s3compat.status(e) == 404, f"{s3compat.status(e)} {s3compat.code(e)}")
        if classes:
            cold = store.bucket("cold")
            for c in CLASSES:
                if c == "STANDARD":
                    continue
                key = store.key("cold", f"_probe/{uuid.uuid4().hex[:12]}")
                made.append((cold, key))
                try:
                    s3.copy_object(Bucket=cold, Key=key, CopySource={"Bucket": bucket, "Key": base + "a"},
                                   StorageClass=c)
                    got_class = s3.head_object(Bucket=cold, Key=key).get("StorageClass") or "STANDARD"
                    out[f"storage-class {c}"] = (got_class == c, f"copy accepted, HEAD says {got_class}")
                except ClientError as e:
                    out[f"storage-class {c}"] = (False, f"{s3compat.status(e)} {s3compat.code(e)}")
        if lifecycle:
            out.update(_probe_lifecycle(s3, bucket, base))
    finally:
        for b, k in made:
            with contextlib.suppress(ClientError):
                s3.delete_object(Bucket=b, Key=k)
    return [Check(f, *out[f], *FEATURES[f]) for f in FEATURES if f in out]


# feature -> (how the product uses it, what it does without it); tried with a node's own identity
LANDING_FEATURES: dict[str, tuple[str, str]] = {
    "landing-no-overwrite": ("write-once landing: a node cannot replace its landed bundle (a PUT without "
                             "If-None-Match is refused)",
                             "core ingest commits only the bytes it validated; a rewrite is reported as "
                             "landing_changed, never committed twice (docs/SECURITY.md)"),
    "landing-no-delete": ("write-once landing: a node cannot delete its landed bundle",
                          "a bundle deleted before core ingest is gone with its own node's samples; deleted "
                          "between validation and commit: landing_vanished, not committed"),
}


def probe_landing(node_store: ObjectStore, node: str, *, s3: S3Client | None = None) -> list[Check]:
    """Try write-once landing with a node's own identity: create `<node>/_probe/<uuid>.probe` create-only
    (not a bundle: discovery takes only `.parquet` keys), then a plain PUT over it and a DELETE. Where the
    store refuses the delete the probe object stays (that is the finding); the janitor's moves take it."""
    s3 = s3 or node_store.client(retries={"total_max_attempts": 1, "mode": "standard"})
    bucket, key = node_store.bucket("landing"), node_store.key("landing", f"{node}/_probe/{uuid.uuid4().hex[:12]}.probe")
    out: dict[str, tuple[bool | None, str]] = {}
    try:
        s3.put_object(Bucket=bucket, Key=key, Body=b"edgehaul landing probe\n", IfNoneMatch="*")
    except ClientError as e:
        why = f"cannot create {key}: {s3compat.status(e)} {s3compat.code(e)}"
        out = {f: (None, why) for f in LANDING_FEATURES}
    else:
        out["landing-no-overwrite"] = _fails(lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"rewritten\n"),
                                             "AccessDenied")
        out["landing-no-delete"] = _fails(lambda: s3.delete_object(Bucket=bucket, Key=key), "AccessDenied")
    return [Check(f, *out[f], *LANDING_FEATURES[f]) for f in LANDING_FEATURES]


def landing_verdict(checks: list[Check]) -> str:
    """One line: "landing write-once: enforced", or what is not (and that the core covers it)."""
    missing = [c.feature.removeprefix("landing-") for c in checks if c.feature in LANDING_FEATURES and not c.present]
    if not missing:
        return "landing write-once: enforced"
    return f"landing write-once: not enforced ({', '.join(missing)}); the core detects changes (docs/SECURITY.md)"


def _probe_lifecycle(s3: S3Client, bucket: str, base: str) -> dict[str, tuple[bool | None, str]]:
    """Put a probe rule beside the bucket's own rules, read it back, then put the bucket's rules back."""
    out: dict[str, tuple[bool | None, str]] = {}
    try:
        before = list(s3.get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", []))
    except ClientError as e:
        if s3compat.code(e) != "NoSuchLifecycleConfiguration":
            return {"lifecycle-expiration-rules": (None, f"cannot read: {s3compat.code(e)}")}
        before = []
    rid = f"edgehaul-probe-{uuid.uuid4().hex[:8]}"
    rule = {"ID": rid, "Status": "Enabled", "Expiration": {"Days": 3650},
            "Filter": {"And": {"Prefix": base, "ObjectSizeGreaterThan": 131072}}}

    def restore() -> None:
        if before:
            s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": before})
        else:
            s3.delete_bucket_lifecycle(Bucket=bucket)

    try:
        s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [*before, rule]})
        back = [r for r in s3.get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", []) if r.get("ID") == rid]
        out["lifecycle-expiration-rules"] = (bool(back), "rule read back" if back else "rule missing on read-back")
        kept = bool(back) and "ObjectSizeGreaterThan" in json.dumps(back[0].get("Filter", {}))
        out["lifecycle-size-filter"] = (kept, "filter kept" if kept else "the server dropped ObjectSizeGreaterThan")
        restore()
    except ClientError as e:
        out["lifecycle-expiration-rules"] = (False, f"{s3compat.status(e)} {s3compat.code(e)}")
    trule = {"ID": rid, "Status": "Enabled", "Filter": {"Prefix": base},
             "Transitions": [{"Days": 3650, "StorageClass": "STANDARD_IA"}]}
    try:
        s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [*before, trule]})
        out["lifecycle-transition-rules"] = (True, "accepted")
        restore()
    except ClientError as e:
        out["lifecycle-transition-rules"] = (False, f"{s3compat.status(e)} {s3compat.code(e)}")
    return out


# ------------------------------------------------------------------------------- the record


def record(store: ObjectStore, checks: list[Check], s3: S3Client | None = None) -> str:
    """Write the checks where flows read them; returns the s3:// URI."""
    s3 = s3 or store.client()
    doc = {"endpoint": store.endpoint_url or "aws", "probed_at": datetime.now(UTC).isoformat(),
           "checks": [asdict(c) for c in checks]}
    s3.put_object(Bucket=store.bucket("ops"), Key=store.key("ops", RECORD_PATH), Body=json.dumps(doc, indent=1).encode(),
                  ContentType="application/json")
    return store.uri("ops", RECORD_PATH)


def load(store: ObjectStore, s3: S3Client | None = None) -> dict[str, Check] | None:
    """The recorded checks by feature, or None when this store was never probed (or the record is unreadable)."""
    s3 = s3 or store.client()
    try:
        doc = json.loads(s3.get_object(Bucket=store.bucket("ops"), Key=store.key("ops", RECORD_PATH))["Body"].read())
    except ClientError as e:
        if s3compat.is_missing(e) or s3compat.status(e) == 403:
            return None
        raise
    return {c["feature"]: Check(**c) for c in doc.get("checks", [])}


def require(store: ObjectStore, features: dict[str, str], s3: S3Client | None = None) -> None:
    """Refuse (StoreCapabilityError naming the feature) when the record says a needed feature is missing.

    `features`: feature -> what the caller needs it for. A group "a|b" is satisfied by either. A store
    never probed is not refused here: the operations themselves fail loudly."""
    caps = load(store, s3)
    if caps is None:
        return
    for feature, why in features.items():
        group = feature.split("|")
        if all(caps.get(f) is not None and caps[f].present is False for f in group):
            raise StoreCapabilityError(
                f"the store at {store.endpoint_url or 'AWS'} lacks {' / '.join(group)} ({caps[group[0]].detail}), "
                f"which {why} needs; see docs/STORAGE.md and `edgehaul store check`")


def missing_classes(policy: RetentionPolicy, caps: dict[str, Check]) -> list[str]:
    """Storage classes the policy names that the probe found missing on the store."""
    named = sorted({r.cold_storage_class for r in policy.rules if r.cold_after_days is not None
                    or r.cold_if_unused_days is not None})
    return [c for c in named if (ck := caps.get(f"storage-class {c}")) is not None and ck.present is False]


def check_policy(store: ObjectStore, policy: RetentionPolicy, s3: S3Client | None = None) -> None:
    """Refuse a retention policy that names a storage class the store does not have (class named)."""
    caps = load(store, s3)
    if caps is None:
        return
    missing = missing_classes(policy, caps)
    if missing:
        raise StoreCapabilityError(
            f"the retention policy moves data to {', '.join(missing)}, which the store at "
            f"{store.endpoint_url or 'AWS'} does not have ({caps[f'storage-class {missing[0]}'].detail}); "
            f"choose a class the probe found present")


# ------------------------------------------------------------------------------- command line


def table(checks: list[Check]) -> str:
    """Markdown table: feature, present, what the server answered, used for, without it."""
    mark = {True: "yes", False: "**no**", None: "?"}
    rows = ["| feature | present | server answered | used for | without it |", "|---|---|---|---|---|"]
    rows += [f"| {c.feature} | {mark[c.present]} | {c.detail} | {c.used_for} | {c.instead} |" for c in checks]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """`edgehaul store check <block>`: probe, print the table, record it; exit 1 if a needed feature is missing."""
    ap = argparse.ArgumentParser(prog="edgehaul store check", description=__doc__.split("\n\n")[0])
    ap.add_argument("block", nargs="?", default="central", help="ObjectStore block name (default: central).")
    ap.add_argument("--endpoint", help="Probe this endpoint with AWS_* keys from the environment instead of a block.")
    ap.add_argument("--no-record", action="store_true", help="Print only; do not write the record flows read.")
    ap.add_argument("--no-lifecycle", action="store_true", help="Leave the ops bucket's lifecycle rules untouched.")
    ap.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    ap.add_argument("--landing", metavar="NODE", help="Only try write-once landing, as node NODE (the block or the "
                    "AWS_* keys must be that node's); prints, records nothing (a node cannot write ops).")
    a = ap.parse_args(argv)
    from edgehaul.blocks.object_store import ObjectStore
    from edgehaul.platform.block_loading import load_block

    store = ObjectStore.from_env(endpoint_url=a.endpoint) if a.endpoint else load_block(ObjectStore, a.block, param="block")
    if a.landing:
        checks = probe_landing(store, a.landing)
        print(json.dumps([asdict(c) for c in checks], indent=1) if a.json else table(checks))
        print(landing_verdict(checks))
        return 0
    checks = probe(store, lifecycle=not a.no_lifecycle)
    print(json.dumps([asdict(c) for c in checks], indent=1) if a.json else table(checks))
    if not a.no_record:
        print(f"\nrecorded: {record(store, checks)}", file=sys.stderr)
    missing = [c.feature for c in checks if c.feature in NEEDED and c.present is False]
    if missing:
        print(f"\nthe product cannot run on this store: missing {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
