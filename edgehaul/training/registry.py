"""The model registry in object storage: model files, their lineage, and the published edge model.

    models/<name>/<model_id>/model.pt     torch file: arch, state_dict, contract, classes
    models/<name>/<model_id>/lineage.json written after model.pt with If-None-Match: * (its presence =
                                          a registered model); read by quota checks and the lifecycle/cost
                                          reports: keys team, accelerator_hours, dataset_version, dataset_uri
    models/<name>/latest.json             the model edges score with; replaced only by compare-and-swap
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from botocore.exceptions import ClientError

from edgehaul.blocks import ObjectStore
from edgehaul.lineage import list_lineages
from edgehaul.platform import s3compat
from edgehaul.platform.s3_errors import error_code
from edgehaul.platform.settings import get_settings


class RegistryError(RuntimeError):
    """A model or lineage record is missing, malformed, or was changed concurrently."""


def code_version() -> str:
    """EDGEHAUL_CODE_VERSION when set (an image knows its own sha), else the git sha of the checkout this
    code runs from, else 'unknown'."""
    if configured := get_settings().code_version:
        return configured
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
            timeout=5, check=True,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def model_key(store: ObjectStore, name: str, model_id: str, file: str) -> str:
    return store.key("models", f"{name}/{model_id}/{file}")


def register_model(
    store: ObjectStore, name: str, model_id: str, model_file: dict[str, Any], lineage: dict[str, Any]
) -> dict[str, Any]:
    """Upload model.pt then lineage.json (conditional: a model id is registered once). Returns lineage."""
    s3 = store.client()
    bucket = store.bucket("models")
    buf = io.BytesIO()
    torch.save(model_file, buf)
    data = buf.getvalue()
    sha = hashlib.sha256(data).hexdigest()
    mkey = model_key(store, name, model_id, "model.pt")
    s3.put_object(Bucket=bucket, Key=mkey, Body=data, Metadata={"sha256": sha, "model-id": model_id})
    record = {
        **lineage, "model_id": model_id, "model_name": name, "model_uri": f"s3://{bucket}/{mkey}",
        "model_sha256": sha, "model_bytes": len(data),
        # what the team keeps for this model: the model file plus any retained checkpoints
        "storage_bytes": int(lineage.get("storage_bytes", 0)) + len(data),
    }
    lkey = model_key(store, name, model_id, "lineage.json")
    try:
        s3.put_object(Bucket=bucket, Key=lkey, Body=json.dumps(record, indent=2).encode(), IfNoneMatch="*",
                      ContentType="application/json")
    except ClientError as e:
        if error_code(e) in ("PreconditionFailed", "412"):
            raise RegistryError(f"model {name}/{model_id} is already registered ({lkey})") from e
        raise
    return record


def read_lineage(store: ObjectStore, name: str, model_id: str) -> dict[str, Any] | None:
    try:
        return read_json(store, store.uri("models", f"{name}/{model_id}/lineage.json"))[0]
    except RegistryError:
        return None


def trained_versions(store: ObjectStore, name: str, dataset_uri: str) -> dict[int, str]:
    """Dataset version -> model id, for every registered model `name` trained on `dataset_uri`."""
    out: dict[int, str] = {}
    for _, _, lineage in list_lineages(store, name):
        on = _trained_on(lineage)
        if on is not None and on[0] == dataset_uri:
            out.setdefault(on[1], str(lineage.get("model_id", "")))
    return out


def parse_s3_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://") or "/" not in uri[5:]:
        raise RegistryError(f"not an s3://bucket/key URI: {uri!r}")
    bucket, key = uri[5:].split("/", 1)
    return bucket, key


def _get_object(store: ObjectStore, uri: str, what: str) -> Any:
    """GetObject of `uri`; a missing key is a RegistryError naming `what`."""
    bucket, key = parse_s3_uri(uri)
    try:
        return store.client().get_object(Bucket=bucket, Key=key)
    except ClientError as e:
        if error_code(e) in ("NoSuchKey", "404"):
            raise RegistryError(f"{what} does not exist") from e
        raise


def read_json(store: ObjectStore, uri: str) -> tuple[dict[str, Any], str]:
    """JSON object at `uri` and its ETag."""
    r = _get_object(store, uri, uri)
    return json.loads(r["Body"].read()), str(r["ETag"])


def latest_uri(store: ObjectStore, name: str = "landcover") -> str:
    return store.uri("models", f"{name}/latest.json")


class NoPublishedModel(RegistryError):
    """No model of that name has been published yet (its latest.json does not exist)."""


def resolve_model_uri(store: ObjectStore, model_uri: str | None) -> str:
    """The model a scorer or reader means: `latest` / `latest:<name>` / None is the published model of
    that name (default `landcover`, through its `latest.json` pointer); anything else is a model URI."""
    model_uri = model_uri or "latest"
    if model_uri != "latest" and not model_uri.startswith("latest:"):
        return model_uri
    name = model_uri.split(":", 1)[1] if ":" in model_uri else "landcover"
    try:
        pointer, _ = read_json(store, latest_uri(store, name))
    except RegistryError as e:
        raise NoPublishedModel(f"no published {name} model yet ({e}); run the publish_model flow") from e
    return str(pointer["model_uri"])


class StaleModel(RegistryError):
    """The model was trained on an older version of the published model's dataset."""


def _trained_on(lineage: dict[str, Any]) -> tuple[str, int] | None:
    uri, version = lineage.get("dataset_uri"), lineage.get("dataset_version")
    return (str(uri), int(version)) if uri is not None and version is not None else None


