"""Downlink: what the core sends to an edge node (a published model, a tiering policy, a contract), fetched
by the node when in contact, verified, applied atomically and reported back.

Central side, in the ops bucket, under the node's own prefix (the node's identity may read it, nothing else):

    downlink/<node>/update.json          {"generation": N, "items": [{name, kind, version, sha256, size}], ...}
    downlink/<node>/blobs/<sha256>       each item's bytes, content-addressed (written once)

`publish_update` writes the blobs first, then replaces update.json by compare-and-swap (If-Match on the
ETag it read, If-None-Match for the first), so two publishers never interleave and a node never sees a
manifest whose blobs are not there yet. Generations only grow.

Node side, in its state dir:

    downlink/gen-<N>/                    one complete generation: update.json + one file per item
    downlink/current -> gen-<N>          the generation in force, switched with one rename

`sync` downloads every item of a newer generation into a staging folder, checks size, sha256 and the
version the content declares (contracts and policies say their own version), fsyncs, renames the folder
into place and then swaps the `current` link. A crash at any point leaves `current` on the old complete
generation (staging leftovers are removed by the next sync), so a node never runs with a half-applied
update. An update that fails a check is refused as a whole, named, and the node keeps what it had.
The outcome goes to the node's outbox (`edgehaul.node.downlink.applied` / `.refused`), which is forwarded
to the central Prefect when in contact.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from botocore.exceptions import ClientError

from edgehaul import events
from edgehaul.platform import s3compat
from edgehaul.platform.private_files import fsync_dir
from edgehaul.platform.s3_errors import error_code

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from edgehaul.blocks.object_store import ObjectStore
    from edgehaul.edge.outbox import Outbox

Kind = Literal["model", "policy", "contract"]
KINDS: tuple[Kind, ...] = ("model", "policy", "contract")
NAME_RE = re.compile(r"^[a-z][a-z0-9_.-]{0,63}$")
MAX_ITEM_BYTES = 512 * 1024 * 1024
APPLIED_EVENT = events.DOWNLINK_APPLIED
REFUSED_EVENT = events.DOWNLINK_REFUSED


class DownlinkError(RuntimeError):
    """An update that cannot be published or applied; the message names the node, generation and item."""


class ConcurrentPublish(DownlinkError):
    """update.json changed between read and write: another publisher won; read again and retry."""


@dataclass(frozen=True, slots=True)
class Item:
    name: str  # what it is on the node, e.g. "landcover" (model), "tiering" (policy), "landsat_patch.v1"
    kind: Kind
    version: str
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return f"{self.kind}-{self.name}"

    @classmethod
    def parse(cls, d: dict[str, Any], where: str) -> Item:
        try:
            item = cls(name=str(d["name"]), kind=d["kind"], version=str(d["version"]), sha256=str(d["sha256"]),
                       size=int(d["size"]))
        except (KeyError, TypeError, ValueError) as e:
            raise DownlinkError(f"{where}: malformed item {d!r}: {e}") from None
        if item.kind not in KINDS or not NAME_RE.match(item.name) or not re.fullmatch(r"[0-9a-f]{64}", item.sha256):
            raise DownlinkError(f"{where}: item {item.name!r} has a bad kind, name or sha256")
        if not 0 <= item.size <= MAX_ITEM_BYTES:
            raise DownlinkError(f"{where}: item {item.name!r} size {item.size} outside 0..{MAX_ITEM_BYTES}")
        return item


@dataclass(frozen=True, slots=True)
class Update:
    node_id: str
    generation: int
    items: tuple[Item, ...]
    published: str = ""
    note: str = ""

    def to_json(self) -> bytes:
        return json.dumps({"node_id": self.node_id, "generation": self.generation, "published": self.published,
                           "note": self.note, "items": [vars_of(i) for i in self.items]}, indent=1).encode()

    @classmethod
    def parse(cls, data: bytes, where: str) -> Update:
        try:
            d = json.loads(data)
            items = tuple(Item.parse(i, where) for i in d["items"])
            up = cls(node_id=str(d["node_id"]), generation=int(d["generation"]), items=items,
                     published=str(d.get("published", "")), note=str(d.get("note", "")))
        except (ValueError, KeyError, TypeError) as e:
            raise DownlinkError(f"{where}: not a downlink update ({type(e).__name__}: {e})") from None
        if len({i.filename for i in items}) != len(items):
            raise DownlinkError(f"{where}: an item appears twice")
        return up


def vars_of(i: Item) -> dict[str, Any]:
    return {"name": i.name, "kind": i.kind, "version": i.version, "sha256": i.sha256, "size": i.size}


def _prefix(store: ObjectStore, node_id: str) -> str:
    return store.key("ops", f"downlink/{node_id}")


def declared_version(kind: Kind, data: bytes) -> str | None:
    """The version an item's content states about itself (None where the format has none to check)."""
    if kind == "contract":
        doc = yaml.safe_load(data)
        return f"{doc['kind']}.v{doc['version']}" if isinstance(doc, dict) and "kind" in doc else ""
    if kind == "policy":
        doc = json.loads(data)
        return str(doc.get("version", "")) if isinstance(doc, dict) else ""
    return None  # a model file is checked by its sha256 (its id is the publisher's)


