"""Model quality per uplinked byte: tiering against FIFO and random, on ground held out by place.

The question an operator asks: "with this link budget, how good is the model the core can train?"
(the scorer's own "value per uplinked MB" cannot answer it: selecting by a score always raises the
mean score of what is selected).

1. Ground truth: the Landsat scene is cut into spatial blocks (`block` x `block` patches); a seeded
   choice of blocks (about a quarter of the patches, every class on both sides where the scene
   allows) is the test set. The edge only ever sees the training blocks: their real patches plus
   patches generated from them alone (`landsat.generate(base=...)`), so every test sample is real
   and neither it nor an augmented copy of it is ever uplinked. The bench checks the content hash of
   every test patch against every dataset version it trains on.
2. The edge stream (i.i.d. shuffled, the scene's own skewed class mix) arrives in two rounds (contact
   windows). Each round runs through the product's edge path (`edge_batch.ingest_batch`: preprocess,
   score, tier, bundles into a `Spool`), then the link carries `budget x raw bytes` of that round,
   where raw bytes = the bundles of every sample of the round sent in full. What is carried is a
   prefix of the spool's own drain order (`Spool.pending()`: tier, then value, then age); bundles
   left over expire with the round.
3. Policies, same bytes: FIFO (every sample normal tier, drained oldest first), random (the same
   over a shuffled copy of the round: a uniform sample), tiering with the novelty scorer, and
   tiering with the model scorer after one closed-loop round (round 1 as novelty; a model trained
   on round 1's dataset version is published to the edge and scores round 2).
4. Core: landed bundles go through the product's uplink (`Uplink.send`), validation
   (`validation.validate_bundles`, Great Expectations) and `datasets.commit_bundles` (one Delta
   commit per round, one table per cell) on a private SeaweedFS. Training: `training.launch.run`,
   the entry point the `train_model` flow's task calls (a flow run per cell would add the Prefect
   server and ~1 s per run, not a different model), with a fixed number of training samples seen
   per model (epochs = passes / rows), fixed seeds, evaluated on the held-out patches.

    python -m benchmarks value          # EDGEHAUL_BENCH_QUICK=1 (or --quick) for the CI variant
Writes benchmarks/results/bench-value{,-quick}.{md,png,json}; the full run (or `--write-docs`) also
docs/bench-value.{json,png} and README's "Model quality per uplinked byte" section. Each cell: bytes, rows,
class mix landed and weighted by 1/inclusion_p against the stream's, macro-F1 and rare-class recall with
90% bootstrap intervals over the test samples and the seeds.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import SecretStr

from edgehaul.blocks import LinkProfile, ObjectStore, TieringPolicy
from edgehaul.contracts import Contract, load_contract
from edgehaul.edge import landsat
from edgehaul.edge.landsat import Patches
from edgehaul.edge.preprocess import content_hashes

if TYPE_CHECKING:
    from edgehaul.edge.spool import Spool, SpoolEntry

KIND = "landsat_patch"
NODE = "edge-bench"
BUDGETS = (0.01, 0.02, 0.05, 0.10, 0.25, 1.0)
QUICK_BUDGETS = (0.05, 0.25, 1.0)
DOCS = Path(__file__).resolve().parents[1] / "docs"
README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "### Model quality per uplinked byte"
BOOTSTRAP = 400  # resamples (test samples x seeds) per interval
POLICIES = ("fifo", "random", "tier-novelty", "tier-model")
RESULTS = Path(__file__).parent / "results"
PATCH = 16  # landsat.real_patches() patch size and stride


@dataclass(frozen=True)
class Config:
    stream: int  # samples in the edge stream, both rounds together
    batch: int  # rows per raw batch at the edge
    bundle_rows: int  # rows per bundle, so that a 2% budget is several bundles
    sample_passes: int  # training samples seen per model, whatever the dataset's size
    width: int  # LandCoverNet width
    seeds: tuple[int, ...]  # training seeds of the evaluated models (round-1 models: the first)
    budgets: tuple[float, ...] = BUDGETS
    block: int = 4  # spatial block side, in patches
    test_share: float = 0.25
    split_seed: int = 0
    stream_seed: int = 0


QUICK = Config(stream=3000, batch=500, bundle_rows=16, sample_passes=6_000, width=16, seeds=(0,),
               budgets=QUICK_BUDGETS)
FULL = Config(stream=12_000, batch=1000, bundle_rows=16, sample_passes=24_000, width=16, seeds=(0, 1, 2))


# ---------------------------------------------------------------- ground truth held out by place


@dataclass(frozen=True)
class Split:
    train: Patches
    test: Patches
    test_blocks: frozenset[tuple[int, int]]
    block: int


def blocks_of(origins: np.ndarray, block: int) -> np.ndarray:
    """(n, 2) block coordinates of patches: block = `block` x `block` patches of the scene."""
    return np.asarray(origins) // (PATCH * block)


def _subset(p: Patches, mask: np.ndarray) -> Patches:
    return Patches(p.pixels[mask], p.labels[mask], p.origins[mask])


def spatial_split(patches: Patches, *, block: int = 4, test_share: float = 0.25, seed: int = 0,
                  tries: int = 400) -> Split:
    """Whole spatial blocks go to the test side until it holds `test_share` of the patches. Of
    `tries` seeded block orders, keep the one with the most classes on both sides, then the largest
    smallest per-class count on either side, then the share closest to the target."""
    b = blocks_of(patches.origins, block)
    ids = b[:, 0] * 10_000 + b[:, 1]
    uniq = np.unique(ids)
    classes = np.unique(patches.labels)
    rng = np.random.default_rng(seed)
    best: tuple[tuple[int, int, float], np.ndarray] | None = None
    for _ in range(tries):
        mask = np.zeros(len(ids), dtype=bool)
        for blk in rng.permutation(uniq):
            if mask.mean() >= test_share:
                break
            mask |= ids == blk
        both = [c for c in classes if (patches.labels[mask] == c).any() and (patches.labels[~mask] == c).any()]
        smallest = min((min(int((patches.labels[mask] == c).sum()), int((patches.labels[~mask] == c).sum()))
                        for c in both), default=0)
        key = (len(both), smallest, -abs(float(mask.mean()) - test_share))
        if best is None or key > best[0]:
            best = (key, mask)
    assert best is not None
    mask = best[1]
    test_blocks = frozenset((int(y), int(x)) for y, x in np.unique(b[mask], axis=0))
    return Split(_subset(patches, ~mask), _subset(patches, mask), test_blocks, block)


def pixel_array(table: pa.Table, contract: Contract) -> np.ndarray:
    """Raw `pixels` column -> (n, h, w, c) array (a copy)."""
    col = table.column("pixels").combine_chunks()
    offsets = np.frombuffer(col.buffers()[1], dtype=np.int32)[col.offset : col.offset + len(col) + 1]
    data = np.frombuffer(col.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    return data.reshape((len(col), *contract.shape)).copy()


def edge_stream(split: Split, n: int, *, batch: int, seed: int, contract: Contract) -> list[pa.Table]:
    """Raw batches of `n` observations: every real training-block patch once, the rest generated
    from the training blocks only, shuffled (the scene's skewed class mix, i.i.d. arrival)."""
    real = split.train
    extra = n - len(real.labels)
    if extra < 0:
        raise ValueError(f"stream of {n} is smaller than the {len(real.labels)} real training patches")
    gen = list(landsat.generate(extra, NODE, seed=seed, base=real, batch_size=max(extra, 1))) if extra else []
    pix = np.concatenate([real.pixels, *(pixel_array(t, contract) for t in gen)])
    labels = np.concatenate([real.labels, *(t.column("label").to_numpy() for t in gen)]).astype(np.int16)
    order = np.random.default_rng([seed, 1]).permutation(n)
    pix, labels = pix[order], labels[order]
    return [landsat.raw_table(pix[a : a + batch], labels[a : a + batch], NODE, start_seq=a, contract=contract)
            for a in range(0, n, batch)]


def pixel_hashes(pixels: np.ndarray) -> set[str]:
    """Content hashes exactly as preprocessing writes them (`content_sha256`)."""
    flat = np.ascontiguousarray(pixels).reshape(len(pixels), -1)
    return set(content_hashes(pa.array([r.tobytes() for r in flat], pa.binary())).to_pylist())


# ---------------------------------------------------------------- the edge, one round per policy


class ConstantScorer:
    """Every sample worth the same: with thresholds 0/1 all are normal tier and the spool's drain
    order (tier, value, age) becomes plain FIFO."""

    version = "constant-0.5"

    def score(self, table: pa.Table) -> np.ndarray:
        return np.full(table.num_rows, 0.5, dtype=np.float32)


def policy_for(name: str, cfg: Config, budget: float | None = None) -> TieringPolicy:
    """The product's TieringPolicy with bundles of about `bundle_rows` rows (a patch of 1,536 B and
    its columns is under 2 KiB uncompressed), so a 2% budget still spans several bundles."""
    cap = 16 * 1024 + cfg.bundle_rows * 2 * 1024
    base = TieringPolicy(version=f"bench-{name}", flush_max_samples=cfg.bundle_rows, flush_max_bytes=cap,
                         urgent_max_bytes=cap)
    if name in ("fifo", "random"):
        return base.model_copy(update={"high_threshold": 1.0, "low_threshold": 0.0})
    # tiering knows its budget: every row gets a known inclusion_p, solved so the expected bytes meet it
    if budget is not None:
        base = base.model_copy(update={"budget_share": budget})
    if name == "tier-novelty":
        return base
    return base.model_copy(update={"scorer": "model", "model_uri": "latest"})


class _Ticker:
    """Spool clock: strictly increasing, so 'oldest first' is the order bundles were spooled."""

    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


def edge_round(batches: list[pa.Table], contract: Contract, policy: TieringPolicy, scorer: Any,
               spool_dir: Path) -> tuple[Spool, list[SpoolEntry]]:
    """Run the batches through the product's edge path into a fresh spool; its drain order."""
    from edgehaul.edge.batch import ingest_batch
    from edgehaul.edge.preprocess import batch_key
    from edgehaul.edge.spool import Spool

    spool = Spool(spool_dir, cap_bytes=1 << 40, node_id=NODE, clock=_Ticker(), emit=lambda *a, **k: False)
    for raw in batches:
        key, hashes = batch_key(raw)
        ingest_batch(raw, contract, policy, spool, scorer, key=key, hashes=hashes, node_id=NODE,
                     scorer_version=scorer.version)
    return spool, spool.pending()


def shuffled(batches: list[pa.Table], seed: int) -> list[pa.Table]:
    """The same observations in a uniformly random order (same sample ids: the random policy
    sends a uniform sample of the round)."""
    t = pa.concat_tables(batches)
    t = t.take(pa.array(np.random.default_rng([seed, 2]).permutation(t.num_rows)))
    size = batches[0].num_rows
    return [t.slice(a, size) for a in range(0, t.num_rows, size)]


def within(entries: list[SpoolEntry], budget: float) -> list[SpoolEntry]:
    """What the link carries: the drain order's prefix that fits the byte budget."""
    out, used = [], 0
    for e in entries:
        if used + e.manifest.nbytes > budget:
            break
        out.append(e)
        used += e.manifest.nbytes
    return out


# ---------------------------------------------------------------- the core: land, validate, commit, train


def land_and_commit(store: ObjectStore, spool: Spool, entries: list[SpoolEntry], contract: Contract,
                    state_dir: Path, quarantined: list[str]) -> int | None:
    """Uplink, validate and commit `entries` as one dataset version of the cell's table. Bundles
    that fail validation stay out of the dataset, as core_ingest quarantines them (their bytes were
    spent all the same); `quarantined` gets one line per such bundle."""
    from edgehaul.core import landed
    from edgehaul.core.datasets import ValidatedBundle, commit_bundles
    from edgehaul.core.validation import validate_bundles
    from edgehaul.uplink.link import Link
    from edgehaul.uplink.transfer import Uplink

    if not entries:
        return None
    up = Uplink(store, Link(LinkProfile(bandwidth_bps=1e10), emit_events=False), state_dir)
    for e in entries:
        up.send(spool.read(e.bundle_id), e.manifest)
    fetched = [landed.fetch(store, up.key_of(e.manifest)) for e in entries]
    if any(f.manifest is None or f.data is None for f in fetched):
        raise RuntimeError(f"landed bundles unreadable: {[f.error for f in fetched if f.error][:3]}")
    checked = validate_bundles([(f.data or b"", f.manifest) for f in fetched if f.manifest is not None])
    vbs = []
    for f, (t, r) in zip(fetched, checked, strict=True):
        if r.success and t is not None and f.manifest is not None:
            vbs.append(ValidatedBundle(f.manifest, t, r))
        else:
            failed = [f"{x.expectation}({x.column})={x.observed_value}" for x in r.expectations if not x.success]
            quarantined.append(f"{f.manifest.tier if f.manifest else '?'} bundle of {r.rows} rows: {r.reason} "
                               f"{failed or r.error}")
    return commit_bundles(store, contract, vbs).version if vbs else None


def version_rows(store: ObjectStore, version: int) -> pa.Table:
    from edgehaul.core.datasets import open_uri, read_version, table_uri
    from edgehaul.training.data import INCLUSION_P

    names = open_uri(table_uri(store, KIND), store.storage_options(), version).schema().to_arrow().names
    cols = ["label", "content_sha256", "is_summary", *([INCLUSION_P] if INCLUSION_P in names else [])]
    return read_version(store, KIND, version, columns=cols)


def train_on(store: ObjectStore, version: int, rows: int, cfg: Config, seed: int,
             run_id: str) -> tuple[str, dict[str, Any]]:
    """The trainer the train_model flow runs, on one dataset version: (the model URI, its quality gate)."""
    from edgehaul.core.datasets import table_uri
    from edgehaul.training.launch import run
    from edgehaul.training.trainer import TrainConfig

    # Early stopping on a held-out stretch of the landed rows keeps the best epoch; the gate is off so a cell
    # that learns nothing is reported as such instead of ending the bench.
    tc = TrainConfig(
        run_id=run_id, dataset_uri=table_uri(store, KIND), dataset_version=version, seed=seed,
        epochs=min(60, max(3, math.ceil(cfg.sample_passes / max(rows, 1)))), width=cfg.width, val_fraction=0.15,
        patience=4, quality_gate=False, num_threads=1, keep_checkpoints=1, emit_events=False,
        checkpoint_every_steps=100_000,
    )
    lineage = run(tc, store, 1).lineage
    return str(lineage["model_uri"]), dict(lineage.get("quality_gate", {}))


def predict(store: ObjectStore, model_uri: str, test: Patches, contract: Contract) -> np.ndarray:
    """The model's labels for the held-out patches, its inputs standardised as it was trained."""
    import torch

    from edgehaul.training.model import build_model, inputs
    from edgehaul.training.registry import load_model_file

    f = load_model_file(store, model_uri)
    arch = dict(f["arch"])
    model = build_model(arch)
    model.load_state_dict(f["state_dict"])
    model.eval()
    raw = landsat.raw_table(test.pixels, test.labels, "test", contract=contract)
    with torch.no_grad():
        pred_idx = model(inputs(raw, contract, arch)).argmax(1).numpy()
    return np.asarray(f["label_values"])[pred_idx]


def evaluate(store: ObjectStore, model_uri: str, test: Patches, contract: Contract,
             rare: list[int]) -> dict[str, float]:
    """Macro-F1 over the classes present in the test set, mean recall of `rare`, accuracy."""
    return scores(test.labels, predict(store, model_uri, test, contract), rare)


def interval(truth: np.ndarray, preds: list[np.ndarray], rare: list[int], key: str, n: int = BOOTSTRAP,
             seed: int = 0) -> tuple[float, float]:
    """90% bootstrap interval of the seed-mean `key`, resampling the test samples and the seeds."""
    if not preds:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(n):
        idx = rng.integers(0, len(truth), len(truth))
        which = rng.integers(0, len(preds), len(preds))
        t = truth[idx]
        present = [c for c in rare if (t == c).any()]
        vals.append(np.mean([scores(t, preds[w][idx], present or rare)[key] for w in which]))
    lo, hi = np.nanpercentile(vals, [5, 95])
    return (float(lo), float(hi))


def scores(truth: np.ndarray, pred: np.ndarray, rare: list[int]) -> dict[str, float]:
    recall, f1 = {}, []
    for c in np.unique(truth):
        tp = int(((pred == c) & (truth == c)).sum())
        p = tp / max(int((pred == c).sum()), 1)
        r = tp / int((truth == c).sum())
        recall[int(c)] = r
        f1.append(2 * p * r / (p + r) if p + r else 0.0)
    return {"macro_f1": float(np.mean(f1)), "rare_recall": float(np.mean([recall[c] for c in rare])),
            "accuracy": float((truth == pred).mean())}


# ---------------------------------------------------------------- the experiment


@dataclass
class Cell:
    policy: str
    budget: float
    bytes: int = 0
    rows: int = 0  # trainable (full) rows landed, both rounds
    class_rows: dict[int, int] = field(default_factory=dict)
    runs: list[dict[str, float]] = field(default_factory=list)  # one per seed
    weighted_mix: dict[int, float] = field(default_factory=dict)  # share per class, rows weighted 1/inclusion_p
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)  # 90% bootstrap intervals
    gate_passed: int = 0  # seeds whose model beat a label-blind guesser on its own validation split
    note: str = ""
    quarantined: list[str] = field(default_factory=list)  # bundles landed but failing validation

    def mean(self, key: str) -> float:
        return float(np.mean([r[key] for r in self.runs])) if self.runs else float("nan")

    def spread(self, key: str) -> float:
        return float(np.std([r[key] for r in self.runs])) if len(self.runs) > 1 else 0.0


