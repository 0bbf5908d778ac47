"""Policy blocks: edge node, link profile, tiering, retention, team quota and prices.

Each is versioned or validated so a bad value fails with a message naming the field.
"""

from __future__ import annotations

from typing import Literal

from prefect.blocks.core import Block
from pydantic import Field, model_validator

from edgehaul.platform.fields import Name
from edgehaul.scorer_names import check_scorer_name

MiB = 1024 * 1024


class EdgeNode(Block):
    """An edge node: identity, team, spool location and the spool's cap and watermarks.

    Watermarks: clean-up from 80% of the cap, alert at 85%.

    Example:
        ```python
        EdgeNode(node_id="node-a", team="geo", spool_dir="/var/lib/edgehaul/spool",
                 spool_cap_bytes=20 * 2**30).save("node-a")
        ```
    """

    _block_type_name = "edgehaul Edge Node"
    _block_type_slug = "edgehaul-edge-node"

    node_id: Name = Field(description="Node id; also its landing prefix.")
    team: str = Field(default="default", description="Team billed for this node's uplink and storage.")
    node_group: str = Field(default="edge", description="Work pool group this node's flows run in.")
    spool_dir: str = Field(description="Durable local spool folder (on the node's persistent disk).")
    spool_cap_bytes: int = Field(default=2 * 1024 * MiB, gt=0, description="Hard cap of the spool's bytes.")
    cleanup_watermark: float = Field(default=0.80, gt=0, lt=1, description="Use fraction that starts clean-up.")
    alert_watermark: float = Field(default=0.85, gt=0, le=1, description="Use fraction that emits the level-2 alert.")
    full_policy: Literal["reject-new", "drop-lowest-value"] = Field(
        default="drop-lowest-value", description="What to do when a write would exceed the cap."
    )
    bundle_ttl_seconds: int = Field(default=7 * 86400, gt=0, description="A bundle not uplinked by then expires.")
    retry_queue_cap: int = Field(default=10_000, gt=0, description="Max entries in the uplink retry queue.")
    retry_expiry_seconds: int = Field(default=3 * 86400, gt=0, description="A retry older than this expires.")
    pass_schedule: str | None = Field(
        default=None, description="YAML file of the node's predicted passes (start, duration_s, rate_bps), as a "
        "ground-station schedule gives them; uplink_drain with by_plan plans each pass from it.")

    @model_validator(mode="after")
    def _check_watermarks(self) -> EdgeNode:
        if not self.cleanup_watermark < self.alert_watermark:
            raise ValueError(
                f"cleanup_watermark ({self.cleanup_watermark}) must be below alert_watermark ({self.alert_watermark})"
            )
        return self



class LinkProfile(Block):
    """The uplink of a node: bandwidth, latency, loss/outages, contact windows and the rate cap.

    The rate cap defaults to 70% of bandwidth (start at 60-70% of the link and tune after a week), which
    also leaves room for control-plane traffic (Prefect API, events).

    Example:
        ```python
        LinkProfile(bandwidth_bps=8_000_000, latency_ms=300, loss_rate=0.01).save("leo-ka")
        ```
    """

    _block_type_name = "edgehaul Link Profile"
    _block_type_slug = "edgehaul-link-profile"

    bandwidth_bps: float = Field(gt=0, description="Physical link bandwidth, bits per second.")
    rate_cap_fraction: float = Field(default=0.70, gt=0, le=0.95, description="Data-plane share of bandwidth.")
    latency_ms: float = Field(default=0.0, ge=0, description="One-way latency added per request.")
    loss_rate: float = Field(default=0.0, ge=0, lt=1, description="Probability a chunk is lost and resent.")
    outage_rate_per_hour: float = Field(default=0.0, ge=0, description="Mean random outages per hour.")
    outage_mean_s: float = Field(default=30.0, ge=0, description="Mean outage length, seconds.")
    contact_period_s: float | None = Field(
        default=None, gt=0, description="Orbit period: contact windows repeat with this period (None: always on)."
    )
    contact_duration_s: float | None = Field(default=None, gt=0, description="Length of each contact window.")
    chunk_bytes: int = Field(default=1 * MiB, ge=64 * 1024, description="Shaping/preemption granularity.")
    multipart_threshold_bytes: int = Field(default=16 * MiB, ge=5 * MiB, description="Multipart from this size.")
    part_bytes: int = Field(default=8 * MiB, ge=5 * MiB, description="Multipart part size (S3 minimum 5 MiB).")
    monthly_budget_bytes: int | None = Field(
        default=None, ge=0, description="Bytes a month this link may carry (a backup link's budget; None: unlimited)."
    )

    @property
    def rate_cap_bytes_per_s(self) -> float:
        return self.bandwidth_bps * self.rate_cap_fraction / 8

    @model_validator(mode="after")
    def _check_contacts(self) -> LinkProfile:
        if (self.contact_period_s is None) != (self.contact_duration_s is None):
            raise ValueError("contact_period_s and contact_duration_s must be set together")
        if self.contact_period_s and self.contact_duration_s and self.contact_duration_s > self.contact_period_s:
            raise ValueError("contact_duration_s cannot exceed contact_period_s")
        return self


