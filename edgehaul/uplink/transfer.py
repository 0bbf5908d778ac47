"""Transfer of bundles into the landing zone, and the priority drain of a spool.

`Uplink.send(data, manifest)` lands one bundle, idempotently:
1. HEAD the content-derived key: an object with the same size and sha256 means it already landed
   (a retry or a duplicate send), so nothing is sent again;
2. small bundles: one PUT with ChecksumSHA256 and IfNoneMatch='*' (two racing senders make one
   object: the loser gets 412 and verifies the winner's object); large bundles: multipart with a
   SHA-256 checksum per part, the upload id and the part ETags persisted in the spool root after
   every part, so a process killed with kill -9 resumes (list_parts) and sends only missing parts;
3. every PUT and part carries Content-MD5 and x-amz-checksum-sha256; a part or object whose bytes
   were corrupted on the way is rejected by the server (BadDigest), or, on a server that checks
   neither, caught by its ETag (the MD5 the server computed of what it stored) and re-sent, up to
   `max_digest_resends` times;
4. prove the landed bytes equal the spooled ones (`Receipt.verified_by`, in this order): the ETag
   the server computed ("etag-md5", or "etag-multipart" = md5 of the part MD5s + "-N"), a checksum
   the caller knows this server enforces (`server_checks`, from the capability probe), or else a
   read-back hash of the whole object ("read-back", metered in `Receipt.readback_bytes`). Sizes and
   the client's own `sha256` metadata are checked too, but prove nothing about the bytes;
5. write the manifest object last (its presence means the bundle is complete).
Only then may the caller remove the bundle from its spool (`Drainer` acks only receipts with a proof).

`Drainer` moves bundles from a source (the spool) through the link: high tier first, then highest
value, then oldest; urgent bundles get a lane of their own and the shaper serves their chunks
before any normal chunk, so they overtake a normal bundle mid-transfer. Failures that are safe to
retry are retried with backoff; a bundle that keeps failing goes to the persistent retry queue.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from botocore.exceptions import ClientError

from edgehaul import events
from edgehaul.bundles import BundleGone, BundleManifest
from edgehaul.platform import s3compat
from edgehaul.platform.s3_errors import DIGEST_CODES, error_code, is_retryable
from edgehaul.uplink.link import Link, LinkDown, Priority, priority_key

if TYPE_CHECKING:
    from edgehaul.blocks.object_store import ObjectStore
    from edgehaul.uplink.retry_queue import RetryQueue

log = logging.getLogger(__name__)

# Proofs that the landed bytes are the spooled ones, each a check the server or the product performed.
PROOFS = frozenset({"etag-md5", "etag-multipart", "server-sha256", "content-md5", "read-back"})
ServerCheck = Literal["sha256", "content-md5"]


class _StoredCorrupt(Exception):
    """The server took a PUT or part but its ETag says the stored bytes differ from the sent ones."""


class UplinkError(RuntimeError):
    """A bundle could not be landed; `retryable` says whether trying again later can help."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def _etag(v: str | None) -> str:
    return (v or "").strip('"')


@dataclass
class Receipt:
    """What landed: where, its checksum, and how it got there."""

    bundle_id: str
    bucket: str
    key: str
    manifest_key: str
    sha256: str
    nbytes: int
    tier: str
    rows: int
    manifest_nbytes: int = 0
    verified_by: str = ""  # one of PROOFS: how the landed bytes were proven equal to the spooled ones
    readback_bytes: int = 0  # bytes read back to prove them (the last-resort proof), metered
    already_present: bool = False
    multipart: bool = False
    parts_total: int = 0
    parts_sent: int = 0
    parts_skipped: int = 0
    digest_resends: int = 0
    seconds: float = 0.0
    landed_at: str = ""
    team: str = ""  # the manifest's team: whose bill the bytes go on
    link: str = "primary"  # which link carried it: "primary" or "backup" (metered separately)


