"""Per-epoch metrics as table rows and a loss/accuracy plot (PNG bytes) for Prefect artifacts."""

from __future__ import annotations

import base64
import io
import math
from typing import Any

METRICS = ("train_loss", "val_loss", "train_acc", "val_acc")


def metrics_table(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for `create_table_artifact` (per-class recall included); NaN (no held-out rows) shown as None."""
    rows = []
    for h in history:
        row: dict[str, Any] = {"epoch": int(h["epoch"]), "step": int(h["step"])}
        for k in (*METRICS, "val_macro_f1", "val_rare_recall", "train_samples", "val_samples",
                  *sorted(k for k in h if k.startswith("val_recall_"))):
            v = h.get(k)
            row[k] = None if v is None or (isinstance(v, float) and math.isnan(v)) else round(float(v), 5)
        rows.append(row)
    return rows


def plot_png(history: list[dict[str, Any]], title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [int(h["epoch"]) for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=90)
    for k, ax in (("train_loss", ax1), ("val_loss", ax1), ("train_acc", ax2), ("val_acc", ax2)):
        ax.plot(epochs, [float(h.get(k, math.nan)) for h in history], marker="o", label=k)
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("cross-entropy")
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("accuracy")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def markdown_with_image(png: bytes, title: str) -> str:
    """Markdown that carries the plot inline (a data URI), for UIs that cannot reach the bucket."""
    return f"### {title}\n\n![loss and accuracy](data:image/png;base64,{base64.b64encode(png).decode()})\n"
