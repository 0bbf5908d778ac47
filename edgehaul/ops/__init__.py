"""Operations, central: storage-class rules, cold-tier lifecycle moves, bucket lifecycle
configuration, and the cost report. Imports the shared formats, `edgehaul.platform` and
`edgehaul.core.datasets` (dataset lineage for costs)."""
