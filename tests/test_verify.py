"""`make verify` checks (edgehaul.verify) against the session stack. The stack has no deployments or
workers, so control_plane and placement are exercised for their FAIL path only (they need `make deploy`
and a demo run on the real stack); high_value, resume, alert_l2 and quota must PASS here."""

from __future__ import annotations

import pytest

from edgehaul import localstack, verify


@pytest.mark.integration
def test_checks_that_run_on_the_session_stack_pass(stack: localstack.StackState) -> None:
    lines: list[str] = []
    checks = verify.run_checks(stack, ("high_value", "resume", "alert_l2", "quota"), say=lines.append)
    print("\n".join(lines))
    assert [c.name for c in checks] == ["high_value", "resume", "alert_l2", "quota"]
    for c in checks:
        assert c.ok, (c.name, c.detail)
    by = {c.name: c.detail for c in checks}
    assert "resumed from step" in by["resume"] and "== uninterrupted" in by["resume"]
    assert "refused" in by["quota"] and "'default'" in by["quota"]
    assert "level-2 alert" in by["alert_l2"]


@pytest.mark.integration
def test_deployment_checks_fail_clearly_without_deployments(stack: localstack.StackState) -> None:
    """Needs deployments/workers to PASS (`make deploy`): on a bare stack they must say what is missing."""
    checks = {c.name: c for c in verify.run_checks(stack, ("control_plane", "placement"), say=lambda s: None)}
    assert not checks["control_plane"].ok and "make deploy" in checks["control_plane"].detail
    # Other tests' runs may exist on test pools: the check must still fail and say what it saw.
    assert not checks["placement"].ok and checks["placement"].detail
