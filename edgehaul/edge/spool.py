"""The durable edge spool: bundles wait here, on local disk, until the core confirms receipt.

Layout under the spool root:
    bundles/<bundle_id>.parquet          bundle bytes (high/normal tier), waiting for uplink
    bundles/<bundle_id>.manifest.json    its manifest (BundleManifest.to_json()), written LAST
    raw/<bundle_id>.parquet + .manifest.json
                                         the local raw store: full low-tier rows (payload kept) whose
                                         summary rows went up in normal bundles; never uplinked, removed
                                         by retention (`raw_ttl_seconds`) or clean-up, counted in the cap
    staging/                             derived intermediates (preprocessed batches for the cache),
                                         counted in the cap, pruned after `staging_ttl_seconds`
    ledger.sqlite                        edgehaul.edge.ledger.Ledger: bounded to LEDGER_SHARE of the cap (at least
                                         LEDGER_FREE_BYTES), oldest rows dropped with a count kept; counted
                                         in the cap beyond its first LEDGER_FREE_BYTES
    spool.sqlite                         acknowledgements (bundle_id, remote key, sha256)

The directory is the index: an entry exists iff its manifest sidecar exists. Writes go to a temp
file, fsync, rename, fsync of the directory, bundle first and sidecar last, so a kill -9 at any
point leaves either a complete entry or leftovers that `Spool(...)` removes when it opens. The
sidecar's mtime is the spooling time (from the injectable clock), which drives TTL and ordering.
Mutations hold an exclusive `flock` on `<root>/.lock`, so the ingest flow and the uplink drain
can share a spool from separate processes.

Cap and watermarks (clean-up from 80% of the cap, alert at 85%): a write is admitted only if it fits
under the cap after clean-up, so the spool never exceeds its cap. At >= cleanup_watermark, clean-up removes expired
entries, stale staging files, then raw-store entries lowest value first, until the spool is back
under the clean-up watermark (bundles waiting for uplink are not touched by clean-up). At
>= alert_watermark after a write, `edgehaul.spool.watermark` (level 2) is emitted once per
upward crossing (a flag in spool.sqlite: once for every process that opens the spool), and appended
to the node's outbox (`edgehaul.edge.outbox`) when the spool has one (`from_block` opens it), so the
alert is kept in order while the central API is out of reach.
When a write would still not fit: `reject-new` refuses it; `drop-lowest-value` drops waiting
bundles of lower value (tier first, then max_value, oldest first) if that frees enough, else refuses.
Every refused, dropped, evicted or expired sample goes to the ledger.
When the link cannot carry what waits, `thin_to` thins the waiting bundles at random (a simple random sample of
the full rows, of the size the capacity holds: each row's inclusion_p multiplied by k/n, the rest moved to the raw
store): the order of
`pending()` decides only what goes first, never which rows a short link leaves out.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import itertools
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from edgehaul import events
from edgehaul.bundles import BundleError, BundleGone, BundleManifest, full_rows, read_bundle, write_bundle
from edgehaul.contracts import INCLUSION_P, contract_by_id, tier_rank
from edgehaul.edge import ledger
from edgehaul.edge.ledger import Ledger
from edgehaul.edge.outbox import PRIO_ALERT_L2, Outbox, node_outbox
from edgehaul.edge.tiering import bundle_cuts, uniforms
from edgehaul.platform.private_files import fsync_dir

if TYPE_CHECKING:
    from edgehaul.blocks.policies import EdgeNode

log = logging.getLogger(__name__)

FULL_POLICIES = ("reject-new", "drop-lowest-value")
# The reject ledger's bound: this share of the cap, at least LEDGER_FREE_BYTES, which the cap does not count
# (so a small spool's accounting never crowds out its bundles); beyond that, every ledger byte counts.
LEDGER_SHARE = 0.05
LEDGER_FREE_BYTES = 1 << 20
STAGE_RAW = "spool-raw"  # ledger stage of the raw store (low-tier payloads; their summaries were kept)
_SIDECAR = ".manifest.json"
_TMP = ".tmp"


FIT_ROUNDS = 8  # thin_to's further fixed-size draws while packing leaves it over, each a row fewer at least
PACKED_SCALE_BYTES = 8 << 20  # bundle bytes thin_to reads and packs to price a packed row


@dataclass
class ThinResult:
    """One thinning: the keep probability, its salt, bundles rewritten, full rows kept / moved out, and summary rows
    dropped (the rows they summarise wait in the raw store)."""

    keep: float
    salt: str
    bundles: int = 0
    rows_kept: int = 0
    rows_out: int = 0
    summaries_out: int = 0



def _pack_limit(pack_bytes: int | None, largest: int, pack_rows: int | None) -> float:
    """A packed bundle's byte limit: `pack_bytes` (what one pass carries in a few bundles), never under the largest
    bundle it replaces (a node already sends bundles that size); none where only `pack_rows` is set."""
    if pack_bytes is None and pack_rows:
        return math.inf
    return max(pack_bytes or 0, largest)


def _solve_keep(entries: list[SpoolEntry], overhead: dict[str, int], room: float,
                pack_rows: int | None = None, drawn_rows: dict[str, int] | None = None,
                pack_bytes: int | None = None, row_scale: dict[str, float] | None = None) -> float:
    """keep in [0, 1] with E[bytes after `Spool.thin`] = room: per contract (`thin_to` packs every tier of a
    contract together), the rows' bytes times keep plus one fixed part per packed bundle (as many as the rows
    kept need at `pack_rows` a bundle, or their bytes at `_pack_limit` a bundle, whichever is more). Of each
    bundle, `drawn_rows` of its rows are drawn from (default: all), the others packed whole (an urgent bundle's, or
    a pack's urgent rows), its bytes apportioned by rows, times `row_scale` of its contract (what a row costs packed
    over what it cost in its bundle). Summary rows are thinned with the same keep (`Spool.thin`)."""
    if room <= 0:
        return 0.0
    groups: dict[str, tuple[float, float, float, float, float, int]] = {}
    for e in entries:
        m = e.manifest
        o = float(overhead.get(m.contract, 0))
        g = m.contract
        rows, body, rows1, body1, _, largest = groups.get(g, (0.0, 0.0, 0.0, 0.0, o, 0))
        drawn = m.row_count if drawn_rows is None else drawn_rows.get(e.bundle_id, m.row_count)
        per_row = max(m.nbytes - o, 0.0) / max(m.row_count, 1) * (row_scale or {}).get(g, 1.0)
        rows, body = rows + drawn, body + drawn * per_row
        rows1, body1 = rows1 + m.row_count - drawn, body1 + (m.row_count - drawn) * per_row
        groups[g] = (rows, body, rows1, body1, o, max(largest, m.nbytes))

    def packs(rows: float, body: float, o: float, largest: int) -> int:
        by_bytes = math.ceil(body / max(_pack_limit(pack_bytes, largest, pack_rows) - o, 1.0) - 1e-9)
        return max(by_bytes, math.ceil(rows / pack_rows - 1e-9) if pack_rows else 1 if rows > 0 else 0)

    def expected(k: float) -> float:
        return sum(k * body + body1 + packs(k * rows + rows1, k * body + body1, o, largest) * o
                   for rows, body, rows1, body1, o, largest in groups.values())

    if expected(1.0) <= room:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):  # expected() is monotone in k
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid) <= room else (lo, mid)
    return lo


def _thinnable(t: pa.Table, bundle_tier: str, tiers: tuple[str, ...]) -> np.ndarray:
    """The rows of a waiting bundle that a thinning of `tiers` draws from, by each row's own tier (a sampled low row
    rides as normal): a pack of urgent and normal rows is an urgent bundle, and its normal rows must still be
    thinned while its urgent rows are kept whole (a 5% digits pass packed into one urgent bundle 131 B over the link
    had nothing left to thin, and sent nothing)."""
    if bundle_tier != "high":
        return np.full(t.num_rows, bundle_tier in tiers)
    urgent = pc.fill_null(pc.equal(t.column("tier"), "high"), True).to_numpy(zero_copy_only=False)
    return np.where(urgent, "high" in tiers, "normal" in tiers)


def _times_keep(kept: pa.Table, full: np.ndarray, keep: float) -> pa.Table:
    """The rows a thinning keeps, each `full` row's inclusion_p times `keep` (its chance of having stayed)."""
    if not kept.num_rows:
        return kept
    p = kept.column(INCLUSION_P).to_numpy(zero_copy_only=False).astype(np.float64)
    p = np.where(full, p * keep, p).astype(np.float32)
    return kept.set_column(kept.schema.get_field_index(INCLUSION_P), kept.schema.field(INCLUSION_P),
                           pa.array(p, pa.float32()))


