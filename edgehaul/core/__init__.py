"""Core stage, central: landed bundles, Great Expectations validation, quarantine, Delta Lake
dataset versions (claims, commits, time travel, lineage) and compaction. `ingest` holds core ingest's
steps as plain functions: the core tasks wrap them and the fault drills call them.

`datasets` is the one way to open a dataset version: training, lifecycle and compaction go through it.
Imports the shared formats and `edgehaul.platform`.
"""
