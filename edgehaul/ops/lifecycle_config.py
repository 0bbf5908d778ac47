"""The S3 lifecycle configuration equivalent to a RetentionPolicy, for stores that should do it themselves.

The store-side equivalent differs from the mover in three ways, each recorded as a note:
- objects transition *in place* (same key, colder class) instead of moving to the cold bucket;
- `cold_if_unused_days` cannot be expressed (S3 lifecycle has no last-access condition);
- the store cannot see which dataset versions are referenced, so `features` (Delta data files) get no
  Expiration and only transitions to classes that stay readable at once (a GLACIER transition
  would break Delta reads); `checkpoints` share the checkpoints bucket with `models/` and cannot be
  told apart by prefix, so they get no rule.

Cost rules are kept: transitions carry `ObjectSizeGreaterThan` 128 KiB - 1 (small objects stay hot;
merge first) plus `TransitionDefaultMinimumObjectSize=all_storage_classes_128K`; transitions to
infrequent-access classes are at least 30 days after creation (an AWS rule); an expiration comes no
earlier than the transition plus the cold class's minimum storage duration.

`apply_configuration` merges our rules (ids `edgehaul:<prefix>:...`) with any other rules of the
bucket, puts the full AWS-correct configuration and, if the server refuses a rule class (SeaweedFS
answers 501 NotImplemented to Transition rules), puts the rules it accepts and reports the refused ones
with the server's error. A rule the server stores differently (another S3 server drops the size filter,
and then moves small manifests to an infrequent-access class) is withdrawn again at once and reported
(`changed_rules`); `lifecycle_moves` fails its run naming them. Nothing is dropped silently.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from botocore.exceptions import ClientError

from edgehaul.ops.storage_classes import CLASSES
from edgehaul.platform.s3_errors import error_code

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from edgehaul.blocks import ObjectStore, RetentionPolicy

DEFAULT_MIN_SIZE = "all_storage_classes_128K"


@dataclass
class BucketConfig:
    bucket: str
    rules: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def configuration(self) -> dict[str, Any]:
        return {"Rules": self.rules}


def rule_prefix(store: ObjectStore) -> str:
    return f"edgehaul:{store.key('landing') or '/'}:"


def _targets(store: ObjectStore, data_class: str) -> list[tuple[str, str]]:
    """(bucket, key prefix) of a data class; [] when a prefix cannot isolate it."""
    base = store.key("landing")
    return {
        "raw": [(store.bucket("landing"), base), (store.bucket("curated"), base + "quarantine/")],
        "features": [(store.bucket("curated"), base + "datasets/")],
        "model_weights": [(store.bucket("models"), base + "models/")],
        "logs": [(store.bucket("ops"), base + "logs/")],
        "reports": [(store.bucket("ops"), base + "reports/")],
    }.get(data_class, [])


def lifecycle_configuration(store: ObjectStore, policy: RetentionPolicy) -> dict[str, BucketConfig]:
    """The AWS-correct lifecycle configuration, per bucket, equivalent to `policy` (as far as expressible)."""
    out: dict[str, BucketConfig] = {}
    general: list[str] = []
    for rule in policy.rules:
        dc = rule.data_class
        targets = _targets(store, dc)
        if not targets:
            general.append(f"{dc}: no prefix isolates it (it shares its bucket prefix with models/); no rule emitted")
            continue
        if rule.cold_if_unused_days is not None:
            general.append(f"{dc}: cold_if_unused_days={rule.cold_if_unused_days:g} not expressible (no last-access "
                           "condition in S3 lifecycle); only the mover applies it")
        target = CLASSES[rule.cold_storage_class]
        for n, (bucket, prefix) in enumerate(targets):
            cfg = out.setdefault(bucket, BucketConfig(bucket))
            rid = f"{rule_prefix(store)}{dc}" + (f":{n}" if n else "")
            transition_days: int | None = None
            if rule.cold_after_days is not None:
                if dc == "features" and not target.instant_read:
                    cfg.notes.append(f"{rid}: no transition to {target.name} (not readable at once; breaks Delta reads)")
                else:
                    transition_days = math.ceil(rule.cold_after_days)
                    if target.min_billable_bytes and transition_days < 30:
                        cfg.notes.append(f"{rid}: transition to {target.name} raised from {transition_days} to 30 days "
                                         "(S3 minimum for infrequent-access transitions)")
                        transition_days = 30
                    cfg.rules.append({
                        "ID": f"{rid}:cold", "Status": "Enabled",
                        "Filter": {"And": {"Prefix": prefix, "ObjectSizeGreaterThan": 128 * 1024 - 1}},
                        "Transitions": [{"Days": transition_days, "StorageClass": target.name}],
                    })
            if rule.expire_after_days is not None:
                if dc == "features":
                    cfg.notes.append(f"{rid}: no expiration (the store cannot see which dataset versions are referenced)")
                    continue
                days = max(1, math.ceil(rule.expire_after_days))
                if transition_days is not None and days < transition_days + target.min_duration_days:
                    floor = transition_days + target.min_duration_days
                    cfg.notes.append(f"{rid}: expiration raised from {days} to {floor} days (minimum storage duration "
                                     f"of {target.name} after the transition at {transition_days})")
                    days = floor
                cfg.rules.append({"ID": f"{rid}:expire", "Status": "Enabled", "Filter": {"Prefix": prefix},
                                  "Expiration": {"Days": days}})
    for cfg in out.values():
        cfg.notes[:0] = general
    return out


@dataclass
class ApplyResult:
    bucket: str
    emitted: list[dict[str, Any]]  # our AWS-correct rules
    applied: list[dict[str, Any]]  # our rules the server accepted
    refused: dict[str, str]  # rule id -> server's error
    read_back: list[dict[str, Any]]  # our rules as the server returns them
    notes: list[str]
    withdrawn: list[str] = field(default_factory=list)  # ids taken off again: the server changed them

    @property
    def round_trip_ok(self) -> bool:
        return _canon(self.applied) == _canon(self.read_back)

    @property
    def changed_rules(self) -> list[str]:
        """Ids of our rules that the server stored differently (or not at all)."""
        back = {r.get("ID"): _canon([r]) for r in self.read_back}
        return sorted(str(r["ID"]) for r in self.applied if back.get(r["ID"]) != _canon([r]))


def _canon(rules: list[dict[str, Any]]) -> list[str]:
    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if x not in (None, [], {})}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    return sorted(json.dumps(clean(r), sort_keys=True) for r in rules)


def _existing(s3: S3Client, bucket: str) -> list[dict[str, Any]]:
    try:
        return list(s3.get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", []))
    except ClientError as e:
        if error_code(e) == "NoSuchLifecycleConfiguration":
            return []
        raise


def _put(s3: S3Client, bucket: str, rules: list[dict[str, Any]]) -> None:
    s3.put_bucket_lifecycle_configuration(
        Bucket=bucket, LifecycleConfiguration={"Rules": rules},
        TransitionDefaultMinimumObjectSize=DEFAULT_MIN_SIZE,
    )


def apply_configuration(store: ObjectStore, policy: RetentionPolicy, s3: S3Client | None = None) -> list[ApplyResult]:
    """Put the configuration on every bucket it covers, keeping other owners' rules; report refusals."""
    s3 = s3 or store.client()
    mine = rule_prefix(store)
    results = []
    for bucket, cfg in lifecycle_configuration(store, policy).items():
        others = [r for r in _existing(s3, bucket) if not str(r.get("ID", "")).startswith(mine)]
        applied = list(cfg.rules)
        refused: dict[str, str] = {}
        notes = list(cfg.notes)
        try:
            _put(s3, bucket, others + applied)
        except ClientError as e:
            code = error_code(e)
            if code not in ("NotImplemented", "501", "InvalidRequest", "MalformedXML"):
                raise
            # The server refuses a rule class: keep what it accepts, name what it refused.
            for r in cfg.rules:
                if "Transitions" in r:
                    refused[r["ID"]] = f"server refused Transition rules: {code}: {e.response['Error'].get('Message', '')}"
            applied = [r for r in cfg.rules if r["ID"] not in refused]
            notes.append(f"{len(refused)} transition rule(s) refused by the server; apply them on a store that "
                         "supports them, or rely on the mover (lifecycle_moves)")
            if applied or others:
                _put(s3, bucket, others + applied)
            else:
                s3.delete_bucket_lifecycle(Bucket=bucket)
        back = [r for r in _existing(s3, bucket) if str(r.get("ID", "")).startswith(mine)]
        res = ApplyResult(bucket, cfg.rules, applied, refused, back, notes)
        if changed := res.changed_rules:
            # A changed rule does something the policy does not say: take it off; the mover covers it.
            kept = [r for r in applied if r["ID"] not in changed]
            if kept or others:
                _put(s3, bucket, others + kept)
            else:
                s3.delete_bucket_lifecycle(Bucket=bucket)
            res.withdrawn = changed
            res.notes.append(f"{len(changed)} rule(s) stored differently by the server and withdrawn: "
                             f"{', '.join(changed)}")
        results.append(res)
    return results
