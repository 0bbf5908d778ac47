"""Core ingest's steps as plain functions (no Prefect): read landed manifests, validate a landed bundle,
quarantine a rejected one, fetch the validated bytes again and commit them as one dataset version.

`edgehaul.tasks.core` wraps each step in a task (retries, caching) and `flows/core_ingest.py` orders
them; the fault drills (`edgehaul_dev.drills`) call these same functions, so there is one
implementation of each step and the drills' accounting is a claim about it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from botocore.exceptions import BotoCoreError, ClientError

from edgehaul.bundles import CONTRACT_ID_PATTERN, DAY_PATTERN, BundleError, BundleManifest, id_problem, read_bundle
from edgehaul.contracts import ContractError, ContractInvalid, contract_by_id, max_manifest_bytes
from edgehaul.core import datasets, landed, quarantine
from edgehaul.core.validation import ValidationResult, suite_for, validate_bundles
from edgehaul.core.validation_cache import ValidationCache, entry_for
from edgehaul.platform.io_pool import IO_WORKERS, io_map
from edgehaul.platform.s3_errors import error_code
from edgehaul.platform.settings import get_settings

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from edgehaul.blocks import ObjectStore

log = logging.getLogger(__name__)

# A data object whose manifest is not there yet is still uploading: it waits this long before it is
# quarantined as `manifest_missing` (an uplink resumes for days at worst; a hook may come early).
MANIFEST_WAIT_S = 24 * 3600.0

# The check itself over (bytes, manifest) pairs, one verdict each: one GE run per contract for all of them.
Validator = Callable[[Sequence[tuple[bytes, BundleManifest]]], list[ValidationResult]]


def validate_fresh(items: Sequence[tuple[bytes, BundleManifest]]) -> list[ValidationResult]:
    """The product's validator: `validate_bundles`, decoding only the columns validation reads."""
    return [res for _, res in validate_bundles(items, full_tables=False)]


def landing_owner(store: ObjectStore, key: str) -> tuple[str, str] | str:
    """(node, bundle) of a landing key `<landing base><node>/<day>/<bundle>.parquet`, or why the key is
    not one. The node is the one whose landing prefix holds the object (a node's identity can write only
    there), so this, not a manifest or a row, says who a bundle belongs to."""
    base = store.key("landing", "")
    if not key.startswith(base):
        return f"key {key[:200]!r} is not under the landing prefix {base!r}"
    parts = key[len(base):].split("/")
    if len(parts) != 3 or not parts[2].endswith(".parquet"):
        return f"key {key[:200]!r} is not <node>/<day>/<bundle>.parquet under {base!r}"
    node, day, name = parts
    if not DAY_PATTERN.fullmatch(day):
        return f"key {key[:200]!r}: day {day[:40]!r} is not yyyy-mm-dd"
    problem = id_problem(node, name.removesuffix(".parquet"))
    return f"key {key[:200]!r}: {problem}" if problem else (node, name.removesuffix(".parquet"))


def manifest_problem(owner: tuple[str, str], m: BundleManifest) -> tuple[str, str]:
    """(reason, error) when a manifest's ids are unsafe or disagree with where the bundle landed."""
    node, bundle = owner
    problem = id_problem(m.node_id, m.bundle_id)
    if problem:
        return "bad_id", f"bundle {bundle} of {node}: manifest {problem}"
    if m.node_id != node:
        return "wrong_node", f"bundle {bundle} landed under {node}/ but its manifest says node {m.node_id!r}"
    if m.bundle_id != bundle:
        return "bad_id", f"bundle {bundle} of {node}: manifest says bundle {m.bundle_id!r}"
    if not CONTRACT_ID_PATTERN.fullmatch(m.contract):  # it names a contract file: never a path
        return "bad_id", f"bundle {bundle} of {node}: contract {m.contract[:80]!r} is not <kind>.v<N>"
    return "", ""


def limits_problem(m: BundleManifest, manifest_bytes: int) -> tuple[str, str]:
    """(reason, error) when the manifest's contract is broken (raises), or the manifest exceeds its limits.
    An unknown contract is the bundle's problem: validation quarantines it as `unknown_contract`."""
    try:
        c = contract_by_id(m.contract)
        suite_for(c)  # builds the expectation suite: an unknown expectation is found before anything moves
    except ContractInvalid:
        raise
    except ContractError:
        return "", ""
    for what, have, limit in (("manifest", manifest_bytes, c.max_manifest_bytes), ("rows", m.row_count, c.max_rows),
                              ("bundle bytes", m.nbytes, c.max_bundle_bytes)):
        if have > limit:
            return "too_large", f"bundle {m.bundle_id}: {what} {have} over the {c.id} limit {limit}"
    return "", ""


