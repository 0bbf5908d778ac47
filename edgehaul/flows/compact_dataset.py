"""compact_dataset: merge a dataset's small files into target-size files, as its own Delta commit.

Rows are rewritten, not changed: the new version reads exactly what its parent read, and every
older version still reads its own files (this flow never vacuums). Appends may run concurrently
(Delta only conflicts when two commits remove the same files).

Blocks: `ObjectStore` (`store_block`, writes curated); the S3Bucket `result_storage` block (deployments:
`edgehaul-core-results`, saved by `edgehaul blocks apply`; this flow never saves a block). Cache policy:
keyed on the dataset's current file set (sorted data file paths) + target size (tasks/core.py
`compact_task`): a rerun over an unchanged file set is Cached and rewrites nothing; results are JSON
records in `result_storage` (central identities only); left empty, Prefect's default result storage of
the worker process (its local disk). `refresh_cache=True` forces a fresh attempt. Runs on the central
pool, e.g. nightly.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.utilities.annotations import NotSet
from pydantic import BaseModel, Field

from edgehaul.blocks import ObjectStore
from edgehaul.platform.block_loading import load_block
from edgehaul.platform.reporting import run_namer, summary_table
from edgehaul.platform.roles import StoreBlock
from edgehaul.platform.runners import from_environment
from edgehaul.tasks.core import compact_task, file_set_task


class CompactDatasetParams(BaseModel):
    store_block: str = Field(default=StoreBlock.INGEST, min_length=1, description="ObjectStore block (curated writer).")
    kind: str = Field(default="landsat_patch", min_length=1, description="Observation kind (one Delta table each).")
    target_size_mb: float = Field(default=256.0, ge=0.01, le=4096.0, description="Target file size in MB.")
    min_files: int = Field(default=2, ge=2, le=100_000, description="Do nothing below this many files.")
    refresh_cache: bool = Field(default=False, description="Recompute even if this file set was compacted before.")
    result_storage: str = Field(default="", description="Result storage block slug (central identities only, e.g. "
                                "'s3-bucket/edgehaul-core-results'); empty: the worker's default (local) storage.")


@flow(name="compact_dataset", task_runner=from_environment(),  # EDGEHAUL_TASK_RUNNER of the run's process
       flow_run_name=run_namer("compact_dataset", CompactDatasetParams, lambda p: p.kind))
def compact_dataset(params: CompactDatasetParams | None = None) -> dict[str, Any]:
    """Bin-pack the dataset's small files into target-size files in one commit."""
    p = params or CompactDatasetParams()
    logger = get_run_logger()
    store = load_block(ObjectStore, p.store_block, param="store_block")
    files = file_set_task(store, p.kind)
    # named, never saved here; NotSet: the worker's default storage
    result = compact_task.with_options(refresh_cache=p.refresh_cache, result_storage=p.result_storage or NotSet)(
        store, files, int(p.target_size_mb * 1024 * 1024), p.min_files)
    summary_table(
        "compact-dataset", [{"kind": p.kind, "files_before": len(files.files), "bytes": files.total_bytes,
                             "version_before": files.version, "version": result["version"],
                             "removed": result["files_removed"], "added": result["files_added"]}],
        f"compact_dataset {p.kind}",
    )
    logger.info("compact_dataset %s: %d files at v%d -> removed %d, added %d (v%s)", p.kind, len(files.files),
                files.version, result["files_removed"], result["files_added"], result["version"])
    return result
