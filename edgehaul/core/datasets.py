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

A bundle enters a dataset once. Bundle ids and sample ids are unique per node only (a node chooses its
own, and another node may choose the same): everything the core keys on them is keyed by (node, id), so a
node's ids can never collide with another node's data. Each commit records one Delta transaction id per
bundle (`txn` action, app id `edgehaul/bundle/<node>/<bundle>`), so "already committed?" is a lookup in
the table snapshot, independent of table size. Delta does not treat two concurrent commits of the same app
id as a conflict, so before committing, a run claims each bundle with a conditional PUT of
`datasets/_claims/<kind>/<node>/<bundle>.json`: exactly one of two racing runs wins; the other skips the
bundle (committed) or defers it (claim held by a live run; taken over when older than the lease, which
covers a run killed mid-commit). A run that fails after claiming gives its claims back.

A sample id enters a node's part of a dataset once, too. The source of truth is the sample id index beside
the table (`datasets/_ids/<kind>/<node>/<shard>.json`: sample id -> the bundle that owns it), written with
If-Match before the Delta commit, so two runs cannot both take an id; a commit reads only the shards its
ids fall in (one or two per bundle for numbered ids), whatever the table's size, and a process keeps a
bounded cache of them. A duplicate row is dropped (the rest of its bundle commits) and named in a record
(`quarantine.record_duplicates`). A commit whose every row is a duplicate makes no version (nothing new
to train on); its bundles are settled as already committed. A table `ensure_table` creates is born with
its (empty) index, which its table properties say (`ID_INDEX_PROPERTY`); on an older table the index is
built by one scan, once, when it is missing (`rebuild_id_index`, docs/MIGRATIONS.md).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import logging
import os
import random
import re
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Container, Iterator
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
from edgehaul.decode import with_derived_features
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
CHECKPOINT_INTERVAL = 5
COMMIT_ATTEMPTS = 50  # lost races for a version before a commit gives up
ID_INDEX_VERSION = 1
# Table property of a table created with its sample id index (empty, like the table): a fresh process
# knows the index exists from the table it opens anyway, without reading `_ids/<kind>/_index.json`.
ID_INDEX_PROPERTY = "edgehaul.idIndex"

Reader = Literal["pyarrow", "polars", "duckdb"]


class DatasetError(ValueError):
    """A commit or read of a dataset cannot proceed (schema mismatch, unknown version, ...)."""


def dataset_schema(contract: Contract) -> pa.Schema:
    schema = contract.bundle_schema
    # Added columns are nullable in a table: the rows committed before they existed have none.
    fields = [f.with_nullable(True) if f.name in ADDED_COLUMNS else f for f in schema]
    return pa.schema([*fields, pa.field(BUNDLE_ID_COLUMN, pa.string(), nullable=False)], metadata=schema.metadata)


def old_derived(dt: DeltaTable, contract: Contract) -> list[str]:
    """Derived features (`Contract.derived_feature_columns`) a table made when bundles carried them still has:
    a commit derives them from the rows' columns (`decode.with_derived_features`), the same numbers."""
    have = set(pa.schema(dt.schema()).names)
    return [n for n in contract.derived_feature_columns if n in have]


def columns_to_add(dt: DeltaTable, contract: Contract) -> list[str]:
    """Columns of the contract's dataset schema an older table lacks (added by the next commit's merge)."""
    have = set(pa.schema(dt.schema()).names)
    return [n for n in dataset_schema(contract).names if n not in have]


def table_uri(store: ObjectStore, kind: str) -> str:
    return store.uri("curated", kind)


def txn_app_id(node_id: str, bundle_id: str) -> str:
    """The Delta transaction id of a committed bundle: scoped by node, as bundle ids are."""
    return f"edgehaul/bundle/{node_id}/{bundle_id}"


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
                configuration={"delta.checkpointInterval": str(CHECKPOINT_INTERVAL),
                               ID_INDEX_PROPERTY: str(ID_INDEX_VERSION)},
                raise_if_key_not_exists=False,  # our own property, which delta-rs does not know
                description=f"edgehaul curated dataset of {contract.kind}",
                commit_properties=CommitProperties(custom_metadata={"edgehaul.contract": contract.id}),
            )
            log.info("created dataset table %s", uri)
            _write_ids_marker(store, contract.kind, {"version": 0, "ids": 0, "shards": 0, "nodes": 0,
                                                      "legacy_bundles": 0, "scans": 0})
            return dt
        except (DeltaError, OSError) as e:
            log.info("dataset table %s created concurrently (%s); re-opening", uri, type(e).__name__)
            dt = DeltaTable(uri, storage_options=opts)
    have = pa.schema(dt.schema())
    # Order aside (a merge appends its columns): the same columns, or older ones lacking only added ones, or
    # holding the derived features bundles no longer carry (`old_derived`: each commit derives them).
    lacking = [n for n in want.names if n not in have.names]
    extra = [n for n in have.names if n not in want.names and n not in contract.derived_feature_columns]
    if extra or [n for n in lacking if n not in ADDED_COLUMNS]:
        raise DatasetError(
            f"dataset {contract.kind}: table columns {have.names} differ from contract {contract.id} {want.names}"
        )
    return dt


# ---------------------------------------------------------------- the process's open tables


Ref = tuple[str, str]  # (node id, bundle id): a bundle id is unique per node only


