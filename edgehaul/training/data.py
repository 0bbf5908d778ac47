"""Streaming a dataset version from the Delta table in object storage, in a resumable order.

The shuffle unit is a data file: each epoch permutes the version's files with a generator seeded
by (seed, epoch), and rank r of W takes files r, r+W, ... of that order (disjoint shards). Each
file is read as a stream of Arrow record batches (only the needed columns, never the whole file
or table in memory). A `Position` (epoch, file index in this rank's shard, batches done in that
file) is all a checkpoint needs to continue exactly where training stopped.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pds

from edgehaul.contracts import Contract
from edgehaul.core.datasets import DatasetError, open_uri

COLUMNS = ["sample_id", "label", "pixels", "is_summary"]
# Read where a data file has them: files written before a column was added lack it (`sample_weights`: p = 1).
OPTIONAL_COLUMNS = ["inclusion_p"]


@dataclass(frozen=True)
class DatasetRef:
    uri: str
    version: int
    storage_options: dict[str, str]


@dataclass
class Position:
    epoch: int = 0
    file: int = 0  # index into this rank's shard of the epoch's file order
    batch: int = 0  # record batches already consumed from that file

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Position:
        return cls(epoch=int(d["epoch"]), file=int(d["file"]), batch=int(d["batch"]))


def latest_version(uri: str, storage_options: dict[str, str]) -> int:
    return int(open_uri(uri, storage_options).version())


def open_fragments(ref: DatasetRef) -> list[pds.ParquetFileFragment]:
    """The version's data files, sorted by path (the order every rank agrees on)."""
    dt = open_uri(ref.uri, ref.storage_options, ref.version)
    ds = dt.to_pyarrow_dataset()
    missing = [c for c in COLUMNS if c not in ds.schema.names]
    if missing:
        raise DatasetError(f"{ref.uri}@v{ref.version} lacks columns {missing} (has {ds.schema.names})")
    frags = sorted(ds.get_fragments(), key=lambda f: f.path)
    if not frags:
        raise DatasetError(f"{ref.uri}@v{ref.version} has no data files")
    return frags  # type: ignore[return-value]


def epoch_order(n_files: int, seed: int, epoch: int) -> list[int]:
    """Deterministic file order of an epoch: same (seed, epoch) -> same order on every rank and restart."""
    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(n_files)]


def shard(order: list[int], rank: int, world: int) -> list[int]:
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of {world}")
    return order[rank::world]


def is_validation(sample_ids: pa.Array, val_fraction: float) -> np.ndarray:
    """Stable hold-out by sample id (crc32), so a sample is on the same side in every epoch and run."""
    if val_fraction <= 0:
        return np.zeros(len(sample_ids), dtype=bool)
    cut = int(val_fraction * 10_000)
    return np.fromiter(
        ((zlib.crc32(s.encode()) % 10_000) < cut for s in sample_ids.to_pylist()), dtype=bool, count=len(sample_ids)
    )


def trainable(batch: pa.RecordBatch, contract: Contract | None = None) -> pa.RecordBatch:
    """Rows usable for supervised training: labelled and with their payload (summary rows have none). The
    label and payload columns are the contract's; without one, Landsat's (`label`, `pixels`)."""
    label = contract.label_column if contract is not None else "label"
    payload = contract.payload_column if contract is not None else "pixels"
    if label is None:
        raise ValueError(f"contract {contract.id if contract else ''} has no label to train on")
    mask = pc.and_(pc.is_valid(batch.column(label)), pc.invert(pc.fill_null(batch.column("is_summary"), False)))
    if payload is not None:  # a columns kind: is_summary alone says whether the readings travelled
        mask = pc.and_(mask, pc.is_valid(batch.column(payload)))
    return batch.filter(mask)


def sample_weights(batch: pa.RecordBatch | pa.Table) -> np.ndarray:
    """Per-row training weights (float32): 1 / inclusion_p, so the rows of a tier sampled at rate p stand for
    the 1/p samples of the node's population each stood in for. 1 where the column is absent or null (rows
    from before tier sampling were sent with certainty). A full row with p outside (0, 1] is an error."""
    if "inclusion_p" not in batch.schema.names:
        return np.ones(batch.num_rows, dtype=np.float32)
    p = pc.fill_null(batch.column("inclusion_p"), 1.0).to_numpy(zero_copy_only=False).astype(np.float64)
    bad = ~((p > 0.0) & (p <= 1.0))  # NaN is bad too
    if bad.any():
        ids = batch.column("sample_id").to_pylist() if "sample_id" in batch.schema.names else []
        first = [ids[i] for i in np.flatnonzero(bad)[:5]] if ids else np.flatnonzero(bad)[:5].tolist()
        raise ValueError(f"inclusion_p outside (0, 1] in {int(bad.sum())} of {len(p)} rows "
                         f"(values {sorted({float(v) for v in p[bad]})[:5]}), e.g. samples {first}")
    return (1.0 / p).astype(np.float32)


def stream(
    fragments: list[pds.ParquetFileFragment], files: list[int], start: Position, batch_size: int
) -> Iterator[tuple[Position, pa.RecordBatch]]:
    """Yield (position after this batch, raw batch) from `files` (indices into `fragments`),
    starting at `start`. Batches before `start.batch` of the first file are read and dropped
    (bounded by one file), so a resumed stream continues with exactly the next batch."""
    for fi in range(start.file, len(files)):
        skip = start.batch if fi == start.file else 0
        frag = fragments[files[fi]]
        columns = COLUMNS + [c for c in OPTIONAL_COLUMNS if c in frag.physical_schema.names]
        for bi, batch in enumerate(frag.to_batches(columns=columns, batch_size=batch_size)):
            if bi < skip or batch.num_rows == 0:
                continue
            yield Position(start.epoch, fi, bi + 1), batch