@contextmanager
def s3_store(root: Path) -> Iterator[ObjectStore]:
    """A private SeaweedFS (no Prefect server: nothing here needs one)."""
    from edgehaul_dev import localstack

    root.mkdir(parents=True, exist_ok=True)
    state = localstack.new_state(root, fixed_ports=False)
    state.save()
    try:
        localstack.start_s3(state)
        cred = state.identities["admin"]
        yield ObjectStore(endpoint_url=state.s3_endpoint, access_key_id=SecretStr(cred.access_key_id),
                          secret_access_key=SecretStr(cred.secret_access_key), prefix="bench-value")
    finally:
        localstack.down(root)


def cell_store(base: ObjectStore, name: str) -> ObjectStore:
    return base.model_copy(update={"prefix": f"{base.prefix}-{name}-{uuid.uuid4().hex[:6]}"})


class Guard:
    """Every dataset version trained on is checked: no held-out patch's content hash in it."""

    def __init__(self, test_hashes: set[str]) -> None:
        self.test_hashes = test_hashes
        self.versions = 0
        self.rows = 0

    def check(self, rows: pa.Table, where: str) -> None:
        hit = self.test_hashes & set(rows.column("content_sha256").to_pylist())
        if hit:
            raise AssertionError(f"{where}: {len(hit)} held-out test patches in a training version")
        self.versions += 1
        self.rows += rows.num_rows


