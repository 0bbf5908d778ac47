"""Operations-guide alerts as Prefect automations, declared in code and applied idempotently.

    level 1  link retransmission rate above threshold, sustained   (edgehaul.link.stats)
    level 2  edge spool above its alert watermark (85%)             (edgehaul.spool.watermark)
    level 3  checkpoint write failure                               (edgehaul.checkpoint.failed)
    level 2  a run of any pipeline stage failed or crashed          (prefect.flow-run.Failed / Crashed)
    level 3  ... and an automatic retry of the train_model run that failed on it (prefect.flow-run.Failed)
    level 2  an edge node silent longer than its contact plan allows       (edgehaul.node.silent)
    level 2  the published model older than the policy bound behind newer data (edgehaul.model.stale)
    level 2  an edge run rejected drop-folder files, each named with why     (edgehaul.drop.rejected)

The last two are decided by the fleet_report flow (edgehaul.ops.fleet), which emits the event with
the bound it applied; the automation turns each into a notification.

Triggers can only match resource labels (globs), so the compared numbers travel as permille labels
that `edgehaul.events.emit` derives from the payload; `at_least_globs` turns a threshold into the
glob list that matches exactly the values at or above it. Notifications go to a
`CustomWebhookNotificationBlock` (any HTTP receiver: chat, paging, or the test's local server).

    python -m edgehaul.services.automations --webhook-url http://127.0.0.1:9000/alerts   # what `make deploy` runs
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from uuid import UUID

from pydantic import BaseModel, Field, model_validator

from edgehaul import events
from edgehaul.blocks.logos import clear_unreachable_logos
from edgehaul.platform.reporting import CHECK_PREFIX
from edgehaul.platform.settings import get_settings

log = logging.getLogger(__name__)

NOTIFY_BLOCK = "edgehaul-alerts"
TAGS = ["edgehaul", "alert"]
L1_NAME = "edgehaul L1: link retransmission sustained"
L2_NAME = "edgehaul L2: edge spool above watermark"
L3_NAME = "edgehaul L3: checkpoint write failed"
L3_RETRY_NAME = "edgehaul L3: retry training after checkpoint failure"
RUN_FAILED_NAME = "edgehaul L2: pipeline run failed or crashed"
NODE_SILENT_NAME = "edgehaul L2: edge node silent beyond its contact plan"
MODEL_STALE_NAME = "edgehaul L2: published model stale"
DROP_REJECTED_NAME = "edgehaul L2: edge drop files rejected"
# Every stage's flow: a failed or crashed run of any of them is an alert, not only the three levels above.
PIPELINE_FLOWS = ("edge_ingest", "uplink_drain", "core_ingest", "compact_dataset", "train_model", "publish_model",
                  "lifecycle_moves", "cost_report", "fleet_report")


class AlertPolicy(BaseModel):
    """Alert thresholds: level 1 sustained link retransmission, level 2 spool fill (85%), level 3 a failed
    checkpoint, retried automatically."""

    retransmission_rate: float = Field(default=0.05, gt=0, lt=1, description="Level-1 threshold (fraction).")
    sustained_samples: int = Field(
        default=3, ge=2, le=100, description="Link-stats samples at/above threshold needed within the window."
    )
    sustained_window_s: float = Field(default=600, ge=10, le=86400, description="Window for the samples, seconds.")
    spool_watermark: float = Field(default=0.85, gt=0, le=1, description="Level-2 spool fill fraction.")
    checkpoint_retry: bool = Field(default=True, description="Level 3 re-runs the failing run's deployment.")
    retry_delay_s: float = Field(
        default=60, ge=0, le=3600, description="Delay before the automatic retry (backs off a store that is down)."
    )

    @model_validator(mode="after")
    def _resolution(self) -> AlertPolicy:
        for name in ("retransmission_rate", "spool_watermark"):
            v = getattr(self, name)
            if abs(v * 1000 - round(v * 1000)) > 1e-6:
                raise ValueError(f"{name}={v}: thresholds have permille resolution")
        return self


def at_least_globs(threshold: int, width: int = 4) -> list[str]:
    """fnmatch globs matching exactly the zero-padded `width`-digit numbers >= `threshold`.

    Walks the digits of the threshold: the number itself, then at each position every larger digit
    followed by wildcards (e.g. 850 -> 0850, 085[1-9], 08[6-9]?, 09??, [1-9]???).
    """
    if not 0 <= threshold < 10**width:
        raise ValueError(f"threshold {threshold} does not fit {width} digits")
    s = f"{threshold:0{width}d}"
    globs = [s]
    for i in range(width - 1, -1, -1):
        d = int(s[i])
        if d < 9:
            nxt = str(d + 1) if d == 8 else f"[{d + 1}-9]"
            globs.append(s[:i] + nxt + "?" * (width - i - 1))
    return globs


def _notify(block_id: UUID, level: int, alert: str, detail: str) -> Any:
    from prefect.events.actions import SendNotification

    # The body is JSON so receivers (pagers, tests) can route on level and resource.
    body = (
        '{"level": ' + str(level) + ', "alert": "' + alert + '", "event": "{{ event.event }}", '
        '"resource": "{{ event.resource.id }}", "occurred": "{{ event.occurred }}", ' + detail + "}"
    )
    return SendNotification(
        block_document_id=block_id,
        subject=f"[edgehaul L{level}] {alert} on {{{{ event.resource.id }}}}",
        body=body,
    )


def _automation(name: str, description: str, actions: list[Any], **trigger: Any) -> Any:
    """An alert automation (prefect.automations.AutomationCore) on a reactive event trigger."""
    from prefect.automations import AutomationCore
    from prefect.events.schemas.automations import EventTrigger, Posture

    return AutomationCore(name=name, description=description, tags=TAGS,
                          trigger=EventTrigger(posture=Posture.Reactive, **trigger), actions=actions)


def _link_retransmission(policy: AlertPolicy, block_id: UUID) -> Any:
    return _automation(
        L1_NAME,
        f"Level 1: {policy.sustained_samples} link-stats samples with retransmission rate >= "
        f"{policy.retransmission_rate:.1%} within {policy.sustained_window_s:.0f} s on one link (a single spike "
        "does not fire).",
        [_notify(block_id, 1, "link-retransmission", '"retransmission_rate": {{ event.payload.retransmission_rate }}')],
        expect={events.LINK_STATS},
        match={events.ALERT_LABELS["retransmission_rate"]: at_least_globs(round(policy.retransmission_rate * 1000))},
        for_each={"prefect.resource.id"},
        threshold=policy.sustained_samples,
        within=timedelta(seconds=policy.sustained_window_s),
    )


def _spool_watermark(policy: AlertPolicy, block_id: UUID) -> Any:
    return _automation(
        L2_NAME,
        f"Level 2: an edge spool reports fill >= {policy.spool_watermark:.0%}.",
        [_notify(block_id, 2, "spool-watermark", '"used_fraction": {{ event.payload.used_fraction }}')],
        expect={events.SPOOL_WATERMARK},
        match={events.ALERT_LABELS["used_fraction"]: at_least_globs(round(policy.spool_watermark * 1000))},
        for_each={"prefect.resource.id"},
        threshold=1,
    )


def _checkpoint_failed(policy: AlertPolicy, block_id: UUID) -> Any:
    return _automation(
        L3_NAME,
        "Level 3: a checkpoint write failed (every failed attempt is reported).",
        [_notify(block_id, 3, "checkpoint-failed", '"error": {{ (event.payload.error or "") | tojson }}')],
        expect={events.CHECKPOINT_FAILED},
        threshold=1,
    )


def _run_failed(policy: AlertPolicy, block_id: UUID) -> Any:
    return _automation(
        RUN_FAILED_NAME,
        "Level 2: a run of any pipeline stage ended Failed or Crashed (its name, flow and message).",
        [_notify(block_id, 2, "run-failed",
                 '"run": "{{ flow_run.name }}", "flow": "{{ flow.name }}", "state": "{{ flow_run.state.name }}", '
                 '"message": {{ (flow_run.state.message or "")[:300] | tojson }}')],
        expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
        match={"prefect.resource.name": f"!{CHECK_PREFIX}*"},  # a check's deliberate failure pages no one
        match_related={"prefect.resource.role": "flow", "prefect.resource.name": list(PIPELINE_FLOWS)},
        threshold=1,
    )


def _node_silent(policy: AlertPolicy, block_id: UUID) -> Any:
    return _automation(
        NODE_SILENT_NAME,
        "Level 2: fleet_report found a node quiet longer than its pass schedule (or the default bound) allows.",
        [_notify(block_id, 2, "node-silent",
                 '"node": "{{ event.payload.node_id }}", "last_seen": {{ event.payload.last_seen | tojson }}, '
                 '"allowed_s": {{ event.payload.allowed_s }}, "reason": {{ event.payload.reason | tojson }}')],
        expect={events.NODE_SILENT},
        for_each={"prefect.resource.id"},
        threshold=1,
    )


def _model_stale(policy: AlertPolicy, block_id: UUID) -> Any:
    return _automation(
        MODEL_STALE_NAME,
        "Level 2: the published model trails its dataset's latest version beyond the policy bound.",
        [_notify(block_id, 2, "model-stale",
                 '"model": "{{ event.payload.model_id }}", "trained_version": {{ event.payload.trained_version }}, '
                 '"latest_version": {{ event.payload.latest_version }}, "age_s": {{ event.payload.age_s }}, '
                 '"max_age_s": {{ event.payload.max_age_s }}')],
        expect={events.MODEL_STALE},
        threshold=1,
    )


def _drop_rejected(policy: AlertPolicy, block_id: UUID) -> Any:
    return _automation(
        DROP_REJECTED_NAME,
        "Level 2: an edge run rejected drop-folder files (or read files with most rows rejected); "
        "the payload names each file and why.",
        [_notify(block_id, 2, "drop-rejected",
                 '"node": "{{ event.payload.node_id }}", "message": {{ event.payload.message[:500] | tojson }}')],
        expect={events.DROP_REJECTED},
        for_each={"prefect.resource.id"},
        threshold=1,
    )


def _checkpoint_retry(policy: AlertPolicy) -> Any:
    # The trainer already retries each write in-process and emits CHECKPOINT_FAILED per attempt, so
    # re-running on that event would start a second trainer beside a live one. The automatic retry
    # fires when the train_model run itself failed with CheckpointError: it re-runs the same
    # deployment ('inferred' from the event) with the failed run's parameters and its run_id, so
    # the new run resumes from the last committed checkpoint.
    from prefect.events.actions import RunDeployment

    params = (
        "{{ dict(flow_run.parameters.params or {}, run_id=(flow_run.parameters.params or {}).run_id"
        " or 'train-' ~ flow_run.id) }}"
    )
    return _automation(
        L3_RETRY_NAME,
        "Level 3 retry: re-run a train_model deployment run that failed on a checkpoint write.",
        [RunDeployment(
            source="inferred", deployment_id=None, parameters={"params": params}, job_variables=None,
            schedule_after=timedelta(seconds=policy.retry_delay_s),
        )],
        expect={"prefect.flow-run.Failed"},
        match={"prefect.state-message": "*CheckpointError*"},
        match_related={"prefect.resource.role": "flow", "prefect.resource.name": "train_model"},
        threshold=1,
    )


# The notifying alerts, in the order they are applied.
_ALERTS: tuple[Callable[[AlertPolicy, UUID], Any], ...] = (
    _link_retransmission, _spool_watermark, _checkpoint_failed, _run_failed, _node_silent, _model_stale,
    _drop_rejected,
)


def alert_automations(policy: AlertPolicy, notify_block_id: UUID) -> list[Any]:
    """The alert automations (prefect.automations.AutomationCore objects), not yet applied."""
    out = [build(policy, notify_block_id) for build in _ALERTS]
    if policy.checkpoint_retry:
        out.append(_checkpoint_retry(policy))
    return out


@dataclass
class Applied:
    name: str
    id: UUID
    created: bool


def ensure_webhook_block(url: str, name: str = NOTIFY_BLOCK, token: str | None = None) -> UUID:
    """Create or update the webhook notification block; returns its block document id."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    headers = {"Authorization": "Bearer {{token}}"} if token else None
    block = CustomWebhookNotificationBlock(
        name=name,
        url=url,
        method="POST",
        json_data={"subject": "{{subject}}", "body": "{{body}}"},
        headers=headers,
        cookies=None,
        secrets={"token": token} if token else {},  # type: ignore[arg-type]
    )
    block_id = block.save(name, overwrite=True)
    assert isinstance(block_id, UUID)
    clear_unreachable_logos(("custom-webhook",))  # the save put the type's internet logo back
    return block_id


