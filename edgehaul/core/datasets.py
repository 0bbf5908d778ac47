"""Versioned curated datasets: one Delta Lake table per observation kind in the object store.

A dataset version is a Delta version. Commits are Delta's own optimistic concurrency on S3
conditional writes (`If-None-Match: *` on the next `_delta_log/<version>.json`): two ingest runs
appending at once both land, one after the other, with no lock service. Each ingest run makes one
commit that carries its lineage in `commitInfo` (custom metadata, see `COMMIT_KEYS`).

The dataset table is the contract's bundle schema plus one column, `bundle_id` (which bundle a row
came from): lineage version -> bundles -> nodes is then a query over the data of any version, and it
survives compaction (which rewrites files but keeps rows).

A column added to the bundle schema later (`contracts.ADDED_COLUMNS`, e.g. `inclusion_p`) joins an
existing table through a Delta schema merge in the first commit that carries it: history is not
rewritten, older rows read it as null (= its default by definition), older versions read as they were
(docs/MIGRATIONS.md).

A bundle enters a dataset once. Each commit also records one Delta transaction id per bundle
(`txn` action, app id `edgehaul/bundle/<id>`), so "already committed?" is a lookup in the table
snapshot, independent of table size. Delta does not treat two concurrent commits of the same app id
as a conflict, so before committing, a run claims each bundle with a conditional PUT of
`datasets/_claims/<kind>/<bundle>.json`: exactly one of two racing runs wins; the other skips the
bundle (committed) or defers it (claim held by a live run; taken over when older than the lease,
which covers a run killed mid-commit).

A sample id enters a dataset once, too. A commit checks its bundles' sample ids against the table
version it is based on (the handle's id index, see `TableHandle.sample_index`) and against each other;
a duplicate row is dropped (the rest of its bundle commits) and named in a record
(`quarantine.record_duplicates`). The commit is attempted at exactly base + 1 (no delta-rs rebase):
a lost race refreshes the table and checks the ids again against what the winner added.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from botocore.exceptions import ClientError
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from edgehaul.bundles import BundleManifest, conform
from edgehaul.contracts import ADDED_COLUMNS, Contract
from edgehaul.core import quarantine
from edgehaul.core.validation import ValidationResult
from edgehaul.platform import s3compat
from edgehaul.platform.s3_errors import error_code

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from edgehaul.blocks import ObjectStore

log = logging.getLogger(__name__)

BUNDLE_ID_COLUMN = "bundle_id"
COMMIT_KEYS = ("edgehaul.commit_id", "edgehaul.run", "edgehaul.contract", "edgehaul.contract_sha256",
               "edgehaul.bundles", "edgehaul.nodes", "edgehaul.validation", "edgehaul.stats")
DEFAULT_LEASE_S = 900.0
CHECKPOINT_INTERVAL = 10
COMMIT_ATTEMPTS = 50  # lost races before a commit gives up (each one re-checks the sample ids)

Reader = Literal["pyarrow", "polars", "duckdb"]


class DatasetError(ValueError):
    """A commit or read of a dataset cannot proceed (schema mismatch, unknown version, ...)."""


def dataset_schema(contract: Contract) -> pa.Schema:
    schema = contract.bundle_schema
    # Added columns are nullable in a table: the rows committed before they existed have none.
    fields = [f.with_nullable(True) if f.name in ADDED_COLUMNS else f for f in schema]
    return pa.schema([*fields, pa.field(BUNDLE_ID_COLUMN, pa.string(), nullable=False)], metadata=schema.metadata)


def columns_to_add(dt: DeltaTable, contract: Contract) -> list[str]:
    """Columns of the contract's dataset schema an older table lacks (added by the next commit's merge)."""
    have = set(pa.schema(dt.schema()).names)
    return [n for n in dataset_schema(contract).names if n not in have]


def table_uri(store: ObjectStore, kind: str) -> str:
    return store.uri("curated", kind)


def txn_app_id(bundle_id: str) -> str:
    return f"edgehaul/bundle/{bundle_id}"


def open_uri(uri: str, storage_options: dict[str, str], version: int | None = None) -> DeltaTable:
    """A dataset table (at `version`, else the latest) by URI: for readers that hold no store block
    (training processes, outside readers). Errors are `DatasetError`s naming the table and version."""
    try:
        return DeltaTable(uri, version=version, storage_options=storage_options)
    except TableNotFoundError as e:
        raise DatasetError(f"no dataset at {uri}: {e}") from e
    except DeltaError as e:
        raise DatasetError(f"cannot open {uri} at version {version}: {e}") from e


def open_table(store: ObjectStore, kind: str, version: int | str | datetime | None = None) -> DeltaTable:
    """The one way to open a dataset version (training, lifecycle and compaction go through here or
    `open_uri`): the latest, a version number, or the version current at a time."""
    try:
        dt = open_uri(table_uri(store, kind), store.storage_options())
    except DatasetError as e:
        raise DatasetError(f"no dataset for kind {kind!r} at {table_uri(store, kind)}") from e
    if version is not None:
        try:
            dt.load_as_version(version)
        except (DeltaError, ValueError, OSError) as e:
            raise DatasetError(f"dataset {kind}: no version {version!r} ({e})") from e
        if isinstance(version, datetime):
            # delta-rs falls back to version 0 for a time before the table existed; that is no version.
            created_ms = int(_commit_json(store, kind, dt.version())["timestamp"])
            if version.timestamp() * 1000 < created_ms:
                raise DatasetError(f"dataset {kind}: no version at {version.isoformat()} (version "
                                   f"{dt.version()} was committed at {datetime.fromtimestamp(created_ms / 1000, UTC)})")
    return dt


def ensure_table(store: ObjectStore, contract: Contract) -> DeltaTable:
    """Open the kind's table, creating it on first use. Two creators racing: the `_delta_log/0.json`
    conditional PUT lets one win; the loser re-opens the winner's table (and checks its schema)."""
    uri, opts = table_uri(store, contract.kind), store.storage_options()
    want = dataset_schema(contract)
    try:
        dt = DeltaTable(uri, storage_options=opts)
    except TableNotFoundError:
        try:
            dt = DeltaTable.create(
                uri, want, mode="error", storage_options=opts, name=contract.kind,
                # A fresh reader replays at most this many commits after the last checkpoint: this
                # bounds the requests of every commit (which first loads the table) whatever its size.
                configuration={"delta.checkpointInterval": str(CHECKPOINT_INTERVAL)},
                description=f"edgehaul curated dataset of {contract.kind}",
                commit_properties=CommitProperties(custom_metadata={"edgehaul.contract": contract.id}),
            )
            log.info("created dataset table %s", uri)
            return dt
        except (DeltaError, OSError) as e:
            log.info("dataset table %s created concurrently (%s); re-opening", uri, type(e).__name__)
            dt = DeltaTable(uri, storage_options=opts)
    have = pa.schema(dt.schema())
    # Order aside (a merge appends its columns): the same columns, or older ones lacking only added ones.
    lacking = [n for n in want.names if n not in have.names]
    if [n for n in have.names if n not in want.names] or [n for n in lacking if n not in ADDED_COLUMNS]:
        raise DatasetError(
            f"dataset {contract.kind}: table columns {have.names} differ from contract {contract.id} {want.names}"
        )
    return dt


