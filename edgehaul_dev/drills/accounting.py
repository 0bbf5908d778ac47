"""Where is each sample? After a trial, every sample offered to an edge spool must be in exactly one of:
the dataset's latest Delta version (once), still queued (a spool entry or the uplink retry queue,
whose bundles stay in the spool), the edge ledger with a reason, or a quarantine record
(`validation.json`, with its sample ids). A sample in none is lost; a sample in the dataset twice,
or in two of those places, is duplicated. Read-only: it lists and reads, it never repairs.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edgehaul.blocks import ObjectStore
from edgehaul.core import datasets, quarantine
from edgehaul.edge.spool import Spool
from edgehaul_dev.drills.pipeline import KIND
from edgehaul_dev.drills.report import TrialResult


@dataclass
class Accounting:
    samples_in: int
    in_dataset: int
    queued: int
    ledgered: int
    quarantined: int
    lost: list[str]
    duplicated: list[str]

    def result(self, hit: bool = True, problems: list[str] | None = None) -> TrialResult:
        problems = list(problems or [])
        if self.lost:
            problems.append(f"lost {len(self.lost)}: {self.lost[:3]}")
        if self.duplicated:
            problems.append(f"duplicated {len(self.duplicated)}: {self.duplicated[:3]}")
        return TrialResult(self.samples_in, self.samples_in - len(self.lost) - len(set(self.duplicated) - set(self.lost)),
                           len(self.lost), len(self.duplicated), hit, problems)


def quarantined_ids(store: ObjectStore, s3: Any) -> Counter[str]:
    out: Counter[str] = Counter()
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=store.bucket("quarantine"),
                                                        Prefix=store.key("quarantine", ""))
    for page in pages:
        for o in page.get("Contents", []):
            if o["Key"].endswith("/" + quarantine.RECORD_NAME):
                doc = json.loads(s3.get_object(Bucket=store.bucket("quarantine"), Key=o["Key"])["Body"].read())
                out.update(doc["sample_ids"])
    return out


def dataset_ids(store: ObjectStore) -> Counter[str]:
    try:
        t = datasets.read_version(store, KIND, columns=["sample_id"])
    except datasets.DatasetError:
        return Counter()
    return Counter(t.column("sample_id").to_pylist())


def account(store: ObjectStore, ids_in: Sequence[str], spools: Sequence[Spool], s3: Any = None) -> Accounting:
    """Where is each sample? Exactly one of dataset (once) / queued / ledger / quarantine, else lost or duplicated."""
    s3 = s3 or store.client()
    ids = list(dict.fromkeys(ids_in))
    ds = dataset_ids(store)
    queued: set[str] = set()
    ledgered: set[str] = set()
    for sp in spools:
        for e in [*sp.pending(), *sp.raw_entries()]:
            queued.update(e.manifest.sample_ids)
        ledgered.update(sp.ledger.lookup(ids))
    q = quarantined_ids(store, s3)
    lost, dup = [], []
    for i in ids:
        places = (ds[i] > 0) + (i in queued) + (i in ledgered) + (q[i] > 0)
        if places == 0:
            lost.append(i)
        elif places > 1 or ds[i] > 1 or q[i] > 1:
            dup.append(i)
    known = set(ids)
    dup.extend(i for i in ds if i not in known)  # a row no spool ever accepted is a phantom copy
    return Accounting(len(ids), sum(1 for i in ids if ds[i]), len(queued & known), len(ledgered),
                      sum(1 for i in ids if q[i]), lost, dup)