def run_experiment(cfg: Config, work: Path, store: ObjectStore, log: Any = print) -> dict[str, Any]:
    from edgehaul.edge.model_scorer import ModelScorer
    from edgehaul.edge.scoring import NoveltyScorer
    from edgehaul.training.registry import publish

    contract = load_contract(KIND)
    split = spatial_split(landsat.real_patches(), block=cfg.block, test_share=cfg.test_share, seed=cfg.split_seed)
    batches = edge_stream(split, cfg.stream, batch=cfg.batch, seed=cfg.stream_seed, contract=contract)
    half = len(batches) // 2
    rounds = [batches[:half], batches[half:]]
    stream_labels = np.concatenate([b.column("label").to_numpy() for b in batches])
    mix = {int(c): int(n) for c, n in zip(*np.unique(stream_labels, return_counts=True), strict=True)}
    present = sorted(int(c) for c in np.unique(split.test.labels))
    rare = sorted(present, key=lambda c: mix.get(c, 0))[:3]
    guard = Guard(pixel_hashes(split.test.pixels))
    test_classes = {int(c): int(n) for c, n in zip(*np.unique(split.test.labels, return_counts=True), strict=True)}
    log(f"split: {len(split.train.labels)} train / {len(split.test.labels)} test patches in "
        f"{len(split.test_blocks)} blocks of {cfg.block}x{cfg.block} patches; test classes {test_classes}")
    log(f"stream: {cfg.stream} samples in 2 rounds, class mix {mix}; rarest test classes {rare}")

    t0 = time.perf_counter()
    spools: dict[tuple[str, int], tuple[Spool, list[SpoolEntry]]] = {}
    for r, rb in enumerate(rounds):
        spools["fifo", r] = edge_round(rb, contract, policy_for("fifo", cfg), ConstantScorer(), work / f"fifo{r}")
        spools["random", r] = edge_round(shuffled(rb, r), contract, policy_for("random", cfg), ConstantScorer(),
                                         work / f"random{r}")
    raw = [sum(e.manifest.nbytes for e in spools["fifo", r][1]) for r in (0, 1)]
    log(f"edge: FIFO and random x 2 rounds in {time.perf_counter() - t0:.1f} s; raw bytes per round {raw}")

    def tier_rounds(budget: float) -> None:
        """The tiered edge plans for its budget, so it runs once per budget (one edge: its sketch runs on
        across rounds)."""
        novelty = NoveltyScorer(contract)
        for r, rb in enumerate(rounds):
            spools["tier-novelty", r] = edge_round(rb, contract, policy_for("tier-novelty", cfg, budget), novelty,
                                                   work / f"novelty{r}-{round(budget * 100)}")

    cells: list[Cell] = []

    def finish(cell: Cell, st: ObjectStore, version: int | None) -> None:
        if version is None:
            cell.note = "nothing landed"
            return
        rows = version_rows(st, version)
        guard.check(rows, f"{cell.policy}@{cell.budget:.0%}")
        full = rows.filter(pc.invert(rows.column("is_summary")))
        cell.rows = full.num_rows
        labels = full.column("label").to_numpy()
        labs, cnt = np.unique(labels, return_counts=True)
        cell.class_rows = {int(c): int(n) for c, n in zip(labs, cnt, strict=True)}
        w = (1.0 / np.asarray(full.column("inclusion_p").fill_null(1.0).to_numpy(), dtype=np.float64)
             if "inclusion_p" in full.schema.names else np.ones(len(labels)))
        cell.weighted_mix = {int(c): float(w[labels == c].sum() / w.sum()) for c in labs}
        preds = []
        for seed in cfg.seeds:
            res = train_on(st, version, cell.rows, cfg, seed, f"{cell.policy}-{round(cell.budget * 100)}-s{seed}")
            uri, gate = res
            cell.gate_passed += int(bool(gate.get("passed")))
            preds.append(predict(st, uri, split.test, contract))
            cell.runs.append(scores(split.test.labels, preds[-1], rare))
        cell.ci = {k: interval(split.test.labels, preds, rare, k) for k in ("macro_f1", "rare_recall")}
        log(f"  {cell.policy:13s} {cell.budget:4.0%}: {cell.bytes:>10,} B, {cell.rows:5d} rows "
            f"{cell.class_rows} -> macro-F1 {cell.mean('macro_f1'):.3f} rare recall {cell.mean('rare_recall'):.3f} "
            f"acc {cell.mean('accuracy'):.3f}  ({time.perf_counter() - t0:.0f} s)")
        for q in cell.quarantined:
            log(f"    quarantined: {q}")

    for budget in cfg.budgets:
        tier_rounds(budget)
        for pol in ("fifo", "random", "tier-novelty"):
            cell = Cell(pol, budget)
            cells.append(cell)
            if pol == "random" and budget == 1.0:
                # The same samples as FIFO at 100%, in another order: reported as FIFO's.
                fifo = next(c for c in cells if c.policy == "fifo" and c.budget == 1.0)
                cell.bytes, cell.rows, cell.class_rows, cell.runs = fifo.bytes, fifo.rows, fifo.class_rows, fifo.runs
                cell.weighted_mix, cell.ci, cell.gate_passed = fifo.weighted_mix, fifo.ci, fifo.gate_passed
                cell.note = "same samples as FIFO"
                continue
            st = cell_store(store, f"{pol}-{round(budget * 100)}")
            version = None
            for r in (0, 1):
                sp, order = spools[pol, r]
                sent = within(order, budget * raw[r])
                cell.bytes += sum(e.manifest.nbytes for e in sent)
                v = land_and_commit(st, sp, sent, contract, work / "uplink", cell.quarantined)
                version = v if v is not None else version
            finish(cell, st, version)

        # Closed loop: round 1 as the novelty edge sent it; a model trained on that version is
        # published to the edge and scores round 2.
        cell = Cell("tier-model", budget)
        cells.append(cell)
        st = cell_store(store, f"model-{round(budget * 100)}")
        sp, order = spools["tier-novelty", 0]
        sent = within(order, budget * raw[0])
        cell.bytes = sum(e.manifest.nbytes for e in sent)
        v1 = land_and_commit(st, sp, sent, contract, work / "uplink", cell.quarantined)
        if v1 is None:
            cell.note = "round 1 landed nothing: no model to publish"
            continue
        r1 = version_rows(st, v1)
        guard.check(r1, f"tier-model@{budget:.0%} round 1")
        n1 = r1.num_rows - int(pc.sum(r1.column("is_summary")).as_py() or 0)
        mid = f"round1-{round(budget * 100)}"
        train_on(st, v1, n1, cfg, cfg.seeds[0], mid)
        publish(st, "landcover", mid)  # the registry's own publish: the bench wants the loop closed whatever its gate
        scorer = ModelScorer("latest", st)
        sp2, order2 = edge_round(rounds[1], contract, policy_for("tier-model", cfg, budget), scorer,
                                 work / f"model{round(budget * 100)}")
        sent2 = within(order2, budget * raw[1])
        cell.bytes += sum(e.manifest.nbytes for e in sent2)
        v2 = land_and_commit(st, sp2, sent2, contract, work / "uplink", cell.quarantined)
        finish(cell, st, v2 if v2 is not None else v1)
        shutil.rmtree(work / f"model{round(budget * 100)}", ignore_errors=True)

    stream_share = {c: n / sum(mix.values()) for c, n in mix.items()}
    return {
        "kind": KIND, "config": asdict(cfg), "raw_bytes": sum(raw), "stream_share": stream_share,
        "test_patches": len(split.test.labels),
        "test_classes": test_classes,
        "train_patches": len(split.train.labels), "stream_mix": mix, "rare_classes": rare,
        "guard": {"versions_checked": guard.versions, "rows_checked": guard.rows,
                  "test_hashes": len(guard.test_hashes), "leaks": 0},
        "cells": [asdict(c) | {f"{k}_{s}": (c.mean(k) if s == "mean" else c.spread(k))
                               for k in ("macro_f1", "rare_recall", "accuracy") for s in ("mean", "std")}
                  for c in cells],
        "seconds": time.perf_counter() - t0,
    }