# ---------------------------------------------------------------- the process's open tables


class TableHandle:
    """A dataset table kept open in this process, with an index of its Delta `txn` app ids.

    Opening a Delta table reads its checkpoint, which grows with the number of files, and
    `DeltaTable.transaction_version` scans checkpoint + log again on every call. A commit through a
    handle instead refreshes incrementally (a LIST and the commits made since, by others) and answers
    "is this bundle committed?" from the index: its request count no longer depends on the table's size.
    The index is built once per process from the latest checkpoint's `txn` column plus the commits
    after it, then kept up to date from each new commit's JSON (one GET each).
    Use under `lock`: a DeltaTable is not meant for concurrent writers in one process.
    """

    def __init__(self, store: ObjectStore, kind: str, dt: DeltaTable, s3: S3Client) -> None:
        self.store, self.kind, self.dt = store, kind, dt
        self.lock = threading.Lock()
        self.txns: dict[str, int] = {}
        self.indexed_upto = -1  # the index holds every txn of versions <= this
        self.exact = True  # False: the index could not be built; fall back to delta-rs lookups
        self.samples: dict[str, str] | None = None  # sample id -> bundle id, built on first commit
        self.samples_upto = -1
        try:
            self.indexed_upto, self.txns = _checkpoint_txns(store, kind, s3)
        except (DatasetError, ClientError, pa.ArrowException, ValueError, KeyError) as e:
            log.warning("dataset %s: no transaction index (%s); using per-bundle log scans", kind, e)
            self.exact = False
        self._index(s3)

    def _index(self, s3: S3Client) -> dict[int, dict[str, Any]]:
        """Fold the txns of versions after the index into it; returns those versions' commitInfo."""
        infos: dict[int, dict[str, Any]] = {}
        if not self.exact:
            return infos
        for v in range(self.indexed_upto + 1, self.dt.version() + 1):
            actions = _log_actions(self.store, self.kind, v, s3)
            for a in actions:
                if "txn" in a:
                    self.txns[str(a["txn"]["appId"])] = int(a["txn"]["version"])
                elif "commitInfo" in a:
                    infos[v] = dict(a["commitInfo"])
            self.indexed_upto = v
        return infos

    def refresh(self, s3: S3Client) -> None:
        """Catch up with commits made since (by other processes): one LIST when there are none."""
        self.dt.update_incremental()
        if self.dt.version() < self.indexed_upto:  # the table was recreated under us: start again
            raise DatasetError(f"dataset {self.kind}: version went back from {self.indexed_upto} to {self.dt.version()}")
        self._index(s3)

    def sample_index(self, s3: S3Client) -> dict[str, str]:
        """sample id -> bundle id of every row of the handle's current version. Built once (the two id
        columns of the table), then folded forward from each new version's added files; a version
        that removes data rows (a delete, not a compaction) makes it rebuild."""
        v = self.dt.version()
        if self.samples is not None and v > self.samples_upto:
            added: list[str] = []
            for u in range(self.samples_upto + 1, v + 1):
                actions = _log_actions(self.store, self.kind, u, s3)
                if any(a.get("remove", {}).get("dataChange", False) for a in actions):
                    self.samples = None
                    break
                added += [a["add"]["path"] for a in actions if "add" in a and a["add"].get("dataChange", True)]
            if self.samples is not None:
                for path in added:
                    self._fold(_read_ids(self.store, self.kind, path, s3))
                self.samples_upto = v
        if self.samples is None:
            self.samples = {}
            self._fold(self.dt.to_pyarrow_dataset().to_table(columns=["sample_id", BUNDLE_ID_COLUMN]))
            self.samples_upto = v
        return self.samples

    def note_commit(self, version: int, data: pa.Table) -> None:
        """Our own commit at `version`: fold its rows into the id index without reading them back, when
        the index was current just before it (else the next `sample_index` reads what it missed)."""
        if self.samples is not None and self.samples_upto == version - 1:
            self._fold(data.select(["sample_id", BUNDLE_ID_COLUMN]))
            self.samples_upto = version

    def _fold(self, ids: pa.Table) -> None:
        assert self.samples is not None
        bundles = {b: sys.intern(b) for b in pc.unique(ids.column(BUNDLE_ID_COLUMN)).to_pylist()}
        for sid, b in zip(ids.column("sample_id").to_pylist(), ids.column(BUNDLE_ID_COLUMN).to_pylist(), strict=True):
            self.samples[sid] = bundles[b]

    def is_committed(self, bundle_id: str) -> bool:
        if self.exact:
            return txn_app_id(bundle_id) in self.txns
        return self.dt.transaction_version(txn_app_id(bundle_id)) is not None

    def absorb(self, s3: S3Client, commit_id: str, *, after: int) -> int:
        """After our write: index the new versions and return the one carrying `commit_id`."""
        infos = self._index(s3)
        for v in sorted(infos, reverse=True):
            if infos[v].get("edgehaul.commit_id") == commit_id:
                return v
        return find_commit(self.store, self.kind, commit_id, after=after, upto=self.dt.version())