class TieringPolicy(Block):
    """Maps a sample's value to a tier and says when a normal-tier bundle is flushed.

    Changing any field changes `fingerprint`, which keys the scoring/tiering cache.

    Example:
        ```python
        TieringPolicy(version="2026-12-a", high_threshold=0.8, low_threshold=0.3).save("default")
        ```
    """

    _block_type_name = "edgehaul Tiering Policy"
    _block_type_slug = "edgehaul-tiering-policy"

    version: str = Field(default="1", min_length=1, description="Policy version, recorded with every bundle.")
    scorer: str = Field(default="novelty", min_length=1, description=(
        "Which scorer values samples: a name registered under the `edgehaul.scorers` entry point "
        "(shipped: novelty, anomaly, density, model)."))
    model_uri: str | None = Field(default=None, description="Model for the 'model' scorer (s3://... or 'latest').")
    fallback_scorer: str | None = Field(default="novelty", description=(
        "The 'model' scorer's stand-in while its kind has no model (none published or downlinked yet): a "
        "registered scorer other than model. None: a missing model fails the batch."))
    use_labels: bool = Field(default=False, description=(
        "Let the novelty and anomaly scorers read a label the edge happens to have (class rarity, labelled "
        "anomalies first). Off: value from the features alone, as on a node that sees no labels."))
    high_threshold: float = Field(default=0.8, gt=0, le=1, description="value >= this: high tier, sent at once.")
    low_threshold: float = Field(default=0.3, ge=0, lt=1, description="value < this: low tier, summary only.")
    # Without it central training sees only what scored high: the population of what nodes observe is lost.
    sample_rate: float = Field(default=0.05, ge=0, le=1, description=(
        "Share of low-tier samples that travel in full anyway (a draw per sample id, the same on every rerun); "
        "each row records its inclusion probability (inclusion_p: 1 for high and normal, this for low), by "
        "which training weights rows back to the population."))
    # With a byte budget every row gets a known chance of crossing the link (a fixed-size draw per batch, p by value
    # with a floor): cutting a value-ranked spool at the budget would land only the top and bias training.
    budget_share: float | None = Field(default=None, gt=0, le=1, description=(
        "Share of each batch's full-row bytes the node plans to send (from its link: "
        "`edgehaul.uplink.pass_plan.planned_share`). Set: every row travels with inclusion_p proportional to "
        "coverage + value, solved so the expected bytes meet it. None: high and normal in full, low at sample_rate."))
    # 0.8, measured (bench_value, 10% budget, one seed): at 0.5 the value-led share landed gait samples a
    # model could not generalise from (tiered 0.49-0.55 against random 0.62); at 0.8 gait ties random, digits
    # tiers at or above it and Landsat keeps its win (0.50 against 0.31), with the weighted mix nearer the stream.
    coverage: float = Field(default=0.8, ge=0, le=1, description=(
        "With a budget: share of it spread evenly over rows (every value stratum keeps rows; the floor of p), "
        "the rest in proportion to value."))
    # A value tilt pays only where a pass holds enough rows: digits at 2% (nine rows a pass, under one per class)
    # trained 0.334 with the tilt as set, 0.383 with it faded, random's 0.383 (bench_value, twelve draws); gait's
    # passes of 190 rows and more are where the tilt bought anomaly recall.
    tilt_full_rows: int = Field(default=100, ge=0, description=(
        "With a budget and a pass schedule: the rows a pass must carry for `coverage` and `urgent_max_share` to "
        "apply as set; a pass of fewer draws nearer a uniform sample (coverage rising toward 1 and the urgent share "
        "falling toward 0 linearly as its rows fall to 0: `tiering.for_pass_rows`). 0: as set whatever the rows."))
    urgent_max_share: float = Field(default=0.5, ge=0, le=1, description=(
        "With a budget: most of it the urgent (high-tier) rows may take at p 1; beyond it they are sampled too."))
    summary_min_ratio: float = Field(default=4.0, ge=1, description=(
        "A row left on the node sends a summary (features, no payload) only when the row is this many times "
        "the summary's bytes; otherwise no summary: it would cost about a row and carry nothing to train on."))
    flush_max_samples: int = Field(default=50_000, gt=0, description="Flush a normal bundle at N samples...")
    flush_max_bytes: int = Field(default=32 * MiB, gt=0, description="...or at B bytes...")
    flush_max_seconds: float = Field(default=300.0, gt=0, description="...or T seconds after its first sample.")
    urgent_max_bytes: int = Field(default=4 * MiB, gt=0, description="Largest urgent (high-tier) bundle.")
    zstd_level: int = Field(default=3, ge=1, le=19, description="Parquet zstd level of bundles.")
    # The raw store never crosses the link, so its level only buys local disk: on pixel data level 1
    # is 1.3-4x faster than 3 for 0-1.5% more bytes (benchmarks/bench_edge.py).
    raw_store_zstd_level: int = Field(
        default=1, ge=1, le=19, description="Parquet zstd level of low-tier raw bundles kept on the node.")
    row_group_rows: int = Field(default=8192, gt=0, description="Rows per Parquet row group.")

    @model_validator(mode="after")
    def _check_thresholds(self) -> TieringPolicy:
        if not self.low_threshold < self.high_threshold:
            raise ValueError(f"low_threshold ({self.low_threshold}) must be below high_threshold ({self.high_threshold})")
        check_scorer_name(self.scorer)
        if self.scorer == "model" and not self.model_uri:
            raise ValueError("scorer 'model' needs model_uri")
        if self.fallback_scorer is not None:
            check_scorer_name(self.fallback_scorer)
            if self.fallback_scorer == "model":
                raise ValueError("fallback_scorer cannot be 'model': it stands in for a missing model")
        return self

    @property
    def fingerprint(self) -> str:
        import hashlib
        import json

        # The fallback only acts for the model scorer: other policies keep the fingerprints (and caches) they had.
        fields = self.model_dump(mode="json", exclude=None if self.scorer == "model" else {"fallback_scorer"})
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


