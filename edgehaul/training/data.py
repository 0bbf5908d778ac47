"""Streaming a dataset version from the Delta table in object storage, in a resumable order.

The shuffle unit is a data file: each epoch permutes the version's files with a generator seeded
by (seed, epoch), and rank r of W takes files r, r+W, ... of that order (disjoint shards). Each
file is read as a stream of Arrow record batches (only the needed columns, never the whole file
or table in memory). A `Position` (epoch, file index in this rank's shard, batches done in that
file) is all a checkpoint needs to continue exactly where training stopped.

What is read follows the contract (`columns_for`): the sample id, the label column, the payload columns,
`is_summary` and, where the table has it, `inclusion_p` (rows sampled into a tier with probability p
weigh 1/p: `sample_weights`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pds

from edgehaul.contracts import Contract, ContractError
from edgehaul.core.datasets import DatasetError, open_uri
from edgehaul.decode import DecodeError, decode_tensors

INCLUSION_P = "inclusion_p"  # optional: the probability a row was sampled with (older tables lack it)
SHUFFLE_ROWS = 8192  # rows permuted together within a file (bounds memory: one window at a time)
VAL_BLOCK_ROWS = 64  # consecutive readings of a node held out together


def columns_for(contract: Contract) -> list[str]:
    """The columns training reads of a contract's dataset (`inclusion_p` is added where the table has it)."""
    if contract.label_column is None:
        raise ContractError(f"contract {contract.id} has no label column to train on")
    return ["sample_id", "node_id", "seq", contract.label_column, *contract.payload_columns, "is_summary"]


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


def open_fragments(ref: DatasetRef, contract: Contract) -> tuple[list[pds.ParquetFileFragment], list[str]]:
    """The version's data files in content order (the order every rank and every store agrees on), and the
    columns to read."""
    dt = open_uri(ref.uri, ref.storage_options, ref.version)
    ds = dt.to_pyarrow_dataset()
    columns = columns_for(contract)
    missing = [c for c in columns if c not in ds.schema.names]
    if missing:
        raise DatasetError(f"{ref.uri}@v{ref.version} lacks columns {missing} of contract {contract.id} "
                           f"(has {ds.schema.names})")
    if INCLUSION_P in ds.schema.names:
        columns.append(INCLUSION_P)
    frags = sorted(ds.get_fragments(), key=_content_order(dt))
    if not frags:
        raise DatasetError(f"{ref.uri}@v{ref.version} has no data files")
    return frags, columns


def _content_order(dt: Any) -> Callable[[pds.ParquetFileFragment], tuple[str, str, int, str]]:
    """Sort key of a version's data files by what they hold (their sample id range and row count from the
    Delta log's statistics), the path last: file names are random, so a path order would make the same data
    train differently in every store it is committed to."""
    adds = pa.table(dt.get_add_actions(flatten=True))
    have = set(adds.column_names)
    lo = adds.column("min.sample_id").to_pylist() if "min.sample_id" in have else [None] * adds.num_rows
    hi = adds.column("max.sample_id").to_pylist() if "max.sample_id" in have else [None] * adds.num_rows
    stats = {path.rsplit("/", 1)[-1]: (a or "", b or "", int(n or 0))
             for path, a, b, n in zip(adds.column("path").to_pylist(), lo, hi, adds.column("num_records").to_pylist(),
                                      strict=True)}

    def key(frag: pds.ParquetFileFragment) -> tuple[str, str, int, str]:
        return (*stats.get(frag.path.rsplit("/", 1)[-1], ("", "", 0)), frag.path)
    return key


def epoch_order(n_files: int, seed: int, epoch: int) -> list[int]:
    """Deterministic file order of an epoch: same (seed, epoch) -> same order on every rank and restart."""
    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(n_files)]


def shard(order: list[int], rank: int, world: int) -> list[int]:
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of {world}")
    return order[rank::world]


def val_block_rows(total_rows: int, val_fraction: float, stretches: int = 20) -> int:
    """Length of a held-out stretch for a version of `total_rows`: VAL_BLOCK_ROWS, shorter when the version is
    too small for about `stretches` held-out stretches (320 rows at 10%: single rows), never below 1."""
    return max(1, min(VAL_BLOCK_ROWS, int(total_rows * val_fraction / stretches)))


def is_validation(batch: pa.RecordBatch | pa.Table, val_fraction: float,
                  block_rows: int = VAL_BLOCK_ROWS) -> np.ndarray:
    """Stable hold-out by time: a row is validation when the crc32 of its stretch (`node_id`,
    `seq // block_rows`) falls under `val_fraction`, so a sample is on the same side in every epoch and run
    and its neighbours in time are on its side. A batch without `node_id`/`seq` holds out by sample id."""
    n = batch.num_rows
    if val_fraction <= 0 or n == 0:
        return np.zeros(n, dtype=bool)
    cut = int(val_fraction * 10_000)
    names = batch.schema.names
    if "node_id" in names and "seq" in names:
        seq = np.asarray(batch.column("seq").to_numpy(zero_copy_only=False), dtype=np.int64) // block_rows
        keys = [f"{node}|{b}" for node, b in zip(batch.column("node_id").to_pylist(), seq.tolist(), strict=True)]
    else:
        keys = batch.column("sample_id").to_pylist()
    uniq, inverse = np.unique(np.asarray(keys, dtype=object), return_inverse=True)
    held = np.fromiter(((zlib.crc32(str(k).encode()) % 10_000) < cut for k in uniq), dtype=bool, count=len(uniq))
    return held[inverse]