_HANDLES: dict[tuple[int, str, str], TableHandle] = {}
_HANDLES_LOCK = threading.Lock()


def _handle_key(store: ObjectStore, kind: str) -> tuple[int, str, str]:
    # pid: a forked child must not reuse its parent's open table (the Rust runtime does not survive fork)
    opts = json.dumps(store.storage_options(), sort_keys=True)
    return os.getpid(), table_uri(store, kind), hashlib.sha256(opts.encode()).hexdigest()


def table_handle(store: ObjectStore, contract: Contract, *, s3: S3Client | None = None) -> TableHandle:
    """The process's open handle on a kind's table (created on first use, see `ensure_table`)."""
    return _handle(store, contract.kind, lambda: ensure_table(store, contract), s3 or store.client())


def _handle(store: ObjectStore, kind: str, opener: Callable[[], DeltaTable], s3: S3Client) -> TableHandle:
    key = _handle_key(store, kind)
    with _HANDLES_LOCK:
        h = _HANDLES.get(key)
    if h is None:
        h = TableHandle(store, kind, opener(), s3)
        with _HANDLES_LOCK:
            h = _HANDLES.setdefault(key, h)
    return h


def forget_handle(store: ObjectStore, kind: str) -> None:
    """Drop the process's open handle (after a failed commit: its state is no longer trusted)."""
    with _HANDLES_LOCK:
        _HANDLES.pop(_handle_key(store, kind), None)