def ref_name(ref: Ref) -> str:
    """A bundle's name in logs and summaries: `<node>/<bundle>`, as its landing prefix says."""
    return f"{ref[0]}/{ref[1]}"


def bundle_ref(m: BundleManifest) -> Ref:
    return m.node_id, m.bundle_id


class TableHandle:
    """A dataset table kept open in this process, with an index of its Delta `txn` app ids and a bounded
    cache of the sample id index's shards (see "The sample id index" below).

    Opening a Delta table reads its checkpoint, which grows with the number of files, and
    `DeltaTable.transaction_version` scans checkpoint + log again on every call. A commit through a
    handle instead refreshes incrementally (a LIST and the commits made since, by others) and answers
    "is this bundle committed?" from the txn index: its request count does not depend on the table's size.
    The txn index is built on first need (most commits never need it: a bundle whose claim is new and whose
    ids nobody holds is not committed) from the latest checkpoint's `txn` column plus the commits after it,
    then kept up to date from each new commit's JSON (one GET each).
    Use under `lock`: a DeltaTable is not meant for concurrent writers in one process.
    """

    def __init__(self, store: ObjectStore, kind: str, dt: DeltaTable) -> None:
        self.store, self.kind, self.dt = store, kind, dt
        self.lock = threading.Lock()
        self.txns: dict[str, int] | None = None  # None: not built yet
        self.indexed_upto = -1  # the txn index holds every txn of versions <= this
        self.exact = True  # False: the index could not be built; fall back to delta-rs lookups
        # the sample id index exists: the table was created with it, or this process saw its marker
        self.ids_ready = dt.metadata().configuration.get(ID_INDEX_PROPERTY) == str(ID_INDEX_VERSION)
        self.legacy: dict[str, set[str]] = {}  # bundle id -> nodes, committed before txn ids were scoped by node
        self.shards: collections.OrderedDict[tuple[str, str], _Shard] = collections.OrderedDict()

    def _txn_index(self, s3: S3Client) -> dict[str, int] | None:
        if self.txns is None and self.exact:
            try:
                self.indexed_upto, self.txns = _checkpoint_txns(self.store, self.kind, s3)
            except (DatasetError, ClientError, pa.ArrowException, ValueError, KeyError) as e:
                log.warning("dataset %s: no transaction index (%s); using per-bundle log scans", self.kind, e)
                self.exact = False
                return None
            self._index(s3)
        return self.txns

    def _index(self, s3: S3Client) -> None:
        """Fold the txns of versions after the txn index into it (when it is built)."""
        if self.txns is None:
            return
        for v in range(self.indexed_upto + 1, self.dt.version() + 1):
            for a in _log_actions(self.store, self.kind, v, s3):
                if "txn" in a:
                    self.txns[str(a["txn"]["appId"])] = int(a["txn"]["version"])
            self.indexed_upto = v

    def refresh(self, s3: S3Client) -> None:
        """Catch up with commits made since (by other processes): one LIST when there are none."""
        before = self.dt.version()
        self.dt.update_incremental()
        if self.dt.version() < before or self.dt.version() < self.indexed_upto:  # recreated under us: start again
            raise DatasetError(f"dataset {self.kind}: version went back from {before} to {self.dt.version()}")
        self._index(s3)

    def is_committed(self, ref: Ref, s3: S3Client) -> bool:
        if ref[0] in self.legacy.get(ref[1], ()):
            return True  # its rows were in the table when the id index was built
        txns = self._txn_index(s3)
        if txns is not None:
            return txn_app_id(*ref) in txns
        return self.dt.transaction_version(txn_app_id(*ref)) is not None

    def note_commit(self, version: int, refs: list[Ref]) -> None:
        """Our own commit at `version`: fold its txns without reading its JSON back, when the txn index was
        current just before it (else the next refresh reads what it missed)."""
        if self.txns is not None and self.indexed_upto == version - 1:
            self.txns.update({txn_app_id(*r): 1 for r in refs})
            self.indexed_upto = version

    def shard(self, node: str, name: str, s3: S3Client) -> _Shard:
        """One shard of a node's sample id index: from this process's cache, else one GET."""
        key = (node, name)
        got = self.shards.get(key)
        if got is None:
            got = _read_shard(self.store, self.kind, node, name, s3)
            self.shards[key] = got
            while len(self.shards) > SHARD_CACHE:
                self.shards.popitem(last=False)
        else:
            self.shards.move_to_end(key)
        return got


_HANDLES: dict[tuple[int, str, str], TableHandle] = {}
_HANDLES_LOCK = threading.Lock()


def _handle_key(store: ObjectStore, kind: str) -> tuple[int, str, str]:
    # pid: a forked child must not reuse its parent's open table (the Rust runtime does not survive fork)
    opts = json.dumps(store.storage_options(), sort_keys=True)
    return os.getpid(), table_uri(store, kind), hashlib.sha256(opts.encode()).hexdigest()


def table_handle(store: ObjectStore, contract: Contract) -> TableHandle:
    """The process's open handle on a kind's table (created on first use, see `ensure_table`)."""
    return _handle(store, contract.kind, lambda: ensure_table(store, contract))


def _handle(store: ObjectStore, kind: str, opener: Callable[[], DeltaTable]) -> TableHandle:
    return _opened_handle(store, kind, opener)[0]


