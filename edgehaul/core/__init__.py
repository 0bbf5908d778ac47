"""Core stage, central: landed bundles, Great Expectations validation, quarantine, Delta Lake
dataset versions (claims, commits, time travel, lineage) and compaction.

`datasets` is the one way to open a dataset version: training, lifecycle and compaction go through it.
Imports the shared formats and `edgehaul.platform`.
"""