# ---------------------------------------------------------------- report


def _budgets(result: dict[str, Any]) -> list[float]:
    return sorted({c["budget"] for c in result["cells"]})


def mix_gap(cell: dict[str, Any], stream_share: dict[Any, float], key: str = "weighted_mix") -> float:
    """Largest difference, in points, between a cell's class shares and the stream's."""
    got = {int(k): float(v) for k, v in (cell.get(key) or {}).items()}
    if not got:
        return math.nan
    return 100 * max(abs(got.get(int(c), 0.0) - float(v)) for c, v in stream_share.items())


def landed_share(cell: dict[str, Any]) -> dict[int, float]:
    rows = {int(k): int(v) for k, v in (cell.get("class_rows") or {}).items()}
    n = sum(rows.values())
    return {k: v / n for k, v in rows.items()} if n else {}


def verdicts(result: dict[str, Any]) -> list[str]:
    """Plain statements: tiering against FIFO and random per budget (a win or a loss only where the 90%
    intervals do not overlap), the 100% model against every other cell, the 10% target."""
    cells = {(c["policy"], c["budget"]): c for c in result["cells"]}
    budgets = _budgets(result)
    out = []

    def ci(c: dict[str, Any], k: str = "macro_f1") -> tuple[float, float]:
        lo_hi = (c.get("ci") or {}).get(k)
        m = c[f"{k}_mean"]
        return (float(lo_hi[0]), float(lo_hi[1])) if lo_hi else (m, m)

    for b in budgets:
        if ("fifo", b) not in cells or ("random", b) not in cells:
            continue
        base_pol = max(("fifo", "random"), key=lambda p: cells[p, b]["macro_f1_mean"])
        base = cells[base_pol, b]
        for pol in ("tier-novelty", "tier-model"):
            if (pol, b) not in cells:
                continue
            t = cells[pol, b]
            (tl, th), (bl, bh) = ci(t), ci(base)
            word = "beats" if tl > bh else ("loses to" if th < bl else "ties (intervals overlap)")
            out.append(f"{b:4.0%} {pol}: macro-F1 {t['macro_f1_mean']:.3f} [{tl:.3f}, {th:.3f}] {word} the better "
                       f"of FIFO/random ({base_pol} {base['macro_f1_mean']:.3f} [{bl:.3f}, {bh:.3f}])")
    full = cells.get(("fifo", 1.0))
    if full is not None:
        fl, fh = ci(full)
        above = [c for c in result["cells"] if c["budget"] < 1.0 and ci(c)[0] > fh]
        if above:
            out.append("LOUD: the 100% model is NOT the best cell within noise: "
                       + ", ".join(f"{c['policy']}@{c['budget']:.0%} {c['macro_f1_mean']:.3f} [{ci(c)[0]:.3f}, "
                                   f"{ci(c)[1]:.3f}]" for c in above)
                       + f" lie wholly above the 100% model's {full['macro_f1_mean']:.3f} [{fl:.3f}, {fh:.3f}]")
        else:
            out.append(f"the 100% model ({full['macro_f1_mean']:.3f} [{fl:.3f}, {fh:.3f}]) is the best cell within noise")
        if (0.10 in budgets) and ("tier-novelty", 0.10) in cells:
            best10 = max(cells[p, 0.10]["macro_f1_mean"] for p in ("tier-novelty", "tier-model") if (p, 0.10) in cells)
            base10 = max(cells["fifo", 0.10]["macro_f1_mean"], cells["random", 0.10]["macro_f1_mean"])
            met = best10 >= 0.95 * full["macro_f1_mean"] and best10 >= base10
            out.append(f"target at 10%: tiered macro-F1 {best10:.3f} vs 0.95 x the 100% model "
                       f"{0.95 * full['macro_f1_mean']:.3f} and FIFO/random {base10:.3f}: {'MET' if met else 'NOT met'}")
    share = result.get("stream_share")
    if share:
        off = [f"{c['policy']}@{c['budget']:.0%} {mix_gap(c, share):.1f}" for c in result["cells"]
               if c["policy"].startswith("tier") and mix_gap(c, share) > 2.0]
        out.append("weighted class mix of every tiered cell within 2 points of the stream's" if not off else
                   "weighted class mix more than 2 points off the stream's (points): " + ", ".join(off))
    return out