def _opened_handle(store: ObjectStore, kind: str, opener: Callable[[], DeltaTable]) -> tuple[TableHandle, bool]:
    """The process's handle, and whether this call opened it."""
    key = _handle_key(store, kind)
    with _HANDLES_LOCK:
        h = _HANDLES.get(key)
    if h is not None:
        return h, False
    mine = TableHandle(store, kind, opener())
    with _HANDLES_LOCK:
        h = _HANDLES.setdefault(key, mine)
    return h, h is mine


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


# ---------------------------------------------------------------- the sample id index (one owner per (node, id))


SHARD_SPAN = 4096  # numbered ids (`<anything><sep><digits>`): consecutive numbers share a shard
HASH_SHARDS = 256  # other ids: spread over this many shards per node
SHARD_CACHE = 64  # shards a process keeps (LRU): at most 64 x 4,096 numbered ids in memory
INDEX_ATTEMPTS = 20  # lost races on a shard (a concurrent run wrote it) before a commit gives up
REBUILD_WAIT_S = 120.0  # how long a commit waits for another process's index rebuild
LIVE_OWNER_WAIT_S = 10.0  # how long a commit waits for a live run to commit ids it owns, before deferring
_NUMBERED = re.compile(r"(.*[^0-9A-Za-z])(\d{1,18})")


def id_shard(sample_id: str) -> str:
    """The shard of a node's id index that holds `sample_id`. Ids that end in a number after a separator
    (`node-a-000000001234`, how nodes number their samples) shard by that number's block of SHARD_SPAN, so a
    bundle's ids fall in one or two shards; any other id by hash."""
    m = _NUMBERED.fullmatch(sample_id)
    if m:
        return f"n{hashlib.sha256(m.group(1).encode()).hexdigest()[:12]}-{int(m.group(2)) // SHARD_SPAN}"
    return f"h{int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16) % HASH_SHARDS:03d}"


def _ids_key(store: ObjectStore, kind: str, path: str) -> str:
    return store.key("curated", f"_ids/{kind}/{path}")


@dataclass
class _Shard:
    ids: dict[str, str]  # sample id -> the bundle (of this node) that owns it
    etag: str | None  # None: not in the store yet


def _read_shard(store: ObjectStore, kind: str, node: str, name: str, s3: S3Client) -> _Shard:
    try:
        got = s3.get_object(Bucket=store.bucket("curated"), Key=_ids_key(store, kind, f"{node}/{name}.json"))
    except ClientError as e:
        if error_code(e) in ("NoSuchKey", "404", "NotFound"):
            return _Shard({}, None)
        raise
    doc = json.loads(got["Body"].read())
    bundles = [sys.intern(b) for b in doc["bundles"]]
    return _Shard({sid: bundles[i] for sid, i in doc["ids"].items()}, got["ETag"])


def _shard_body(ids: dict[str, str]) -> bytes:
    bundles = sorted(set(ids.values()))
    pos = {b: i for i, b in enumerate(bundles)}
    return json.dumps({"v": ID_INDEX_VERSION, "bundles": bundles, "ids": {s: pos[b] for s, b in ids.items()}},
                      separators=(",", ":")).encode()


