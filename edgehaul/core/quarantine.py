"""Quarantine: a bundle that failed validation is copied from the landing zone to `quarantine/<node>/<bundle>/`.

Landing is write-once (written by its node, then only read until the janitor moves it): no central identity
writes or deletes there, so the bundle and its manifest are copied server-side (no download) and left where
they landed. `validation.json` beside
the copies holds the reason, every sample id the bundle carried (the accounting of those samples) and the
ETags of the landing objects it copied; its presence is what keeps core ingest from taking the bundle
again (`landing_state`), and a landing object whose ETag no longer matches is reported as changed, never
ingested. Repeating a quarantine after a crash is safe: missing landing objects are skipped, the record is
rewritten. Landing objects leave landing only through the janitor (the lifecycle identity's moves).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

from edgehaul import events
from edgehaul.bundles import BundleManifest, id_problem
from edgehaul.core.validation import ValidationResult
from edgehaul.platform.s3_errors import error_code

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from edgehaul.blocks import ObjectStore

log = logging.getLogger(__name__)

RECORD_NAME = "validation.json"


@dataclass(frozen=True)
class QuarantineRecord:
    bundle_id: str
    node_id: str
    reason: str
    error: str
    landing_key: str
    quarantine_prefix: str
    objects: list[str]
    sample_ids: list[str]
    sample_ids_known: bool
    validation: dict[str, Any]
    quarantined_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat())
    # landing object name -> its ETag when copied: a later rewrite of landing shows as another ETag
    landing_etags: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()


def manifest_key_for(data_key: str) -> str:
    return data_key.removesuffix(".parquet") + ".manifest.json"


def ids_from_key(data_key: str) -> tuple[str, str]:
    """(node_id, bundle_id) from a landing key `[prefix/]<node>/<day>/<bundle>.parquet`."""
    parts = data_key.split("/")
    bundle = parts[-1].removesuffix(".parquet").removesuffix(".manifest.json")
    node = parts[-3] if len(parts) >= 3 else "unknown-node"
    return node, bundle


def _etag(s3: S3Client, bucket: str, key: str) -> str | None:
    """The object's ETag (unquoted), None when there is no such object."""
    try:
        return str(s3.head_object(Bucket=bucket, Key=key)["ETag"]).strip('"')
    except ClientError as e:
        if error_code(e) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def _exists(s3: S3Client, bucket: str, key: str) -> bool:
    return _etag(s3, bucket, key) is not None


def quarantine_bundle(
    store: ObjectStore,
    data_key: str,
    result: ValidationResult,
    manifest: BundleManifest | None,
    sample_ids: list[str] | None = None,
    *,
    s3: S3Client | None = None,
    emit_event: bool = True,
) -> QuarantineRecord:
    """Copy a failed bundle (landing key of its Parquet object) to quarantine with its result; landing is
    left as it is (write-once: the caller's identity may not write there).

    `sample_ids` defaults to the manifest's; pass the file's own ids when the manifest is unreadable.
    """
    s3 = s3 or store.client()
    src_bucket, dst_bucket = store.bucket("landing"), store.bucket("quarantine")
    # The landing key says whose bundle it is (a node writes only under its own prefix), never the manifest.
    node, bundle = ids_from_key(data_key)
    problem = id_problem(node, bundle)
    if problem:
        raise ValueError(f"cannot quarantine {data_key!r}: {problem}")
    prefix = store.key("quarantine", f"{node}/{bundle}/")
    moved, etags = [], {}
    for src in (data_key, manifest_key_for(data_key)):
        name = src.rsplit("/", 1)[-1]
        etag = _etag(s3, src_bucket, src)
        if etag is None:
            continue
        s3.copy_object(Bucket=dst_bucket, Key=prefix + name, CopySource={"Bucket": src_bucket, "Key": src})
        moved.append(prefix + name)
        etags[name] = etag
    ids = sample_ids if sample_ids is not None else (list(manifest.sample_ids) if manifest else [])
    record = QuarantineRecord(
        bundle_id=bundle, node_id=node, reason=result.reason, error=result.error, landing_key=data_key,
        quarantine_prefix=prefix, objects=moved, sample_ids=ids,
        sample_ids_known=sample_ids is not None or manifest is not None, validation=result.to_dict(),
        landing_etags=etags,
    )
    # The record is the bundle's end in core ingest: `landing_state` finds it and the bundle is not taken again.
    s3.put_object(Bucket=dst_bucket, Key=prefix + RECORD_NAME, Body=record.to_json(), ContentType="application/json")
    log.warning("quarantined bundle %s from %s: %s (%d samples)", bundle[:12], node, result.reason, len(ids))
    if emit_event:
        events.emit(
            events.BUNDLE_QUARANTINED, f"edgehaul.bundle.{bundle}",
            {"reason": result.reason, "error": result.error[:500], "samples": len(ids), "prefix": prefix},
            **{"edgehaul.node": node},
        )
    return record


