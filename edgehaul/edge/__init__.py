"""Edge stage, on each node: preprocess against the contract, score, tier, bundle, spool, ledger.

Plain functions over a batch (Arrow / polars / numpy); no Prefect server needed. Imports the shared
formats (`edgehaul.bundles`, `.contracts`, `.events`), `edgehaul.platform` and `edgehaul.training.model`
(the edge model scorer); never `tasks`, `flows` or another stage's internals.
"""