class Uplink:
    """Lands bundles in `store`'s landing zone through `link`. Thread-safe (one boto3 client)."""

    def __init__(
        self,
        store: ObjectStore,
        link: Link,
        state_dir: Path,
        *,
        max_digest_resends: int = 3,
        contact_wait_s: float = 0.0,
        client: Any | None = None,
        server_checks: frozenset[ServerCheck] | set[ServerCheck] = frozenset(),
    ) -> None:
        self.store = store
        self.link = link
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.max_digest_resends = max_digest_resends
        # Checks this server is known to enforce (the capability probe sent a wrong sum and was refused).
        # An echoed checksum in a 200 is no proof on its own: some servers accept a wrong one.
        self.server_checks = frozenset(server_checks)
        self.contact_wait_s = contact_wait_s
        self.bucket = store.bucket("landing")
        # botocore must neither retry on its own (we count and classify every failure) nor sign the
        # payload (over http that reads the body twice, and the body is what the link paces).
        self.client = client or store.client(
            retries={"total_max_attempts": 1, "mode": "standard"},
            s3={"addressing_style": "path" if store.path_style else "auto", "payload_signing_enabled": False},
        )
        link.attach(self.client)
        self.profile = link.profile

    # -- public -----------------------------------------------------------------------------------
    def key_of(self, manifest: BundleManifest) -> str:
        return self.store.key("landing", manifest.object_key)

    def send(self, data: bytes, manifest: BundleManifest, *, priority: Priority | None = None,
             link: str = "primary") -> Receipt:
        """Land one bundle (idempotent); raises UplinkError or the underlying boto error. `link` names the
        link that carries it, recorded on its manifest object (the cost report meters each link)."""
        t0 = time.monotonic()
        if len(data) != manifest.nbytes or hashlib.sha256(data).hexdigest() != manifest.sha256:
            raise UplinkError(f"bundle {manifest.bundle_id}: bytes do not match the manifest (spool corrupt?)",
                              retryable=False)
        prio = priority if priority is not None else priority_key(manifest.tier, manifest.max_value, manifest.created_at)
        if not self.link.is_up() and not self.link.wait_until_up(self.contact_wait_s):
            raise LinkDown(endpoint_url=self.store.endpoint_url or "s3", why=self.link.down_reason())
        key = self.key_of(manifest)
        r = Receipt(
            bundle_id=manifest.bundle_id, bucket=self.bucket, key=key,
            manifest_key=self.store.key("landing", manifest.manifest_key), sha256=manifest.sha256,
            nbytes=manifest.nbytes, tier=manifest.tier, rows=manifest.row_count, team=manifest.team, link=link,
        )
        small = manifest.nbytes < self.profile.multipart_threshold_bytes
        # HEAD first saves re-sending the bytes of a bundle that already landed (a crash between
        # landing and ack). An urgent bundle is small and latency-bound: it skips that round trip,
        # and IfNoneMatch still keeps a duplicate from making a second object.
        present = not (small and manifest.tier == "high") and self._landed(key, manifest)
        if present and self._verify(key, manifest, data, r):
            r.already_present = True
        elif not small:
            self._multipart(data, manifest, key, prio, r)
        else:
            self._single(data, manifest, key, prio, r)
        if not r.verified_by and not self._verify(key, manifest, data, r):
            # The landed bytes were not ours (now deleted): a later attempt sends them again.
            raise UplinkError(f"bundle {manifest.bundle_id}: landed object differs from the spooled bytes; "
                              "deleted, to be re-sent", retryable=True)
        self.forget(manifest.bundle_id)  # proven: no resume state is needed any more
        r.manifest_nbytes = self._put_manifest(manifest, r.manifest_key, prio, r)
        r.seconds = time.monotonic() - t0
        r.landed_at = datetime.now(UTC).isoformat()
        return r

    def abort_orphans(
        self, node_id: str, *, older_than_s: float, live_bundles: set[str] | None = None
    ) -> list[tuple[str, str]]:
        """Abort multipart uploads under the node's prefix older than the bound that no local
        resume state refers to (a crash before the state was saved, or a dropped bundle).

        With `live_bundles` (the spool's pending ids), resume states of bundles no longer in the
        spool are forgotten first, so their uploads count as orphans too."""
        states = self._states()
        if live_bundles is not None:
            for st in states:
                if st.get("bundle_id") and st["bundle_id"] not in live_bundles:
                    self.forget(st["bundle_id"])
            states = [st for st in states if not st.get("bundle_id") or st["bundle_id"] in live_bundles]
        live = {st.get("upload_id") for st in states}
        prefix = self.store.key("landing", f"{node_id}/")
        now = datetime.now(UTC)
        aborted = []
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        while True:
            page = self.client.list_multipart_uploads(**kw)
            for up in page.get("Uploads", []) or []:
                age = (now - up["Initiated"]).total_seconds()
                if up["UploadId"] in live or age < older_than_s:
                    continue
                with contextlib.suppress(ClientError):
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                    aborted.append((up["Key"], up["UploadId"]))
            if not page.get("IsTruncated"):
                break
            kw.update(KeyMarker=page.get("NextKeyMarker"), UploadIdMarker=page.get("NextUploadIdMarker"))
        if aborted:
            log.info("aborted %d orphaned multipart uploads under %s", len(aborted), prefix)
        return aborted

    def forget(self, bundle_id: str) -> None:
        """Drop local resume state (the bundle left the spool another way)."""
        self._state_path(bundle_id).unlink(missing_ok=True)

    # -- single PUT ---------------------------------------------------------------------------------
    def _metadata(self, m: BundleManifest) -> dict[str, str]:
        return {"sha256": m.sha256, "contract": m.contract, "rows": str(m.row_count), "tier": m.tier,
                "bundle-id": m.bundle_id}

    def _with_digest_resends(self, what: str, r: Receipt, fn: Callable[[], Any]) -> Any:
        for attempt in range(self.max_digest_resends + 1):
            try:
                return fn()
            except (ClientError, _StoredCorrupt) as e:
                why = "stored ETag != local MD5" if isinstance(e, _StoredCorrupt) else error_code(e)
                if isinstance(e, ClientError) and why not in DIGEST_CODES:
                    raise
                if attempt == self.max_digest_resends:
                    raise UplinkError(f"{what}: checksum rejected {attempt + 1} times ({why})",
                                      retryable=False) from e
                r.digest_resends += 1
                log.info("%s: corrupted on the way (%s), re-sending", what, why)
        raise AssertionError("unreachable")

    def _proof_of_write(self, resp: dict[str, Any], local_md5: str, checksum: str) -> str:
        """The proof a write's own response gives, "" if none. Raises _StoredCorrupt when the server's
        ETag is an MD5 and not the one of the bytes sent (a server that checked neither header)."""
        etag = s3compat.unquoted(resp.get("ETag"))
        if s3compat.is_md5(etag):
            if etag.lower() != local_md5:
                raise _StoredCorrupt(etag)
            return "etag-md5"
        if "sha256" in self.server_checks and resp.get("ChecksumSHA256") == checksum:
            return "server-sha256"
        if "content-md5" in self.server_checks:
            return "content-md5"
        return ""

    def _single(self, data: bytes, m: BundleManifest, key: str, prio: Priority, r: Receipt) -> None:
        checksum = _b64(bytes.fromhex(m.sha256))
        md5 = hashlib.md5(data).digest()

        def put() -> Any:
            resp = self.client.put_object(
                Bucket=self.bucket, Key=key, Body=self.link.body(data, prio), ChecksumSHA256=checksum,
                ContentMD5=_b64(md5), IfNoneMatch="*", Metadata=self._metadata(m),
                ContentType="application/vnd.apache.parquet",
            )
            try:
                r.verified_by = self._proof_of_write(resp, md5.hex(), checksum)
            except _StoredCorrupt:
                # Ours and wrong: remove it so IfNoneMatch lets the re-send through.
                self.client.delete_object(Bucket=self.bucket, Key=key)
                raise
            return resp

        try:
            self._with_digest_resends(f"bundle {m.bundle_id}", r, put)
            r.parts_total = r.parts_sent = 1
        except ClientError as e:
            if not s3compat.is_precondition_failed(e):
                raise
            r.already_present = True  # another sender won the race; _verify checks its object

    # -- multipart ------------------------------------------------------------------------------------
    def _state_path(self, bundle_id: str) -> Path:
        return self.state_dir / f"{bundle_id}.mpu.json"

    def _states(self) -> list[dict[str, Any]]:
        out = []
        for p in self.state_dir.glob("*.mpu.json"):
            with contextlib.suppress(OSError, json.JSONDecodeError):
                out.append(json.loads(p.read_text()))
        return out

    def _save_state(self, bundle_id: str, state: dict[str, Any]) -> None:
        path = self._state_path(bundle_id)
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)

    def _load_state(self, m: BundleManifest, key: str, part_bytes: int) -> dict[str, Any] | None:
        path = self._state_path(m.bundle_id)
        if not path.exists():
            return None
        try:
            st = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if st.get("sha256") != m.sha256 or st.get("key") != key or st.get("part_bytes") != part_bytes:
            return None
        return dict(st)

    def _server_parts(self, key: str, upload_id: str) -> dict[int, dict[str, Any]] | None:
        """Parts the server holds (the last entry wins per part number); None if the upload is gone."""
        parts: dict[int, dict[str, Any]] = {}
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": key, "UploadId": upload_id}
        try:
            while True:
                page = self.client.list_parts(**kw)
                for p in page.get("Parts", []) or []:
                    parts[int(p["PartNumber"])] = {"etag": _etag(p.get("ETag")), "size": int(p["Size"])}
                if not page.get("IsTruncated"):
                    return parts
                kw["PartNumberMarker"] = page.get("NextPartNumberMarker")
        except ClientError as e:
            if error_code(e) == "NoSuchUpload":
                return None
            raise

    def _multipart(self, data: bytes, m: BundleManifest, key: str, prio: Priority, r: Receipt) -> None:
        size = int(self.profile.part_bytes)
        n_parts = (len(data) + size - 1) // size
        r.multipart, r.parts_total = True, n_parts
        st = self._load_state(m, key, size)
        server: dict[int, dict[str, Any]] | None = None
        if st is not None:
            server = self._server_parts(key, st["upload_id"])
            if server is None:
                st = None  # aborted or completed elsewhere: start a new upload (HEAD said not landed)
        if st is None:
            up = self.client.create_multipart_upload(
                Bucket=self.bucket, Key=key, ChecksumAlgorithm="SHA256", Metadata=self._metadata(m),
                ContentType="application/vnd.apache.parquet",
            )
            st = {"bundle_id": m.bundle_id, "key": key, "upload_id": up["UploadId"], "sha256": m.sha256,
                  "part_bytes": size, "nbytes": len(data), "created": time.time(), "parts": {}}
            self._save_state(m.bundle_id, st)
            server = {}
        assert server is not None
        done: dict[str, dict[str, str]] = st["parts"]
        digests: list[bytes] = []
        for n in range(1, n_parts + 1):
            chunk = data[(n - 1) * size : n * size]
            digest = hashlib.sha256(chunk).digest()
            digests.append(digest)
            have = server.get(n)
            mine = done.get(str(n))
            # Killed after the server took the part but before the state was saved: S3's part ETag
            # is the part's MD5 (no SSE-KMS on landing), so the part can still be recognised.
            if have and have["size"] == len(chunk) and (
                (mine and mine["etag"] == have["etag"]) or (not mine and have["etag"] == hashlib.md5(chunk).hexdigest())
            ):
                done[str(n)] = {"etag": have["etag"], "checksum": _b64(digest)}
                r.parts_skipped += 1
                continue
            checksum = _b64(digest)

            def put_part(chunk: bytes = chunk, n: int = n, checksum: str = checksum) -> Any:
                md5 = hashlib.md5(chunk).digest()
                resp = self.client.upload_part(
                    Bucket=self.bucket, Key=key, UploadId=st["upload_id"], PartNumber=n,
                    Body=self.link.body(chunk, prio), ChecksumSHA256=checksum, ChecksumAlgorithm="SHA256",
                    ContentMD5=_b64(md5),
                )
                etag = s3compat.unquoted(resp.get("ETag"))
                if s3compat.is_md5(etag) and etag.lower() != md5.hex():
                    raise _StoredCorrupt(etag)  # the same part number is simply uploaded again
                return resp

            resp = self._with_digest_resends(f"bundle {m.bundle_id} part {n}", r, put_part)
            done[str(n)] = {"etag": _etag(resp.get("ETag")), "checksum": checksum}
            r.parts_sent += 1
            self._save_state(m.bundle_id, st)
        st["composite"] = _b64(hashlib.sha256(b"".join(digests)).digest()) + f"-{n_parts}"
        self._save_state(m.bundle_id, st)
        parts = [{"PartNumber": n, "ETag": f'"{done[str(n)]["etag"]}"', "ChecksumSHA256": done[str(n)]["checksum"]}
                 for n in range(1, n_parts + 1)]
        try:
            # If-None-Match keeps a duplicate sender from completing twice; a server that ignores it on
            # complete rewrites the same content-addressed key with the same bytes, which is harmless.
            done_resp = self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=st["upload_id"], MultipartUpload={"Parts": parts}, IfNoneMatch="*",
            )
            want = s3compat.multipart_etag_of(data, size)
            if s3compat.unquoted(done_resp.get("ETag")).lower() == want:
                r.verified_by = "etag-multipart"  # the server's MD5s of the parts it stored, combined
        except ClientError as e:
            code = error_code(e)
            if code == "PreconditionFailed":
                r.already_present = True  # a duplicate sender completed first: ours is not needed
                with contextlib.suppress(ClientError):
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=st["upload_id"])
            elif code != "NoSuchUpload":  # NoSuchUpload: completed before a crash; _verify decides
                raise

    # -- verify + manifest ----------------------------------------------------------------------------
    def _landed(self, key: str, m: BundleManifest) -> bool:
        try:
            h = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if s3compat.is_missing(e):
                return False
            if s3compat.status(e) == 403:
                # HEAD of a missing key answers 403 to an identity without ListBucket (AWS does this too,
                # and a node's identity is scoped to its prefix): treat it as "not there". The write that
                # follows is conditional (If-None-Match), and a real denial fails that write loudly.
                return False
            raise
        meta = h.get("Metadata", {}) or {}
        if int(h["ContentLength"]) == m.nbytes and meta.get("sha256") == m.sha256:
            return True
        raise UplinkError(
            f"bundle {m.bundle_id}: {key} exists with size {h['ContentLength']} / sha256 {meta.get('sha256', '?')[:12]}, "
            f"expected {m.nbytes} / {m.sha256[:12]}: not overwriting", retryable=False,
        )

    def _verify(self, key: str, m: BundleManifest, data: bytes, r: Receipt) -> bool:
        """Prove the object at `key` holds exactly `data` (sets `r.verified_by`, returns True), or delete
        it and return False when it does not. The ETag is the server's own hash of what it stored; only
        when it is not an MD5 of a known shape (SSE-KMS, another part size) and no enforced checksum
        covers it, the whole object is read back and hashed, which costs a GET of its size."""
        h = self.client.head_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
        meta = h.get("Metadata", {}) or {}
        problems = []
        if int(h["ContentLength"]) != m.nbytes:
            problems.append(f"size {h['ContentLength']} != {m.nbytes}")
        if meta.get("sha256") != m.sha256:
            problems.append(f"sha256 metadata {meta.get('sha256', '?')[:12]} != {m.sha256[:12]}")
        etag = s3compat.unquoted(h.get("ETag")).lower()
        proof = ""
        if not problems:
            parts = s3compat.multipart_parts(etag)
            part_bytes = int(self.profile.part_bytes)
            if s3compat.is_md5(etag):
                if etag == hashlib.md5(data).hexdigest():
                    proof = "etag-md5"
                else:
                    problems.append("ETag is not the MD5 of the spooled bytes")
            elif parts and parts == (len(data) + part_bytes - 1) // part_bytes and (
                etag == s3compat.multipart_etag_of(data, part_bytes)
            ):
                proof = "etag-multipart"
            elif "sha256" in self.server_checks and h.get("ChecksumSHA256") == _b64(bytes.fromhex(m.sha256)):
                proof = "server-sha256"
        if not problems and not proof:
            got = self.client.get_object(Bucket=self.bucket, Key=key)
            hasher = hashlib.sha256()
            for block in iter(lambda: got["Body"].read(1 << 20), b""):
                hasher.update(block)
                r.readback_bytes += len(block)
            if hasher.hexdigest() == m.sha256:
                proof = "read-back"
            else:
                problems.append("read-back SHA-256 differs")
        if problems:
            log.warning("bundle %s: landed object fails verification (%s); deleting it", m.bundle_id, "; ".join(problems))
            self.client.delete_object(Bucket=self.bucket, Key=key)
            return False
        r.verified_by = proof
        self.forget(m.bundle_id)
        return True

    def _put_manifest(self, m: BundleManifest, manifest_key: str, prio: Priority, r: Receipt) -> int:
        """Write the manifest, proven like the bundle (its bytes cross the same link); returns the bytes
        sent (0 when it was already there)."""
        body = m.to_json()
        md5 = hashlib.md5(body).digest()
        checksum = _b64(hashlib.sha256(body).digest())

        def put() -> int:
            try:
                resp = self.client.put_object(
                    Bucket=self.bucket, Key=manifest_key, Body=self.link.body(body, prio), ChecksumSHA256=checksum,
                    ContentMD5=_b64(md5), IfNoneMatch="*", ContentType="application/json",
                    Metadata={"bundle-id": m.bundle_id, "sha256": m.sha256, "link": r.link},
                )
            except ClientError as e:
                if not s3compat.is_precondition_failed(e):
                    raise
                h = self.client.head_object(Bucket=self.bucket, Key=manifest_key)
                etag = s3compat.unquoted(h.get("ETag")).lower()
                if not s3compat.is_md5(etag) or etag == md5.hex():
                    return 0
                resp = {"ETag": etag}  # an earlier manifest landed corrupt: replaced below
            try:
                self._proof_of_write(resp, md5.hex(), checksum)
            except _StoredCorrupt:
                self.client.delete_object(Bucket=self.bucket, Key=manifest_key)
                raise
            return len(body)

        sent: int = self._with_digest_resends(f"bundle {m.bundle_id} manifest", r, put)
        return sent