# --- central side -------------------------------------------------------------------------------------------


def read_update(s3: S3Client, bucket: str, key: str) -> tuple[Update | None, str | None]:
    try:
        r = s3.get_object(Bucket=bucket, Key=key)
    except ClientError as e:
        if s3compat.is_missing(e):
            return None, None
        raise
    return Update.parse(r["Body"].read(), f"s3://{bucket}/{key}"), r.get("ETag")


def publish_update(
    store: ObjectStore, node_id: str, items: list[tuple[str, Kind, str, bytes]], *, note: str = "",
    s3: S3Client | None = None,
) -> Update:
    """Publish `items` (name, kind, version, content) as the node's next generation. Items of the previous
    generation not named here are kept (an update of the policy does not drop the model)."""
    s3 = s3 or store.client()
    bucket, prefix = store.bucket("ops"), _prefix(store, node_id)
    current, etag = read_update(s3, bucket, f"{prefix}/update.json")
    new: dict[str, Item] = {i.filename: i for i in (current.items if current else ())}
    for name, kind, version, data in items:
        stated = declared_version(kind, data)
        if stated is not None and stated != version:
            raise DownlinkError(f"downlink {node_id}: {kind} {name} says version {stated!r}, published as {version!r}")
        item = Item.parse({"name": name, "kind": kind, "version": version, "size": len(data),
                           "sha256": hashlib.sha256(data).hexdigest()}, f"downlink {node_id}")
        try:  # content-addressed: an existing blob already holds exactly these bytes
            s3.put_object(Bucket=bucket, Key=f"{prefix}/blobs/{item.sha256}", Body=data, IfNoneMatch="*")
        except ClientError as e:
            if not s3compat.is_precondition_failed(e):
                raise
        new[item.filename] = item
    up = Update(node_id=node_id, generation=(current.generation if current else 0) + 1,
                items=tuple(sorted(new.values(), key=lambda i: i.filename)),
                published=datetime.now(UTC).isoformat(), note=note)
    body = up.to_json()
    try:
        if etag:
            s3compat.if_match(store.endpoint_url, etag, lambda et: s3.put_object(
                Bucket=bucket, Key=f"{prefix}/update.json", Body=body, ContentType="application/json", IfMatch=et))
        else:
            s3.put_object(Bucket=bucket, Key=f"{prefix}/update.json", Body=body, ContentType="application/json",
                          IfNoneMatch="*")
    except ClientError as e:
        if error_code(e) in ("PreconditionFailed", "412"):
            raise ConcurrentPublish(f"downlink {node_id}: update.json changed while publishing generation "
                                    f"{up.generation}; read it again and retry") from e
        raise
    return up


# --- node side ----------------------------------------------------------------------------------------------


@dataclass
class SyncResult:
    node_id: str
    applied: int | None = None  # generation now in force (None: nothing new)
    refused: int | None = None  # generation refused, with why
    why: str = ""
    items: list[str] = field(default_factory=list)


def root(state_dir: Path) -> Path:
    return Path(state_dir) / "downlink"


def current_generation(state_dir: Path) -> int:
    link = root(state_dir) / "current"
    try:
        return int(os.readlink(link).removeprefix("gen-"))
    except (FileNotFoundError, ValueError):
        return 0


def current_file(state_dir: Path, kind: Kind, name: str) -> Path | None:
    """The file in force for an item (resolved through `current` once: a reader sees one generation)."""
    gen = root(state_dir) / "current"
    try:
        target = root(state_dir) / os.readlink(gen)
    except FileNotFoundError:
        return None
    p = target / f"{kind}-{name}"
    return p if p.is_file() else None


