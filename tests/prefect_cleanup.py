"""Tear-down of what a test put on the session's one Prefect server. Tests share that server for the whole run:
a trigger or alert automation a test leaves behind keeps firing on later tests' events (runs nobody executes go
Late; notifications to a receiver that is gone fail and retry), and shows up as their server errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from uuid import UUID


def delete_automations(ids: Iterable[UUID]) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for i in ids:
            with contextlib.suppress(Exception):  # already gone
                client.delete_automation(i)


def delete_deployments(ids: Iterable[UUID]) -> None:
    """The deployments, their trigger automations and their runs that have not ended (nothing executes them)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    ids = list(ids)
    if not ids:
        return
    with get_client(sync_client=True) as client:
        for run in client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=ids))):
            if not (run.state and run.state.is_final()):
                with contextlib.suppress(Exception):
                    client.delete_flow_run(run.id)
        for i in ids:
            with contextlib.suppress(Exception):
                client.delete_resource_owned_automations(f"prefect.deployment.{i}")
            with contextlib.suppress(Exception):
                client.delete_deployment(i)


def delete_deployments_named(names: Iterable[str]) -> None:
    """By `flow/deployment` name; names not on the server are skipped."""
    from prefect.client.orchestration import get_client

    found = []
    with get_client(sync_client=True) as client:
        for n in names:
            with contextlib.suppress(Exception):
                found.append(client.read_deployment_by_name(n).id)
    delete_deployments(found)