def _write_shard(store: ObjectStore, kind: str, node: str, name: str, shard: _Shard, s3: S3Client) -> str:
    """Conditional write: If-Match the ETag it was read with (If-None-Match when new). Raises the 412."""
    bucket, key, body = store.bucket("curated"), _ids_key(store, kind, f"{node}/{name}.json"), _shard_body(shard.ids)
    if shard.etag is None:
        return str(s3.put_object(Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")["ETag"])

    def put(etag: str) -> Any:
        return s3.put_object(Bucket=bucket, Key=key, Body=body, IfMatch=etag)

    return str(s3compat.if_match(store.endpoint_url, shard.etag, put)["ETag"])


class _LostRace(Exception):
    pass


def _holder_state(store: ObjectStore, h: TableHandle, ref: Ref, run_id: str, lease_s: float,
                  s3: S3Client) -> Literal["committed", "live", "stale"]:
    """Whether the bundle that owns an id in the index committed it, is being committed by a live run (its
    index write comes before its Delta commit, usually by well under a second: waited for up to
    LIVE_OWNER_WAIT_S), or died before committing (its ownership lapses)."""
    deadline = time.monotonic() + LIVE_OWNER_WAIT_S
    while True:
        if h.is_committed(ref, s3):
            return "committed"
        try:
            held = s3.get_object(Bucket=store.bucket("curated"), Key=_claim_key(store, h.kind, ref))
        except ClientError as e:
            if error_code(e) in ("NoSuchKey", "404", "NotFound"):
                return "stale"
            raise
        doc = _claim_doc(held["Body"].read(), held["LastModified"])
        if doc.get("run") == run_id or time.time() - float(doc.get("at", 0)) >= lease_s or doc.get("settled"):
            return "stale"
        if time.monotonic() > deadline:
            return "live"
        time.sleep(random.uniform(0.05, 0.25))
        h.refresh(s3)  # the owner's commit, when it lands


@dataclass
class _Reserved:
    held: set[tuple[str, str]]  # (node, sample id) another committed bundle owns: dropped as duplicates
    deferred: list[Ref]  # carry ids a live run is committing: left for the next run
    committed: list[Ref]  # committed before (claim lost, e.g. moved by the lifecycle): a no-op


def _reserve_ids(store: ObjectStore, h: TableHandle, todo: list[ValidatedBundle], run_id: str, lease_s: float,
                 s3: S3Client) -> _Reserved:
    """Make the commit's bundles the owners of their new sample ids in the index, before the Delta commit.

    The index is the source of truth for "does this node's dataset already hold this sample id?": one small
    object per (node, shard), written with If-Match, so two runs committing the same id cannot both win. An
    owner that never committed and whose claim is gone or stale (its run died) loses its ids to the next
    bundle that carries them; an owner whose run is live makes that bundle wait (deferred)."""
    mine = {bundle_ref(vb.manifest): vb for vb in todo}
    for attempt in range(1, INDEX_ATTEMPTS + 1):
        states: dict[Ref, str] = {}
        out = _Reserved(set(), [], [])
        changed: dict[tuple[str, str], _Shard] = {}
        try:
            for ref in sorted(mine):
                vb, (node, bundle) = mine[ref], ref
                ids = vb.table.column("sample_id").to_pylist()
                claims: list[tuple[_Shard, tuple[str, str], str]] = []
                verdict = "ok"
                for sid in ids:
                    name = id_shard(sid)
                    shard = changed.get((node, name)) or h.shard(node, name, s3)
                    owner = shard.ids.get(sid)
                    if owner is None:
                        claims.append((shard, (node, name), sid))
                        continue
                    if owner == bundle:  # ours: an earlier attempt, or this bundle committed before
                        claims.append((shard, (node, name), sid))
                        if ref not in states:
                            states[ref] = "committed" if h.is_committed(ref, s3) else "mine"
                        if states[ref] == "committed":
                            verdict = "committed"
                            break
                        continue
                    if (node, owner) in mine and (node, owner) < ref:
                        out.held.add((node, sid))  # an earlier bundle of this commit has it
                        continue
                    o = (node, owner)
                    if o not in states:
                        states[o] = "mine" if o in mine else _holder_state(store, h, o, run_id, lease_s, s3)
                    if states[o] == "committed":
                        out.held.add((node, sid))
                    elif states[o] == "live":
                        verdict = "live"
                        break
                    else:  # stale, or a later bundle of this commit (sorted order decides): taken over
                        claims.append((shard, (node, name), sid))
                if verdict == "committed":
                    out.committed.append(ref)
                    continue
                if verdict == "live":
                    out.deferred.append(ref)
                    continue
                for shard, k, sid in claims:
                    if shard.ids.get(sid) != bundle:
                        if k not in changed:
                            changed[k] = _Shard(dict(shard.ids), shard.etag)
                            h.shards.pop(k, None)
                        changed[k].ids[sid] = bundle
            for (node, name), shard in sorted(changed.items()):
                try:
                    shard.etag = _write_shard(store, h.kind, node, name, shard, s3)
                except ClientError as e:
                    if not (s3compat.is_precondition_failed(e) or error_code(e) == "ConditionalRequestConflict"):
                        raise
                    raise _LostRace(f"{node}/{name}") from e
                h.shards[(node, name)] = shard
            while len(h.shards) > SHARD_CACHE:
                h.shards.popitem(last=False)
            return out
        except _LostRace as e:
            # Another run wrote a shard since we read it: read it again, decide again.
            for k in list(changed):
                h.shards.pop(k, None)
            log.info("dataset %s: id index shard %s written concurrently (attempt %d); re-checking", h.kind, e,
                     attempt)
            time.sleep(random.uniform(0.0, 0.02 * min(attempt, 10)))
    raise DatasetError(f"dataset {h.kind}: sample id index contended {INDEX_ATTEMPTS} times, nothing written")


def _load_ids_marker(store: ObjectStore, h: TableHandle, s3: S3Client) -> bool:
    """Whether the kind's id index exists (one GET); loads the map of bundles committed before ids were
    scoped by node when it has one."""
    bucket = store.bucket("curated")
    try:
        doc = json.loads(s3.get_object(Bucket=bucket, Key=_ids_key(store, h.kind, "_index.json"))["Body"].read())
    except ClientError as e:
        if error_code(e) in ("NoSuchKey", "404", "NotFound"):
            return False
        raise
    if doc.get("legacy_bundles"):
        raw = s3.get_object(Bucket=bucket, Key=_ids_key(store, h.kind, "_legacy_bundles.json"))["Body"].read()
        h.legacy = {b: set(ns) for b, ns in json.loads(raw).items()}
    h.ids_ready = True
    return True


def _ensure_id_index(store: ObjectStore, contract: Contract, h: TableHandle, s3: S3Client) -> None:
    """The kind's id index exists (one HEAD per process), else build it from the table, once, under a lock."""
    if h.ids_ready:
        return
    bucket, lock = store.bucket("curated"), _ids_key(store, h.kind, "_rebuild.json")
    deadline = time.monotonic() + REBUILD_WAIT_S
    while True:
        if _load_ids_marker(store, h, s3):
            return
        body = json.dumps({"run": uuid.uuid4().hex, "at": time.time()}).encode()
        try:
            s3.put_object(Bucket=bucket, Key=lock, Body=body, IfNoneMatch="*")
        except ClientError as e:
            if not s3compat.is_precondition_failed(e) and error_code(e) != "ConditionalRequestConflict":
                raise
            held = s3.get_object(Bucket=bucket, Key=lock)
            doc = _claim_doc(held["Body"].read(), held["LastModified"])
            if time.time() - float(doc.get("at", 0)) > REBUILD_LEASE_S:  # its builder died: take the lock over
                s3.delete_object(Bucket=bucket, Key=lock)
                continue
            if time.monotonic() > deadline:
                raise DatasetError(f"dataset {h.kind}: its sample id index is being built by another process "
                                   f"(since {datetime.fromtimestamp(float(doc.get('at', 0)), UTC).isoformat()}); "
                                   "nothing committed, the next run commits") from e
            time.sleep(1.0)
            continue
        try:
            rebuild_id_index(store, contract, s3=s3, handle=h)
        finally:
            s3.delete_object(Bucket=bucket, Key=lock)


def _write_ids_marker(store: ObjectStore, kind: str, counts: dict[str, int], s3: S3Client | None = None
                      ) -> dict[str, Any]:
    """`_ids/<kind>/_index.json`: the kind's id index exists, built from `version` with these counts."""
    doc = {"v": ID_INDEX_VERSION, **counts, "built_at": datetime.now(UTC).isoformat()}
    (s3 or store.client()).put_object(Bucket=store.bucket("curated"), Key=_ids_key(store, kind, "_index.json"),
                                      Body=json.dumps(doc).encode())
    return doc


REBUILD_LEASE_S = 1800.0
REBUILD_PART_IDS = 1_000_000  # ids a rebuild holds at once (about 360 bytes each): more ids, more scans


def rebuild_id_index(store: ObjectStore, contract: Contract, *, s3: S3Client | None = None,
                     handle: TableHandle | None = None) -> dict[str, int]:
    """Build the kind's sample id index from the table: every (node, sample id) of the latest version and the
    bundle holding it. The one full scan of the table, done once: by the first commit after an upgrade to
    identity-scoped ids (under a lock, see `_ensure_id_index`), or by an operator after deleting rows (with
    core ingest stopped). Bundles committed before txn ids were scoped by node are listed beside it
    (`_legacy_bundles.json`: bundle id -> the nodes whose rows carry it), so "already committed?" stays
    exact for them. Returns counts."""
    s3 = s3 or store.client()
    kind = contract.kind
    h = handle or TableHandle(store, kind, open_table(store, kind))
    dt = h.dt
    bucket = store.bucket("curated")
    pairs: set[Ref] = set()
    n = n_shards = 0
    nodes_seen: set[str] = set()
    cols = ["node_id", "sample_id", BUNDLE_ID_COLUMN]
    rows = sum(int(r or 0) for r in dt.get_add_actions(flatten=True).column("num_records").to_pylist())
    # Memory is bounded by scanning once per part of the shards, each part holding about REBUILD_PART_IDS ids
    parts = max(1, -(-rows // REBUILD_PART_IDS))
    for part in range(parts):
        shards: dict[tuple[str, str], dict[str, str]] = {}
        for batch in dt.to_pyarrow_dataset().to_batches(columns=cols):
            nodes, sids, bids = (batch.column(c).to_pylist() for c in cols)
            for node, sid, b in zip(nodes, sids, bids, strict=True):
                k = (node, id_shard(sid))
                if parts > 1 and zlib.crc32(f"{k[0]}/{k[1]}".encode()) % parts != part:
                    continue
                shards.setdefault(k, {}).setdefault(sid, sys.intern(b))
                pairs.add((node, b))
                n += 1
        for (node, name), ids in shards.items():
            s3.put_object(Bucket=bucket, Key=_ids_key(store, kind, f"{node}/{name}.json"), Body=_shard_body(ids))
        n_shards += len(shards)
        nodes_seen.update(k[0] for k in shards)
        del shards
    h.shards.clear()
    # Bundles committed before txn ids were scoped by node carry `edgehaul/bundle/<bundle>`: which node's
    # bundle each was is what their rows say. Kept beside the index (never a new version of the table).
    legacy: dict[str, list[str]] = {}
    for node, b in sorted(pairs):
        if not h.is_committed((node, b), s3):
            legacy.setdefault(b, []).append(node)
    if legacy:
        s3.put_object(Bucket=bucket, Key=_ids_key(store, kind, "_legacy_bundles.json"),
                      Body=json.dumps(legacy, separators=(",", ":")).encode())
    doc = _write_ids_marker(store, kind, {"version": dt.version(), "ids": n, "shards": n_shards,
                                          "nodes": len(nodes_seen), "legacy_bundles": len(legacy), "scans": parts},
                            s3)
    h.legacy = {b: set(ns) for b, ns in legacy.items()}
    h.ids_ready = True
    log.info("dataset %s: sample id index built from v%d: %d ids of %d nodes in %d shards (%d scans)", kind,
             doc["version"], n, doc["nodes"], n_shards, parts)
    return {k: int(v) for k, v in doc.items() if isinstance(v, int)}


# ---------------------------------------------------------------- claims (one committer per bundle)


def _claim_key(store: ObjectStore, kind: str, ref: Ref) -> str:
    return store.key("curated", f"_claims/{kind}/{ref[0]}/{ref[1]}.json")


@dataclass
class Claims:
    claimed: list[Ref] = field(default_factory=list)
    committed: list[Ref] = field(default_factory=list)  # already in the table (or settled with no new row): no-op
    deferred: list[Ref] = field(default_factory=list)  # a live run holds the claim: try again later


def claim_bundles(
    store: ObjectStore, dt: DeltaTable, kind: str, refs: list[Ref], run_id: str, *,
    lease_s: float = DEFAULT_LEASE_S, s3: S3Client | None = None, handle: TableHandle | None = None,
) -> Claims:
    """Claim each bundle (node, bundle id) for this run. `handle` (the process's cached table, see
    `table_handle`) answers "already committed?" from its transaction index; without one, every lookup scans
    the Delta log. A new claim needs no lookup at all: a bundle nobody claimed was never committed, unless its
    claim was moved away since, which the id index then tells (`_reserve_ids`)."""
    s3 = s3 or store.client()
    bucket = store.bucket("curated")
    out = Claims()

    def committed(r: Ref) -> bool:
        return handle.is_committed(r, s3) if handle else dt.transaction_version(txn_app_id(*r)) is not None

    def refresh() -> None:
        if handle:
            handle.refresh(s3)
        else:
            dt.update_incremental()

    for r in refs:
        key = _claim_key(store, kind, r)
        body = json.dumps({"run": run_id, "at": time.time()}).encode()
        try:
            s3.put_object(Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")
            out.claimed.append(r)
            continue
        except ClientError as e:
            if error_code(e) not in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise
        held = s3.get_object(Bucket=bucket, Key=key)
        doc = _claim_doc(held["Body"].read(), held["LastModified"])
        refresh()
        if doc.get("settled") or committed(r):
            out.committed.append(r)
        elif doc.get("run") == run_id:
            out.claimed.append(r)  # our own claim from an earlier attempt of this run
        elif time.time() - float(doc.get("at", 0)) < lease_s:
            out.deferred.append(r)
        else:
            # Stale claim (its run died before committing): take it over, conditionally, with If-Match
            # in the ETag form this server honours (some answer 412 to the quoted form boto3 returns).
            def take_over(etag: str, key: str = key, body: bytes = body) -> Any:
                return s3.put_object(Bucket=bucket, Key=key, Body=body, IfMatch=etag)

            try:
                s3compat.if_match(store.endpoint_url, held["ETag"], take_over)
                out.claimed.append(r)
            except ClientError as e:
                if not s3compat.is_precondition_failed(e):
                    raise
                now = s3.head_object(Bucket=bucket, Key=key)
                if s3compat.unquoted(now.get("ETag")) == s3compat.unquoted(held["ETag"]):
                    # Unchanged, yet every If-Match form was refused: waiting cannot help, say so.
                    raise DatasetError(
                        f"dataset {kind}: the store at {store.endpoint_url or 'AWS'} refuses If-Match on an unchanged "
                        f"object, so the stale claim on bundle {ref_name(r)} can never be taken over; the product "
                        "needs conditional PUT with If-Match (see docs/STORAGE.md, `edgehaul store check`)") from e
                out.deferred.append(r)  # another run took it over first
    return out


def settle_claims(store: ObjectStore, kind: str, refs: list[Ref], run_id: str, s3: S3Client) -> None:
    """Mark claims of bundles that hold no new row as settled: later runs treat them as committed (no
    version was made for them, so there is no txn id to find)."""
    for r in refs:
        body = json.dumps({"run": run_id, "at": time.time(), "settled": "no_new_rows"}).encode()
        s3.put_object(Bucket=store.bucket("curated"), Key=_claim_key(store, kind, r), Body=body)


def release_claims(store: ObjectStore, kind: str, handle: TableHandle, refs: list[Ref], s3: S3Client) -> int:
    """After a failed commit, give back this run's claims so the next run commits those bundles at once
    instead of deferring them for the whole lease. A bundle the refreshed table holds after all (the
    commit landed despite the error) keeps its claim; so do all of them when the table cannot be read
    now (the lease then frees them). Returns how many claims were released."""
    try:
        handle.refresh(s3)
        done = {r for r in refs if handle.is_committed(r, s3)}
    except (DeltaError, DatasetError, ClientError, OSError) as e:
        log.warning("dataset %s: claims kept until their lease ends (table unreadable: %s)", kind, e)
        return 0
    released = 0
    for r in refs:
        if r in done:
            continue
        try:
            s3.delete_object(Bucket=store.bucket("curated"), Key=_claim_key(store, kind, r))
            released += 1
        except ClientError as e:
            log.warning("dataset %s: claim on %s kept until its lease ends (%s)", kind, ref_name(r), e)
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
    """What a commit did. Bundle lists hold bundle ids (unique per node only); `refs` names each listed bundle
    as `<node>/<bundle>` in the same order, per list."""

    kind: str
    version: int | None  # None: nothing new to commit (no version made)
    parent: int | None
    commit_id: str
    bundles: list[str]
    nodes: list[str]
    rows: int
    already_committed: list[str]  # in the table already, or settled with no new row (no version made for them)
    deferred: list[str]
    stats: dict[str, Any]
    seconds: float
    duplicates: dict[str, list[str]] = field(default_factory=dict)  # `<node>/<bundle>` -> sample ids dropped
    refs: dict[str, list[str]] = field(default_factory=dict)  # "bundles" / "already_committed" / "deferred" -> names

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def nodes_of(self, which: Literal["bundles", "already_committed", "deferred"]) -> list[tuple[str, str]]:
        """(node, bundle id) of each bundle in one of the lists."""
        return [(n, b) for n, _, b in (r.partition("/") for r in self.refs.get(which, []))]


def _result(kind: str, version: int | None, parent: int | None, commit_id: str, committed: list[Ref], rows: int,
            already: list[Ref], deferred: list[Ref], stats: dict[str, Any], t0: float,
            dups: dict[str, list[str]] | None = None) -> CommitResult:
    return CommitResult(kind, version, parent, commit_id, [b for _, b in committed], sorted({n for n, _ in committed}),
                        rows, [b for _, b in already], [b for _, b in deferred], stats, time.perf_counter() - t0,
                        dups or {}, {"bundles": [ref_name(r) for r in committed],
                                     "already_committed": [ref_name(r) for r in already],
                                     "deferred": [ref_name(r) for r in deferred]})


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

    Bundles already in the table are a no-op; bundles claimed by another live run are deferred; bundles
    whose every sample id the dataset already holds are settled with no version (nothing new to train on).
    """
    t0 = time.perf_counter()
    run_id = run_id or uuid.uuid4().hex
    commit_id = uuid.uuid4().hex
    for vb in bundles:
        if not vb.result.success:
            raise DatasetError(f"bundle {vb.manifest.bundle_id} failed validation ({vb.result.reason}); not committing")
        if vb.manifest.contract != contract.id:
            raise DatasetError(f"bundle {vb.manifest.bundle_id} is {vb.manifest.contract}, dataset commit is {contract.id}")
    by_ref = {bundle_ref(vb.manifest): vb for vb in bundles}  # the same bundle twice in one run: once
    s3 = s3 or store.client()
    with _locked_handle(store, contract.kind, s3, lambda: ensure_table(store, contract)) as h:
        try:
            return _commit_locked(store, contract, h, by_ref, run_id, commit_id, lease_s, s3, t0)
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
        h, opened = _opened_handle(store, kind, opener)
        with h.lock:
            try:
                if not opened:  # a table this call opened is current: no second LIST
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
    store: ObjectStore, contract: Contract, h: TableHandle, by_ref: dict[Ref, ValidatedBundle], run_id: str,
    commit_id: str, lease_s: float, s3: S3Client, t0: float,
) -> CommitResult:
    kind, dt = contract.kind, h.dt
    claims = claim_bundles(store, dt, kind, sorted(by_ref), run_id, lease_s=lease_s, s3=s3, handle=h)
    if not claims.claimed:
        return _result(kind, None, dt.version(), commit_id, [], 0, claims.committed, claims.deferred, {}, t0)
    try:
        return _commit_claimed(store, contract, h, by_ref, claims, run_id, commit_id, lease_s, s3, t0)
    except BaseException as e:
        # Every failure after claiming gives the claims back (a bundle the table holds after all keeps its
        # claim): the next run commits these bundles at once instead of deferring them for the lease.
        released = release_claims(store, kind, h, claims.claimed, s3)
        if isinstance(e, DeltaError | OSError) and not isinstance(e, DatasetError):
            raise DatasetError(f"dataset {kind}: commit of {len(claims.claimed)} bundles failed, nothing written "
                               f"({released} claims released): {e}") from e
        log.warning("dataset %s: commit of %d bundles failed (%s: %s); %d claims released", kind, len(claims.claimed),
                    type(e).__name__, str(e)[:300], released)
        raise


def _commit_claimed(
    store: ObjectStore, contract: Contract, h: TableHandle, by_ref: dict[Ref, ValidatedBundle], claims: Claims,
    run_id: str, commit_id: str, lease_s: float, s3: S3Client, t0: float,
) -> CommitResult:
    kind, dt = contract.kind, h.dt
    _ensure_id_index(store, contract, h, s3)
    res = _reserve_ids(store, h, [by_ref[r] for r in claims.claimed], run_id, lease_s, s3)
    already, deferred = [*claims.committed, *res.committed], [*claims.deferred, *res.deferred]
    if res.deferred:  # a live run owns some of their ids: ours go back, the next run decides
        log.info("dataset %s: %d bundles carry sample ids a live run is committing; deferred", kind, len(res.deferred))
        release_claims(store, kind, h, res.deferred, s3)
    todo = [by_ref[r] for r in claims.claimed if r not in set(res.deferred) | set(res.committed)]
    if not todo:
        return _result(kind, None, dt.version(), commit_id, [], 0, already, deferred, {}, t0)
    data, kept, dups = _without_duplicates(contract, todo, res.held)
    for ref, ids in dups.items():
        vb = by_ref[ref]
        quarantine.record_duplicates(store, kind, vb.manifest, ids, kept.get(ref, 0), base_version=dt.version(),
                                     run_id=run_id, s3=s3)
    dup_names = {ref_name(r): v for r, v in dups.items()}
    refs = [bundle_ref(vb.manifest) for vb in todo]
    if data.num_rows == 0:
        # Nothing new to train on: no version, so no `edgehaul.dataset.committed` and no training run. The bundles
        # are settled as already committed (their claims say so); the duplicate records name every id.
        settle_claims(store, kind, refs, run_id, s3)
        log.info("dataset %s: %d bundles hold no new rows (%d sample ids already in the dataset); no version made",
                 kind, len(todo), sum(len(v) for v in dups.values()))
        return _result(kind, None, dt.version(), commit_id, [], 0, [*already, *refs], deferred, {}, t0, dup_names)
    metadata = _commit_metadata(contract, todo, kept, dups, data, commit_id, run_id)
    # Rows in capture order, whatever order the bundles (random ids) were listed or validated in: a version's
    # layout depends only on what it holds, so the same rows train the same model and read by time in order.
    data = with_derived_features(data, contract, old_derived(dt, contract)).sort_by(
        [(c, "ascending") for c in ("capture_time", "seq", "sample_id") if c in data.column_names])
    txns = [Transaction(app_id=txn_app_id(*r), version=1) for r in refs]
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        added = columns_to_add(dt, contract)
        if added:
            log.info("dataset %s: adding columns %s at v%d (schema merge; older rows read null)", kind, added,
                     dt.version() + 1)
        try:
            # The id index already made these rows' ids ours: a lost race only needs the next version.
            write_deltalake(
                dt, data, mode="append", schema_mode="merge" if added else None,
                commit_properties=CommitProperties(custom_metadata=metadata, app_transactions=txns,
                                                   max_commit_retries=0),
            )
            break
        except CommitFailedError as e:
            if attempt == COMMIT_ATTEMPTS:
                raise DatasetError(f"dataset {kind}: commit of {len(todo)} bundles lost {attempt} races, "
                                   f"nothing written: {e}") from e
            log.info("dataset %s: lost the race for v%d (attempt %d); retrying", kind, dt.version() + 1, attempt)
            time.sleep(random.uniform(0.0, 0.02 * min(attempt, 10)))
            h.refresh(s3)
    version = dt.version()
    h.note_commit(version, refs)
    nodes = sorted({n for n, _ in refs})
    log.info("dataset %s v%d: %d bundles, %d rows from %s, %d duplicate sample ids dropped", kind, version,
             len(todo), data.num_rows, nodes, sum(len(v) for v in dups.values()))
    return _result(kind, version, version - 1, commit_id, refs, data.num_rows, already, deferred,
                   json.loads(metadata["edgehaul.stats"]), t0, dup_names)


def _without_duplicates(
    contract: Contract, todo: list[ValidatedBundle], held: Container[tuple[str, str]],
) -> tuple[pa.Table, dict[Ref, int], dict[Ref, list[str]]]:
    """The rows to append (dataset schema), rows kept per bundle, and per bundle the sample ids dropped
    because the node's data (`held`: (node, sample id)) or an earlier bundle of this commit from the same
    node (by bundle id) already has them. Ids are scoped by node: another node's id is never a duplicate."""
    schema = dataset_schema(contract)
    parts, kept, dups = [], {}, {}
    seen: set[tuple[str, str]] = set()
    for vb in sorted(todo, key=lambda v: bundle_ref(v.manifest)):
        ref, node = bundle_ref(vb.manifest), vb.manifest.node_id
        t = conform(vb.table, contract)
        ids = t.column("sample_id").to_pylist()
        fresh = [(node, sid) not in held and (node, sid) not in seen for sid in ids]
        if not all(fresh):
            dups[ref] = [sid for sid, ok in zip(ids, fresh, strict=True) if not ok]
            t = t.filter(pa.array(fresh))
        seen.update((node, sid) for sid in ids)
        kept[ref] = t.num_rows
        parts.append(t.append_column(schema.field(BUNDLE_ID_COLUMN), pa.array([vb.manifest.bundle_id] * t.num_rows,
                                                                               pa.string())))
    return pa.concat_tables(parts).cast(schema), kept, dups  # added columns nullable, as the table has them


def _commit_metadata(
    contract: Contract, todo: list[ValidatedBundle], kept: dict[Ref, int], dups: dict[Ref, list[str]], data: pa.Table,
    commit_id: str, run_id: str,
) -> dict[str, str]:
    lineage = []
    for vb in todo:
        ref = bundle_ref(vb.manifest)
        lineage.append({"bundle_id": vb.manifest.bundle_id, "node_id": vb.manifest.node_id, "sha256": vb.manifest.sha256,
                        "rows": kept[ref], "tier": vb.manifest.tier, "created_at": vb.manifest.created_at,
                        **({"duplicates": len(dups[ref])} if ref in dups else {})})
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


def committed_bundle_ids(store: ObjectStore, kind: str, refs: list[Ref], *,
                         s3: S3Client | None = None) -> set[Ref]:
    """Which of these bundles (node, bundle id) the latest version holds (DatasetError when there is no dataset
    yet); answered from the process's transaction index, not one log scan per bundle."""
    s3 = s3 or store.client()
    with _locked_handle(store, kind, s3, lambda: open_table(store, kind)) as h:
        if not h.ids_ready:
            _load_ids_marker(store, h, s3)  # bundles committed before ids were scoped by node
        return {r for r in refs if h.is_committed(r, s3)}


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
    added: dict[Ref, tuple[int, str]] = {}
    for h in dt.history():  # newest first, from the latest commit; keep those up to `version`
        if int(h["version"]) > version:
            continue
        for b in json.loads(h.get("edgehaul.bundles") or "[]"):
            added.setdefault((b.get("node_id", ""), b["bundle_id"]), (int(h["version"]), b.get("sha256", "")))
    bundles = sorted(
        ({"bundle_id": g[BUNDLE_ID_COLUMN], "node_id": g["node_id"], "rows": int(g["count_all"]),
          "added_in": added.get((g["node_id"], g[BUNDLE_ID_COLUMN]), (-1, ""))[0],
          "sha256": added.get((g["node_id"], g[BUNDLE_ID_COLUMN]), (-1, ""))[1]}
         for g in grouped),
        key=lambda b: (b["added_in"], b["node_id"], b["bundle_id"]),
    )
    return Lineage(kind, version, data.num_rows, sorted({b["node_id"] for b in bundles}), bundles,
                   commit_info(store, kind, version))

