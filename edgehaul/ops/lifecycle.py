"""Cold-tier lifecycle: select objects by class, age and last use, then move or expire them safely.

What is managed (`classify`): landing bundles and quarantined bundles are `raw`, the Parquet files of
the Delta datasets are `features`, `models/` objects are `model_weights`, the rest of the checkpoints
bucket is `checkpoints`, and `logs/` / `reports/` in the ops bucket are `logs` / `reports`. Delta logs,
the move journal and the metering log are never touched. Small metadata objects (`*.manifest.json`,
`lineage.json`) are never moved: they mark completeness and feed the cost report; they expire with
their class.

Moves are server-side: `copy_object` (or `upload_part_copy` from `multipart_threshold`, 5 GiB by
default) to the cold bucket with the rule's storage class, then a delete of the source; no bytes
pass through the client. The cold key mirrors the source: `<cold prefix><source bucket>/<key without
the store prefix>`. The copy carries its provenance in metadata (`eh-source`, `eh-source-etag`,
`eh-created`, `eh-class-since`), and is made with `CopySourceIfMatch`, so it is a copy of exactly the
version that was planned.

Crash safety: each batch of actions is written to a journal object in the ops bucket
(`lifecycle/journal/<batch>.json`, `If-None-Match: *`) before it runs and marked done after. An
interrupted batch leaves objects in one of three states: not copied (the source is authoritative), copied
and not yet deleted (two identical copies: the cold copy is authoritative, `resolve` says so), or
moved. A rerun first finishes every journalled batch without a done marker; each action is idempotent
(an existing verified copy is not copied again; a delete of a missing key is a no-op).

Models: the published model of each name (`models/<name>/latest.json`: `model_id`) and the one it
replaced (`previous`, the rollback target) are protected like referenced dataset files; the pointer
itself is never touched.

Delta datasets (decision): Delta paths are relative to the table root, so a data file moved out of the
table breaks every version that reads it. A version is *protected* when it is among the latest
`keep_latest_versions`, in `pinned_versions`, or referenced by a model's `lineage.json`
(`dataset_uri` + `dataset_version`). Files read by any protected version are never moved or expired.
Files read only by unprotected old versions (removed by a later overwrite or compaction) follow their
rule: moved to cold, they stay readable by key through `resolve`, but time travel to those unprotected
versions stops working (as after a vacuum). If a version becomes protected after its files were moved
(a new model trained on it, a new pin), the next run restores them into the table (`restore` actions,
allowed before the cold class's minimum duration because a broken read costs more; the reason is
recorded). Restoring from GLACIER / DEEP_ARCHIVE needs an S3 restore first and is reported, not done.

Races are healed, not locked out: a version that becomes protected between plan and run (a model
trained on it meanwhile) may lose files to that run; the next run restores them. An object rewritten
or deleted after the plan is left alone (`skipped: changed since planned` / `source gone`).
`pinned_versions` apply to every table.

Time is injected: every decision takes `now`. Hot objects' age and class start are their
LastModified; cold copies use the `eh-created` / `eh-class-since` written at move time (the injected
`now`). Last use of an object is the latest of its creation, access records (`record_access`) and,
for dataset files, the lineage time of every model trained on a version that reads the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote

from botocore.exceptions import ClientError

from edgehaul.core.datasets import open_uri
from edgehaul.lineage import list_lineages
from edgehaul.ops.storage_classes import CLASSES, Verdict, check_delete, check_move, storage_class
from edgehaul.platform import s3compat
from edgehaul.platform.s3_errors import error_code

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from edgehaul.blocks import ObjectStore, RetentionPolicy, RetentionRule

log = logging.getLogger(__name__)

DAY = timedelta(days=1)
MULTIPART_THRESHOLD = 5 * 1024**3  # single CopyObject is limited to 5 GiB
PART_BYTES = 512 * 1024**2
META_FILES = (".manifest.json", "/lineage.json")
JOURNAL = "lifecycle/journal/"
ACCESS = "lifecycle/access/"

ActionKind = Literal["move", "restore", "delete"]


class LifecycleError(RuntimeError):
    """An action could not be carried out; the message names the object."""


# ---------------------------------------------------------------------------------------------- keys


def _base(store: ObjectStore) -> str:
    return store.key("landing")  # the tenant prefix ("" or "<prefix>/"), shared by every bucket


def cold_key(store: ObjectStore, bucket: str, key: str) -> str:
    """Key in the cold bucket of a source object (mirrors source bucket and key)."""
    base = _base(store)
    if not key.startswith(base):
        raise ValueError(f"s3://{bucket}/{key} is outside the store prefix {base!r}")
    return store.key("cold", f"{bucket}/{key[len(base):]}")


def origin_of(store: ObjectStore, key: str) -> tuple[str, str]:
    """Inverse of `cold_key`: the source bucket and key of a cold object."""
    base = store.key("cold")
    if not key.startswith(base) or "/" not in key[len(base):]:
        raise ValueError(f"cold key {key!r} does not follow <prefix><bucket>/<key>")
    bucket, rest = key[len(base):].split("/", 1)
    return bucket, _base(store) + rest


def classify(store: ObjectStore, bucket: str, key: str) -> str | None:
    """Data class of a hot object by its bucket and key layout (None: not managed)."""
    base = _base(store)
    if not key.startswith(base):
        return None
    rel = key[len(base):]
    if bucket == store.bucket("landing"):
        return "raw"
    if bucket == store.bucket("curated"):
        if rel.startswith("datasets/"):
            return None if "/_delta_log/" in rel or rel.endswith("/_delta_log") else "features"
        if rel.startswith("quarantine/"):
            return "raw"
        return None
    if bucket == store.bucket("checkpoints"):
        if rel.startswith("models/"):
            return None if rel.endswith("/latest.json") else "model_weights"  # the published pointer: never touched
        return "checkpoints"
    if bucket == store.bucket("ops"):
        if rel.startswith("logs/"):
            return "logs"
        if rel.startswith("reports/"):
            return "reports"
    return None


def _is_meta_file(key: str) -> bool:
    return key.endswith(META_FILES) or key == "lineage.json"


# --------------------------------------------------------------------------------------- listing


@dataclass(frozen=True)
class ObjectInfo:
    bucket: str
    key: str
    size: int
    etag: str  # unquoted
    last_modified: datetime
    storage_class: str


def _etag(v: str) -> str:
    return v.strip('"')


def list_objects(s3: S3Client, bucket: str, prefix: str) -> Iterator[ObjectInfo]:
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            yield ObjectInfo(
                bucket, o["Key"], int(o["Size"]), _etag(o.get("ETag", "")), o["LastModified"],
                o.get("StorageClass") or "STANDARD",
            )


def _head(s3: S3Client, bucket: str, key: str) -> dict[str, Any] | None:
    try:
        return dict(s3.head_object(Bucket=bucket, Key=key))
    except ClientError as e:
        if s3compat.is_missing(e):
            return None
        if s3compat.status(e) != 403:
            raise
    # 403 is what a missing key gets on servers (and AWS identities) that hide absence without
    # ListBucket: the listing, which the lifecycle identity may read, says whether it exists.
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1).get("Contents", [])
    if listed and listed[0]["Key"] == key:
        raise PermissionError(f"s3://{bucket}/{key} exists but HEAD is denied to this identity")
    return None


def _iso(v: str | None, default: datetime) -> datetime:
    if not v:
        return default
    d = datetime.fromisoformat(v)
    return d if d.tzinfo else d.replace(tzinfo=UTC)


# ------------------------------------------------------------------------------- resolution


@dataclass(frozen=True)
class Location:
    bucket: str
    key: str
    storage_class: str
    tier: Literal["hot", "cold"]


def resolve(store: ObjectStore, bucket: str, key: str, s3: S3Client | None = None) -> Location:
    """The one authoritative place of an object, whatever state a move left it in.

    A cold copy made from the current source version (its `eh-source-etag` equals the source's ETag)
    is authoritative even while the source still exists (a move interrupted before the delete). A
    source rewritten after the copy wins over the stale copy.
    """
    s3 = s3 or store.client()
    ck = cold_key(store, bucket, key)
    cold = _head(s3, store.bucket("cold"), ck)
    hot = _head(s3, bucket, key)
    if cold is not None and (hot is None or cold["Metadata"].get("eh-source-etag") == _etag(hot["ETag"])):
        return Location(store.bucket("cold"), ck, cold.get("StorageClass") or "STANDARD", "cold")
    if hot is not None:
        return Location(bucket, key, hot.get("StorageClass") or "STANDARD", "hot")
    raise FileNotFoundError(f"s3://{bucket}/{key} is neither in place nor in the cold tier ({ck})")


def read_object(store: ObjectStore, bucket: str, key: str, s3: S3Client | None = None) -> bytes:
    """Bytes of an object wherever the lifecycle put it."""
    s3 = s3 or store.client()
    loc = resolve(store, bucket, key, s3)
    return s3.get_object(Bucket=loc.bucket, Key=loc.key)["Body"].read()


# ---------------------------------------------------------------------------------- usage


def record_access(
    store: ObjectStore, *, at: datetime, reader: str, dataset_uri: str | None = None,
    dataset_version: int | None = None, bucket: str | None = None, prefix: str | None = None,
    s3: S3Client | None = None,
) -> str:
    """Append an access record (a reader used a dataset version, or objects under a prefix).

    Format, one JSON object per record at `<ops prefix>lifecycle/access/<yyyy-mm-dd>/<uuid>.json`:
    `{"at": iso, "reader": str, "dataset_uri": str|null, "dataset_version": int|null,
    "bucket": str|null, "prefix": str|null}`. Returns the record's key.
    """
    if (dataset_uri is None) == (bucket is None):
        raise ValueError("record_access needs either dataset_uri (+ dataset_version) or bucket (+ prefix)")
    if at.tzinfo is None:
        raise ValueError("record_access: `at` must be timezone-aware")
    s3 = s3 or store.client()
    doc = {"at": at.isoformat(), "reader": reader, "dataset_uri": dataset_uri, "dataset_version": dataset_version,
           "bucket": bucket, "prefix": prefix or ""}
    key = store.key("ops", f"{ACCESS}{at:%Y-%m-%d}/{uuid.uuid4().hex}.json")
    s3.put_object(Bucket=store.bucket("ops"), Key=key, Body=json.dumps(doc).encode(), IfNoneMatch="*")
    return key


def access_records(s3: S3Client, store: ObjectStore) -> list[dict[str, Any]]:
    out = []
    for o in list_objects(s3, store.bucket("ops"), store.key("ops", ACCESS)):
        out.append(json.loads(s3.get_object(Bucket=o.bucket, Key=o.key)["Body"].read()))
    return out


def model_lineages(s3: S3Client, store: ObjectStore) -> list[dict[str, Any]]:
    """Every `models/<name>/<model_id>/lineage.json`, with `_key` and `_at` (created_at or LastModified)."""
    out = []
    for key, last_modified, doc in list_lineages(store, s3=s3):
        doc["_key"] = key
        at = doc.get("finished_at") or doc.get("finished") or doc.get("created_at")
        doc["_at"] = _iso(at, last_modified) if isinstance(at, str) else last_modified
        out.append(doc)
    return out


# ----------------------------------------------------------------------------- Delta protection


def _norm_uri(uri: str) -> str:
    return uri.rstrip("/")


@dataclass
class TableFiles:
    uri: str
    latest: int
    protected: dict[int, str]  # version -> why
    protected_keys: set[str]
    used_at: dict[str, datetime]  # key -> last recorded use of a version reading it
    notes: list[str] = field(default_factory=list)


def _version_keys(store: ObjectStore, uri: str, version: int) -> set[str]:
    dt = open_uri(uri, store.storage_options(), version)
    bucket = store.bucket("curated")
    keys = set()
    for u in dt.file_uris():
        u = unquote(u)
        keys.add(u.removeprefix(f"s3://{bucket}/").removeprefix(f"s3a://{bucket}/"))
    return keys


def delta_protection(
    store: ObjectStore, table_roots: list[str], policy: RetentionPolicy, lineages: list[dict[str, Any]],
    accesses: list[dict[str, Any]],
) -> dict[str, TableFiles]:
    """Per table: which versions are protected (and why), the files they read, and last use per file."""
    out: dict[str, TableFiles] = {}
    bucket = store.bucket("curated")
    for root in table_roots:
        uri = f"s3://{bucket}/{root}"
        latest = open_uri(uri, store.storage_options()).version()
        why: dict[int, str] = {}
        for v in range(max(0, latest - policy.keep_latest_versions + 1), latest + 1):
            why[v] = f"latest {policy.keep_latest_versions}"
        for v in policy.pinned_versions:
            if 0 <= v <= latest:
                why.setdefault(v, "pinned")
        uses: dict[int, datetime] = {}
        for lin in lineages:
            if _norm_uri(str(lin.get("dataset_uri", ""))) == uri and lin.get("dataset_version") is not None:
                v = int(lin["dataset_version"])
                why.setdefault(v, f"model {lin['_key'].rsplit('/', 2)[-2]}")
                uses[v] = max(uses.get(v, lin["_at"]), lin["_at"])
        for rec in accesses:
            if rec.get("dataset_uri") and _norm_uri(rec["dataset_uri"]) == uri and rec.get("dataset_version") is not None:
                v, at = int(rec["dataset_version"]), _iso(rec["at"], datetime.now(UTC))
                uses[v] = max(uses.get(v, at), at)
        tf = TableFiles(uri, latest, why, set(), {})
        cache: dict[int, set[str]] = {}
        for v in sorted(set(why) | set(uses)):
            try:
                cache[v] = _version_keys(store, uri, v)
            except Exception as e:  # a vacuumed or corrupt version: say so, protect nothing else for it
                tf.notes.append(f"{uri}@v{v} ({why.get(v, 'used')}) not loadable: {e}")
                continue
            if v in why:
                tf.protected_keys |= cache[v]
        for v, at in uses.items():
            for k in cache.get(v, ()):
                tf.used_at[k] = max(tf.used_at.get(k, at), at)
        out[root] = tf
    return out


# ------------------------------------------------------------------------------------ planning


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    src_bucket: str
    src_key: str
    dst_bucket: str  # delete: the cold bucket (its copy, if any, is deleted too)
    dst_key: str
    size: int
    etag: str
    storage_class: str  # target class (move/restore) or current class (delete)
    data_class: str
    created: str  # ISO time the data was first written
    reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Plan:
    now: datetime
    actions: list[Action] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    skipped_keys: dict[str, str] = field(default_factory=dict)  # key -> reason
    protected_versions: dict[str, dict[int, str]] = field(default_factory=dict)
    protected_keys: set[str] = field(default_factory=set)  # files read by protected dataset versions
    notes: list[str] = field(default_factory=list)

    def skip(self, key: str, reason: str) -> None:
        self.skipped[reason.split(" (")[0]] += 1
        self.skipped_keys[key] = reason

    def counts(self) -> dict[str, int]:
        return dict(Counter(a.kind for a in self.actions))

    def batches(self, max_actions: int) -> list[list[Action]]:
        return [self.actions[i:i + max_actions] for i in range(0, len(self.actions), max_actions)]


def _due_move(rule: RetentionRule, age: timedelta, idle: timedelta) -> str | None:
    if rule.cold_after_days is not None and age >= rule.cold_after_days * DAY:
        return f"age {age / DAY:.0f}d >= {rule.cold_after_days:g}d"
    if rule.cold_if_unused_days is not None and idle >= rule.cold_if_unused_days * DAY:
        return f"unused {idle / DAY:.0f}d >= {rule.cold_if_unused_days:g}d"
    return None


@dataclass
class _Survey:
    """What planning knows before it decides: the hot listing, the keys that stay hot (and why), last uses."""

    store: ObjectStore
    policy: RetentionPolicy
    now: datetime
    force_reason: str | None
    s3: S3Client
    hot: dict[tuple[str, str], ObjectInfo]
    accesses: list[dict[str, Any]]
    protected: dict[str, str] = field(default_factory=dict)  # key -> why it stays hot
    used_at: dict[str, datetime] = field(default_factory=dict)  # dataset file -> last use of a version reading it

    @property
    def cold_bucket(self) -> str:
        return self.store.bucket("cold")

    def last_use(self, o: ObjectInfo, created: datetime) -> datetime:
        t = max(created, self.used_at.get(o.key, created))
        for rec in self.accesses:
            if rec.get("bucket") == o.bucket and o.key.startswith(rec.get("prefix") or ""):
                t = max(t, _iso(rec["at"], t))
        return t


def _list_hot(s3: S3Client, store: ObjectStore) -> dict[tuple[str, str], ObjectInfo]:
    base = _base(store)
    hot: dict[tuple[str, str], ObjectInfo] = {}
    for bucket in dict.fromkeys(store.bucket(z) for z in ("landing", "curated", "checkpoints", "ops")):
        for o in list_objects(s3, bucket, base):
            hot[(o.bucket, o.key)] = o
    return hot


def _protect_dataset_files(p: Plan, sv: _Survey, lineages: list[dict[str, Any]]) -> None:
    """Files read by protected Delta versions stay hot; every dataset file gets its last use."""
    curated = sv.store.bucket("curated")
    roots = sorted({k.split("/_delta_log/")[0] for (b, k) in sv.hot if b == curated and "/_delta_log/" in k})
    for tf in delta_protection(sv.store, roots, sv.policy, lineages, sv.accesses).values():
        p.protected_versions[tf.uri] = dict(sorted(tf.protected.items()))
        p.notes.extend(tf.notes)
        for k in tf.protected_keys:
            sv.protected[k] = f"referenced: {tf.uri} protected versions"
        p.protected_keys |= tf.protected_keys
        sv.used_at.update(tf.used_at)


def _protect_published_models(p: Plan, sv: _Survey) -> None:
    # the published model (and the one it replaced, the rollback target) stay hot: edges load them
    store, s3 = sv.store, sv.s3
    prefixes: dict[str, str] = {}
    for (b, k) in sv.hot:
        if b == store.bucket("models") and k.startswith(store.key("models")) and k.endswith("/latest.json"):
            ptr = json.loads(s3.get_object(Bucket=b, Key=k)["Body"].read())
            for mid in (ptr.get("model_id"), ptr.get("previous")):
                if mid:
                    prefixes[k.removesuffix("latest.json") + f"{mid}/"] = f"referenced: published model {mid}"
    if not prefixes:
        return
    cold_origins = [origin_of(store, c.key) for c in list_objects(s3, store.bucket("cold"), store.key("cold"))
                    if c.key.count("/") > store.key("cold").count("/")]
    for (b, k) in [*sv.hot, *cold_origins]:
        for pre, why in prefixes.items():
            if b == store.bucket("models") and k.startswith(pre):
                sv.protected[k] = why
                p.protected_keys.add(k)


def _expired(rule: RetentionRule, v: Verdict) -> str:
    return f"expired after {rule.expire_after_days:g}d" + (f"; {v.reason}" if v.forced else "")


@dataclass(frozen=True)
class _ColdCopy:
    """A cold object with its origin and what its HEAD says."""

    obj: ObjectInfo
    src_bucket: str
    src_key: str
    data_class: str  # "" when its origin is not managed
    rule: RetentionRule | None
    created: datetime
    since: datetime  # in its storage class since
    storage_class: str
    source_etag: str | None


def _cold_copy(sv: _Survey, c: ObjectInfo) -> _ColdCopy | None:
    """The cold object's origin and HEAD, where a decision needs them (None: nothing to decide)."""
    try:
        sb, sk = origin_of(sv.store, c.key)
    except ValueError:
        return None
    dc = classify(sv.store, sb, sk)
    rule = sv.policy.rule(dc) if dc else None
    expires = rule is not None and rule.expire_after_days is not None
    if not ((sb, sk) in sv.hot or sk in sv.protected or expires):
        return None
    h = _head(sv.s3, sv.cold_bucket, c.key)
    if h is None:
        return None
    meta = h.get("Metadata", {})
    return _ColdCopy(c, sb, sk, dc or "", rule, _iso(meta.get("eh-created"), c.last_modified),
                     _iso(meta.get("eh-class-since"), c.last_modified), h.get("StorageClass") or "STANDARD",
                     meta.get("eh-source-etag"))


def _plan_cold_copy(p: Plan, sv: _Survey, cc: _ColdCopy) -> bool:
    """Decide one cold copy; True when that settles its hot source too (the hot pass leaves it alone)."""
    c, sb, sk, cold, cls = cc.obj, cc.src_bucket, cc.src_key, sv.cold_bucket, cc.storage_class
    src = sv.hot.get((sb, sk))
    if src is not None and sk in sv.protected:
        # an interrupted move of a file that became referenced: keep it in the table, drop the copy
        p.actions.append(Action("delete", cold, c.key, cold, c.key, c.size, c.etag, cls, cc.data_class,
                                cc.created.isoformat(), f"{sv.protected[sk]}; redundant cold copy"))
        return True
    if src is not None:
        if cc.source_etag == src.etag:
            p.actions.append(Action("move", sb, sk, cold, c.key, src.size, src.etag, cls, cc.data_class,
                                    cc.created.isoformat(), "finish interrupted move"))
            return True
        p.notes.append(f"s3://{sb}/{sk} was rewritten after its cold copy; the cold copy is stale")
        return False
    if sk in sv.protected:
        if not storage_class(cls).instant_read:
            p.skip(c.key, f"restore needs an S3 restore from {cls} first")
            return False
        p.actions.append(Action("restore", cold, c.key, sb, sk, c.size, c.etag, "STANDARD", cc.data_class,
                                cc.created.isoformat(), f"{sv.protected[sk]}; restored early on purpose"))
        return False
    rule = cc.rule
    if rule is not None and rule.expire_after_days is not None and sv.now - cc.created >= rule.expire_after_days * DAY:
        v = check_delete(cls, cc.since, sv.now, sv.force_reason)
        if not v.allowed:
            p.skip(c.key, v.reason)
            return False
        p.actions.append(Action("delete", cold, c.key, cold, c.key, c.size, c.etag, cls, cc.data_class,
                                cc.created.isoformat(), _expired(rule, v)))
    return False


def _plan_cold(p: Plan, sv: _Survey) -> set[tuple[str, str]]:
    """Cold tier: expiry, restores of newly protected files, and finishing moves whose journal was lost.
    Returns the hot objects a cold copy settled."""
    settled: set[tuple[str, str]] = set()
    for c in list_objects(sv.s3, sv.cold_bucket, sv.store.key("cold")):
        cc = _cold_copy(sv, c)
        if cc is not None and _plan_cold_copy(p, sv, cc):
            settled.add((cc.src_bucket, cc.src_key))
    return settled


def _plan_hot_object(p: Plan, sv: _Survey, o: ObjectInfo, dc: str, rule: RetentionRule) -> None:
    """Expire, move to cold, or leave one managed hot object."""
    created = o.last_modified
    age = sv.now - created
    if rule.expire_after_days is not None and age >= rule.expire_after_days * DAY:
        v = check_delete(o.storage_class, o.last_modified, sv.now, sv.force_reason)
        if not v.allowed:
            p.skip(o.key, v.reason)
            return
        ck = cold_key(sv.store, o.bucket, o.key)
        p.actions.append(Action("delete", o.bucket, o.key, sv.cold_bucket, ck, o.size, o.etag, o.storage_class, dc,
                                created.isoformat(), _expired(rule, v)))
        return
    due = _due_move(rule, age, sv.now - sv.last_use(o, created))
    if due is None:
        return
    if _is_meta_file(o.key):
        p.skip(o.key, "skipped: metadata object stays hot")
        return
    if storage_class(o.storage_class).rank >= CLASSES[rule.cold_storage_class].rank:
        p.skip(o.key, f"skipped: already {o.storage_class}")
        return
    v = check_move(o.size, o.storage_class, o.last_modified, rule.cold_storage_class, sv.now, sv.force_reason)
    if not v.allowed:
        p.skip(o.key, v.reason)
        return
    p.actions.append(Action("move", o.bucket, o.key, sv.cold_bucket, cold_key(sv.store, o.bucket, o.key), o.size,
                            o.etag, rule.cold_storage_class, dc, created.isoformat(),
                            due + (f"; {v.reason}" if v.forced else "")))


def _plan_hot(p: Plan, sv: _Survey, settled: set[tuple[str, str]]) -> None:
    for (bucket, key), o in sv.hot.items():
        if (bucket, key) in settled:
            continue
        dc = classify(sv.store, bucket, key)
        rule = sv.policy.rule(dc) if dc else None
        if rule is None or dc is None:
            continue
        if key in sv.protected:
            p.skip(key, sv.protected[key])
            continue
        _plan_hot_object(p, sv, o, dc, rule)


def plan(
    store: ObjectStore, policy: RetentionPolicy, now: datetime, *, force_reason: str | None = None,
    s3: S3Client | None = None,
) -> Plan:
    """Select what to move, restore or expire at `now` under `policy` (no writes)."""
    if now.tzinfo is None:
        raise ValueError("plan: `now` must be timezone-aware")
    s3 = s3 or store.client()
    p = Plan(now=now)
    lineages = model_lineages(s3, store)
    accesses = access_records(s3, store)
    sv = _Survey(store, policy, now, force_reason, s3, _list_hot(s3, store), accesses)
    _protect_dataset_files(p, sv, lineages)
    _protect_published_models(p, sv)
    settled = _plan_cold(p, sv)
    _plan_hot(p, sv, settled)
    log.info("lifecycle plan at %s: %s, skipped %s", now.date(), p.counts(), dict(p.skipped))
    return p


# ----------------------------------------------------------------------------------- execution

Hook = Callable[[str, Action], None]


@dataclass
class BatchResult:
    batch_id: str
    done: Counter[str] = field(default_factory=Counter)  # outcome -> count
    bytes_moved: int = 0
    errors: list[str] = field(default_factory=list)


def _copy(
    s3: S3Client, a: Action, meta: dict[str, str], content_type: str, *, multipart_threshold: int, part_bytes: int
) -> None:
    src = {"Bucket": a.src_bucket, "Key": a.src_key}
    endpoint = s3.meta.endpoint_url
    if a.size <= multipart_threshold:
        # CopySourceIfMatch in the ETag form this server honours; servers that ignore it are covered
        # by the check after the copy (`_transfer`).
        s3compat.if_match(endpoint, a.etag, lambda etag: s3.copy_object(
            Bucket=a.dst_bucket, Key=a.dst_key, CopySource=src, CopySourceIfMatch=etag,
            MetadataDirective="REPLACE", Metadata=meta, ContentType=content_type,
            StorageClass=a.storage_class,
        ), op="copy")
        return
    up = s3.create_multipart_upload(
        Bucket=a.dst_bucket, Key=a.dst_key, Metadata=meta, ContentType=content_type,
        StorageClass=a.storage_class,
    )
    try:
        parts = []
        for n, start in enumerate(range(0, a.size, part_bytes), 1):
            end = min(start + part_bytes, a.size) - 1
            def part(etag: str, n: int = n, start: int = start, end: int = end) -> Any:
                return s3.upload_part_copy(
                    Bucket=a.dst_bucket, Key=a.dst_key, UploadId=up["UploadId"], PartNumber=n, CopySource=src,
                    CopySourceRange=f"bytes={start}-{end}", CopySourceIfMatch=etag,
                )

            r = s3compat.if_match(endpoint, a.etag, part, op="copy")
            parts.append({"PartNumber": n, "ETag": r["CopyPartResult"]["ETag"]})
        s3.complete_multipart_upload(
            Bucket=a.dst_bucket, Key=a.dst_key, UploadId=up["UploadId"], MultipartUpload={"Parts": parts}
        )
    except Exception:
        s3.abort_multipart_upload(Bucket=a.dst_bucket, Key=a.dst_key, UploadId=up["UploadId"])
        raise


def _holds_plan(dst: dict[str, Any] | None, a: Action) -> bool:
    """Whether an existing destination is a copy of the planned version, by its own evidence: the size, and
    the copy's ETag where both are plain MD5s (a server that ignored CopySourceIfMatch may have written
    other bytes under the recorded `eh-source-etag`); the recorded ETag only where the ETags cannot say."""
    if dst is None or dst["ContentLength"] != a.size:
        return False
    if _etag(dst["ETag"]) == a.etag:
        return True
    if s3compat.is_md5(a.etag) and s3compat.is_md5(dst["ETag"]):
        return False
    return bool(dst["Metadata"].get("eh-source-etag") == a.etag)


def _copy_verified(s3: S3Client, a: Action, dst: dict[str, Any] | None) -> bool:
    """After a copy: its own ETag (the server's MD5 of the copied bytes) is the planned one, or, for ETags
    that are not a plain MD5 (multipart sources), the source still has the planned ETag after the copy."""
    if dst is None or dst["ContentLength"] != a.size:
        return False
    if s3compat.is_md5(a.etag) and s3compat.is_md5(dst["ETag"]):
        return _etag(dst["ETag"]) == a.etag
    after = _head(s3, a.src_bucket, a.src_key)
    return after is not None and _etag(after["ETag"]) == a.etag


def _drop_unverified(s3: S3Client, a: Action, dst: dict[str, Any] | None) -> None:
    """Remove a copy this action made (its `eh-source-etag`) that does not hold the planned version."""
    if dst is not None and dst["Metadata"].get("eh-source-etag") == a.etag:
        s3.delete_object(Bucket=a.dst_bucket, Key=a.dst_key)
        log.warning("%s s3://%s/%s: unverified copy at s3://%s/%s removed", a.kind, a.src_bucket, a.src_key,
                    a.dst_bucket, a.dst_key)


def _source_outcome(s3: S3Client, a: Action, src: dict[str, Any] | None, dst: dict[str, Any] | None,
                    copied: bool) -> str | None:
    """The outcome when the source is gone or is no longer the planned version (None: go on)."""
    if src is None:
        # gone without a verified copy: deleted by someone else since the plan; nothing to move
        if copied:
            return "already done"
        _drop_unverified(s3, a, dst)
        return "skipped: source gone"
    if _etag(src["ETag"]) != a.etag:
        if not copied:
            _drop_unverified(s3, a, dst)  # an interrupted copy of another version
        log.warning("%s s3://%s/%s changed since planned; left for the next plan", a.kind, a.src_bucket, a.src_key)
        return "skipped: changed since planned"
    return None


def _copy_meta(a: Action, src: dict[str, Any], now: datetime) -> dict[str, str]:
    meta = {k: v for k, v in src.get("Metadata", {}).items() if not k.startswith("eh-")}
    if a.kind == "move":
        meta.update({"eh-source": f"{a.src_bucket}/{a.src_key}", "eh-source-etag": a.etag,
                     "eh-created": a.created, "eh-class-since": now.isoformat()})
    else:  # restore: drop the cold bookkeeping, keep the first-written time
        meta["eh-created"] = a.created
        meta["eh-source-etag"] = a.etag
    return meta


def _copy_checked(
    s3: S3Client, a: Action, src: dict[str, Any], now: datetime, *, multipart_threshold: int, part_bytes: int
) -> str | None:
    """Copy the planned version and verify the copy; the outcome when the source changed meanwhile."""
    meta = _copy_meta(a, src, now)
    try:
        _copy(s3, a, meta, src.get("ContentType") or "binary/octet-stream",
              multipart_threshold=multipart_threshold, part_bytes=part_bytes)
    except ClientError as e:
        # the server honoured CopySourceIfMatch: the source changed between the HEAD above and the copy
        if not s3compat.is_precondition_failed(e):
            raise
        log.warning("%s s3://%s/%s changed during the copy (copy refused); left for the next plan",
                    a.kind, a.src_bucket, a.src_key)
        return "skipped: changed since planned"
    dst = _head(s3, a.dst_bucket, a.dst_key)
    if _copy_verified(s3, a, dst):
        return None
    # Some servers ignore CopySourceIfMatch: a source rewritten between the HEAD above and the
    # copy leaves a copy of other bytes under the planned ETag. Whatever is wrong with it (size,
    # ETag, source changed), it is removed before anything else is decided.
    if dst is not None:
        s3.delete_object(Bucket=a.dst_bucket, Key=a.dst_key)
    after = _head(s3, a.src_bucket, a.src_key)
    if after is None or _etag(after["ETag"]) != a.etag:
        log.warning("%s s3://%s/%s changed during the copy; copy removed, left for the next plan",
                    a.kind, a.src_bucket, a.src_key)
        return "skipped: changed since planned"
    raise LifecycleError(f"{a.kind} s3://{a.src_bucket}/{a.src_key}: copy not verified at "
                         f"s3://{a.dst_bucket}/{a.dst_key} (removed; the source is unchanged)")


def _transfer(
    s3: S3Client, a: Action, now: datetime, hook: Hook | None, *, multipart_threshold: int, part_bytes: int
) -> str:
    """Move (hot->cold) or restore (cold->hot) one object; idempotent. Returns the outcome."""
    dst = _head(s3, a.dst_bucket, a.dst_key)
    src = _head(s3, a.src_bucket, a.src_key)
    copied = _holds_plan(dst, a)
    outcome = _source_outcome(s3, a, src, dst, copied)
    if outcome is not None:
        return outcome
    assert src is not None  # _source_outcome answered for a missing source
    if not copied:
        outcome = _copy_checked(s3, a, src, now, multipart_threshold=multipart_threshold, part_bytes=part_bytes)
        if outcome is not None:
            return outcome
    if hook:
        hook("copied", a)
    s3.delete_object(Bucket=a.src_bucket, Key=a.src_key)
    if hook:
        hook("deleted", a)
    return "moved" if a.kind == "move" else "restored"


def _delete(s3: S3Client, a: Action, hook: Hook | None) -> str:
    s3.delete_object(Bucket=a.src_bucket, Key=a.src_key)
    if hook:
        hook("deleted", a)
    if (a.dst_bucket, a.dst_key) != (a.src_bucket, a.src_key):
        s3.delete_object(Bucket=a.dst_bucket, Key=a.dst_key)  # a copy left by an interrupted move
    return "deleted"


def batch_id(actions: list[Action]) -> str:
    h = hashlib.sha256(json.dumps([a.to_json() for a in actions], sort_keys=True).encode())
    return h.hexdigest()[:24]


def _journal_key(store: ObjectStore, bid: str, done: bool = False) -> str:
    return store.key("ops", f"{JOURNAL}{bid}.{'done' if done else 'json'}")


def journal_batch(store: ObjectStore, actions: list[Action], now: datetime, s3: S3Client | None = None) -> str:
    """Write the batch's intent before running it (If-None-Match: an identical replanned batch reuses it)."""
    s3 = s3 or store.client()
    bid = batch_id(actions)
    body = json.dumps({"batch_id": bid, "planned_at": now.isoformat(), "actions": [a.to_json() for a in actions]})
    try:
        s3.put_object(Bucket=store.bucket("ops"), Key=_journal_key(store, bid), Body=body.encode(), IfNoneMatch="*")
    except ClientError as e:
        if error_code(e) not in ("PreconditionFailed", "412"):
            raise
    return bid


def pending_batches(store: ObjectStore, s3: S3Client | None = None) -> dict[str, tuple[datetime, list[Action]]]:
    """Journalled batches without a done marker: the work an interrupted run left."""
    s3 = s3 or store.client()
    keys = {o.key for o in list_objects(s3, store.bucket("ops"), store.key("ops", JOURNAL))}
    out = {}
    for k in sorted(keys):
        if k.endswith(".json") and k.removesuffix(".json") + ".done" not in keys:
            doc = json.loads(s3.get_object(Bucket=store.bucket("ops"), Key=k)["Body"].read())
            out[doc["batch_id"]] = (_iso(doc["planned_at"], datetime.now(UTC)), [Action(**a) for a in doc["actions"]])
    return out


def prune_journal(store: ObjectStore, older_than: datetime, s3: S3Client | None = None) -> int:
    """Delete finished batches (journal + done marker) whose marker is older than `older_than`; returns how many.

    Unfinished batches are never pruned: they are the only record of an interrupted run's intent.
    """
    s3 = s3 or store.client()
    objs = {o.key: o for o in list_objects(s3, store.bucket("ops"), store.key("ops", JOURNAL))}
    n = 0
    for k, o in objs.items():
        if k.endswith(".done") and o.last_modified < older_than:
            for key in (k.removesuffix(".done") + ".json", k):  # intent first: a marker alone is harmless
                s3.delete_object(Bucket=store.bucket("ops"), Key=key)
            n += 1
    return n


def run_batch(
    store: ObjectStore, actions: list[Action], now: datetime, *, hook: Hook | None = None,
    multipart_threshold: int = MULTIPART_THRESHOLD, part_bytes: int = PART_BYTES, s3: S3Client | None = None,
    protected: set[str] | frozenset[str] = frozenset(),
) -> BatchResult:
    """Journal, then carry out a batch of actions; a crash anywhere leaves it for `pending_batches`.

    `protected`: keys a fresh plan found referenced; journalled moves/deletes of them (planned before
    they became referenced) are skipped instead of finished.

    Errors of single objects are collected (the batch stays pending and is retried on the next run);
    anything else the hook raises (a test's simulated crash between two steps) propagates.
    """
    s3 = s3 or store.client()
    bid = journal_batch(store, actions, now, s3)
    res = BatchResult(bid)
    for a in actions:
        if a.kind != "restore" and a.src_key in protected:
            res.done["skipped: now referenced"] += 1
            continue
        try:
            if a.kind == "delete":
                out = _delete(s3, a, hook)
            else:
                out = _transfer(s3, a, now, hook, multipart_threshold=multipart_threshold, part_bytes=part_bytes)
                res.bytes_moved += a.size if out in ("moved", "restored") else 0
            res.done[out] += 1
        except (LifecycleError, ClientError) as e:
            # Name the object and the class: "InvalidArgument ... CopyObject" alone says neither.
            res.errors.append(f"{a.kind} s3://{a.src_bucket}/{a.src_key} -> s3://{a.dst_bucket}/{a.dst_key} "
                              f"(storage class {a.storage_class}): {e}")
    if not res.errors:
        s3.put_object(Bucket=store.bucket("ops"), Key=_journal_key(store, bid, done=True), Body=b"{}")
    log.info("batch %s: %s, %d errors", bid, dict(res.done), len(res.errors))
    return res