# ---------------------------------------------------------------------------------------------------
# Draining a spool
# ---------------------------------------------------------------------------------------------------

class PendingEntry(Protocol):
    """One bundle waiting in a source, as the drain orders it (read-only: spool entries are frozen)."""

    @property
    def bundle_id(self) -> str: ...
    @property
    def tier(self) -> str: ...
    @property
    def max_value(self) -> float: ...
    @property
    def created_at(self) -> Any: ...  # ISO string or epoch seconds
    @property
    def manifest(self) -> BundleManifest: ...


class Source(Protocol):
    """What the drain needs from a spool (edgehaul.edge.spool.Spool satisfies it)."""

    def pending(self) -> Sequence[PendingEntry]: ...
    def read(self, bundle_id: str) -> bytes: ...  # BundleGone: no longer held, and accounted for by the source
    def ack(self, bundle_id: str, *, remote_key: str, sha256: str) -> Any: ...


def _created(e: Any) -> str:
    c = getattr(e, "created_at", "")
    if isinstance(c, int | float):
        return f"{float(c):020.6f}"
    return str(c)


def _tier(e: Any) -> str:
    return str(getattr(e, "tier", None) or e.manifest.tier)


@dataclass
class DrainReport:
    """What one drain did, and the link metrics of the run."""

    landed: list[Receipt] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # bundle_id -> last error
    queued_for_retry: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)  # left the source while listed (corrupt on disk: ledgered there)
    attempts: int = 0
    seconds: float = 0.0
    bytes_landed: int = 0  # bundle bytes newly landed (duplicates not counted)
    manifest_bytes_landed: int = 0
    link: dict[str, float] = field(default_factory=dict)
    landing_latency_s: dict[str, list[float]] = field(default_factory=dict)  # tier -> capture-to-landed
    queue_lengths: dict[str, int] = field(default_factory=dict)  # tier -> still pending at the end
    bytes_by_link: dict[str, int] = field(default_factory=dict)  # "primary"/"backup" -> bundle bytes newly landed
    backup_refusals: int = 0  # urgent sends the backup refused (budget spent): they wait for the primary

    @property
    def goodput_bps(self) -> float:
        """Useful bits per second: bundles and their manifests landed (no re-sends, no duplicates)."""
        return 8 * (self.bytes_landed + self.manifest_bytes_landed) / self.seconds if self.seconds > 0 else 0.0

    def metrics(self, cap_bytes_per_s: float) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float | None:
            if not xs:
                return None
            s = sorted(xs)
            return round(s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))], 3)

        return {
            "bundles_landed": len(self.landed),
            "bundles_failed": len(self.failed),
            "queued_for_retry": len(self.queued_for_retry),
            "bundles_gone": len(self.gone),
            "bytes_landed": self.bytes_landed,
            "seconds": round(self.seconds, 3),
            "goodput_bps": round(self.goodput_bps, 1),
            "rate_cap_use": round(self.goodput_bps / (8 * cap_bytes_per_s), 4) if cap_bytes_per_s else 0.0,
            "retransmission_rate": self.link.get("retransmission_rate", 0.0),
            "digest_resends": sum(r.digest_resends for r in self.landed),
            "proofs": dict(sorted(Counter(r.verified_by for r in self.landed).items())),
            "readback_bytes": sum(r.readback_bytes for r in self.landed),
            "queue_lengths": dict(self.queue_lengths),
            "capture_to_landed_p50_s": {t: pct(v, 0.5) for t, v in self.landing_latency_s.items()},
            "capture_to_landed_p99_s": {t: pct(v, 0.99) for t, v in self.landing_latency_s.items()},
        }


