"""Domain log lines (`edgehaul.*`) reach a flow run's logs on the Prefect server, tagged with the node;
human units in table artifacts."""

from __future__ import annotations

import logging
import uuid

import pytest

from edgehaul.platform.reporting import human_bytes, human_table
from edgehaul_dev import localstack
from tests.waiting import run_log_lines


def test_byte_columns_are_shown_in_human_units() -> None:
    assert human_bytes(978098) == "955 KiB" and human_bytes(512) == "512 B" and human_bytes(3 * 2**30) == "3 GiB"
    rows = human_table([{"uplink_bytes": 1536, "bytes": 2**20, "rows": 1536}, {"uplink_bytes": "", "bytes": True}])
    assert rows[0] == {"uplink_bytes": "1.5 KiB", "bytes": "1 MiB", "rows": 1536}
    assert rows[1] == {"uplink_bytes": "", "bytes": True, "rows": ""}


@pytest.mark.integration
def test_a_retry_decision_and_a_node_tagged_line_reach_the_flow_runs_logs(stack: localstack.StackState) -> None:
    from botocore.exceptions import ClientError
    from prefect import flow, task
    from prefect.runtime import flow_run

    import edgehaul.tasks  # noqa: F401  (importing the product's tasks attaches the domain loggers)
    from edgehaul.platform import run_logging
    from edgehaul.platform.s3_errors import IO_RETRY

    uid = uuid.uuid4().hex[:8]
    calls: list[int] = []

    @task(name=f"flaky-put-{uid}", **{**IO_RETRY, "retry_delay_seconds": 0})
    def flaky_put() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise ClientError({"Error": {"Code": "SlowDown", "Message": "slow down"},  # type: ignore[typeddict-item]
                               "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject")
        return len(calls)

    @flow(name=f"logs-{uid}")
    def node_work() -> str:
        with run_logging.for_node(f"node-{uid}"):
            logging.getLogger("edgehaul.edge.spool").info("spool at %d%%", 81)
        assert flaky_put() == 2
        return str(flow_run.id)

    run_id = uuid.UUID(node_work())
    lines = run_log_lines(run_id, f"retrying flaky-put-{uid}")
    tagged = f"[node=node-{uid}] spool at 81%"
    assert any(line.startswith("edgehaul.edge.spool: ") and tagged in line for line in lines), lines
    assert any(line.startswith("edgehaul.platform.s3_errors: ") and f"retrying flaky-put-{uid} after SlowDown" in line
               for line in lines), lines