class _ThinnedOut:
    """The rows a thinning leaves on the node, to the raw store in few bundles: one per thinned bundle filled the
    raw store with small files (Landsat at 25%: hundreds a pass), and each put counts the spool's files. A thinned
    bundle is released to packing only once the raw bundle holding its rows is written; refused (the log says
    why; no ledger row, as no sample left), it stays whole."""

    MAX_ROWS = 50_000
    MAX_BYTES = 32 * 1024 * 1024

    def __init__(self, spool: Spool, salt: str) -> None:
        self.spool, self.salt = spool, salt
        self.waiting: dict[tuple[str, str, str], list[tuple[SpoolEntry, pa.Table, pa.Table, int]]] = {}
        self.size: dict[tuple[str, str, str], tuple[int, int]] = {}  # rows and bytes waiting per key
        self.written: dict[tuple[str, str, str], list[SpoolEntry]] = {}  # raw bundles written, per key

    def add(self, e: SpoolEntry, gone: pa.Table, kept: pa.Table,
            rows_kept: int) -> list[tuple[SpoolEntry, pa.Table, int, int]]:
        """(bundle, kept rows, rows out, full rows kept) of the bundles now released."""
        if not gone.num_rows:
            return [(e, kept, 0, rows_kept)]
        m = e.manifest
        key = (m.contract, m.policy_version, m.team)
        self.waiting.setdefault(key, []).append((e, gone, kept, rows_kept))
        rows, nbytes = self.size.get(key, (0, 0))
        self.size[key] = rows + gone.num_rows, nbytes + gone.nbytes
        if self.size[key][0] >= self.MAX_ROWS or self.size[key][1] >= self.MAX_BYTES:
            return self._flush(key)
        return []

    def flush_all(self) -> list[tuple[SpoolEntry, pa.Table, int, int]]:
        return [ready for key in list(self.waiting) for ready in self._flush(key)]

    def _flush(self, key: tuple[str, str, str]) -> list[tuple[SpoolEntry, pa.Table, int, int]]:
        parts = self.waiting.pop(key)
        self.size.pop(key, None)
        contract_id, version, team = key
        data, man = write_bundle(pa.concat_tables([g for _, g, _, _ in parts]), contract_by_id(contract_id),
                                 tier="low", policy_fingerprint=f"thinned-out|{self.salt}", policy_version=version,
                                 scorer_version=",".join(sorted({e.manifest.scorer_version for e, _, _, _ in parts})),
                                 team=team)
        # refused, the rows stay in their bundles, which stay whole: nothing left the node's normal path
        entry = self.spool.put(data, man, ledger_refusal=False)
        if entry is None:
            return []
        self.written.setdefault(key, []).append(entry)
        return [(e, kept, g.num_rows, n) for e, g, kept, n in parts]

    def undo(self, key: tuple[str, str, str]) -> int:
        """Take back the raw bundles written for `key`, whose bundles stay whole (their packs found no room): their
        rows still wait there. A raw bundle still on disk would keep each row twice on the node; one the clean-up
        evicted meanwhile (a pack's write evicts the raw store before it gives up) left its rows in the ledger as
        evicted while they wait to be sent. Both are undone. Returns the rows taken back."""
        gone = self.written.pop(key, [])
        with self.spool._locked():
            for r in gone:
                self.spool._remove(r)
            self.spool.ledger.forget([r.bundle_id for r in gone], stage=STAGE_RAW)
        return sum(r.manifest.row_count for r in gone)


def _draw_size(keep: float, first: bool, n: int) -> int:
    """Rows a fixed-size thinning draw keeps of `n`: keep x n rounded, plus one, for the first draw; a later one (the
    packing left the pass over) keep x n rounded too, and at least one row fewer. Never under: a draw that overruns
    is cut a row at a time by the next round, where one that falls short can add no row back. A later round's solve
    prices rows by the packs the overrun split, a footer each: rounded down, 8.8 rows kept 8 where 9 fit (digits at
    2%: 2,734 B of a 2,872 B pass, where random's 9 rows packed to 2,825-2,857)."""
    return max(0, min(n, round(keep * n) + 1) if first else min(n - 1, round(keep * n)))


class SpoolError(RuntimeError):
    """A spool operation cannot be done as asked (bad input, unknown bundle, checksum mismatch)."""


class NoRoom(SpoolError):
    """A thinning's packs found no room in the spool (over its cap, as after the cap was lowered, and nothing it may
    displace); the bundles they would have replaced stay whole."""


class NoSuchBundle(SpoolError, BundleGone):
    """The spool holds no bundle of that id (sent, thinned or dropped since it was listed)."""


class CorruptBundle(SpoolError, BundleGone):
    """A spooled bundle's bytes no longer match its manifest's SHA-256 (the disk changed them). Raised once the
    spool has dropped it and ledgered its samples (`CORRUPT`): no copy is left to send."""