@dataclass
class LandedScan:
    """What `read_manifests` found for each landing key; every key is in exactly one field."""

    manifests: dict[str, BundleManifest] = field(default_factory=dict)  # ready to validate, parsed once
    rejected: dict[str, tuple[str, str]] = field(default_factory=dict)  # key -> (reason, error): quarantine
    waiting: list[str] = field(default_factory=list)  # data without a manifest yet: left in landing
    skipped: dict[str, str] = field(default_factory=dict)  # not a bundle we can name or move: left, logged
    # quarantined by an earlier run (landing is write-once, so it stays there): key -> what the record says
    quarantined: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # transport trouble reading it: left for the next run


def read_manifests(
    store: ObjectStore, keys: list[str], *, s3: S3Client | None = None, manifest_wait_s: float = MANIFEST_WAIT_S,
    now: datetime | None = None,
) -> LandedScan:
    """Sort landing keys before any key is built from their content: keys that are not
    `<node>/<day>/<bundle>.parquet` with safe ids are skipped; a data object without its manifest waits
    (quarantined as `manifest_missing` once older than `manifest_wait_s`); a manifest that is too large
    (a ranged read: never downloaded whole), malformed, has unsafe ids, names another node or bundle
    than its key, or exceeds its contract's limits is rejected. A bundle with a quarantine record is done
    (`quarantined`), or skipped as `landing_changed` when landing was rewritten after its quarantine.
    A manifest is parsed bounded (`BundleManifest.from_json`: nesting, number length); anything one object
    holds that no check foresaw is that object's rejection, and transport trouble on one key is that key's
    `errors` (left in landing), so no landed object fails the scan for the others.
    Raises ContractInvalid when a manifest names a broken contract, before anything has moved."""
    s3 = s3 or store.client(max_pool_connections=IO_WORKERS)
    bucket = store.bucket("landing")
    now = now or datetime.now(UTC)
    limit = max_manifest_bytes()

    def scan(key: str) -> tuple[str, Any]:
        """(field of LandedScan, value) for one key; whatever one object holds is its own verdict, never the
        run's failure (only a broken contract file, the operator's, fails the run)."""
        try:
            return look(key)
        except ContractInvalid:
            raise
        except (ClientError, BotoCoreError) as e:
            return "errors", f"{type(e).__name__}: {str(e)[:300]}"
        except Exception as e:  # bytes no check foresaw: quarantined with what broke
            return "rejected", ("unreadable", f"{quarantine.manifest_key_for(key)}: {type(e).__name__}: {str(e)[:300]}")

    def look(key: str) -> tuple[str, Any]:
        owner = landing_owner(store, key)
        if isinstance(owner, str):
            return "skipped", owner
        done = quarantine.landing_state(store, key, s3=s3)
        if done is not None:
            return ("quarantined", done[1]) if done[0] == "quarantined" else ("skipped", f"{done[0]}: {done[1]}")
        mkey = quarantine.manifest_key_for(key)
        try:
            raw = landed.read_limited(s3, bucket, mkey, limit)
        except landed.TooLarge:
            return "rejected", ("too_large", f"manifest {mkey} is larger than {limit} bytes")
        except ClientError as e:
            if error_code(e) not in ("NoSuchKey", "404", "NotFound"):
                raise
            age = _age_s(s3, bucket, key, now)
            if age is None:
                return "skipped", f"no object {key} (nor its manifest) in landing"
            if age < manifest_wait_s:
                return "waiting", None
            return "rejected", ("manifest_missing", f"manifest {mkey} missing {age / 3600:.1f} h after the data "
                                                    f"(limit {manifest_wait_s / 3600:.1f} h)")
        try:
            m = BundleManifest.from_json(raw)
        except BundleError as e:
            return "rejected", ("unreadable", f"{mkey}: {e}")
        reason, error = manifest_problem(owner, m)
        if not reason:
            reason, error = limits_problem(m, len(raw))  # raises ContractInvalid for a broken contract
        return ("rejected", (reason, error)) if reason else ("manifests", m)

    out = LandedScan()
    keys = list(dict.fromkeys(keys))
    for key, (where, value) in zip(keys, io_map(scan, keys), strict=True):  # reads in parallel, verdicts in order
        if where == "waiting":
            out.waiting.append(key)
        else:
            getattr(out, where)[key] = value
    return out