def duplicates_key(store: ObjectStore, kind: str, node_id: str, bundle_id: str) -> str:
    return store.key("quarantine", f"_duplicates/{kind}/{node_id}/{bundle_id}.json")


def record_duplicates(
    store: ObjectStore, kind: str, manifest: BundleManifest, sample_ids: list[str], kept_rows: int, *,
    base_version: int, run_id: str, s3: S3Client | None = None,
) -> str:
    """Name the sample ids of a committed bundle that were dropped because the dataset (or an earlier
    bundle of the same commit) already holds them: a re-sent id is accounted for by this record, not a
    second row. Written before the commit; rewritten by a retry (the set can only grow). Returns the key."""
    s3 = s3 or store.client()
    key = duplicates_key(store, kind, manifest.node_id, manifest.bundle_id)
    doc = {"bundle_id": manifest.bundle_id, "node_id": manifest.node_id, "kind": kind, "reason": "duplicate",
           "sample_ids": sample_ids, "kept_rows": kept_rows, "base_version": base_version, "run": run_id,
           "recorded_at": datetime.now(UTC).isoformat()}
    s3.put_object(Bucket=store.bucket("quarantine"), Key=key, Body=json.dumps(doc, indent=1).encode(),
                  ContentType="application/json")
    log.warning("bundle %s from %s: %d sample ids already in dataset %s (v%d), dropped", manifest.bundle_id[:12],
                manifest.node_id, len(sample_ids), kind, base_version)
    return key


def read_record(store: ObjectStore, node_id: str, bundle_id: str, *, s3: S3Client | None = None) -> QuarantineRecord:
    s3 = s3 or store.client()
    key = store.key("quarantine", f"{node_id}/{bundle_id}/{RECORD_NAME}")
    doc = json.loads(s3.get_object(Bucket=store.bucket("quarantine"), Key=key)["Body"].read())
    return QuarantineRecord(**doc)


def landing_state(store: ObjectStore, data_key: str, *, s3: S3Client | None = None) -> tuple[str, str] | None:
    """None when the landed bundle at `data_key` was never quarantined; else ("quarantined", what) when
    its record says so and landing still holds the objects it copied, or ("landing_changed", what) when a
    landing object's ETag differs from the recorded one (rewritten after quarantine: never ingested)."""
    s3 = s3 or store.client()
    node, bundle = ids_from_key(data_key)
    try:
        rec = read_record(store, node, bundle, s3=s3)
    except ClientError as e:
        if error_code(e) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise
    bucket = store.bucket("landing")
    for name, etag in sorted(rec.landing_etags.items()):
        now = _etag(s3, bucket, data_key.rsplit("/", 1)[0] + "/" + name)
        if now is not None and now != etag:
            return "landing_changed", (f"bundle {bundle} of {node}: landing object {name} rewritten after its quarantine "
                                       f"({rec.reason}, {rec.quarantined_at}): ETag {etag} -> {now}; not ingested")
    return "quarantined", f"quarantined {rec.quarantined_at}: {rec.reason}"


