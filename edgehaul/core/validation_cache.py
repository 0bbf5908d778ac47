"""The per-bundle cache of successful validations, read and written by the core itself.

One core ingest run validates its bundles in a few task runs (a chunk each), not one task run per bundle:
a task run costs Prefect API calls and a result write, which at fleet scale set the core's pace. The
cache stays per bundle, as Prefect's task cache was, and in the same place and format:

- key: `validation_key` = the bundle's SHA-256 (its manifest's) + the landed object (bucket, key) + its
  ETag and size as the store reports them to the core (a HEAD by the core's identity: the store's digest of
  the bytes it holds, not a claim of the node) + the contract file's SHA-256 + `VALIDATION_VERSION` +
  `CORE_CACHE_VERSION`;
- value: a Prefect result record (JSON serializer) holding the `ValidationResult`, in the flow's result
  storage (`result_storage`: the central `edgehaul-core-results` S3 folder, or the worker's default
  storage), which only central identities may write (`edgehaul.platform.caching`);
- the storage is pinned: `named` takes a block only when it is the configured central folder
  (`EDGEHAUL_CORE_RESULTS_URI`, default the core store's `<ops bucket>/<prefix>prefect-results/core`, on the
  core store's endpoint). A block an API client re-pointed elsewhere (a node's landing prefix, another
  server) is refused: no cache, every bundle validated, one error line;
- only successes are written: a rejection is validated again by every run;
- a read takes a record only when it is JSON and holds a successful result for this very bundle and
  checksum; anything else (pickle, another serializer, garbage, expired, another bundle) is a miss,
  logged, and never decoded as code. The commit re-checks the bytes against the validated checksum, so
  even a forged success could not admit other bytes.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from botocore.exceptions import ClientError

from edgehaul.contracts import ContractError, contract_by_id
from edgehaul.core.validation import VALIDATION_VERSION, ValidationResult
from edgehaul.platform.caching import RESULT_SERIALIZER, cache_key
from edgehaul.platform.s3_errors import error_code

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from prefect.filesystems import WritableFileSystem
    from prefect.types._datetime import DateTime

    from edgehaul.blocks import ObjectStore
    from edgehaul.bundles import BundleManifest

log = logging.getLogger(__name__)

CORE_CACHE_VERSION = "core-2"  # bump to invalidate every cached validation / compaction result
VALIDATION_TTL = timedelta(days=30)


def validation_key(bundle_sha256: str, landed_object: str, landed_etag: str, contract_sha256: str) -> str:
    return cache_key("core-validate", CORE_CACHE_VERSION, VALIDATION_VERSION, bundle_sha256, landed_object, landed_etag,
                     contract_sha256)


def landed_etag(store: ObjectStore, key: str, *, s3: S3Client | None = None) -> str:
    """`<ETag>:<size>` of the landed object as the store reports it to the core; 'missing' when it is not there
    (validation then rejects it, and rejections are never cached)."""
    try:
        head = (s3 or store.client()).head_object(Bucket=store.bucket("landing"), Key=key)
    except ClientError as e:
        if error_code(e) in ("404", "NoSuchKey", "NotFound"):
            return "missing"
        raise
    return f"{head['ETag'].strip(chr(34))}:{head['ContentLength']}"


def entry_for(store: ObjectStore, key: str, manifest: BundleManifest, *, s3: S3Client | None = None) -> str:
    """The cache entry of the landed bundle at `key` as it is in the store now (one HEAD)."""
    try:
        contract_sha = contract_by_id(manifest.contract).sha256
    except ContractError:
        contract_sha = f"unknown:{manifest.contract}"  # validation rejects it; nothing is cached under it
    return validation_key(manifest.sha256, f"{store.bucket('landing')}/{key}", landed_etag(store, key, s3=s3),
                          contract_sha)


def pinned_location(store: ObjectStore | None) -> tuple[str, str, str | None] | None:
    """(bucket, folder, endpoint) the validation cache may use: EDGEHAUL_CORE_RESULTS_URI, else the core
    store's central results folder; None when neither is known (then no named block is accepted)."""
    from edgehaul.platform.caching import CORE_RESULTS_FOLDER
    from edgehaul.platform.settings import get_settings

    endpoint = store.endpoint_url if store is not None else None
    uri = get_settings().core_results_uri
    if uri:
        bucket, _, folder = uri.removeprefix("s3://").partition("/")
        return bucket, folder.strip("/"), endpoint
    if store is None:
        return None
    return store.bucket("ops"), store.key("ops", CORE_RESULTS_FOLDER).strip("/"), endpoint