def _log_actions(store: ObjectStore, kind: str, version: int, s3: S3Client) -> list[dict[str, Any]]:
    key = store.key("curated", f"{kind}/_delta_log/{version:020d}.json")
    try:
        body = s3.get_object(Bucket=store.bucket("curated"), Key=key)["Body"].read()
    except ClientError as e:
        raise DatasetError(f"dataset {kind}: no commit log entry for version {version} ({key})") from e
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def _read_ids(store: ObjectStore, kind: str, path: str, s3: S3Client) -> pa.Table:
    """The sample and bundle ids of one data file of the table (a relative `add` path)."""
    from urllib.parse import unquote

    key = store.key("curated", f"{kind}/{unquote(path)}")
    body = s3.get_object(Bucket=store.bucket("curated"), Key=key)["Body"].read()
    return pq.read_table(io.BytesIO(body), columns=["sample_id", BUNDLE_ID_COLUMN])


def _checkpoint_txns(store: ObjectStore, kind: str, s3: S3Client) -> tuple[int, dict[str, int]]:
    """(checkpoint version, app id -> txn version) from the latest classic checkpoint; (-1, {}) when
    there is none yet. A checkpoint holds the reconciled txn set of every version up to its own."""
    bucket, log_dir = store.bucket("curated"), store.key("curated", f"{kind}/_delta_log/")
    try:
        last = json.loads(s3.get_object(Bucket=bucket, Key=log_dir + "_last_checkpoint")["Body"].read())
    except ClientError as e:
        if error_code(e) in ("NoSuchKey", "404", "NotFound"):
            return -1, {}
        raise
    if "v2Checkpoint" in last:
        raise DatasetError("V2 checkpoints are not indexed")
    v, parts = int(last["version"]), int(last.get("parts") or 0)
    names = ([f"{v:020d}.checkpoint.{i:010d}.{parts:010d}.parquet" for i in range(1, parts + 1)] if parts
             else [f"{v:020d}.checkpoint.parquet"])
    txns: dict[str, int] = {}
    for name in names:
        body = s3.get_object(Bucket=bucket, Key=log_dir + name)["Body"].read()
        col = pq.read_table(io.BytesIO(body), columns=["txn"]).column("txn")
        for t in col.drop_null().to_pylist():
            txns[str(t["appId"])] = int(t["version"])
    return v, txns


# ---------------------------------------------------------------- claims (one committer per bundle)


def _claim_key(store: ObjectStore, kind: str, bundle_id: str) -> str:
    return store.key("curated", f"_claims/{kind}/{bundle_id}.json")


@dataclass
class Claims:
    claimed: list[str] = field(default_factory=list)
    committed: list[str] = field(default_factory=list)  # already in the table: no-op
    deferred: list[str] = field(default_factory=list)  # a live run holds the claim: try again later