def _age_s(s3: S3Client, bucket: str, key: str, now: datetime) -> float | None:
    """Seconds since the object was written; None when there is no such object."""
    try:
        head = s3.head_object(Bucket=bucket, Key=key)
    except ClientError as e:
        if error_code(e) in ("NoSuchKey", "404", "NotFound"):
            return None
        raise
    return (now - head["LastModified"]).total_seconds()


def unreadable(key: str, error: str, reason: str = "unreadable") -> ValidationResult:
    """The rejection of a bundle whose manifest cannot be used (node and bundle from its key)."""
    node, bundle = quarantine.ids_from_key(key)
    return ValidationResult(bundle_id=bundle, node_id=node, contract="", contract_sha256="", bundle_sha256="", rows=0,
                            success=False, reason=reason, error=error)


def _manifest_rejection(key: str, m: BundleManifest) -> dict[str, Any] | None:
    """The manifest as a task input, checked again against its landing key (`read_manifests` sorted these out):
    the rejection (a ValidationResult dict) when its fields or ids disagree with the key."""
    m.check_types()
    reason, error = manifest_problem(quarantine.ids_from_key(key), m)
    return unreadable(key, error, reason).to_dict() if reason else None


def _fetch_rejection(m: BundleManifest, lb: landed.LandedBundle) -> dict[str, Any]:
    """The rejection of a bundle whose bytes could not be read (missing, over its limit)."""
    return ValidationResult(
        bundle_id=m.bundle_id, node_id=m.node_id, contract=m.contract, contract_sha256="", bundle_sha256="",
        rows=m.row_count, success=False, reason="too_large" if lb.too_large else "unreadable", error=lb.error,
    ).to_dict()


@dataclass
class ValidatedBatch:
    """What `validate_landed_many` made of each key; every key is in exactly one of passed, rejected, errors."""

    passed: dict[str, ValidationResult] = field(default_factory=dict)
    rejected: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> the rejection (a ValidationResult dict)
    errors: dict[str, str] = field(default_factory=dict)  # transport trouble after the client's retries: left in landing
    cached: list[str] = field(default_factory=list)  # the passed keys served from the cache


def validate_landed_many(
    store: ObjectStore, items: Sequence[tuple[str, BundleManifest]], *, cache: ValidationCache | None = None,
    refresh: bool = False, s3: S3Client | None = None, workers: int = IO_WORKERS, validate: Validator = validate_fresh,
) -> ValidatedBatch:
    """Validate landed bundles: each manifest against its landing key, then the bytes (checksum, manifest
    row count and sample ids, schema, rows, the contract's expectation suite) with one Great Expectations
    run for all of them (`validate`) and their reads `workers` at a time. A bundle with a usable cached
    success (`cache`, unless `refresh`) is not fetched; each new success is cached. Bad data is a
    rejection, never an exception; a broken contract raises ContractInvalid; a bundle whose reads keep
    failing (transport, after the client's retries) is in `errors`, left in landing for the next run."""
    s3 = s3 or store.client(max_pool_connections=workers)
    out = ValidatedBatch()
    todo: list[tuple[str, BundleManifest]] = []
    for key, m in items:
        rejection = _manifest_rejection(key, m)
        if rejection:
            out.rejected[key] = rejection
        else:
            todo.append((key, m))

    def look(item: tuple[str, BundleManifest]) -> tuple[str, ValidationResult | landed.LandedBundle | str]:
        key, manifest = item
        try:
            entry = ""
            if cache is not None:
                entry = entry_for(store, key, manifest, s3=s3)
                hit = None if refresh else cache.get(entry, manifest)
                if hit is not None:
                    return entry, hit
            return entry, landed.fetch(store, key, s3=s3)
        except (ClientError, BotoCoreError) as e:
            return "", f"{type(e).__name__}: {str(e)[:300]}"

    looked = io_map(look, todo, workers)
    fresh: list[tuple[str, str, BundleManifest, bytes]] = []
    for (key, m), (entry, got) in zip(todo, looked, strict=True):
        if isinstance(got, ValidationResult):
            out.passed[key] = got
            out.cached.append(key)
        elif isinstance(got, str):
            out.errors[key] = got
        elif got.data is None:
            out.rejected[key] = _fetch_rejection(m, got)
        else:
            fresh.append((key, entry, m, got.data))
    # one GE run per contract for all of them; a ContractInvalid (the contract is broken) propagates
    verdicts = validate([(data, m) for _, _, m, data in fresh]) if fresh else []
    to_cache: list[tuple[str, ValidationResult]] = []
    for (key, entry, _, _), result in zip(fresh, verdicts, strict=True):
        if result.success:
            out.passed[key] = result
            if cache is not None:
                to_cache.append((entry, result))
        else:
            out.rejected[key] = result.to_dict()
    if cache is not None and to_cache:
        io_map(lambda er: cache.put(*er), to_cache, workers)
    return out


