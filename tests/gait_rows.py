"""Generated daphnet_gait readings (columns kind) with a known anomaly rate: `gait_raw` as a node reads them
(the contract's raw schema), `gait_rows` the same through the edge's real preprocessing (`norm_<column>`
features, content digest), ready for scoring.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa

from edgehaul.contracts import Contract, load_contract
from edgehaul.edge.preprocess import preprocess

GAIT = load_contract("daphnet_gait")
# Means of a worn sensor standing upright (milli-g): vertical axes near 1 g.
_MEAN = {"ankle_horiz_fwd": 80.0, "ankle_vert": 980.0, "ankle_horiz_lateral": -40.0, "leg_horiz_fwd": 120.0,
         "leg_vert": 1000.0, "leg_horiz_lateral": 30.0, "trunk_horiz_fwd": -60.0, "trunk_vert": 1010.0,
         "trunk_horiz_lateral": 10.0}


def gait_raw(n: int, *, anomaly_rate: float, seed: int, node_id: str = "node-a", start_seq: int = 0,
             outliers: int = 0, contract: Contract = GAIT) -> pa.Table:
    """n readings, a share `anomaly_rate` of them labelled freezes (strong tremor), the first `outliers`
    normal-labelled rows far off (a knocked sensor: unlabelled anomalies)."""
    rng = np.random.default_rng(seed)
    anomaly = rng.random(n) < anomaly_rate
    cols = [c.name for c in contract.columns]
    x = np.column_stack([rng.normal(_MEAN[c], 60.0, n) for c in cols])
    x[anomaly] += rng.normal(0.0, 900.0, (int(anomaly.sum()), len(cols)))  # freezing: 3-8 Hz trembling
    normal_idx = np.flatnonzero(~anomaly)[:outliers]
    x[normal_idx] += rng.choice([-1.0, 1.0], (len(normal_idx), len(cols))) * 2500.0
    x = np.clip(x, -5000, 5000).astype(np.float32)
    seq = np.arange(start_seq, start_seq + n)
    t0 = datetime(2026, 3, 1, tzinfo=UTC)
    data: dict[str, pa.Array] = {
        "sample_id": pa.array([f"{node_id}-gait-{s:09d}" for s in seq]),
        "node_id": pa.array([node_id] * n),
        "capture_time": pa.array([t0 + timedelta(milliseconds=int(s) * 15) for s in seq],
                                 pa.timestamp("ms", tz="UTC")),
        "seq": pa.array(seq, pa.int64()),
        "is_anomaly": pa.array(anomaly.astype(np.int16)),
    }
    for j, c in enumerate(cols):
        data[c] = pa.array(x[:, j])
    return pa.table(data).cast(contract.raw_schema)


def gait_rows(n: int, *, anomaly_rate: float, seed: int, node_id: str = "node-a", start_seq: int = 0,
              outliers: int = 0, contract: Contract = GAIT) -> pa.Table:
    """`gait_raw` through the real preprocessing (every generated row is accepted)."""
    raw = gait_raw(n, anomaly_rate=anomaly_rate, seed=seed, node_id=node_id, start_seq=start_seq, outliers=outliers,
                   contract=contract)
    res = preprocess(raw, contract, node_id=node_id)
    assert res.accepted.num_rows == n, res.reject_counts
    return res.accepted