def trainable(batch: pa.RecordBatch, contract: Contract) -> pa.RecordBatch:
    """Rows usable for supervised training: labelled, not a summary, and with their payload (a tensor or
    file kind's payload column; every non-nullable data column of a columns kind)."""
    if contract.label_column is None:
        raise ContractError(f"contract {contract.id} has no label column to train on")
    needed = [contract.label_column]
    if contract.layout == "columns":
        needed += [c.name for c in contract.columns if not c.nullable]
    else:
        needed += list(contract.payload_columns)
    mask = pc.invert(pc.fill_null(batch.column("is_summary"), False))
    for name in needed:
        mask = pc.and_(mask, pc.is_valid(batch.column(name)))
    return batch.filter(mask)


def sample_weights(batch: pa.RecordBatch | pa.Table) -> np.ndarray:
    """Per-row loss weights (float64): 1/inclusion_p where the batch has an `inclusion_p` column (a row kept
    with probability p stands for 1/p rows of the population), 1 where it has none or the value is null.
    A p outside (0, 1] is an error naming the row's sample id."""
    n = batch.num_rows
    if INCLUSION_P not in batch.schema.names:
        return np.ones(n, dtype=np.float64)
    p = np.asarray(pc.fill_null(batch.column(INCLUSION_P).cast(pa.float64()), 1.0).to_numpy(zero_copy_only=False),
                   dtype=np.float64)
    bad = ~((p > 0) & (p <= 1))  # NaN included
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        sid = batch.column("sample_id")[i].as_py() if "sample_id" in batch.schema.names else f"row {i}"
        raise ValueError(f"{INCLUSION_P} {p[i]!r} of sample {sid} is outside (0, 1]; "
                         f"{int(bad.sum())} of {n} rows of the batch are")
    return 1.0 / p


def stream(
    fragments: list[pds.ParquetFileFragment], files: list[int], start: Position, batch_size: int, columns: list[str],
    shuffle_seed: int | None = None,
) -> Iterator[tuple[Position, pa.RecordBatch]]:
    """Yield (position after this batch, raw batch) from `files` (indices into `fragments`),
    starting at `start`. With `shuffle_seed`, each window of `SHUFFLE_ROWS` rows of a file is permuted
    (seeded by (seed, epoch, file, window)) before it is cut into batches; without, the stored order.
    Batches before `start.batch` of the first file are read and dropped (bounded by one file), so a
    resumed stream continues with exactly the next batch."""
    for fi in range(start.file, len(files)):
        skip = start.batch if fi == start.file else 0
        frag = fragments[files[fi]]
        # A file written before the table gained inclusion_p (schema merge) lacks it: its rows weigh 1.
        have = frag.physical_schema.names
        cols = [c for c in columns if c != INCLUSION_P or c in have]
        window = SHUFFLE_ROWS if shuffle_seed is not None else batch_size
        bi = 0
        for wi, chunk in enumerate(frag.to_batches(columns=cols, batch_size=window)):
            if chunk.num_rows == 0:
                continue
            if shuffle_seed is not None:
                rng = np.random.default_rng([shuffle_seed, start.epoch, files[fi], wi])
                chunk = chunk.take(pa.array(rng.permutation(chunk.num_rows)))
            for a in range(0, chunk.num_rows, batch_size):
                bi += 1
                if bi <= skip:
                    continue
                yield Position(start.epoch, fi, bi), chunk.slice(a, batch_size)


def decodable(rows: pa.RecordBatch, contract: Contract) -> tuple[pa.RecordBatch, list[dict[str, str]]]:
    """(the rows whose payload decodes, [{sample_id, reason}] of those that do not). A tensor or file kind's
    payload comes from a node: one that passed the core but does not decode (junk bytes behind an image
    signature) is skipped and named, never allowed to fail the run. Row by row: callers decode the whole
    batch first and come here only when that failed, to find which rows."""
    if contract.layout == "columns" or rows.num_rows == 0:
        return rows, []
    col = rows.column(contract.payload_columns[0])
    ok = np.ones(rows.num_rows, dtype=bool)
    skipped: list[dict[str, str]] = []
    ids = rows.column("sample_id")
    for i in range(rows.num_rows):  # the failure path only: find the rows that do not decode
        try:
            decode_tensors(col.slice(i, 1), contract)
        except DecodeError as e:
            ok[i] = False
            skipped.append({"sample_id": str(ids[i].as_py()), "reason": str(e).split(": ", 1)[-1]})
    return rows.filter(pa.array(ok)), skipped
