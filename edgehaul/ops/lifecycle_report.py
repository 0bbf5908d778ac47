"""What a lifecycle_moves run reports: the store-lifecycle rows, the markdown summary and the failure message."""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Any

from edgehaul.ops.lifecycle import Plan
from edgehaul.ops.lifecycle_config import ApplyResult


def config_rows(results: list[ApplyResult]) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per bucket of an applied S3 lifecycle configuration, and the rules the server changed
    (`bucket: rule id`)."""
    rows = [{"bucket": r.bucket, "applied": [x["ID"] for x in r.applied], "refused": r.refused,
             "round_trip_ok": r.round_trip_ok, "changed_by_server": r.changed_rules, "withdrawn": r.withdrawn,
             "notes": r.notes} for r in results]
    return rows, [f"{r.bucket}: {rid}" for r in results for rid in r.changed_rules]


def summary_markdown(now: datetime, plan: Plan, done: Counter[str], errors: list[str], requests: int,
                     changed: list[str], *, dry_run: bool, force_reason: str | None) -> str:
    md = [f"# lifecycle_moves at {now:%Y-%m-%d %H:%M} UTC" + (" (dry run)" if dry_run else ""), "",
          "| what | count |", "|---|---:|"]
    md += [f"| planned {k} | {v} |" for k, v in sorted(plan.counts().items())]
    md += [f"| done: {k} | {v} |" for k, v in sorted(done.items())]
    md += [f"| {k} | {v} |" for k, v in sorted(plan.skipped.items())]
    md += [f"| errors | {len(errors)} |", f"| S3 requests | {requests} |"]
    md += [f"| store lifecycle rule changed by the server, withdrawn | {c} |" for c in changed]
    if force_reason:
        md += ["", f"Forced: {force_reason}"]
    return "\n".join(md)


def failure_message(errors: list[str], changed: list[str], endpoint_url: str | None) -> str | None:
    """Why the run did not do its job, or None: failed actions (each stays journalled for the next run) and
    lifecycle rules the store kept differently than given."""
    failed = [f"{len(errors)} lifecycle action(s) failed; first: " + "; ".join(errors[:3])] if errors else []
    if changed:
        # The rules were taken off again, but the store does not do what the policy asked: the run says so
        # in its state (a WARNING in a Completed run went unseen while the store moved small manifests).
        failed.append(f"the store at {endpoint_url or 'AWS'} stored lifecycle rule(s) {'; '.join(changed)} "
                      "differently (e.g. dropped the size filter); withdrawn, the mover applies the policy: run "
                      "with apply_store_lifecycle=false on this store")
    return ". ".join(failed) if failed else None