def markdown(result: dict[str, Any]) -> str:
    share = result.get("stream_share") or {}
    lines = [
        "| budget | policy | bytes landed | rows | landed mix off (pts) | weighted mix off (pts) | macro-F1 [90% CI] "
        "| rare recall [90% CI] | accuracy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def pm(c: dict[str, Any], k: str) -> str:
        lo_hi = (c.get("ci") or {}).get(k)
        return f"{c[k + '_mean']:.3f}" + (f" [{lo_hi[0]:.3f}, {lo_hi[1]:.3f}]" if lo_hi else "")

    for c in result["cells"]:
        notes = [c["note"]] if c["note"] else []
        if c["quarantined"]:
            notes.append(f"{len(c['quarantined'])} bundles quarantined")
        note = f" ({'; '.join(notes)})" if notes else ""
        landed = 100 * max((abs(landed_share(c).get(int(k), 0.0) - float(v)) for k, v in share.items()),
                           default=math.nan)
        lines.append(f"| {c['budget']:.0%} | {c['policy']}{note} | {c['bytes']:,} | {c['rows']:,} | {landed:.1f} | "
                     f"{mix_gap(c, share):.1f} | {pm(c, 'macro_f1')} | {pm(c, 'rare_recall')} | "
                     f"{c['accuracy_mean']:.3f} |")
    return "\n".join(lines)


def chart(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = _budgets(result)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, title in zip(axes, ("macro_f1", "rare_recall"),
                              ("macro-F1 (90% bootstrap interval)", f"recall of rarest classes {result['rare_classes']}"),
                              strict=True):
        for pol in POLICIES:
            cs = [c for c in result["cells"] if c["policy"] == pol]
            if not cs:
                continue
            ys = [c[f"{key}_mean"] for c in cs]
            lo = [y - (c.get("ci") or {}).get(key, (y, y))[0] for y, c in zip(ys, cs, strict=True)]
            hi = [(c.get("ci") or {}).get(key, (y, y))[1] - y for y, c in zip(ys, cs, strict=True)]
            ax.errorbar([c["budget"] * 100 for c in cs], ys, yerr=[lo, hi], marker="o", capsize=3, label=pol)
        ax.set_xscale("log")
        ax.set_xticks([b * 100 for b in budgets], [f"{b:.0%}" for b in budgets])
        ax.set_xlabel("link budget (share of raw bytes)")
        ax.set_title(title)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Model quality per uplinked byte, held-out Landsat blocks ({result['test_patches']} real patches)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def readme_section(result: dict[str, Any], table: str, lines: list[str], quick: bool) -> str:
    """README's section, regenerated from a run: what was measured, the table, the chart, the verdict."""
    cfg = result["config"]
    return "\n".join([
        f"{SECTION} (`benchmarks/bench_value.py`)",
        "",
        "What the centre can train when the link carries only part of what the edge sees. Kind: Landsat "
        f"patches (skewed classes), {result['test_patches']} real patches held out by place (blocks of "
        f"{cfg['block']}x{cfg['block']} patches; test classes {result['test_classes']}); none of them, nor a "
        f"generated copy, reaches the edge (checked: {result['guard']['versions_checked']} versions). Stream: "
        f"{cfg['stream']:,} samples in two rounds; per round the link carries a share of the round's raw bytes "
        "in the spool's drain order. Product code end to end (edge path, uplink, Great Expectations, Delta "
        "commit, the `train_model` trainer with early stopping on a held-out stretch of the landed rows). "
        f"Seeds {list(cfg['seeds'])}; intervals are 90% bootstrap over test samples and seeds. "
        + ("**Quick variant** (`EDGEHAUL_BENCH_QUICK=1`): fewer budgets and seeds than the full run; the "
           "full run was not made for these figures. " if quick else "")
        + f"{result['seconds']:.0f} s on 2 shared cores. Daphnet gait and a balanced kind are not yet in "
        "this bench.",
        "",
        table,
        "",
        "![Model quality per uplinked byte](docs/bench-value.png)",
        "",
        "Verdict, as the bench states it:",
        "",
        *[f"- {v}" for v in lines],
        "",
    ])


def write_docs(result: dict[str, Any], table: str, lines: list[str], png: Path, quick: bool) -> None:
    """docs/bench-value.{json,png} and README's section (up to the next heading of the same level)."""
    DOCS.mkdir(exist_ok=True)
    (DOCS / "bench-value.json").write_text(json.dumps({**result, "quick": quick, "verdicts": lines}, indent=1))
    shutil.copyfile(png, DOCS / "bench-value.png")
    text = README.read_text()
    if SECTION in text:
        a = text.index(SECTION)
        nxt = text.find("\n## ", a)
        nxt3 = text.find("\n### ", a + len(SECTION))
        ends = [e for e in (nxt, nxt3) if e != -1]
        b = min(ends) + 1 if ends else len(text)
        text = text[:a] + readme_section(result, table, lines, quick) + "\n" + text[b:]
        README.write_text(text)


def publish_artifacts(result: dict[str, Any], lines: list[str], png: bytes) -> None:
    """The table and the chart as Prefect artifacts of the run (`--flow`); no-ops outside a run."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext

    from edgehaul.platform.reporting import summary_table

    if FlowRunContext.get() is None:
        return
    def ci(c: dict[str, Any], k: str) -> str:
        lo_hi = (c.get("ci") or {}).get(k)
        return f"[{lo_hi[0]:.3f}, {lo_hi[1]:.3f}]" if lo_hi else ""

    rows = [{"budget": f"{c['budget']:.0%}", "policy": c["policy"], "bytes_landed": c["bytes"], "rows": c["rows"],
             "macro_f1": round(c["macro_f1_mean"], 3), "macro_f1_90ci": ci(c, "macro_f1"),
             "rare_recall": round(c["rare_recall_mean"], 3), "rare_recall_90ci": ci(c, "rare_recall"),
             "accuracy": round(c["accuracy_mean"], 3)} for c in result["cells"]]
    summary_table("bench-value", rows, "model quality per uplinked byte, held-out Landsat blocks")
    b64 = base64.b64encode(png).decode()
    create_markdown_artifact(
        "### Model quality per uplinked byte\n\n" + "\n".join(f"- {v}" for v in lines)
        + f"\n\n![macro-F1 by budget](data:image/png;base64,{b64})\n", key="bench-value-chart")


def run(quick: bool) -> dict[str, Any]:
    cfg = QUICK if quick else FULL
    for name in ("edgehaul", "deltalake", "botocore", "great_expectations"):
        logging.getLogger(name).setLevel(logging.WARNING)
    import torch

    torch.set_num_threads(1)
    print(f"value benchmark ({'quick' if quick else 'full'}): {cfg}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-value-") as d:
        root = Path(d)
        with s3_store(root / "stack") as store:
            result = run_experiment(cfg, root / "work", store, log=lambda s: print(s, flush=True))
    table = markdown(result)
    lines = verdicts(result)
    g = result["guard"]
    print("\n" + table + "\n")
    print("\n".join(lines))
    print(f"split guard: {g['test_hashes']} held-out patch hashes, none in the {g['versions_checked']} training "
          f"versions ({g['rows_checked']:,} rows) checked; {result['seconds']:.0f} s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"bench-value{'-quick' if quick else ''}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(table + "\n\n" + "\n".join(f"- {v}" for v in lines) + "\n")
    chart(result, stem.with_suffix(".png"))
    print(f"wrote {stem}.{{json,md,png}}")
    if not quick or "--write-docs" in sys.argv:
        write_docs(result, table, lines, stem.with_suffix(".png"), quick)
        print("wrote docs/bench-value.{json,png} and README's section")
    publish_artifacts(result, lines, stem.with_suffix(".png").read_bytes())
    return result


def main() -> None:
    """`python -m benchmarks value [--quick] [--flow]`; `--flow` runs it as a Prefect flow (PREFECT_API_URL)
    whose artifacts are the table and the chart."""
    quick = os.environ.get("EDGEHAUL_BENCH_QUICK") == "1" or "--quick" in sys.argv
    if "--flow" in sys.argv:
        from prefect import flow

        flow(name="bench_value", log_prints=True)(run)(quick)
    else:
        run(quick)


if __name__ == "__main__":
    main()