def quarantine_rejected(
    store: ObjectStore, key: str, result: dict[str, Any], m: BundleManifest | None, *,
    s3: S3Client | None = None, emit_event: bool = True,
) -> dict[str, Any]:
    """Move a rejected bundle to quarantine with its validation record; returns the record."""
    ids = None
    if m is None:  # no usable manifest: account for the samples from the file itself when it parses
        lb = landed.fetch(store, key, s3=s3)
        if lb.data is not None:
            try:  # bounded as validation reads (the bytes may be a bomb); only the ids column
                ids = [str(i) for i in read_bundle(lb.data, columns=["sample_id"]).column("sample_id").to_pylist()]
            except Exception:  # unreadable in any way: the record says the ids are not known
                ids = None
    record = quarantine.quarantine_bundle(store, key, ValidationResult.from_dict(result), m, ids, s3=s3,
                                          emit_event=emit_event)
    return asdict(record)


def fetch_validated(
    store: ObjectStore, validated: list[tuple[str, ValidationResult]], *, s3: S3Client | None = None,
) -> list[datasets.ValidatedBundle]:
    """Fetch the validated bundles again (by reference) and check they are the bytes that were validated."""
    s3 = s3 or store.client(max_pool_connections=IO_WORKERS)

    def check(item: tuple[str, ValidationResult]) -> datasets.ValidatedBundle | None:
        key, result = item
        lb = landed.fetch(store, key, s3=s3)
        # A store may let a node rewrite or delete its landed objects (see docs/SECURITY.md): what changed
        # since validation is not committed, and not this run's to fail on. Left to the next run, which
        # validates what is there then (a bundle id enters a dataset once: the Delta txn per bundle).
        if lb.data is None or lb.manifest is None:  # gone (the janitor, or a store that let its node delete) or garbled
            log.warning("bundle %s: %s since validation (%s); not committed", key,
                        "landing_vanished" if "missing" in lb.error else "landing_changed", lb.error[:200])
            return None
        # read_bundle re-checks the checksum against the manifest; the manifest must be the validated one
        if lb.manifest.sha256 != result.bundle_sha256:
            log.warning("bundle %s: landing_changed since validation (sha256 %s -> %s); not committed, left for the "
                        "next run", key, result.bundle_sha256[:12], lb.manifest.sha256[:12])
            return None
        try:
            table = read_bundle(lb.data, lb.manifest)
        except BundleError as e:  # the data object was rewritten under the validated manifest
            log.warning("bundle %s: landing_changed since validation (%s); not committed, left for the next run",
                        key, str(e)[:200])
            return None
        reason, error = manifest_problem(quarantine.ids_from_key(key), lb.manifest)
        if reason or lb.manifest.node_id != result.node_id:
            # the manifest was rewritten since validation (same bytes, other owner or id): not this run's to
            # commit; left in landing, the next run validates it again (and quarantines it)
            log.warning("bundle %s: manifest changed since validation (%s); left for the next run", key,
                        error or f"node {result.node_id} -> {lb.manifest.node_id}")
            return None
        return datasets.ValidatedBundle(lb.manifest, table, result)

    return [b for b in io_map(check, validated) if b is not None]


def commit_validated(
    store: ObjectStore, contract_id: str, validated: list[tuple[str, ValidationResult]], run_id: str, lease_s: float,
    *, s3: S3Client | None = None,
) -> datasets.CommitResult:
    """Append the validated bundles of one contract to its dataset in one commit (see `fetch_validated`)."""
    contract = contract_by_id(contract_id)
    s3 = s3 or store.client(max_pool_connections=IO_WORKERS)
    items = fetch_validated(store, validated, s3=s3)
    return datasets.commit_bundles(store, contract, items, run_id=run_id, lease_s=lease_s, s3=s3)


# ---------------------------------------------------------------- catching up


@dataclass(frozen=True)
class QueuedBatch:
    """The landing keys of a core ingest run still waiting to start (a trigger's batch)."""

    run_id: str
    keys: tuple[str, ...]


def take_queued(own: list[str], queued: list[QueuedBatch], bound: int) -> tuple[list[str], list[QueuedBatch]]:
    """(keys, taken): this run's own keys, then the keys of whole queued batches, oldest first, while the
    total stays within `bound`. A batch is taken whole or not at all, so a taken batch can be completed
    once all its keys are settled; a batch that does not fit is left to its own run."""
    keys = list(dict.fromkeys(own))
    seen = set(keys)
    taken = []
    for b in queued:
        new = [k for k in dict.fromkeys(b.keys) if k not in seen]
        if len(keys) + len(new) > bound:
            continue  # a smaller one behind it may still fit
        keys += new
        seen.update(new)
        taken.append(b)
    return keys, taken