def sync(store: ObjectStore, node_id: str, state_dir: Path, *, outbox: Outbox | None = None,
         s3: S3Client | None = None) -> SyncResult:
    """Fetch, verify and apply the node's newest update if it is newer than the one in force."""
    s3 = s3 or store.client()
    bucket, prefix = store.bucket("ops"), _prefix(store, node_id)
    base = root(state_dir)
    base.mkdir(parents=True, exist_ok=True)
    for left in base.glob(".staging-*"):  # a sync that died half-way: its files were never in force
        shutil.rmtree(left, ignore_errors=True)
    have = current_generation(state_dir)
    where = f"s3://{bucket}/{prefix}/update.json"
    up, _ = read_update(s3, bucket, f"{prefix}/update.json")
    res = SyncResult(node_id=node_id)
    if up is None or up.generation <= have:
        return res
    try:
        if up.node_id != node_id:
            raise DownlinkError(f"{where} is addressed to {up.node_id!r}, not {node_id!r}")
        staging = base / f".staging-{up.generation}-{os.getpid()}"
        staging.mkdir()
        for item in up.items:
            data = _fetch(s3, bucket, f"{prefix}/blobs/{item.sha256}", item, where)
            p = staging / item.filename
            with open(p, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        (staging / "update.json").write_bytes(up.to_json())
        fsync_dir(staging)
        final = base / f"gen-{up.generation}"
        if final.exists():  # applied before a crash between rename and link switch: it is complete
            shutil.rmtree(staging)
        else:
            os.rename(staging, final)
        tmp_link = base / f".current-{os.getpid()}"
        tmp_link.unlink(missing_ok=True)
        os.symlink(final.name, tmp_link)
        os.replace(tmp_link, base / "current")  # the one atomic step: readers see old or new, never a mix
        fsync_dir(base)
    except DownlinkError as e:
        shutil.rmtree(base / f".staging-{up.generation}-{os.getpid()}", ignore_errors=True)
        res.refused, res.why = up.generation, str(e)
        if outbox is not None:
            outbox.append(REFUSED_EVENT, {"generation": up.generation, "in_force": have, "why": str(e)}, priority=2)
        return res
    res.applied, res.items = up.generation, [f"{i.kind}/{i.name}@{i.version}" for i in up.items]
    for old in base.glob("gen-*"):  # keep the one in force and the one before it (for a manual rollback)
        g = int(old.name.removeprefix("gen-"))
        if g < have and g != up.generation:
            shutil.rmtree(old, ignore_errors=True)
    if outbox is not None:
        outbox.append(APPLIED_EVENT, {"generation": up.generation, "previous": have, "items": res.items})
    return res


def _fetch(s3: S3Client, bucket: str, key: str, item: Item, where: str) -> bytes:
    try:
        extra = {"Range": f"bytes=0-{item.size}"} if item.size else {}  # never more than one byte past its size
        data = s3.get_object(Bucket=bucket, Key=key, **extra)["Body"].read()
    except ClientError as e:
        if s3compat.is_missing(e):
            raise DownlinkError(f"{where}: {item.kind} {item.name}: blob {item.sha256[:12]} is missing") from None
        raise
    if len(data) != item.size or hashlib.sha256(data).hexdigest() != item.sha256:
        raise DownlinkError(f"{where}: {item.kind} {item.name}@{item.version}: content does not match its sha256 "
                            f"({len(data)} bytes, expected {item.size})")
    try:
        stated = declared_version(item.kind, data)
    except (ValueError, yaml.YAMLError) as e:
        raise DownlinkError(f"{where}: {item.kind} {item.name}: unreadable ({e})") from None
    if stated is not None and stated != item.version:
        raise DownlinkError(f"{where}: {item.kind} {item.name}: content says version {stated!r}, "
                            f"update says {item.version!r}")
    return data


def install_contracts(state_dir: Path, contracts_dir: Path) -> list[str]:
    """Copy the contracts of the generation in force into the folder the node's runs read contracts from.
    A contract id names fixed content: an id already there with other bytes is refused (a new content is a
    new version), never overwritten. Each file appears whole (written beside, then renamed). Returns the
    ids installed now."""
    cur = root(state_dir) / "current"
    if not cur.exists():
        return []
    up = Update.parse((cur / "update.json").read_bytes(), str(cur))
    done = []
    for item in up.items:
        if item.kind != "contract":
            continue
        data = (cur / item.filename).read_bytes()
        dest = Path(contracts_dir) / f"{item.name}.yaml"
        if dest.exists():
            if dest.read_bytes() != data:
                raise DownlinkError(f"contract {item.name} in {contracts_dir} differs from the downlinked one "
                                    f"(generation {up.generation}): a changed contract needs a new version")
            continue
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
        done.append(item.name)
    return done