def claim_bundles(
    store: ObjectStore, dt: DeltaTable, kind: str, bundle_ids: list[str], run_id: str, *,
    lease_s: float = DEFAULT_LEASE_S, s3: S3Client | None = None, handle: TableHandle | None = None,
) -> Claims:
    """Claim each bundle for this run. `handle` (the process's cached table, see `table_handle`) answers
    "already committed?" from its transaction index; without one, every lookup scans the Delta log."""
    s3 = s3 or store.client()
    bucket = store.bucket("curated")
    out = Claims()

    def committed(b: str) -> bool:
        return handle.is_committed(b) if handle else dt.transaction_version(txn_app_id(b)) is not None

    def refresh() -> None:
        if handle:
            handle.refresh(s3)
        else:
            dt.update_incremental()

    for b in bundle_ids:
        if committed(b):
            out.committed.append(b)
            continue
        key = _claim_key(store, kind, b)
        body = json.dumps({"run": run_id, "at": time.time()}).encode()
        try:
            s3.put_object(Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")
            out.claimed.append(b)
            continue
        except ClientError as e:
            if error_code(e) not in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise
        held = s3.get_object(Bucket=bucket, Key=key)
        doc = _claim_doc(held["Body"].read(), held["LastModified"])
        refresh()
        if committed(b):
            out.committed.append(b)
        elif doc.get("run") == run_id:
            out.claimed.append(b)  # our own claim from an earlier attempt of this run
        elif time.time() - float(doc.get("at", 0)) < lease_s:
            out.deferred.append(b)
        else:
            # Stale claim (its run died before committing): take it over, conditionally, with If-Match
            # in the ETag form this server honours (some answer 412 to the quoted form boto3 returns).
            def take_over(etag: str, key: str = key, body: bytes = body) -> Any:
                return s3.put_object(Bucket=bucket, Key=key, Body=body, IfMatch=etag)

            try:
                s3compat.if_match(store.endpoint_url, held["ETag"], take_over)
                out.claimed.append(b)
            except ClientError as e:
                if not s3compat.is_precondition_failed(e):
                    raise
                now = s3.head_object(Bucket=bucket, Key=key)
                if s3compat.unquoted(now.get("ETag")) == s3compat.unquoted(held["ETag"]):
                    # Unchanged, yet every If-Match form was refused: waiting cannot help, say so.
                    raise DatasetError(
                        f"dataset {kind}: the store at {store.endpoint_url or 'AWS'} refuses If-Match on an unchanged "
                        f"object, so the stale claim on bundle {b} can never be taken over; the product needs "
                        "conditional PUT with If-Match (see docs/STORAGE.md, `edgehaul store check`)") from e
                out.deferred.append(b)  # another run took it over first
    return out


def release_claims(store: ObjectStore, kind: str, handle: TableHandle, bundle_ids: list[str], s3: S3Client) -> int:
    """After a failed commit, give back this run's claims so the next run commits those bundles at once
    instead of deferring them for the whole lease. A bundle the refreshed table holds after all (the
    commit landed despite the error) keeps its claim; so do all of them when the table cannot be read
    now (the lease then frees them). Returns how many claims were released."""
    try:
        handle.refresh(s3)
    except (DeltaError, DatasetError, ClientError, OSError) as e:
        log.warning("dataset %s: claims kept until their lease ends (table unreadable: %s)", kind, e)
        return 0
    released = 0
    for b in bundle_ids:
        if handle.is_committed(b):
            continue
        try:
            s3.delete_object(Bucket=store.bucket("curated"), Key=_claim_key(store, kind, b))
            released += 1
        except ClientError as e:
            log.warning("dataset %s: claim on %s kept until its lease ends (%s)", kind, b, e)
    return released


def _claim_doc(raw: bytes, last_modified: datetime) -> dict[str, Any]:
    """A claim's content; an unreadable one (some stores keep a 0-byte object when the claimant died
    mid-PUT) counts as a claim by nobody, aged from its last-modified time, so its lease runs out."""
    try:
        doc = json.loads(raw)
        if isinstance(doc, dict) and "at" in doc:
            return doc
    except ValueError:
        pass
    return {"run": None, "at": last_modified.timestamp()}


# ---------------------------------------------------------------- commit


@dataclass(frozen=True)
class CommitResult:
    kind: str
    version: int | None  # None: nothing new to commit
    parent: int | None
    commit_id: str
    bundles: list[str]
    nodes: list[str]
    rows: int
    already_committed: list[str]
    deferred: list[str]
    stats: dict[str, Any]
    seconds: float
    duplicates: dict[str, list[str]] = field(default_factory=dict)  # bundle -> sample ids dropped as duplicates

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summary_stats(table: pa.Table, contract: Contract) -> dict[str, Any]:
    """Small numbers worth keeping with a version: counts by label and tier, value and band means."""
    def counts(col: str) -> dict[str, int]:
        vc = pc.value_counts(table.column(col)).to_pylist()
        return {str(d["values"]): int(d["counts"]) for d in vc}

    times = table.column("capture_time")
    # a kind may have no label, and channel means only where it has a tensor with mean_* features
    channels = [c for c in (contract.channels if contract.tensor else ()) if f"mean_{c}" in table.column_names]
    return {
        "rows": table.num_rows,
        "summary_rows": int(pc.sum(table.column("is_summary")).as_py() or 0),
        "labels": counts(contract.label_column) if contract.label_column else {},
        "tiers": counts("tier"),
        "value_mean": float(pc.mean(table.column("value")).as_py() or 0.0),
        "band_means": {c: round(float(pc.mean(table.column(f"mean_{c}")).as_py() or 0.0), 6) for c in channels},
        "min_capture_time": pc.min(times).as_py().isoformat() if table.num_rows else None,
        "max_capture_time": pc.max(times).as_py().isoformat() if table.num_rows else None,
    }


@dataclass
class ValidatedBundle:
    manifest: BundleManifest
    table: pa.Table
    result: ValidationResult


def commit_bundles(
    store: ObjectStore, contract: Contract, bundles: list[ValidatedBundle], *, run_id: str = "",
    lease_s: float = DEFAULT_LEASE_S, s3: S3Client | None = None,
) -> CommitResult:
    """Append validated bundles to the kind's dataset as ONE Delta commit (all or nothing).

    Bundles already in the table are a no-op; bundles claimed by another live run are deferred.
    """
    t0 = time.perf_counter()
    run_id = run_id or uuid.uuid4().hex
    commit_id = uuid.uuid4().hex
    for vb in bundles:
        if not vb.result.success:
            raise DatasetError(f"bundle {vb.manifest.bundle_id} failed validation ({vb.result.reason}); not committing")
        if vb.manifest.contract != contract.id:
            raise DatasetError(f"bundle {vb.manifest.bundle_id} is {vb.manifest.contract}, dataset commit is {contract.id}")
    by_id = {vb.manifest.bundle_id: vb for vb in bundles}  # the same bundle twice in one run: once
    s3 = s3 or store.client()
    with _locked_handle(store, contract.kind, s3, lambda: ensure_table(store, contract)) as h:
        try:
            return _commit_locked(store, contract, h, by_id, run_id, commit_id, lease_s, s3, t0)
        except BaseException:
            forget_handle(store, contract.kind)  # reopen from storage next time
            raise


@contextlib.contextmanager
def _locked_handle(
    store: ObjectStore, kind: str, s3: S3Client, opener: Callable[[], DeltaTable],
) -> Iterator[TableHandle]:
    """The process's handle, locked and refreshed; a handle that cannot refresh (table deleted or
    recreated) is replaced by a freshly opened one."""
    for attempt in (1, 2):
        h = _handle(store, kind, opener, s3)
        with h.lock:
            try:
                h.refresh(s3)
            except (DeltaError, DatasetError, ClientError, OSError) as e:
                forget_handle(store, kind)
                if attempt == 2:
                    raise
                log.info("dataset %s: reopening the table (%s)", kind, e)
                continue
            yield h
            return


def _commit_locked(
    store: ObjectStore, contract: Contract, h: TableHandle, by_id: dict[str, ValidatedBundle], run_id: str,
    commit_id: str, lease_s: float, s3: S3Client, t0: float,
) -> CommitResult:
    dt = h.dt
    claims = claim_bundles(store, dt, contract.kind, sorted(by_id), run_id, lease_s=lease_s, s3=s3, handle=h)
    todo = [by_id[b] for b in claims.claimed]
    if not todo:
        return CommitResult(contract.kind, None, dt.version(), commit_id, [], [], 0, claims.committed,
                            claims.deferred, {}, time.perf_counter() - t0)
    parent = dt.version()
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        # Checked against the version this attempt commits on top of: a lost race re-checks (see below).
        data, kept, dups = _without_duplicates(contract, todo, h.sample_index(s3))
        for b, ids in dups.items():
            quarantine.record_duplicates(store, contract.kind, by_id[b].manifest, ids, kept.get(b, 0),
                                         base_version=dt.version(), run_id=run_id, s3=s3)
        metadata = _commit_metadata(contract, todo, kept, dups, data, commit_id, run_id)
        txns = [Transaction(app_id=txn_app_id(vb.manifest.bundle_id), version=1) for vb in todo]
        added = columns_to_add(dt, contract)
        if added:
            log.info("dataset %s: adding columns %s at v%d (schema merge; older rows read null)", contract.kind, added,
                     dt.version() + 1)
        try:
            # The open table at exactly its version + 1: no delta-rs rebase over a concurrent append,
            # whose rows our duplicate check has not seen.
            write_deltalake(
                dt, data, mode="append", schema_mode="merge" if added else None,
                commit_properties=CommitProperties(custom_metadata=metadata, app_transactions=txns,
                                                   max_commit_retries=0),
            )
            break
        except CommitFailedError as e:
            if attempt == COMMIT_ATTEMPTS:
                released = release_claims(store, contract.kind, h, claims.claimed, s3)
                raise DatasetError(f"dataset {contract.kind}: commit of {len(todo)} bundles lost {attempt} races, "
                                   f"nothing written ({released} claims released): {e}") from e
            log.info("dataset %s: lost the race for v%d (attempt %d); re-checking sample ids", contract.kind,
                     dt.version() + 1, attempt)
            time.sleep(random.uniform(0.0, 0.02 * min(attempt, 10)))
            h.refresh(s3)  # another commit won this version: re-read it, then check our ids again
        except (DeltaError, OSError) as e:
            released = release_claims(store, contract.kind, h, claims.claimed, s3)
            raise DatasetError(f"dataset {contract.kind}: commit of {len(todo)} bundles failed, nothing written "
                               f"({released} claims released): {e}") from e
    version = h.absorb(s3, commit_id, after=parent)
    h.note_commit(version, data)
    nodes = sorted({vb.manifest.node_id for vb in todo})
    n_dups = sum(len(v) for v in dups.values())
    log.info("dataset %s v%d: %d bundles, %d rows from %s, %d duplicate sample ids dropped", contract.kind, version,
             len(todo), data.num_rows, nodes, n_dups)
    return CommitResult(contract.kind, version, version - 1, commit_id, [vb.manifest.bundle_id for vb in todo], nodes,
                        data.num_rows, claims.committed, claims.deferred, json.loads(metadata["edgehaul.stats"]),
                        time.perf_counter() - t0, dups)


def _without_duplicates(
    contract: Contract, todo: list[ValidatedBundle], held: dict[str, str],
) -> tuple[pa.Table, dict[str, int], dict[str, list[str]]]:
    """The rows to append (dataset schema), rows kept per bundle, and per bundle the sample ids dropped
    because the table (`held`) or an earlier bundle of this commit (by bundle id) already has them."""
    schema = dataset_schema(contract)
    parts, kept, dups = [], {}, {}
    seen: set[str] = set()
    for vb in sorted(todo, key=lambda v: v.manifest.bundle_id):
        t = conform(vb.table, contract)
        ids = t.column("sample_id").to_pylist()
        fresh = [sid not in held and sid not in seen for sid in ids]
        if not all(fresh):
            dups[vb.manifest.bundle_id] = [sid for sid, ok in zip(ids, fresh, strict=True) if not ok]
            t = t.filter(pa.array(fresh))
        seen.update(ids)
        kept[vb.manifest.bundle_id] = t.num_rows
        parts.append(t.append_column(schema.field(BUNDLE_ID_COLUMN), pa.array([vb.manifest.bundle_id] * t.num_rows,
                                                                               pa.string())))
    return pa.concat_tables(parts).cast(schema), kept, dups  # added columns nullable, as the table has them


def _commit_metadata(
    contract: Contract, todo: list[ValidatedBundle], kept: dict[str, int], dups: dict[str, list[str]], data: pa.Table,
    commit_id: str, run_id: str,
) -> dict[str, str]:
    lineage = [
        {"bundle_id": vb.manifest.bundle_id, "node_id": vb.manifest.node_id, "sha256": vb.manifest.sha256,
         "rows": kept[vb.manifest.bundle_id], "tier": vb.manifest.tier, "created_at": vb.manifest.created_at,
         **({"duplicates": len(dups[vb.manifest.bundle_id])} if vb.manifest.bundle_id in dups else {})}
        for vb in todo
    ]
    return {
        "edgehaul.commit_id": commit_id,
        "edgehaul.run": run_id,
        "edgehaul.contract": contract.id,
        "edgehaul.contract_sha256": contract.sha256,
        "edgehaul.bundles": json.dumps(lineage),
        "edgehaul.nodes": json.dumps(sorted({vb.manifest.node_id for vb in todo})),
        "edgehaul.validation": json.dumps([vb.result.summary() for vb in todo]),
        "edgehaul.stats": json.dumps(summary_stats(data, contract)),
    }


def find_commit(store: ObjectStore, kind: str, commit_id: str, *, after: int, upto: int) -> int:
    """The version whose commitInfo carries `commit_id`: newest first from `upto` (where the writer
    ended), back to just after `after` (where it started): one GET per concurrent commit, no listing."""
    for v in range(upto, after, -1):
        if _commit_json(store, kind, v).get("edgehaul.commit_id") == commit_id:
            return v
    raise DatasetError(f"dataset {kind}: commit {commit_id} not found in versions {after + 1}..{upto}")


def committed_bundle_ids(store: ObjectStore, kind: str, bundle_ids: list[str], *,
                         s3: S3Client | None = None) -> set[str]:
    """Which of these bundles the latest version holds (DatasetError when there is no dataset yet);
    answered from the process's transaction index, not one log scan per bundle."""
    s3 = s3 or store.client()
    with _locked_handle(store, kind, s3, lambda: open_table(store, kind)) as h:
        return {b for b in bundle_ids if h.is_committed(b)}


# ---------------------------------------------------------------- reading, time travel, lineage


def read_version(
    store: ObjectStore, kind: str, version: int | datetime | None = None, *, reader: Reader = "pyarrow",
    columns: list[str] | None = None,
) -> pa.Table:
    """Read a version with a reader that knows nothing of edgehaul (only URI, storage options, version)."""
    dt = open_table(store, kind, version)  # resolves a time to the version current at that time
    if reader == "polars":
        import polars as pl

        return pl.read_delta(table_uri(store, kind), version=dt.version(), storage_options=store.storage_options(),
                             columns=columns).to_arrow()
    ds = dt.to_pyarrow_dataset()
    if reader == "pyarrow":
        return ds.to_table(columns=columns)
    if reader == "duckdb":
        import duckdb

        con = duckdb.connect()
        try:
            con.register("ds", ds)
            cols = ", ".join(f'"{c}"' for c in columns) if columns else "*"
            return con.sql(f"SELECT {cols} FROM ds").to_arrow_table()
        finally:
            con.close()
    raise DatasetError(f"unknown reader {reader!r}")


def content_sha256(table: pa.Table) -> str:
    """Order- and layout-independent digest of a table's content (rows sorted by bundle, sample id)."""
    keys = [(c, "ascending") for c in (BUNDLE_ID_COLUMN, "sample_id") if c in table.column_names]
    table = table.sort_by(keys)
    h = hashlib.sha256()
    for name in sorted(table.column_names):
        col = table.column(name)
        t = col.type
        # Readers differ in string/binary flavours (large_, _view) and timestamp tz; normalise.
        if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
            col = col.cast(pa.large_string())
        elif pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
            col = col.cast(pa.large_binary())
        elif pa.types.is_boolean(t):
            col = col.cast(pa.uint8())
        elif pa.types.is_timestamp(t):
            col = col.cast(pa.timestamp("us", tz=t.tz)).cast(pa.int64())
        h.update(name.encode())
        arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
        h.update(np.packbits(valid).tobytes())
        if pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type):
            for v in arr.to_pylist():
                h.update(b"\x00" if v is None else (v.encode() if isinstance(v, str) else v) + b"\x01")
        else:
            h.update(arr.fill_null(0).to_numpy(zero_copy_only=False).tobytes())
    return h.hexdigest()