def _batch_claim_key(store: ObjectStore, run_id: str) -> str:
    return store.key("curated", f"_claims/_batches/{run_id}.json")


def claim_batches(
    store: ObjectStore, batches: list[QueuedBatch], taker: str, *, s3: S3Client | None = None,
) -> list[QueuedBatch]:
    """The batches this run wins: a conditional PUT (If-None-Match) of `_claims/_batches/<run>.json` per
    batch, as bundles are claimed, so runs starting together split the queue instead of all validating
    the same bundles. A batch lost here is another run's; its own run still does it if nobody completes it
    (a taker that dies leaves the queued run as it was)."""
    s3 = s3 or store.client()
    won = []
    for b in batches:
        body = json.dumps({"run": taker, "at": time.time()}).encode()
        try:
            s3.put_object(Bucket=store.bucket("curated"), Key=_batch_claim_key(store, b.run_id), Body=body,
                          IfNoneMatch="*")
        except ClientError as e:
            if error_code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                continue
            raise
        won.append(b)
    return won


def release_batch_claims(store: ObjectStore, batches: list[QueuedBatch], *, s3: S3Client | None = None) -> None:
    """Drop a run's batch claims when it ends: a claim only keeps runs starting together apart, and its batch
    is then either settled (its run completed, or finding everything committed) or free to be taken again."""
    s3 = s3 or store.client()
    for b in batches:
        try:
            s3.delete_object(Bucket=store.bucket("curated"), Key=_batch_claim_key(store, b.run_id))
        except ClientError as e:  # a claim left behind costs one small object, never a bundle
            log.warning("batch claim of run %s kept (%s)", b.run_id, e)


def settled_batches(taken: list[QueuedBatch], unsettled: set[str]) -> list[QueuedBatch]:
    """The taken batches none of whose keys is unsettled (still waiting for a manifest, deferred to another
    live run, or left after an error): their own runs have nothing left to do."""
    return [b for b in taken if not unsettled.intersection(b.keys)]


def settled(store: ObjectStore, keys: list[str], *, s3: S3Client | None = None) -> set[str]:
    """The landing keys whose bundle is already settled: committed in any kind's dataset, or quarantined.

    For a sweep of landing: no read per bundle, only one listing of the quarantine records and each dataset's
    transaction index (kept open by the process, caught up incrementally), so a sweep that finds nothing new
    costs a few listings. A (node, bundle id) pair is in one kind's dataset at most, so each kind is asked for all."""
    s3 = s3 or store.client()
    owners = {k: o for k in keys if not isinstance(o := landing_owner(store, k), str)}
    qbase = store.key("quarantine", "")
    quarantined = {tuple(k[len(qbase):].split("/")[:2]) for k in quarantine._record_keys(s3, store)}
    done = {k for k, o in owners.items() if o in quarantined}
    refs: list[datasets.Ref] = sorted({(n, b) for k, (n, b) in owners.items() if k not in done})
    kinds = sorted({p.stem.rpartition(".v")[0] for p in get_settings().contracts_dir.glob("*.v*.yaml")})
    committed: set[datasets.Ref] = set()
    for kind in kinds:
        if not refs:
            break
        try:
            committed |= datasets.committed_bundle_ids(store, kind, refs, s3=s3)
        except datasets.DatasetError:
            continue  # no dataset of that kind yet
    return done | {k for k, o in owners.items() if o in committed}


def already_committed(
    store: ObjectStore, manifests: dict[str, BundleManifest], *, s3: S3Client | None = None,
) -> dict[str, str]:
    """key -> bundle id of the bundles whose dataset already holds them (one index lookup per bundle on the
    process's open table, see `datasets.committed_bundle_ids`): a run skips them before validating."""
    by_contract: dict[str, dict[datasets.Ref, str]] = {}
    for key, m in manifests.items():  # a bundle id is unique per node only
        by_contract.setdefault(m.contract, {})[(m.node_id, m.bundle_id)] = key
    out: dict[str, str] = {}
    for contract_id, ids in sorted(by_contract.items()):
        try:
            kind = contract_by_id(contract_id).kind
        except ContractError:
            continue  # validation quarantines it as unknown_contract
        try:
            done = datasets.committed_bundle_ids(store, kind, sorted(ids), s3=s3)
        except datasets.DatasetError:
            continue  # no dataset yet: nothing committed
        out.update({ids[r]: r[1] for r in done})
    return out