# ---------------------------------------------------------------- operator: list and re-admit

AUDIT_PREFIX = "quarantine/audit"  # in the ops bucket: one object per record, written once (If-None-Match)


class QuarantineError(ValueError):
    """An operator request on quarantine cannot be done; the message names the bundle and why."""


@dataclass(frozen=True)
class Readmission:
    bundle_id: str
    node_id: str
    moved: dict[str, str]  # quarantine key -> landing key
    audit_key: str


def _record_keys(s3: S3Client, store: ObjectStore, node: str | None = None) -> list[str]:
    keys = []
    prefix = store.key("quarantine", f"{node}/" if node else "")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=store.bucket("quarantine"), Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", []) if o["Key"].endswith(f"/{RECORD_NAME}")]
    return sorted(keys)


def list_quarantined(store: ObjectStore, *, node: str | None = None, reason: str | None = None,
                     s3: S3Client | None = None) -> list[QuarantineRecord]:
    """Quarantine records (oldest first), optionally of one node and/or one reason."""
    s3 = s3 or store.client()
    bucket = store.bucket("quarantine")
    records = [QuarantineRecord(**json.loads(s3.get_object(Bucket=bucket, Key=k)["Body"].read()))
               for k in _record_keys(s3, store, node)]
    return sorted((r for r in records if reason is None or r.reason == reason), key=lambda r: r.quarantined_at)


def _find(s3: S3Client, store: ObjectStore, bundle_ids: list[str]) -> dict[str, QuarantineRecord]:
    by_bundle: dict[str, str] = {}
    for k in _record_keys(s3, store):
        by_bundle.setdefault(k.rsplit("/", 2)[-2], k)
    unknown = [b for b in bundle_ids if b not in by_bundle]
    if unknown:
        raise QuarantineError(f"not in quarantine: {', '.join(unknown)} (nothing re-admitted)")
    out = {}
    for b in bundle_ids:
        rec = QuarantineRecord(**json.loads(s3.get_object(Bucket=store.bucket("quarantine"),
                                                          Key=by_bundle[b])["Body"].read()))
        names = {o.rsplit("/", 1)[-1] for o in rec.objects}
        if names != {f"{b}.parquet", f"{b}.manifest.json"}:
            raise QuarantineError(f"bundle {b} ({rec.node_id}): quarantine holds {sorted(names)}, not the bundle and "
                                  "its manifest; nothing re-admitted")
        gone = [o for o in rec.objects if not _exists(s3, store.bucket("quarantine"), o)]
        if gone:  # the lifecycle moves quarantine to the cold tier after a while: restore it first
            raise QuarantineError(f"bundle {b}: {', '.join(gone)} no longer in quarantine (cold tier?); "
                                  "nothing re-admitted")
        if not rec.landing_key.startswith(store.key("landing", f"{rec.node_id}/")):
            raise QuarantineError(f"bundle {b}: landing key {rec.landing_key} is not under node {rec.node_id}'s prefix; "
                                  "nothing re-admitted")
        out[b] = rec
    return out


