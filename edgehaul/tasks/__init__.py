"""Prefect `@task` wrappers, one module per stage: retries for I/O only (the stage's
`retry_condition_fn` decides what is safe to retry), cache policies keyed on content.
They import the stages, `edgehaul.platform` and `edgehaul.blocks`; only flows import them."""

from edgehaul.platform import run_logging

run_logging.attach()  # domain log lines reach the flow run's logs in the UI
