"""The `density` scorer: a row is worth what its neighbourhood lacks, from the features alone (no label, no model).

value = 1 - exp(-(r - 1)+) with r = the row's distance to its k-th nearest neighbour among its batch, over the
median of that distance in the batch (features standardised by the batch's median and MAD). A row in a region as
dense as most gets ~0; one in a sparse region (a rare class, an event) gets more the sparser it is.

Why not distance from the mean (`novelty`): a common class that lies far from the mean (a distinctive digit)
scores high on every row and takes the budget; by density, the rows of any well-populated cluster, near or far,
score alike, and only what is thinly populated stands out. On a balanced kind that keeps the sample near uniform;
on a skewed kind it finds the rare classes.

Stateless: a batch is scored by itself, so a rerun scores the same. The neighbours are searched in a reference of
at most `REFERENCE_ROWS` rows of the batch (a seeded choice from the batch's own content), in blocks, so memory is
O(block x reference) whatever the batch size.

    scorer = DensityScorer(contract)
    values = scorer.score(table)         # preprocessed rows of the contract (its feature columns)
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa

from edgehaul.contracts import Contract
from edgehaul.edge.scorer_registry import ScorerContext
from edgehaul.edge.scoring import CannotScore

DENSITY_VERSION = "density-1"
NEIGHBOURS = 10  # k: enough to see a cluster, few enough that a rare class of a dozen rows is still sparse
REFERENCE_ROWS = 4096  # neighbours are searched among at most this many rows of the batch
BLOCK_ROWS = 1024  # rows whose distances are computed at once
MAD_TO_SIGMA = 1.4826
SCALE_FLOOR = 1e-6


class DensityScorer:
    """Sparse neighbourhood = value, per batch, for any contract with feature columns."""

    def __init__(self, contract: Contract, neighbours: int = NEIGHBOURS) -> None:
        self.contract = contract
        self.neighbours = neighbours

    @classmethod
    def from_context(cls, ctx: ScorerContext) -> DensityScorer:
        """The `density` entry point (no state: nothing to keep per node)."""
        return cls(ctx.contract)

    @property
    def version(self) -> str:
        return f"{DENSITY_VERSION}+k{self.neighbours}"

    def _standardised(self, table: pa.Table) -> np.ndarray:
        x = np.column_stack([np.asarray(table.column(c).to_numpy(zero_copy_only=False), dtype=np.float64)
                             for c in self.contract.feature_columns])
        x[~np.isfinite(x)] = np.nan
        median = np.nanmedian(x, axis=0)
        scale = np.maximum(MAD_TO_SIGMA * np.nanmedian(np.abs(x - median), axis=0), SCALE_FLOOR)
        z = (x - np.nan_to_num(median)) / np.where(np.isfinite(scale), scale, 1.0)
        return np.nan_to_num(z, nan=0.0)  # a missing feature adds no distance

    def score(self, table: pa.Table) -> np.ndarray:
        n = table.num_rows
        if n == 0:
            return np.zeros(0, np.float32)
        if not self.contract.feature_columns:
            raise CannotScore(f"density: contract {self.contract.id} has no feature columns")
        if n <= self.neighbours:
            raise CannotScore(f"density: {n} rows, too few to have {self.neighbours} neighbours each")
        z = self._standardised(table)
        ref_idx = np.arange(n)
        if n > REFERENCE_ROWS:  # the same rows on every rerun: seeded by the batch's content
            seed = int.from_bytes(hashlib.sha256(z.tobytes()).digest()[:8], "little")
            ref_idx = np.sort(np.random.default_rng(seed).choice(n, REFERENCE_ROWS, replace=False))
        ref = z[ref_idx]
        ref_sq = (ref**2).sum(axis=1)
        kth = np.empty(n)
        for a in range(0, n, BLOCK_ROWS):
            block = z[a : a + BLOCK_ROWS]
            d2 = np.maximum((block**2).sum(axis=1)[:, None] + ref_sq[None, :] - 2.0 * block @ ref.T, 0.0)
            own = np.searchsorted(ref_idx, np.arange(a, a + len(block)))  # a row is not its own neighbour
            hit = (own < len(ref_idx)) & (ref_idx[np.minimum(own, len(ref_idx) - 1)] == np.arange(a, a + len(block)))
            d2[np.flatnonzero(hit), own[hit]] = np.inf
            kth[a : a + len(block)] = np.sqrt(np.partition(d2, self.neighbours - 1, axis=1)[:, self.neighbours - 1])
        typical = float(np.median(kth))
        r = kth / typical if typical > 0 else np.where(kth > 0, np.inf, 1.0)
        value = 1.0 - np.exp(-np.maximum(r - 1.0, 0.0))
        return np.clip(value, 0.0, 1.0).astype(np.float32)