def readmit(store: ObjectStore, bundle_ids: list[str], *, why: str, by: str, s3: S3Client | None = None,
            now: datetime | None = None) -> list[Readmission]:
    """Give quarantined bundles back to landing under their node's prefix, for the next core_ingest to
    validate for real (re-admission is not a commit). Landing is write-once: where it still holds the
    bundle's bytes (quarantine copies, never moves) nothing is written there; an object gone from landing
    (the janitor moved it) is put back create-only (`If-None-Match: *`, an identity with landing writes:
    the operator's), Parquet object first, manifest last, each checked byte-identical. Then an audit record
    goes to the ops bucket (one object, never overwritten), and only then is the bundle removed from
    quarantine (its record is what kept core ingest away). Every id is checked first: an unknown bundle
    changes nothing at all."""
    if not why.strip() or not by.strip():
        raise QuarantineError("a re-admission needs a reason (--reason) and who asks for it (--by)")
    s3 = s3 or store.client()
    q_bucket, l_bucket = store.bucket("quarantine"), store.bucket("landing")
    records = _find(s3, store, list(dict.fromkeys(bundle_ids)))
    plans = {}
    for b, rec in records.items():
        src_of = {o.rsplit("/", 1)[-1]: o for o in rec.objects}
        plans[b] = {src_of[f"{b}.parquet"]: rec.landing_key, src_of[f"{b}.manifest.json"]: manifest_key_for(rec.landing_key)}
        for src, dst in plans[b].items():  # another object where the bundle goes back: change nothing, say so
            if _exists(s3, l_bucket, dst) and (s3.get_object(Bucket=l_bucket, Key=dst)["Body"].read()
                                               != s3.get_object(Bucket=q_bucket, Key=src)["Body"].read()):
                raise QuarantineError(f"bundle {b}: landing already holds a different {dst}; nothing re-admitted")
    done = []
    for b, rec in records.items():
        moved = plans[b]
        for src, dst in moved.items():  # data first, manifest last
            got = s3.get_object(Bucket=q_bucket, Key=src)
            body = got["Body"].read()
            if not _exists(s3, l_bucket, dst):  # checked equal above when present; a PUT, not a copy: AWS
                # refuses CopyObject where a bucket policy demands If-None-Match
                s3.put_object(Bucket=l_bucket, Key=dst, Body=body, IfNoneMatch="*", Metadata=got.get("Metadata", {}),
                              ContentType=got.get("ContentType", "application/octet-stream"))
            if s3.get_object(Bucket=l_bucket, Key=dst)["Body"].read() != body:
                raise QuarantineError(f"bundle {b}: copy {dst} differs from {src}; left in quarantine")
        at = now or datetime.now(UTC)
        audit_key = store.key("ops", f"{AUDIT_PREFIX}/{at:%Y-%m-%dT%H%M%S.%fZ}-{b}.json")
        audit = {"action": "readmit", "bundle_id": b, "node_id": rec.node_id, "by": by, "at": at.isoformat(),
                 "why": why, "quarantine_reason": rec.reason, "quarantine_error": rec.error[:500],
                 "quarantined_at": rec.quarantined_at, "samples": len(rec.sample_ids),
                 "from": sorted(moved), "to": [moved[k] for k in sorted(moved)]}
        s3.put_object(Bucket=store.bucket("ops"), Key=audit_key, Body=json.dumps(audit, indent=1).encode(),
                      ContentType="application/json", IfNoneMatch="*")
        # the record first: it is what keeps core ingest away; copies left by a crash here are only copies
        for key in [rec.quarantine_prefix + RECORD_NAME, *moved]:
            s3.delete_object(Bucket=q_bucket, Key=key)
        log.warning("re-admitted bundle %s of %s to landing (%d samples) by %s: %s", b[:12], rec.node_id,
                    len(rec.sample_ids), by, why)
        done.append(Readmission(bundle_id=b, node_id=rec.node_id, moved=moved, audit_key=audit_key))
    return done


def audit_records(store: ObjectStore, *, s3: S3Client | None = None) -> list[dict[str, Any]]:
    """Every re-admission audit record, oldest first."""
    s3 = s3 or store.client()
    out = []
    prefix = store.key("ops", AUDIT_PREFIX + "/")
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=store.bucket("ops"), Prefix=prefix)
    for key in sorted(o["Key"] for p in pages for o in p.get("Contents", [])):
        out.append(json.loads(s3.get_object(Bucket=store.bucket("ops"), Key=key)["Body"].read()))
    return out
