"""What one core_ingest run did, phase by phase, and what it reports: the events of its commits (dataset
committed, one receipt per bundle), the validation table, the run's summary and its unsettled keys. Plain
typed records; the flow (`edgehaul.flows.core_ingest`) fills them by running the tasks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgehaul import events
from edgehaul.contracts import contract_by_id
from edgehaul.core.datasets import CommitResult
from edgehaul.core.ingest import LandedScan, QueuedBatch, ValidatedBatch, unreadable
from edgehaul.core.validation import ValidationResult


def emit_already_committed(scan: LandedScan, done_before: dict[str, str], own: set[str]) -> None:
    """A receipt (`already_committed`) for each bundle already in its dataset that the trigger named, as a
    commit of it would answer its node; bundles this run took from the queue or discovered get none."""
    for key, b in done_before.items():
        if key in own:
            m = scan.manifests[key]
            events.emit(events.BUNDLE_RECEIPT, f"edgehaul.bundle.{b}",
                        {"status": "already_committed", "kind": contract_by_id(m.contract).kind, "version": None,
                         "node_id": m.node_id},
                        **{"edgehaul.node.id": m.node_id})


def emit_commit(c: CommitResult, contract_id: str) -> None:
    """`edgehaul.dataset.committed` for a commit that made a version, and one receipt per bundle in the dataset."""
    if c.version is not None:  # a commit with no new row makes none: no training run for nothing new
        events.emit(events.DATASET_COMMITTED, f"edgehaul.dataset.{c.kind}",
                    {"kind": c.kind, "version": c.version, "parent": c.parent, "bundles": c.bundles,
                     "nodes": c.nodes, "rows": c.rows, "contract": contract_id},
                    **events.dataset_committed_labels(c.kind, contract_by_id(contract_id).training is not None))
    for (node, b), status in [*((r, "committed") for r in c.nodes_of("bundles")),
                              *((r, "already_committed") for r in c.nodes_of("already_committed"))]:
        events.emit(events.BUNDLE_RECEIPT, f"edgehaul.bundle.{b}",
                    {"status": status, "kind": c.kind, "version": c.version, "node_id": node},
                    **{"edgehaul.node.id": node})


def scan_rejections(scan: LandedScan) -> dict[str, dict[str, Any]]:
    """The rejections `read_manifests` made (key -> a ValidationResult dict), to quarantine with the others."""
    return {k: unreadable(k, e, r).to_dict() for k, (r, e) in scan.rejected.items()}


def by_contract(passed: dict[str, ValidationResult]) -> list[tuple[str, list[tuple[str, ValidationResult]]]]:
    """The valid bundles per contract (contract id order): each contract's are one commit."""
    out: dict[str, list[tuple[str, ValidationResult]]] = {}
    for key, res in passed.items():
        out.setdefault(res.contract, []).append((key, res))
    return sorted(out.items())


def artifact_rows(passed: list[ValidationResult], rejected: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's validation table: one row per valid and per rejected bundle, failed checks named."""
    rows = []
    for r in passed:
        rows.append({"bundle": r.bundle_id[:12], "node": r.node_id, "rows": r.rows, "success": True, "reason": "ok",
                     "checks": f"{len(r.expectations)}/{len(r.expectations)}", "failed": ""})
    for d in rejected:
        r = ValidationResult.from_dict(d)
        failed = [f"{e.expectation}({e.column})={e.observed_value}" for e in r.expectations if not e.success]
        ok = sum(e.success for e in r.expectations)
        rows.append({"bundle": r.bundle_id[:12], "node": r.node_id, "rows": r.rows, "success": False,
                     "reason": r.reason, "checks": f"{ok}/{len(r.expectations)}",
                     "failed": "; ".join(failed) or r.error[:300]})
    return rows


@dataclass
class IngestRun:
    """One run's bundles through its phases. Every key ends in one place: already committed, valid (then
    committed or deferred), quarantined, waiting, skipped, or in `errors` (left in landing for the next run)."""

    keys: list[str]  # this run's keys: its own, then those taken from queued runs
    own: set[str]  # the keys the run was given or discovered
    taken: list[QueuedBatch] = field(default_factory=list)  # queued runs' batches claimed by this run
    scan: LandedScan = field(default_factory=LandedScan)
    done_before: dict[str, str] = field(default_factory=dict)  # key -> bundle id already in its dataset
    checked: ValidatedBatch = field(default_factory=ValidatedBatch)  # passed, rejected (to quarantine), errors
    validation_tasks: int = 0
    quarantined: list[dict[str, Any]] = field(default_factory=list)  # quarantine records
    commits: list[CommitResult] = field(default_factory=list)
    covered: int = 0  # queued runs completed as covered by this one

    @property
    def errors(self) -> dict[str, str]:
        return self.checked.errors

    @property
    def deferred(self) -> list[str]:
        return sorted(b for c in self.commits for b in c.deferred)

    def unsettled(self) -> set[str]:
        """Keys still to do after this run: waiting for a manifest, left after an error, or deferred to
        another live run."""
        key_of = {f"{r.node_id}/{r.bundle_id}": k for k, r in self.checked.passed.items()}  # bundle ids: per node
        deferred = (key_of[r] for c in self.commits for r in c.refs.get("deferred", []) if r in key_of)
        return {*self.scan.waiting, *self.errors, *deferred}

    def summary(self) -> dict[str, Any]:
        scan, checked = self.scan, self.checked
        return {
            "bundles": len(self.keys),
            "taken_from_queue": len(self.keys) - len(self.own),
            "taken_runs": [b.run_id for b in self.taken],
            "queued_runs_completed": self.covered,
            "already_committed": sorted(self.done_before.values()),
            "valid": len(checked.passed),
            "cached": len(checked.cached),  # of the valid: served from the validation cache, not fetched again
            "validation_tasks": self.validation_tasks,
            "waiting": scan.waiting,
            "skipped": scan.skipped,
            "already_quarantined": sorted(scan.quarantined),
            "quarantined": [{"bundle_id": q["bundle_id"], "reason": q["reason"], "prefix": q["quarantine_prefix"],
                             "samples": len(q["sample_ids"])} for q in self.quarantined],
            "errors": self.errors,
            "commits": [c.to_dict() for c in self.commits],
            "versions": {c.kind: c.version for c in self.commits},
            "deferred": self.deferred,
        }
