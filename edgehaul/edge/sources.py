"""Raw batches from an edge node's sources: the Landsat demo generator and a folder of Parquet files (the drop
folder's reader is `edgehaul.edge.drop_folder.DropRun`). Each yields bounded batches, so memory follows the
batch size, not the input size; nothing is read before the first batch is asked for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from edgehaul.edge.landsat import CaptureLog, generate


def generated_batches(node_id: str, spool_dir: str, n_samples: int, *, run_id: str, batch_size: int, seed: int = 0,
                      class_weights: dict[int, float] | None = None, start_seq: int | None = None
                      ) -> Iterator[pa.Table]:
    """Generated Landsat patches, numbered past every sample this node generated before (unless `start_seq`)."""
    # real capture times, recorded beside the spool (not in it: a wiped spool regenerates the same batches)
    log = CaptureLog(f"{spool_dir.rstrip('/')}.captures.sqlite")
    try:
        start = start_seq if start_seq is not None else log.first_seq(run_id, n_samples)
        yield from generate(n_samples, node_id, seed=seed, class_weights=class_weights, start_seq=start,
                            batch_size=batch_size, start_time=log)
    finally:
        log.close()


def parquet_batches(folder: str, batch_size: int) -> Iterator[pa.Table]:
    """Every `*.parquet` file of `folder`, in name order, in batches of at most `batch_size` rows."""
    files = sorted(Path(folder).glob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"no *.parquet files in {folder}")
    for path in files:
        for rb in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
            yield pa.Table.from_batches([rb])
