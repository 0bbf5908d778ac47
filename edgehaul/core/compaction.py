"""Compaction: merge a dataset's small files into target-size files as one Delta commit.

Delta's optimize rewrites rows without changing them: the new version reads the same rows as its
parent, and old versions still read their old files (until a vacuum, which this module never runs),
so no version's content changes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from deltalake import CommitProperties
from deltalake.exceptions import DeltaError

from edgehaul.core.datasets import DatasetError, open_table

if TYPE_CHECKING:
    from edgehaul.blocks import ObjectStore

log = logging.getLogger(__name__)

DEFAULT_TARGET_SIZE = 256 * 1024 * 1024  # bytes; typical targets are 100 MB - 1 GB


@dataclass(frozen=True)
class FileSet:
    kind: str
    version: int
    files: tuple[str, ...]  # data file paths of that version, sorted
    total_bytes: int

    @property
    def fingerprint(self) -> str:
        """Identity of the input of a compaction: the sorted set of data files (the cache key)."""
        return hashlib.sha256(json.dumps([self.kind, *self.files]).encode()).hexdigest()


def file_set(store: ObjectStore, kind: str) -> FileSet:
    dt = open_table(store, kind)
    actions = dt.get_add_actions(flatten=True)
    paths = actions.column("path").to_pylist()
    sizes = actions.column("size_bytes").to_pylist()
    return FileSet(kind, dt.version(), tuple(sorted(paths)), int(sum(sizes)))


@dataclass(frozen=True)
class CompactionResult:
    kind: str
    version_before: int
    version: int | None  # None: nothing to compact
    files_before: int
    files_removed: int
    files_added: int
    target_size: int
    input_fingerprint: str
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compact(
    store: ObjectStore, kind: str, target_size: int = DEFAULT_TARGET_SIZE, *, min_files: int = 2
) -> CompactionResult:
    """Bin-pack the current version's small files into files of about `target_size` bytes."""
    if target_size < 1024:
        raise DatasetError(f"compaction target_size {target_size} bytes is below 1 KiB")
    t0 = time.perf_counter()
    dt = open_table(store, kind)
    before = file_set(store, kind)
    if len(before.files) < min_files:
        return CompactionResult(kind, before.version, None, len(before.files), 0, 0, target_size, before.fingerprint,
                                time.perf_counter() - t0)
    try:
        metrics = dt.optimize.compact(
            target_size=target_size,
            commit_properties=CommitProperties(custom_metadata={
                "edgehaul.operation": "compact", "edgehaul.input_fingerprint": before.fingerprint,
                "edgehaul.target_size": str(target_size),
            }),
        )
    except (DeltaError, OSError) as e:
        raise DatasetError(f"dataset {kind}: compaction failed, nothing committed: {e}") from e
    added, removed = int(metrics.get("numFilesAdded", 0)), int(metrics.get("numFilesRemoved", 0))
    version = dt.version() if removed else None
    log.info("compacted %s: %d files -> %d (v%s)", kind, removed, added, version)
    return CompactionResult(kind, before.version, version, len(before.files), removed, added, target_size,
                            before.fingerprint, time.perf_counter() - t0)