@dataclass(frozen=True)
class SpoolEntry:
    bundle_id: str
    tier: str
    max_value: float
    created_at: float
    path: Path
    manifest: BundleManifest
    nbytes: int


@dataclass(frozen=True)
class SpoolUsage:
    used_bytes: int
    cap_bytes: int
    fraction: float


def _atomic_write(path: Path, data: bytes, *, mtime: float | None = None) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}{_TMP}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    if mtime is not None:
        os.utime(tmp, ns=(int(mtime * 1e9), int(mtime * 1e9)))
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _value_key(e: SpoolEntry) -> tuple[int, float, float]:
    """Lower sorts first = cheaper to lose: low tier, then smaller max_value, then oldest."""
    return (-tier_rank(e.tier), e.max_value, e.created_at)


class Spool:
    def __init__(
        self,
        root: Path,
        *,
        cap_bytes: int,
        cleanup_watermark: float = 0.80,
        alert_watermark: float = 0.85,
        full_policy: str = "drop-lowest-value",
        ttl_seconds: float = 7 * 86400,
        node_id: str = "",
        clock: Callable[[], float] = time.time,
        raw_ttl_seconds: float | None = None,
        staging_ttl_seconds: float = 86400,
        emit: Callable[..., bool] | None = None,
        outbox: Outbox | None = None,
    ) -> None:
        if cap_bytes <= 0:
            raise SpoolError(f"cap_bytes must be > 0, got {cap_bytes}")
        if not 0 < cleanup_watermark < alert_watermark <= 1:
            raise SpoolError(f"watermarks must satisfy 0 < cleanup ({cleanup_watermark}) < alert ({alert_watermark}) <= 1")
        if full_policy not in FULL_POLICIES:
            raise SpoolError(f"full_policy {full_policy!r} is not one of {FULL_POLICIES}")
        self.root = Path(root)
        self.cap_bytes = int(cap_bytes)
        self.cleanup_watermark = cleanup_watermark
        self.alert_watermark = alert_watermark
        self.full_policy = full_policy
        self.ttl_seconds = float(ttl_seconds)
        self.raw_ttl_seconds = float(raw_ttl_seconds if raw_ttl_seconds is not None else ttl_seconds)
        self.staging_ttl_seconds = float(staging_ttl_seconds)
        self.node_id = node_id
        self.clock = clock
        self._fixed_parts: dict[str, int] = {}  # per contract: `fixed_part`
        # How alerts leave: edgehaul.events.emit (Prefect events) unless a test passes a recorder.
        self._emit = emit or events.emit
        self.outbox = outbox
        self.bundles_dir = self.root / "bundles"
        self.raw_dir = self.root / "raw"
        self.staging_dir = self.root / "staging"
        for d in (self.bundles_dir, self.raw_dir, self.staging_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.ledger = Ledger(self.root / "ledger.sqlite", clock=clock,
                             max_bytes=max(LEDGER_FREE_BYTES, int(self.cap_bytes * LEDGER_SHARE)))
        self._acks = sqlite3.connect(self.root / "spool.sqlite", timeout=30.0, check_same_thread=False, isolation_level=None)
        self._acks.execute("PRAGMA journal_mode=WAL")
        self._acks.execute("PRAGMA synchronous=FULL")
        self._acks.execute(
            "CREATE TABLE IF NOT EXISTS acks (bundle_id TEXT PRIMARY KEY, remote_key TEXT, sha256 TEXT, at REAL)"
        )
        # "above the alert watermark" is the spool's state, not one opener's: every batch task and drain opens
        # its own Spool, and a crossing must alert once, not once per opener
        self._acks.execute("CREATE TABLE IF NOT EXISTS flags (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
        self._acks.execute("INSERT OR IGNORE INTO flags VALUES ('alerted', 0)")
        self._tlock = threading.RLock()
        self._cache: dict[Path, tuple[int, int, SpoolEntry]] = {}
        self.alerts: list[dict[str, float | int | str]] = []  # watermark alerts emitted by this instance
        with self._locked():
            self.recovered = self._recover()

    @classmethod
    def from_block(cls, node: EdgeNode, clock: Callable[[], float] = time.time) -> Spool:
        return cls(
            Path(node.spool_dir),
            cap_bytes=node.spool_cap_bytes,
            cleanup_watermark=node.cleanup_watermark,
            alert_watermark=node.alert_watermark,
            full_policy=node.full_policy,
            ttl_seconds=node.bundle_ttl_seconds,
            node_id=node.node_id,
            clock=clock,
            outbox=node_outbox(node.spool_dir, node.node_id),
        )

    # ---- locking and recovery -------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._tlock:
            fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def _recover(self) -> int:
        """Remove what a crash can leave: temp files, bundles without sidecar, entries whose bytes
        do not match the manifest's size. Returns how many files were removed."""
        removed = 0
        for d in (self.bundles_dir, self.raw_dir, self.staging_dir):
            for p in d.iterdir():
                if p.name.endswith(_TMP):
                    p.unlink(missing_ok=True)
                    removed += 1
            if d is self.staging_dir:
                continue
            for p in d.glob("*.parquet"):
                if not self._sidecar(p).exists():
                    p.unlink(missing_ok=True)
                    removed += 1
            for side in d.glob(f"*{_SIDECAR}"):
                data = side.with_name(side.name.removesuffix(_SIDECAR) + ".parquet")
                try:
                    manifest = BundleManifest.from_json(side.read_bytes())
                except BundleError:
                    manifest = None
                if manifest is None or not data.exists() or data.stat().st_size != manifest.nbytes:
                    if manifest is not None:
                        self.ledger.record(manifest.sample_ids, stage=ledger.STAGE_SPOOL, reason=ledger.CORRUPT,
                                           bundle_id=manifest.bundle_id, detail="found incomplete at open")
                    side.unlink(missing_ok=True)
                    data.unlink(missing_ok=True)
                    removed += 1
            fsync_dir(d)
        if removed:
            log.info("spool %s: removed %d leftover files at open", self.root, removed)
        return removed

    # ---- listing ----------------------------------------------------------------------------

    @staticmethod
    def _sidecar(data_path: Path) -> Path:
        return data_path.with_name(data_path.name.removesuffix(".parquet") + _SIDECAR)

    def _load(self, side: Path) -> SpoolEntry | None:
        try:
            st = side.stat()
        except FileNotFoundError:
            return None
        hit = self._cache.get(side)
        if hit and hit[0] == st.st_mtime_ns and hit[1] == st.st_size:
            return hit[2]
        try:
            manifest = BundleManifest.from_json(side.read_bytes())
        except (BundleError, FileNotFoundError):
            return None
        path = side.with_name(side.name.removesuffix(_SIDECAR) + ".parquet")
        entry = SpoolEntry(
            bundle_id=manifest.bundle_id, tier=manifest.tier, max_value=manifest.max_value,
            created_at=st.st_mtime_ns / 1e9, path=path, manifest=manifest, nbytes=manifest.nbytes + st.st_size,
        )
        self._cache[side] = (st.st_mtime_ns, st.st_size, entry)
        return entry

    def _entries(self, d: Path) -> list[SpoolEntry]:
        out = []
        for side in d.glob(f"*{_SIDECAR}"):
            e = self._load(side)
            if e is not None:
                out.append(e)
        return out

    def pending(self) -> list[SpoolEntry]:
        """Bundles waiting for uplink: high tier first, then max_value desc, then oldest."""
        with self._tlock:
            entries = self._entries(self.bundles_dir)
            return sorted(entries, key=lambda e: (tier_rank(e.tier), -e.max_value, e.created_at))

    def raw_entries(self) -> list[SpoolEntry]:
        """The local raw store (low-tier rows with their payload), oldest first."""
        with self._tlock:
            return sorted(self._entries(self.raw_dir), key=lambda e: e.created_at)

    def get(self, bundle_id: str) -> SpoolEntry | None:
        with self._tlock:
            for d in (self.bundles_dir, self.raw_dir):
                e = self._load(d / f"{bundle_id}{_SIDECAR}")
                if e is not None:
                    return e
            return None

    def read(self, bundle_id: str) -> bytes:
        """The bundle's bytes, checked against its manifest's SHA-256. A bundle corrupt on disk is dropped, its
        samples ledgered (`CORRUPT`) and an error logged before CorruptBundle is raised: the node holds no other copy,
        and one bad file must stop neither a pass's thinning nor its drain (it went to the retry queue, was read
        corrupt again at every retry and expired as `retry-expired`, the cause lost)."""
        e = self.get(bundle_id)
        if e is None:
            raise NoSuchBundle(f"spool {self.root}: no bundle {bundle_id}")
        try:
            data = e.path.read_bytes()
        except FileNotFoundError as exc:  # sent or thinned between the listing and the read
            raise NoSuchBundle(f"spool {self.root}: bundle {bundle_id} is gone") from exc
        digest = hashlib.sha256(data).hexdigest()
        if digest != e.manifest.sha256:
            problem = (f"spool {self.root}: bundle {bundle_id} corrupt on disk (sha256 {digest[:12]}, manifest "
                       f"{e.manifest.sha256[:12]})")
            with self._locked():
                if self.get(bundle_id) is not None:  # not dropped meanwhile by another reader
                    self._drop(e, ledger.STAGE_SPOOL, ledger.CORRUPT, detail=problem)
                    log.error("%s: dropped, its %d samples ledgered as %s", problem, e.manifest.row_count,
                              ledger.CORRUPT)
            raise CorruptBundle(problem)
        return data

    def _read_waiting(self, e: SpoolEntry, columns: list[str] | None = None) -> pa.Table | None:
        """A waiting bundle's rows for a thinning; None where it is gone (sent meanwhile) or corrupt on disk (`read`
        has dropped and ledgered it): the pass thins the rest."""
        try:
            return read_bundle(self.read(e.bundle_id), e.manifest, columns=columns)
        except SpoolError:
            return None

    def usage(self) -> SpoolUsage:
        used = 0
        for d in (self.bundles_dir, self.raw_dir, self.staging_dir):
            with os.scandir(d) as it:
                for f in it:
                    with contextlib.suppress(FileNotFoundError):
                        used += f.stat().st_size
        used += max(0, self.ledger.used_bytes() - LEDGER_FREE_BYTES)
        return SpoolUsage(used, self.cap_bytes, used / self.cap_bytes)

    def is_acked(self, bundle_id: str) -> bool:
        with self._tlock:
            return self._acks.execute("SELECT 1 FROM acks WHERE bundle_id=?", (bundle_id,)).fetchone() is not None

    # ---- writes -----------------------------------------------------------------------------

    def put(self, data: bytes, manifest: BundleManifest, *, ledger_refusal: bool = True,
            replacing: int = 0) -> SpoolEntry | None:
        """Spool a bundle (tier low goes to the raw store). Idempotent on bundle_id; returns None
        when refused (the ledger says why, unless `ledger_refusal` is False: a caller that still holds the
        samples elsewhere, whose refusal loses nothing) or when that bundle was already acknowledged.
        `replacing`: bytes of waiting bundles this write replaces, removed once it is written (a thinning's
        packing), counted as free: a full spool must still be able to thin, or its pass would send nothing."""
        if len(data) != manifest.nbytes or hashlib.sha256(data).hexdigest() != manifest.sha256:
            raise SpoolError(f"bundle {manifest.bundle_id}: bytes do not match the manifest "
                             f"({len(data)} bytes, manifest {manifest.nbytes})")
        side_bytes = manifest.to_json()
        need = len(data) + len(side_bytes)
        d = self.raw_dir if manifest.tier == "low" else self.bundles_dir
        with self._locked():
            existing = self._load(d / f"{manifest.bundle_id}{_SIDECAR}")
            if existing is not None:
                return existing
            if d is self.bundles_dir and self.is_acked(manifest.bundle_id):
                log.info("bundle %s already acknowledged; not spooled again", manifest.bundle_id)
                return None
            if need > self.cap_bytes:
                self._refuse(manifest, ledger.TOO_LARGE, f"{need} bytes > cap {self.cap_bytes}", ledger_refusal)
                return None
            before = self._make_room(need - min(replacing, need), manifest)
            if before is None:
                used = self.usage().used_bytes
                self._refuse(manifest, ledger.FULL_REJECTED,
                             f"policy {self.full_policy}: {need} bytes do not fit ({used}/{self.cap_bytes} used)",
                             ledger_refusal)
                return None
            now = self.clock()
            path = d / f"{manifest.bundle_id}.parquet"
            _atomic_write(path, data)
            _atomic_write(self._sidecar(path), side_bytes, mtime=now)
            entry = self._load(self._sidecar(path))
            # the lock is held since the count: what changed is these two files (a second scan per put made a
            # pass's thinning quadratic in the files of a large raw store)
            usage = SpoolUsage(before + need, self.cap_bytes, (before + need) / self.cap_bytes)
        self._check_alert(usage)
        return entry

    def thin(self, keep: float, *, salt: str, tiers: tuple[str, ...] = ("normal",),
             skip: frozenset[str] = frozenset(), pack_rows: int | None = None,
             pack_with: tuple[str, ...] = (), repack: bool = False,
             keep_rows: int | Callable[[int], int] | None = None, pack_bytes: int | None = None) -> ThinResult:
        """Random thinning of the bundles waiting in `tiers`, for a link that cannot carry what was planned: each
        full row stays with probability `keep` (u(salt, sample id) < keep, independent of the tier draw) and its
        inclusion_p is multiplied by `keep`, so the rows that land still know their chance of landing; the rows
        thinned out move to the raw store with their payload (kept on the node, as rows never drawn), those of many
        bundles together (`_ThinnedOut`). A summary row stays with probability `keep` too (its inclusion_p, its row's
        chance of travelling in full, unchanged); one thinned out is dropped, as the row it summarises waits in the
        raw store. Never a cut by drain order: that would land only the top of the value ranking.

        The rows that stay are packed into as few bundles as their bytes allow, per tier and writer: each at most
        `pack_bytes` (never under the largest bundle it replaces; with only `pack_rows` set, no byte bound) and, where
        set, `pack_rows` rows. Rows are drawn by their own tier: an urgent pack's normal rows are thinned while its
        urgent rows are kept whole (`_thinnable`). A bundle's fixed
        Parquet part (footer, page headers) costs as much as a dozen small rows: thinning twenty bundles to two rows
        each would spend the link on footers, and so did packing by the originals' row count (a 5% digits pass of 18
        rows went as 16 + 2, the second bundle 1.7 KB for two rows of 130 B).
        Thinning urgent and normal bundles together (`tiers` both: the urgent ones are then sampled with the rest)
        packs their rows together too, urgent rows first, a packed bundle urgent when it holds an urgent row: a
        bundle of one to four urgent rows per batch paid a whole footer (at a 2% budget, most of its bytes). The
        bundles of `pack_with` tiers are packed the same way but keep every row and its p (urgent bundles while
        only the normal tier is thinned: what waits crosses in this pass or not at all, so their own footers buy
        no latency; gait at 5% spent 46% of a pass on four urgent bundles of nine rows). With `repack`, a keep of 1
        still packs (what waits fits once its rows share footers: ten digits bundles of 1-7 rows, 27.5 KB, are 12 KB
        in three). A packed bundle's scorer_version lists those of the bundles its rows come from.

        `keep_rows`: a draw of fixed size instead (`keep` is then ignored): exactly that many of the full rows in
        `tiers` stay (a function of how many wait: sized in the same read; nothing done where none waits), those
        with the smallest u(salt, sample id), a simple random sample without replacement, so each row's inclusion_p
        is multiplied by keep_rows / rows (its exact chance, given the rows that waited)."""
        if not 0.0 <= keep <= 1.0:
            raise SpoolError(f"thinning keep {keep} is outside [0, 1]")
        pack_with = tuple(t for t in pack_with if t not in tiers)
        every = (*tiers, *pack_with)
        cut = 2.0  # u below or at it stays (a Poisson draw: u < keep)
        hashed: dict[str, np.ndarray] = {}  # u per waiting bundle, hashed once for the cut and the draw
        if keep_rows is not None:
            fixed = self._fixed_size_cut(tiers, every, skip, salt, keep_rows)
            if fixed is None:
                return ThinResult(keep=1.0, salt=salt)
            hashed, keep, cut = fixed
        out = ThinResult(keep=keep, salt=salt)
        if keep >= 1.0 and not repack:
            return out
        merged = len(set(every)) > 1
        groups: dict[tuple[str, ...], list[tuple[SpoolEntry, pa.Table]]] = {}
        thinned_out = _ThinnedOut(self, salt)

        order: list[str] = []  # drain order, which packing keeps (urgent rows first), whenever a bundle is released
        released: dict[str, tuple[SpoolEntry, pa.Table, int, int]] = {}
        for e in self.pending():
            if e.tier not in every or e.bundle_id in skip:
                continue
            t = self._read_waiting(e)
            if t is None:
                continue
            order.append(e.bundle_id)
            u = hashed.pop(e.bundle_id) if e.bundle_id in hashed else np.asarray(uniforms(t.column("sample_id"), salt))
            full = full_rows(t)
            drawn_from = _thinnable(t, e.tier, tiers)
            row_keep = np.where(drawn_from, keep, 1.0)
            drawn = ~drawn_from | ((u <= cut) if keep_rows is not None else (u < keep))
            # a summary stays with the same chance; one thinned out is dropped (the row it summarises is in the raw
            # store): kept whole, summaries outweighed a tight pass and every full row was thinned away for them
            stay = np.where(full, drawn, u < row_keep)
            kept = _times_keep(t.filter(pa.array(stay)), (full & drawn_from)[stay], keep)
            released.update((r[0].bundle_id, r) for r in thinned_out.add(e, t.filter(pa.array(full & ~stay)), kept,
                                                                       int(full[stay].sum())))
        released.update((r[0].bundle_id, r) for r in thinned_out.flush_all())
        for bundle_id in (b for b in order if b in released):
            e, kept, rows_out, rows_kept = released[bundle_id]
            m = e.manifest  # scorer versions differ batch to batch; drain order puts urgent rows first
            groups.setdefault((m.contract, "+".join(every) if merged else e.tier, m.policy_version, m.team),
                              []).append((e, kept))
            out.bundles, out.rows_out, out.rows_kept = out.bundles + 1, out.rows_out + rows_out, out.rows_kept + rows_kept
            out.summaries_out += m.row_count - rows_out - kept.num_rows
        keys = list(groups)
        for i, key in enumerate(keys):
            try:
                self._write_packs(key, groups[key], salt=salt, every=every, merged=merged, pack_rows=pack_rows,
                                  pack_bytes=pack_bytes)
            except NoRoom:
                # this group and those after it stay whole (the packs already written were removed): the raw
                # bundles of their thinned-out rows go too, or each of those rows would wait on the node twice
                undone = sum(thinned_out.undo((k[0], k[2], k[3])) for k in keys[i:])
                log.warning("spool %s: %d thinned-out rows taken back out of the raw store (their bundles stay "
                            "whole)", self.node_id or self.root, undone)
                raise
        if out.bundles:
            log.info("spool %s: thinned %d bundles to keep %.4f: %d full rows stay, %d to the raw store, %d summaries "
                     "dropped", self.node_id or self.root, out.bundles, keep, out.rows_kept, out.rows_out,
                     out.summaries_out)
        return out

    def _write_packs(self, key: tuple[str, ...], parts: list[tuple[SpoolEntry, pa.Table]], *, salt: str,
                     every: tuple[str, ...], merged: bool, pack_rows: int | None,
                     pack_bytes: int | None) -> None:
        """The rows kept of one group's bundles, packed into bundles of at most `_pack_limit` bytes (each row
        reckoned at its bundle's bytes per row, the fixed part aside) and `pack_rows` rows, replace those bundles."""
        contract_id, tier, version, team = key
        scorer = ",".join(sorted({e.manifest.scorer_version for e, _ in parts}))
        stays = [(e, k) for e, k in parts if k.num_rows]
        rows = pa.concat_tables([k for _, k in stays]) if stays else pa.table({})
        fixed = self.fixed_part(parts[0][0])
        # a row reckoned at its bundle's bytes per row (rounded down: a bundle's rows always fit one pack again)
        row_bytes = np.concatenate([np.zeros(0, dtype=np.int64), *(
            np.full(k.num_rows, max(e.manifest.nbytes - fixed, 0) // max(e.manifest.row_count, 1), dtype=np.int64)
            for e, k in stays)])
        contract = contract_by_id(contract_id)  # its caps: what a core accepts of a bundle
        limit = min(_pack_limit(pack_bytes, max(e.manifest.nbytes for e, _ in parts), pack_rows),
                    contract.max_bundle_bytes) - fixed
        max_rows = pack_rows or contract.max_rows
        cuts = bundle_cuts(row_bytes, max_rows, int(max(limit, 1)))
        bounds = [0, *cuts, rows.num_rows] if rows.num_rows else [0]

        def pack(a: int, b: int) -> tuple[bytes, BundleManifest]:
            chunk = rows.slice(a, b - a)
            chunk_tier = tier
            if merged:  # the most urgent packed tier among its rows (a sampled low row rides as normal)
                present = set(pc.unique(chunk.column("tier")).to_pylist()) & set(every)
                chunk_tier = min(present, key=tier_rank) if present else max(every, key=tier_rank)
            return write_bundle(chunk, contract, tier=chunk_tier, policy_fingerprint=f"thinned|{salt}",
                                policy_version=version, scorer_version=scorer, team=team)

        packs: dict[tuple[int, int], tuple[bytes, BundleManifest]] = {}
        if len(bounds) > 2 and bounds[-1] - bounds[-3] <= max_rows:
            # rows are reckoned at their bundles' bytes per row, and small bundles carry a row in more than a pack
            # does: the last pack may be a row or two cut off for nothing, paying a footer of its own (digits at
            # 2%: 9 rows cut into packs of 2,738 + 1,719 B for a 2,872 B pass, which as one took 2,865 B)
            joined = pack(bounds[-3], bounds[-1])
            if len(joined[0]) <= limit + fixed:
                bounds = [*bounds[:-2], bounds[-1]]
                packs[(bounds[-2], bounds[-1])] = joined
        credit = sum(self._bytes_on_disk(e) for e, _ in parts)  # the packs replace these bundles and sidecars
        written: list[SpoolEntry] = []
        for a, b in itertools.pairwise(bounds):
            data, man = packs.pop((a, b)) if (a, b) in packs else pack(a, b)
            packed = self.put(data, man, ledger_refusal=False, replacing=credit)
            if packed is None:  # the packs written hold copies of rows their bundles still hold
                with self._locked():
                    for w in written:
                        self._remove(w)
                raise NoRoom(f"spool {self.root}: no room for a thinned bundle of {len(parts)} bundles "
                             f"({len(data)} bytes); they stay whole")
            credit, written = max(0, credit - len(data) - len(man.to_json())), [*written, packed]
        with self._locked():
            for e, _ in parts:
                # Recorded like an acknowledgement: a rerun of the batch that built it never spools it again.
                self._acks.execute("INSERT OR REPLACE INTO acks VALUES (?,?,?,?)",
                                   (e.bundle_id, f"thinned:{salt}", e.manifest.sha256, self.clock()))
                self._remove(e)

    def _fixed_size_cut(self, tiers: tuple[str, ...], every: tuple[str, ...], skip: frozenset[str], salt: str,
                        keep_rows: int | Callable[[int], int]) -> tuple[dict[str, np.ndarray], float, float] | None:
        """(u per waiting bundle, keep, the u at or under which a full row stays) of a draw of `keep_rows` of the
        full rows of `tiers` in the bundles of `every` (a function of how many wait: sized in the same read); None
        where it is one and no such row waits."""
        hashed, u_all = self._waiting_uniforms(tiers, every, skip, salt)
        if callable(keep_rows):
            if not len(u_all):
                return None
            keep_rows = keep_rows(len(u_all))
        if not 0 <= keep_rows <= len(u_all):
            raise SpoolError(f"thinning keep_rows {keep_rows} is outside [0, {len(u_all)}] waiting rows")
        keep = keep_rows / len(u_all) if len(u_all) else 1.0
        return hashed, keep, float(np.sort(u_all)[keep_rows - 1]) if keep_rows else -1.0

    def _waiting_uniforms(self, tiers: tuple[str, ...], every: tuple[str, ...], skip: frozenset[str],
                          salt: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """u(salt, sample id) of every row of the bundles waiting in `every` (per bundle id), and of their full rows
        of `tiers` together (`_thinnable`). Ids, flags and tiers only: what waits can be far larger than memory."""
        hashed, full_u = {}, []
        for e in self.pending():
            if e.tier in every and e.bundle_id not in skip:
                t = self._read_waiting(e, ["sample_id", "is_summary", "tier"])
                if t is None:
                    continue
                hashed[e.bundle_id] = np.asarray(uniforms(t.column("sample_id"), salt))
                full_u.append(hashed[e.bundle_id][full_rows(t) & _thinnable(t, e.tier, tiers)])
        return hashed, np.concatenate([np.zeros(0), *full_u])

    def _bytes_on_disk(self, e: SpoolEntry) -> int:
        """A waiting bundle's bytes and its sidecar's, as `usage` counts them."""
        with contextlib.suppress(FileNotFoundError):
            return e.manifest.nbytes + self._sidecar(e.path).stat().st_size
        return e.manifest.nbytes

    def _packed_scale(self, entries: list[SpoolEntry], overhead: dict[str, int], rows: int) -> dict[str, float]:
        """Per contract, what a row costs in a pack of about `rows` rows over what it cost in its bundle (both less
        the fixed part): the first bundles' rows, up to `rows` and `PACKED_SCALE_BYTES`, written as one bundle."""
        out: dict[str, float] = {}
        for contract in {e.manifest.contract for e in entries}:
            parts, n, nbytes, body = [], 0, 0, 0.0
            o = overhead.get(contract, 0)
            for e in (e for e in entries if e.manifest.contract == contract):
                if n >= max(rows, 2) or nbytes >= PACKED_SCALE_BYTES:
                    break
                t = self._read_waiting(e)
                if t is None:
                    continue
                parts.append(t)
                n, nbytes, body = n + e.manifest.row_count, nbytes + e.manifest.nbytes, body + max(e.manifest.nbytes - o, 0)
            if n < 2 or body <= 0 or len(parts) < 2:
                continue  # one bundle: its rows are priced as packed already
            packed = len(write_bundle(pa.concat_tables(parts), contract_by_id(contract), tier="normal")[0]) - o
            out[contract] = min(1.5, max(0.1, packed / body))
        return out

    def _drawn_rows(self, e: SpoolEntry, tiers: tuple[str, ...]) -> int:
        """How many of a waiting bundle's rows a thinning of `tiers` draws from (`_thinnable`): all or none but for
        an urgent pack while only the normal tier is thinned, whose tiers are read."""
        if e.tier != "high" or ("high" in tiers) == ("normal" in tiers):  # every row or none
            return e.manifest.row_count if e.tier in tiers else 0
        t = self._read_waiting(e, ["tier"])
        return 0 if t is None else int(_thinnable(t, e.tier, tiers).sum())

    def fixed_part(self, e: SpoolEntry) -> int:
        """Bytes of a bundle of e's contract that do not grow with its rows (Parquet footer, page headers): a one-row
        bundle less its row, near enough. Measured once per contract."""
        c = e.manifest.contract
        if c not in self._fixed_parts:
            t = self._read_waiting(e)
            if t is None:  # gone or corrupt: priced as rows only this once
                return 0
            one = t.slice(0, 1)
            o1 = len(write_bundle(one, contract_by_id(c), tier=e.tier)[0])
            self._fixed_parts[c] = max(0, o1 - (e.manifest.nbytes - o1) // max(e.manifest.row_count - 1, 1))
        return self._fixed_parts[c]

    def thin_to(self, capacity_bytes: int, *, salt: str, max_rounds: int = 4,
                skip: frozenset[str] = frozenset(), urgent_share: float = 0.5,
                pack_rows: int | None = None, pack_bytes: int | None = None) -> list[ThinResult]:
        """Thin the waiting bundles until they fit `capacity_bytes`: the normal tier while the urgent bundles take at
        most `urgent_share` of it (they are the latency path, as `TieringPolicy.urgent_max_share`), every tier
        beyond it (urgent rows are then sampled with the rest, as the budgeted draw does). Each round is a draw of
        fixed size (`thin` with `keep_rows`): k of the n full rows stay, k the expected-bytes solution (`_solve_keep`
        x n, rounded) with the rows that stay packed into bundles of up to `pack_bytes` bytes (never under the largest
        bundle replaced) and `pack_rows` rows, each paying a bundle's fixed Parquet part (measured once per contract)
        once. Fixed, not Poisson: a Poisson thinning falls short of
        the pass as often as it overruns, and what it leaves idle no later round can add (digits at 2%: about ten
        rows a pass, so a draw one row short wasted a tenth of it). While a round's packing still leaves it over,
        the next draws at least one row fewer, up to `max_rounds` + FIT_ROUNDS rounds. What fits once packed is
        repacked with every row kept. Bundles in `skip` (part-sent, in the retry queue) stay whole."""
        done: list[ThinResult] = []
        overhead: dict[str, int] = {}
        tiers: tuple[str, ...] = ()
        for r in range(max_rounds + FIT_ROUNDS):
            pending = self.pending()
            total = sum(e.manifest.nbytes for e in pending)
            if total <= capacity_bytes or not pending:
                break
            if not tiers:  # decided once: a packed bundle that holds an urgent row is urgent, normal rows and all
                urgent = sum(e.manifest.nbytes * self._drawn_rows(e, ("high",)) / max(e.manifest.row_count, 1)
                             for e in pending if e.tier == "high")  # an urgent pack's normal rows are not urgent
                tiers = ("normal",) if urgent <= urgent_share * capacity_bytes else ("high", "normal")
            if not any(e.tier in ("high", "normal") and e.bundle_id not in skip for e in pending):
                break  # (an urgent pack may hold normal rows: `thin` draws by each row's tier)
            # the urgent bundles are packed with the thinned rows either way (sampled or kept whole)
            thinned = [e for e in pending if e.tier in ("high", "normal") and e.bundle_id not in skip]
            for e in thinned:
                overhead[e.manifest.contract] = self.fixed_part(e)
            room = capacity_bytes - (total - sum(e.manifest.nbytes for e in thinned))
            whole = frozenset({"high"} - set(tiers))
            drawn_rows = {e.bundle_id: self._drawn_rows(e, tiers) for e in thinned}
            solve = functools.partial(_solve_keep, thinned, overhead, room, pack_rows, pack_bytes=pack_bytes,
                                      drawn_rows=drawn_rows)
            keep = solve()
            if (pack_bytes is not None or (pack_rows or 0) > 1) and not done and keep < 1.0:
                # rows packed many to a bundle compress better than in the bundles they came from (gait: 56 B a row
                # against 162 B less the fixed part): priced at the latter, a pass went 75% full
                rows = keep * sum(drawn_rows.values()) + sum(e.manifest.row_count - drawn_rows[e.bundle_id]
                                                             for e in thinned)
                keep = solve(row_scale=self._packed_scale(thinned, overhead, int(min(rows, pack_rows or rows))))
            # over only for its footers (keep 1 on the first round): packed, every row fits; otherwise the first
            # draw meets the expected bytes, and a later one (the packing left it over) is a row fewer at least
            every_row = keep >= 1.0 and not done
            size = {} if every_row else {"keep_rows": functools.partial(_draw_size, keep, not done)}
            try:
                res = self.thin(1.0, salt=f"{salt}|{r}", tiers=tiers, skip=skip, pack_rows=pack_rows,
                                pack_bytes=pack_bytes, pack_with=tuple(whole), repack=True, **size)
            except NoRoom as exc:  # raised, it stopped the pass's plan: nothing was sent to free the room
                log.warning("%s: the pass plans the bundles as they wait", exc)
                break
            if every_row or res.bundles:
                done.append(res)
            if not res.bundles:  # no full row waits in the tiers thinned
                break
        return done

    def write_staging(self, name: str, data: bytes) -> Path:
        """Atomically write a derived intermediate under staging/ (counted in the cap, pruned by TTL)."""
        if "/" in name or name.startswith("."):
            raise SpoolError(f"bad staging name {name!r}")
        with self._locked():
            used = self.usage().used_bytes
            if used + len(data) >= self.cleanup_watermark * self.cap_bytes:
                self._cleanup(int(self.cleanup_watermark * self.cap_bytes) - len(data))
                used = self.usage().used_bytes
            if used + len(data) > self.cap_bytes:
                raise SpoolError(f"spool {self.root}: no room for {len(data)} staging bytes ({used}/{self.cap_bytes})")
            path = self.staging_dir / name
            _atomic_write(path, data, mtime=self.clock())
            usage = self.usage()
        self._check_alert(usage)
        return path

    def _refuse(self, manifest: BundleManifest, reason: str, detail: str, record: bool = True) -> None:
        if not record:  # the caller still holds these samples: a ledger row would count them twice
            log.warning("spool %s: refused bundle %s (%d samples, still held elsewhere): %s: %s",
                        self.node_id or self.root, manifest.bundle_id, manifest.row_count, reason, detail)
            return
        stage = STAGE_RAW if manifest.tier == "low" else ledger.STAGE_SPOOL
        n = self.ledger.record(manifest.sample_ids, stage=stage, reason=reason, bundle_id=manifest.bundle_id, detail=detail)
        log.warning("spool %s: refused bundle %s (%d samples): %s", self.node_id or self.root, manifest.bundle_id, n, reason)

    def _remove(self, e: SpoolEntry) -> None:
        """Sidecar first (the entry stops existing), then the bytes."""
        side = self._sidecar(e.path)
        side.unlink(missing_ok=True)
        e.path.unlink(missing_ok=True)
        self._cache.pop(side, None)
        fsync_dir(e.path.parent)

    def _drop(self, e: SpoolEntry, stage: str, reason: str, detail: str = "") -> None:
        # Ledger first: a crash between the two re-drops the same entry, and the ledger ignores repeats.
        self.ledger.record(e.manifest.sample_ids, stage=stage, reason=reason, bundle_id=e.bundle_id, detail=detail)
        self._remove(e)

    def _make_room(self, need: int, incoming: BundleManifest) -> int | None:
        """Room for `need` bytes, by clean-up or displacing cheaper bundles; the bytes used once it is made (before
        the incoming write), or None where there is none."""
        used = self.usage().used_bytes
        if used + need >= self.cleanup_watermark * self.cap_bytes:
            self._cleanup(int(self.cleanup_watermark * self.cap_bytes) - need)
            used = self.usage().used_bytes
        if used + need <= self.cap_bytes:
            return used
        if self.full_policy == "reject-new" or incoming.tier == "low":
            return None
        rank_in = (-tier_rank(incoming.tier), incoming.max_value)
        cheaper = [e for e in sorted(self._entries(self.bundles_dir), key=_value_key) if _value_key(e)[:2] < rank_in]
        plan, freed = [], 0
        for e in cheaper:
            if used + need - freed <= self.cap_bytes:
                break
            plan.append(e)
            freed += e.nbytes
        if used + need - freed > self.cap_bytes:
            return None
        why = f"spool full: displaced by {incoming.tier} bundle {incoming.bundle_id} (max_value {incoming.max_value:.3f})"
        for e in plan:
            self._drop(e, ledger.STAGE_SPOOL, ledger.FULL_DROPPED, why)
        log.warning("spool %s full: dropped %d bundles (%d samples) for %s", self.node_id or self.root, len(plan),
                    sum(e.manifest.row_count for e in plan), incoming.bundle_id)
        return self.usage().used_bytes

    def _cleanup(self, target_bytes: int) -> None:
        """Expired entries and stale staging, then raw-store entries lowest value first."""
        self._expire_locked()
        used = self.usage().used_bytes
        for e in sorted(self._entries(self.raw_dir), key=_value_key):
            if used <= target_bytes:
                break
            self._drop(e, STAGE_RAW, ledger.RAW_EVICTED, "clean-up above the clean-up watermark")
            used -= e.nbytes

    def _check_alert(self, usage: SpoolUsage) -> None:
        below = usage.fraction < self.alert_watermark
        with self._tlock:  # test-and-set in one statement: two processes crossing together alert once
            cur = self._acks.execute("UPDATE flags SET value = ? WHERE name = 'alerted' AND value = ?",
                                     (0, 1) if below else (1, 0))
        if below or cur.rowcount != 1:
            return
        payload: dict[str, float | int | str] = {
            "level": 2, "used_fraction": round(usage.fraction, 4), "node_id": self.node_id,
            "used_bytes": usage.used_bytes, "cap_bytes": usage.cap_bytes,
        }
        self.alerts.append(payload)
        log.warning("spool %s at %.1f%% of cap: alert", self.node_id or self.root, 100 * usage.fraction)
        if self.outbox is not None and not events.routing():  # routed, the emit below is the outbox's append
            self.outbox.append(events.SPOOL_WATERMARK, dict(payload), priority=PRIO_ALERT_L2,
                               occurred=datetime.fromtimestamp(self.clock(), UTC))
        self._emit(events.SPOOL_WATERMARK, f"edgehaul.spool.{self.node_id or 'local'}", dict(payload),
                    **{"edgehaul.node": self.node_id})

    def check_watermarks(self) -> SpoolUsage:
        """Re-evaluate the alert (e.g. at the end of a flow run); returns current usage."""
        usage = self.usage()
        self._check_alert(usage)
        return usage

    def ack(self, bundle_id: str, *, remote_key: str, sha256: str) -> None:
        """The core confirmed receipt of this exact content: forget the bundle. Idempotent."""
        with self._locked():
            e = self._load(self.bundles_dir / f"{bundle_id}{_SIDECAR}")
            if e is None:
                row = self._acks.execute("SELECT sha256 FROM acks WHERE bundle_id=?", (bundle_id,)).fetchone()
                if row and row[0] == sha256:
                    return
                raise SpoolError(f"spool {self.root}: ack for unknown bundle {bundle_id}")
            if sha256 != e.manifest.sha256:
                raise SpoolError(f"bundle {bundle_id}: receipt sha256 {sha256[:12]} does not match spooled "
                                 f"{e.manifest.sha256[:12]}; not acknowledged")
            self._acks.execute("INSERT OR REPLACE INTO acks VALUES (?,?,?,?)", (bundle_id, remote_key, sha256, self.clock()))
            self._remove(e)
        self._check_alert(self.usage())

    def discard(self, bundle_id: str) -> bool:
        """Remove a waiting bundle whose samples the caller already recorded in the ledger (e.g. the
        uplink retry queue gave up on it). Returns whether it was there."""
        with self._locked():
            e = self._load(self.bundles_dir / f"{bundle_id}{_SIDECAR}")
            if e is None:
                return False
            self._remove(e)
        self._check_alert(self.usage())
        return True

    def expire(self) -> list[SpoolEntry]:
        """TTL expiry of bundles (ledger reason ttl-expired), raw-store retention, stale staging."""
        with self._locked():
            out = self._expire_locked()
            usage = self.usage()
        self._check_alert(usage)
        return out

    def _expire_locked(self) -> list[SpoolEntry]:
        now = self.clock()
        out = []
        for e in self._entries(self.bundles_dir):
            if e.created_at + self.ttl_seconds <= now:
                self._drop(e, ledger.STAGE_SPOOL, ledger.TTL_EXPIRED, f"not uplinked within {self.ttl_seconds:.0f} s")
                out.append(e)
        for e in self._entries(self.raw_dir):
            if e.created_at + self.raw_ttl_seconds <= now:
                self._drop(e, STAGE_RAW, ledger.RAW_RETENTION, f"raw kept {self.raw_ttl_seconds:.0f} s")
                out.append(e)
        for p in self.staging_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if p.stat().st_mtime + self.staging_ttl_seconds <= now:
                    p.unlink()
        if out:
            log.info("spool %s: expired %d entries (%d samples)", self.node_id or self.root, len(out),
                     sum(e.manifest.row_count for e in out))
        return out

    def close(self) -> None:
        self.ledger.close()
        self._acks.close()
        if self.outbox is not None:
            self.outbox.close()
