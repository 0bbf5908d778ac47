"""The glue every stage shares: settings, S3 error classification, block loading, role block names, shared field
types, logging into Prefect's run logs, task caching, task runners, alert automations and the webhook gateway.

Imports nothing of the stages; the stages, tasks and flows import it.
"""