DataClass = Literal["raw", "features", "model_weights", "logs", "checkpoints", "reports"]


class RetentionRule(Block):
    _block_type_name = "edgehaul Retention Rule"
    data_class: DataClass = Field(description="Which class of data this rule covers.")
    cold_after_days: float | None = Field(default=30, ge=0, description="Move to cold after this age (None: never).")
    cold_if_unused_days: float | None = Field(default=None, ge=0, description="Move when no run read it for D days.")
    cold_storage_class: Literal["STANDARD_IA", "ONEZONE_IA", "GLACIER_IR", "GLACIER", "DEEP_ARCHIVE"] = Field(
        default="STANDARD_IA", description="Storage class in the cold tier."
    )
    expire_after_days: float | None = Field(default=None, ge=0, description="Delete after this age (None: keep).")


class RetentionPolicy(Block):
    """Retention per data class, and which dataset versions stay pinned.

    Example:
        ```python
        RetentionPolicy(rules=[RetentionRule(data_class="raw", cold_after_days=30, expire_after_days=365)],
                        keep_latest_versions=3).save("default")
        ```
    """

    _block_type_name = "edgehaul Retention Policy"
    _block_type_slug = "edgehaul-retention-policy"

    rules: list[RetentionRule] = Field(default_factory=list, description="One rule per data class.")
    keep_latest_versions: int = Field(default=3, ge=1, description="Latest N dataset versions are never moved.")
    pinned_versions: list[int] = Field(default_factory=list, description="Dataset versions pinned by users.")

    def rule(self, data_class: str) -> RetentionRule | None:
        return next((r for r in self.rules if r.data_class == data_class), None)


class TeamQuota(Block):
    """A team's accelerator and storage quota; training refuses to start beyond it.

    Example:
        ```python
        TeamQuota(team="geo", accelerator_hours_per_month=100, storage_bytes=5 * 2**40).save("geo")
        ```
    """

    _block_type_name = "edgehaul Team Quota"
    _block_type_slug = "edgehaul-team-quota"

    team: Name = Field(description="Team name.")
    accelerator_hours_per_month: float = Field(ge=0, description="Accelerator hours the team may use a month.")
    max_accelerators_per_run: int = Field(default=8, ge=0, description="Accelerators one run may request.")
    storage_bytes: int = Field(ge=0, description="Bytes the team may keep in the curated and cold tiers.")


class PriceSheet(Block):
    """Unit prices for the cost report (defaults are list-price-like placeholders; set yours).

    Example:
        ```python
        PriceSheet(currency="USD", uplink_per_gb=0.09).save("default")
        ```
    """

    _block_type_name = "edgehaul Price Sheet"
    _block_type_slug = "edgehaul-price-sheet"

    currency: str = Field(default="USD", min_length=3, max_length=3, description="ISO currency code.")
    uplink_per_gb: float = Field(default=0.50, ge=0, description="Price of 1 GB uplinked (metered on its own).")
    backup_uplink_per_gb: float = Field(
        default=5.00, ge=0, description="Price of 1 GB over a node's backup link (fail-over; dearer)."
    )
    storage_per_gb_month: dict[str, float] = Field(
        default_factory=lambda: {
            "STANDARD": 0.023, "STANDARD_IA": 0.0125, "ONEZONE_IA": 0.01, "GLACIER_IR": 0.004,
            "GLACIER": 0.0036, "DEEP_ARCHIVE": 0.00099,
        },
        description="Price of 1 GB-month per storage class.",
    )
    accelerator_hour: float = Field(default=2.50, ge=0, description="Price of one accelerator hour.")
    per_1000_requests: float = Field(default=0.005, ge=0, description="Price of 1,000 object-store requests.")