def apply_automations(policy: AlertPolicy | None = None, *, webhook_url: str, block_name: str = NOTIFY_BLOCK,
                      token: str | None = None) -> list[Applied]:
    """Create or update (by name) the alert automations; running it twice changes nothing."""
    from prefect.client.orchestration import get_client

    policy = policy or AlertPolicy()
    block_id = ensure_webhook_block(webhook_url, block_name, token)
    out = []
    with get_client(sync_client=True) as client:
        for auto in alert_automations(policy, block_id):
            existing = client.read_automations_by_name(auto.name)
            if existing:
                client.update_automation(existing[0].id, auto)
                for extra in existing[1:]:  # a duplicate from a concurrent apply
                    client.delete_automation(extra.id)
                out.append(Applied(auto.name, existing[0].id, False))
            else:
                out.append(Applied(auto.name, client.create_automation(auto), True))
    log.info("automations: %d created, %d updated", sum(a.created for a in out), sum(not a.created for a in out))
    return out


def main(argv: list[str] | None = None) -> int:
    settings = get_settings()
    ap = argparse.ArgumentParser(prog="edgehaul automations", description="apply the alert automations")
    ap.add_argument("--webhook-url", default=settings.alert_webhook_url, required=False,
                    help="default: EDGEHAUL_ALERT_WEBHOOK_URL")
    ap.add_argument("--block-name", default=NOTIFY_BLOCK)
    args = ap.parse_args(argv)
    if not args.webhook_url:
        ap.error("--webhook-url or EDGEHAUL_ALERT_WEBHOOK_URL is required")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for a in apply_automations(webhook_url=args.webhook_url, block_name=args.block_name,
                               token=settings.alert_webhook_token.get_secret_value()
                               if settings.alert_webhook_token else None):
        print(f"{'created' if a.created else 'updated'} {a.name} ({a.id})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