def refusal(storage: Any, store: ObjectStore | None) -> str:
    """Why `storage` (a resolved result-storage block) is not the pinned central folder; '' when it is."""
    pin = pinned_location(store)
    if pin is None:
        return "no pinned location (EDGEHAUL_CORE_RESULTS_URI unset and no core store given)"
    bucket, folder, endpoint = pin
    got_bucket = getattr(storage, "bucket_name", None)
    if got_bucket is None:
        return f"a {type(storage).__name__}, not the central S3 folder s3://{bucket}/{folder}"
    got_folder = str(getattr(storage, "bucket_folder", "") or "").strip("/")
    if (got_bucket, got_folder) != (bucket, folder):
        return f"it names s3://{got_bucket}/{got_folder}, not the pinned s3://{bucket}/{folder}"
    params = getattr(getattr(storage, "credentials", None), "aws_client_parameters", None)
    got_endpoint = getattr(params, "endpoint_url", None)
    if endpoint is not None and got_endpoint is not None and str(got_endpoint).rstrip("/") != endpoint.rstrip("/"):
        return f"its endpoint {str(got_endpoint)[:80]} is not the core store's {endpoint}"
    return ""


class ValidationCache:
    """Successful validations by entry, in a Prefect result storage block (S3Bucket, LocalFileSystem, ...)."""

    def __init__(self, storage: WritableFileSystem | None, ttl: timedelta = VALIDATION_TTL) -> None:
        self.storage = storage  # None: refused storage, every lookup a miss and nothing written
        self.ttl = ttl
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def named(cls, result_storage: str, store: ObjectStore | None = None) -> ValidationCache:
        """The block named by its slug (`s3-bucket/edgehaul-core-results`) when it is the pinned central
        folder (`pinned_location`), or Prefect's default result storage of this process when empty (its
        local disk: correct, but a cache no other worker shares). A block anywhere else is refused."""
        from prefect.results import get_default_result_storage, resolve_result_storage

        if not result_storage:  # sync here (no event loop in a task's thread); async_dispatch's types say either
            return cls(cast("WritableFileSystem", get_default_result_storage(_sync=True)))  # type: ignore[call-arg]
        storage = resolve_result_storage(result_storage)
        why = refusal(storage, store)
        if why:
            log.error("validation cache: result storage %s refused: %s; validating every bundle", result_storage, why)
            return cls(None)
        return cls(cast("WritableFileSystem", storage))

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from prefect._internal.compatibility.blocks import call_explicitly_sync_block_method

        if self.storage is None:
            raise RuntimeError("refused result storage")
        return call_explicitly_sync_block_method(self.storage, method, args, kwargs)

    def get(self, entry: str, manifest: BundleManifest) -> ValidationResult | None:
        """The cached success for `entry`, when there is a usable one for this bundle; else None."""
        if self.storage is None:
            return None
        try:
            raw = self._call("read_path", entry)
        except (FileNotFoundError, ValueError):
            return None  # LocalFileSystem: no such record
        except ClientError as e:
            if error_code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            self._unusable("read", e)
            return None
        except Exception as e:  # a cache is a saving: storage trouble (credentials, network) means validating
            self._unusable("read", e)
            return None
        return self._decode(entry, raw, manifest)

    def _decode(self, entry: str, raw: bytes, manifest: BundleManifest) -> ValidationResult | None:
        from prefect.serializers import JSONSerializer

        try:
            rec = json.loads(raw)
            meta = rec["metadata"]
            if meta["serializer"]["type"] != RESULT_SERIALIZER:  # pickle and friends are never decoded
                raise ValueError(f"serializer {str(meta['serializer']['type'])[:40]!r}")
            expires = meta.get("expiration")
            if expires is not None and datetime.fromisoformat(str(expires)) <= datetime.now(UTC):
                return None
            value = JSONSerializer().loads(str(rec["result"]).encode())
            if not isinstance(value, ValidationResult):
                raise ValueError(f"holds a {type(value).__name__}")
        except (ValueError, KeyError, TypeError) as e:
            log.warning("validation cache: record %s refused (%s); validating", entry, str(e)[:200])
            return None
        if not (value.success and value.bundle_sha256 == manifest.sha256 and value.bundle_id == manifest.bundle_id
                and value.node_id == manifest.node_id):
            log.warning("validation cache: record %s is not this bundle's success; validating", entry)
            return None
        return value

    def put(self, entry: str, result: ValidationResult) -> bool:
        """Write a success (never a rejection); False when it could not be written (logged: only a saving lost)."""
        from prefect._internal.result_records import ResultRecord, ResultRecordMetadata
        from prefect.serializers import JSONSerializer
        from prefect.types._datetime import now

        if not result.success:
            raise ValueError(f"bundle {result.bundle_id}: only a successful validation is cached ({result.reason})")
        if self.storage is None:
            return False
        meta = ResultRecordMetadata(storage_key=entry, serializer=JSONSerializer(),
                                    expiration=cast("DateTime", now("UTC") + self.ttl))
        try:
            self._call("write_path", entry, content=ResultRecord(metadata=meta, result=result).serialize())
        except Exception as e:  # only a saving lost: the bundle was validated
            self._unusable("write", e)
            return False
        return True

    def _unusable(self, what: str, e: Exception) -> None:
        """Say once per cache (a run's chunk) that its storage failed, with the reason: a cache that never
        hits costs every run a full validation, which an operator must be able to see."""
        with self._lock:
            if what in self._warned:
                return
            self._warned.add(what)
        log.warning("validation cache: cannot %s %s (%s: %s); validating without it", what,
                    type(self.storage).__name__, type(e).__name__, str(e)[:200])