PUBLISH_MARGIN = 0.05  # the publish gate's floor: validation macro-F1 at least chance + this


class QualityGateFailed(RegistryError):
    """A model's validation macro-F1 is below the publish gate's floor (or was never measured)."""


def check_quality(lineage: dict[str, Any], margin: float = PUBLISH_MARGIN, min_val_acc: float = 0.0) -> dict[str, Any]:
    """The publish gate, on by default: a model reaches the edge only when the validation macro-F1 of its
    registered (best) epoch is at least a uniform-prior guesser's plus `margin`, and its val_acc at least
    `min_val_acc`. A model without validation (trained with val_fraction 0) has no measure and is refused.
    Returns the figures it judged; raises `QualityGateFailed` naming them."""
    from edgehaul.training.metrics import chance_of, val_classes_present

    final = lineage.get("final", {}) or {}
    mid = lineage.get("model_id", "?")
    f1 = float(final.get("val_macro_f1", math.nan))
    chance = final.get("val_chance_macro_f1")
    labels = [int(k.removeprefix("val_support_")) for k in final if k.startswith("val_support_")]
    chance = float(chance) if chance is not None else chance_of(final, labels)
    acc = float(final.get("val_acc", math.nan))
    out = {"val_macro_f1": f1, "chance_macro_f1": chance, "floor": chance + margin, "val_acc": acc}
    if not (math.isfinite(f1) and math.isfinite(chance)):
        raise QualityGateFailed(f"model {mid}: no validation macro-F1 to judge (trained without validation rows): "
                                "below the publish gate")
    present = val_classes_present(final)
    if len(present) == 1:  # one class: a constant guesser scores 1.0, so no model can be judged against it
        raise QualityGateFailed(f"model {mid}: its validation rows hold one class only ({present[0]}), so its "
                                "quality cannot be judged: below the publish gate")
    if not f1 >= chance + margin:
        raise QualityGateFailed(f"model {mid}: validation macro-F1 {f1:.3f} below the publish gate "
                                f"{chance + margin:.3f} (chance {chance:.3f} + {margin:.2f})")
    if min_val_acc > 0 and not acc >= min_val_acc:
        raise QualityGateFailed(f"model {mid}: final val_acc {acc:.3f} below the publish gate {min_val_acc:.3f}")
    return out


def publish(store: ObjectStore, name: str, model_id: str, allow_older: bool = False) -> dict[str, Any]:
    """Make `model_id` the edge model: compare-and-swap of latest.json (create-if-absent or If-Match).

    Trainings triggered by successive commits can finish out of version order; a model trained on an
    older version of the same dataset than the published one is refused (`StaleModel`) unless
    `allow_older` (an operator's rollback)."""
    lineage, _ = read_json(store, store.uri("models", f"{name}/{model_id}/lineage.json"))
    s3 = store.client()
    bucket, key = parse_s3_uri(latest_uri(store, name))
    previous: str | None = None
    etag: str | None = None
    cur: dict[str, Any] = {}
    try:
        cur, etag = read_json(store, latest_uri(store, name))
        previous = cur.get("model_id")
    except RegistryError:
        pass
    if previous == model_id:
        return cur
    new, old = _trained_on(lineage), _trained_on(cur)
    if not allow_older and new and old and new[0] == old[0] and new[1] < old[1]:
        raise StaleModel(
            f"model {model_id} was trained on version {new[1]} of {new[0]}, older than the published model "
            f"{previous} (version {old[1]}); publish with allow_older to roll back"
        )
    pointer = {
        "model_id": model_id, "model_name": name, "model_uri": lineage["model_uri"],
        "lineage_uri": store.uri("models", f"{name}/{model_id}/lineage.json"), "model_sha256": lineage["model_sha256"],
        "published": datetime.now(UTC).isoformat(), "previous": previous,
        "dataset_uri": lineage.get("dataset_uri"), "dataset_version": lineage.get("dataset_version"),
    }
    body = json.dumps(pointer).encode()
    try:
        if etag:
            # If-Match in the ETag form this server honours (quoted first, then unquoted; remembered).
            s3compat.if_match(store.endpoint_url, etag, lambda et: s3.put_object(
                Bucket=bucket, Key=key, Body=body, ContentType="application/json", IfMatch=et))
        else:
            s3.put_object(Bucket=bucket, Key=key, Body=body, ContentType="application/json", IfNoneMatch="*")
    except ClientError as e:
        if error_code(e) in ("PreconditionFailed", "412"):
            raise RegistryError(
                f"{name}/latest.json changed while publishing {model_id} (was {previous}); retry the publish"
            ) from e
        raise
    return pointer


def read_model_bytes(store: ObjectStore, model_uri: str) -> bytes:
    """A model file's bytes, checked against the sha256 it was stored with."""
    r = _get_object(store, model_uri, f"model {model_uri}")
    data: bytes = r["Body"].read()
    want = r.get("Metadata", {}).get("sha256")
    if want and hashlib.sha256(data).hexdigest() != want:
        raise RegistryError(f"model {model_uri} is corrupt: sha256 differs from its metadata")
    return data


def parse_model_file(data: bytes) -> dict[str, Any]:
    out: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    return out


def load_model_file(store: ObjectStore, model_uri: str) -> dict[str, Any]:
    return parse_model_file(read_model_bytes(store, model_uri))