def _commit_json(store: ObjectStore, kind: str, version: int) -> dict[str, Any]:
    """The commitInfo action of one version, read straight from its `_delta_log` entry (one GET)."""
    s3 = store.client()
    key = store.key("curated", f"{kind}/_delta_log/{version:020d}.json")
    try:
        body = s3.get_object(Bucket=store.bucket("curated"), Key=key)["Body"].read()
    except ClientError as e:
        raise DatasetError(f"dataset {kind}: no commit log entry for version {version} ({key})") from e
    for line in body.splitlines():
        action = json.loads(line)
        if "commitInfo" in action:
            return dict(action["commitInfo"])
    raise DatasetError(f"dataset {kind}: version {version} has no commitInfo")


def commit_info(store: ObjectStore, kind: str, version: int) -> dict[str, Any]:
    """Delta commitInfo of one version (operation, timestamp, edgehaul lineage), JSON fields decoded."""
    info = _commit_json(store, kind, version)
    info["version"] = version
    for k in ("edgehaul.bundles", "edgehaul.nodes", "edgehaul.validation", "edgehaul.stats"):
        if isinstance(info.get(k), str):
            info[k] = json.loads(info[k])
    return info


@dataclass(frozen=True)
class Lineage:
    kind: str
    version: int
    rows: int
    nodes: list[str]
    bundles: list[dict[str, Any]]  # bundle_id, node_id, rows, added_in (version), sha256
    commit: dict[str, Any]  # this version's own commit: operation, bundles it added, contract, stats