class Drainer:
    """Drains a source through an `Uplink`, in priority (or FIFO) order, with bounded concurrency.

    `max_active` transfers share the link; `urgent_lanes` extra lanes are kept for high-tier bundles so
    an urgent bundle never waits for a normal one to finish (the shaper then gives its chunks
    precedence), and several urgent bundles overlap their request round trips.
    """

    def __init__(
        self,
        uplink: Uplink,
        source: Source,
        *,
        max_active: int = 2,
        urgent_lanes: int = 2,
        policy: Literal["priority", "fifo"] = "priority",
        attempts: int = 3,
        backoff_s: Sequence[float] = (0.5, 2.0, 8.0),
        retry_queue: RetryQueue | None = None,
        on_landed: Callable[[Receipt, Any], None] | None = None,
        poll_s: float = 0.02,
        refresh_s: float = 0.25,
        capture_time: Callable[[Any], float] | None = None,
        emit_events: bool = True,
        plan: Sequence[str] | None = None,
        backup: Uplink | None = None,
        backup_budget_bytes: int | None = None,
    ) -> None:
        self.uplink = uplink
        # Fail-over: while the primary link is down, urgent (tier high) bundles go over `backup` as long as
        # `backup_budget_bytes` (what is left of its monthly budget; None: unlimited) covers them. Bulk waits.
        self.backup = backup
        self.backup_budget_left = backup_budget_bytes
        self._backup_lock = threading.Lock()
        self._backup_refusals = 0
        self.source = source
        # A pass plan (edgehaul.uplink.pass_plan): only these bundles, in this order, then the run ends.
        self._plan_rank = {b: i for i, b in enumerate(plan)} if plan is not None else None
        self.max_active = max_active
        self.urgent_lanes = urgent_lanes
        self.policy = policy
        self.attempts = attempts
        self.backoff_s = list(backoff_s)
        self.retry_queue = retry_queue
        self.on_landed = on_landed
        self.poll_s = poll_s
        # How often the source is re-read for new bundles while transfers run (a spool lists its
        # directory; after a transfer ends it is re-read at once).
        self.refresh_s = refresh_s
        self.capture_time = capture_time
        self.emit_events = emit_events
        self._stop = threading.Event()
        self._batch: list[tuple[str, str, str]] = []  # landed, not yet announced in a LANDING_BATCH event

    def stop(self) -> None:
        self._stop.set()

    def _order(self, e: Any) -> Priority:
        if self._plan_rank is not None:
            return (self._plan_rank.get(e.bundle_id, len(self._plan_rank)),)
        if self.policy == "fifo":
            return (_created(e),)
        return priority_key(_tier(e), float(getattr(e, "max_value", e.manifest.max_value)), _created(e))

    def _shaper_priority(self, e: Any) -> Priority:
        # FIFO: everyone equal, the shaper then serves callers in arrival order.
        return () if self.policy == "fifo" else self._order(e)

    def _latency(self, e: Any, landed_wall: float) -> float:
        if self.capture_time is not None:
            return landed_wall - self.capture_time(e)
        first = datetime.fromisoformat(e.manifest.min_capture_time)
        if first.tzinfo is None:
            first = first.replace(tzinfo=UTC)
        return landed_wall - first.timestamp()

    def run(self, *, max_seconds: float = 300.0, until_empty: bool = True) -> DrainReport:
        rep = DrainReport()
        t0 = time.monotonic()
        deadline = t0 + max_seconds
        tries: dict[str, int] = {}
        not_before: dict[str, float] = {}
        active: dict[Future[Receipt], Any] = {}
        done_ids: set[str] = set()
        blocked = self.retry_queue.blocked_ids() if self.retry_queue is not None else set()
        listed: list[Any] = []
        listed_at = -1e9
        with ThreadPoolExecutor(max_workers=self.max_active + self.urgent_lanes, thread_name_prefix="uplink") as pool:
            while not self._stop.is_set():
                now = time.monotonic()
                if now - listed_at >= self.refresh_s:
                    listed, listed_at = list(self.source.pending()), now
                busy = {e.bundle_id for e in active.values()}
                pending = [
                    e for e in listed
                    if e.bundle_id not in busy and e.bundle_id not in rep.failed and e.bundle_id not in blocked
                    and not_before.get(e.bundle_id, 0.0) <= now and e.bundle_id not in done_ids
                    and (self._plan_rank is None or e.bundle_id in self._plan_rank)
                ]
                pending.sort(key=self._order)
                if now < deadline:
                    for e in pending:
                        n_active = len(active)
                        high_active = sum(1 for a in active.values() if _tier(a) == "high")
                        lane = n_active < self.max_active or (
                            self.policy == "priority" and _tier(e) == "high" and high_active < self.urgent_lanes
                            and n_active < self.max_active + self.urgent_lanes
                        )
                        if not lane:
                            if self.policy == "priority" and _tier(e) != "high":
                                break
                            continue
                        tries[e.bundle_id] = tries.get(e.bundle_id, 0) + 1
                        rep.attempts += 1
                        active[pool.submit(self._transfer, e)] = e
                if not active:
                    waiting = any(nb > now for nb in not_before.values())
                    if now >= deadline or (until_empty and not pending and not waiting):
                        break
                    time.sleep(self.poll_s)
                    continue
                done, _ = wait(list(active), timeout=self.poll_s, return_when=FIRST_COMPLETED)
                if done:
                    listed_at = -1e9  # something finished: re-read the source on the next round
                for f in done:
                    e = active.pop(f)
                    exc = f.exception()
                    if exc is None:
                        done_ids.add(e.bundle_id)
                        not_before.pop(e.bundle_id, None)
                        try:
                            self._landed(e, f.result(), rep)
                        except Exception as ack_exc:  # landed but not acknowledged: keep draining the others
                            log.error("bundle %s landed but the spool ack failed: %s", e.bundle_id, ack_exc)
                            rep.failed[e.bundle_id] = f"ack failed: {type(ack_exc).__name__}: {ack_exc}"
                        continue
                    if isinstance(exc, BundleGone):  # the source accounted for it: nothing to retry, ever
                        log.error("bundle %s not sent: %s", e.bundle_id, exc)
                        rep.failed[e.bundle_id] = f"{type(exc).__name__}: {exc}"
                        rep.gone.append(e.bundle_id)
                        not_before.pop(e.bundle_id, None)
                        if self.retry_queue is not None:
                            self.retry_queue.remove(e.bundle_id)
                        continue
                    retryable = is_retryable(exc)
                    log.info("bundle %s attempt %d failed (%s): %s", e.bundle_id, tries[e.bundle_id],
                             "retryable" if retryable else "not retryable", exc)
                    if retryable and tries[e.bundle_id] < self.attempts:
                        delay = self.backoff_s[min(tries[e.bundle_id] - 1, len(self.backoff_s) - 1)]
                        if isinstance(exc, LinkDown):
                            delay = max(delay, self.uplink.link.next_up() - self.uplink.link.clock())
                        not_before[e.bundle_id] = time.monotonic() + delay
                        continue
                    rep.failed[e.bundle_id] = f"{type(exc).__name__}: {exc}"
                    not_before.pop(e.bundle_id, None)
                    if self.retry_queue is not None:
                        self.retry_queue.add(e.manifest, error=rep.failed[e.bundle_id])
                        rep.queued_for_retry.append(e.bundle_id)
        self._emit_batch()
        rep.seconds = time.monotonic() - t0
        rep.link = self.uplink.link.snapshot()
        rep.backup_refusals = self._backup_refusals
        for e in self.source.pending():
            rep.queue_lengths[_tier(e)] = rep.queue_lengths.get(_tier(e), 0) + 1
        return rep

    def _transfer(self, e: Any) -> Receipt:
        data = self.source.read(e.bundle_id)
        if self.backup is not None and _tier(e) == "high" and not self.uplink.link.is_up() and self._take_backup(e):
            r = self.backup.send(data, e.manifest, priority=self._shaper_priority(e), link="backup")
            return r
        # Primary down and no backup for this one: send raises LinkDown and the bundle is retried later.
        return self.uplink.send(data, e.manifest, priority=self._shaper_priority(e))

    def _take_backup(self, e: Any) -> bool:
        """Reserve the bundle's bytes from the backup budget; False (logged, counted) when it is spent."""
        n = int(e.manifest.nbytes)
        with self._backup_lock:
            if self.backup_budget_left is not None:
                if n > self.backup_budget_left:
                    self._backup_refusals += 1
                    log.warning("backup link budget spent (%d B left, bundle %s needs %d B): waits for the primary",
                                self.backup_budget_left, e.bundle_id, n)
                    return False
                # Reserved before sending: a failed attempt still spent (some of) it on the wire.
                self.backup_budget_left -= n
            return True

    def _emit_batch(self) -> None:
        batch, self._batch = self._batch, []
        if batch and events.routing():  # a node never starts central work: its outbox announces each bundle
            log.info("%d bundles landed, announced through the node's outbox", len(batch))
            return
        if batch:
            batch_id = str(uuid.uuid4())
            resource, payload = events.landing_batch(batch_id, "uplink", batch)
            labels = {k: v for k, v in resource.items() if k != "prefect.resource.id"}
            events.emit(events.LANDING_BATCH, resource["prefect.resource.id"], payload, **labels)
            log.info("landing batch %s: %d bundles announced", batch_id[:8], len(batch))

    def _landed(self, e: Any, r: Receipt, rep: DrainReport) -> None:
        # The object is proven equal to the spooled bytes and its manifest written: only now may the spool let go.
        if r.verified_by not in PROOFS:
            raise UplinkError(f"bundle {r.bundle_id}: no proof of the landed bytes ({r.verified_by!r}); kept",
                              retryable=False)
        self.source.ack(e.bundle_id, remote_key=r.key, sha256=r.sha256)
        if self.retry_queue is not None:
            self.retry_queue.remove(e.bundle_id)
        wall = time.time()
        rep.landed.append(r)
        if not r.already_present:
            rep.bytes_landed += r.nbytes
            rep.bytes_by_link[r.link] = rep.bytes_by_link.get(r.link, 0) + r.nbytes
        rep.manifest_bytes_landed += r.manifest_nbytes
        rep.landing_latency_s.setdefault(r.tier, []).append(self._latency(e, wall))
        if self.emit_events:
            # Same payload fields as the gateway's bundle-uploaded hook (object/manifest keys relative to
            # the store prefix), plus the full `key` and `bucket` that core_ingest takes.
            m = e.manifest
            events.emit(
                events.BUNDLE_LANDED, f"edgehaul.bundle.{r.bundle_id}",
                {"node_id": m.node_id, "bundle_id": m.bundle_id, "object_key": m.object_key,
                 "manifest_key": m.manifest_key, "sha256": r.sha256, "row_count": r.rows, "contract": m.contract,
                 "tier": r.tier, "nbytes": r.nbytes, "bucket": r.bucket, "key": r.key, "duplicate": r.already_present,
                 "proof": r.verified_by, "readback_bytes": r.readback_bytes},
                **{"edgehaul.node.id": m.node_id},
            )
            # What starts core_ingest is the run's batch event (one run for the drain, not one per bundle).
            self._batch.append((m.object_key, m.node_id, m.bundle_id))
            if len(self._batch) >= events.LANDING_BATCH_MAX:
                self._emit_batch()
        if self.on_landed is not None:
            self.on_landed(r, e)
