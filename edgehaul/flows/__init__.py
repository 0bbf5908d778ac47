"""Deployable flows, one per file, orchestration only: each file's docstring says what the flow does,
which blocks and settings it needs, and its cache policy. `deployments/prefect.yaml` names them by
path (`flows/<name>.py:<name>`, through the repository's top-level `flows` link).
May import everything in the package; nothing imports a flow except tests and the dev harness."""

from edgehaul.platform import run_logging

run_logging.attach()  # domain log lines reach the flow run's logs in the UI