def lineage(store: ObjectStore, kind: str, version: int) -> Lineage:
    """Version -> bundles -> edge nodes: which bundles (and nodes) make up `version`, and which
    commit added each one."""
    data = read_version(store, kind, version, columns=[BUNDLE_ID_COLUMN, "node_id"])
    grouped = data.group_by([BUNDLE_ID_COLUMN, "node_id"]).aggregate([([], "count_all")]).to_pylist()
    dt = open_table(store, kind, version)
    added: dict[str, tuple[int, str]] = {}
    for h in dt.history():  # newest first, from the latest commit; keep those up to `version`
        if int(h["version"]) > version:
            continue
        for b in json.loads(h.get("edgehaul.bundles") or "[]"):
            added.setdefault(b["bundle_id"], (int(h["version"]), b.get("sha256", "")))
    bundles = sorted(
        ({"bundle_id": g[BUNDLE_ID_COLUMN], "node_id": g["node_id"], "rows": int(g["count_all"]),
          "added_in": added.get(g[BUNDLE_ID_COLUMN], (-1, ""))[0], "sha256": added.get(g[BUNDLE_ID_COLUMN], (-1, ""))[1]}
         for g in grouped),
        key=lambda b: (b["added_in"], b["bundle_id"]),
    )
    return Lineage(kind, version, data.num_rows, sorted({b["node_id"] for b in bundles}), bundles,
                   commit_info(store, kind, version))

