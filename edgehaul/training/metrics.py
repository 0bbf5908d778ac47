"""Per-class metrics from a (weighted) confusion matrix: what accuracy hides on imbalanced kinds.

An anomaly kind with 2% anomalies reaches 0.98 accuracy by never predicting one; its recall of the
anomaly class (the rarest) is then 0, and its macro-F1 about 0.5.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def rare_classes(support: np.ndarray) -> list[int]:
    """Indices of the rarest classes present: the quarter of the present classes (at least one) with the
    least support."""
    present = np.flatnonzero(support > 0)
    if present.size == 0:
        return []
    k = max(1, math.ceil(present.size / 4))
    return sorted(int(i) for i in present[np.argsort(support[present], kind="stable")[:k]])


def class_metrics(confusion: np.ndarray, label_values: tuple[int, ...] | list[int]) -> dict[str, float]:
    """`confusion[true][predicted]` (sums of row weights) -> `val_recall_<label>` and `val_f1_<label>` per
    class present in validation, `val_support_<label>` per class (its weighted count), `val_macro_f1` (mean
    F1 over the classes present) and `val_rare_recall` (mean recall of `rare_classes`); those two are NaN
    without validation rows."""
    cm = np.asarray(confusion, dtype=np.float64)
    support = cm.sum(axis=1)
    predicted = cm.sum(axis=0)
    tp = np.diag(cm)
    with np.errstate(divide="ignore", invalid="ignore"):
        recall = np.where(support > 0, tp / support, np.nan)
        precision = np.where(predicted > 0, tp / predicted, 0.0)
        f1 = np.where(support > 0, np.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0),
                      np.nan)
    out: dict[str, float] = {}
    for i, v in enumerate(label_values):
        out[f"val_support_{v}"] = float(support[i])
        if support[i] > 0:  # no NaN per class: a lineage record compares equal to the history it was made of
            out[f"val_recall_{v}"] = float(recall[i])
            out[f"val_f1_{v}"] = float(f1[i])
    present = support > 0
    out["val_macro_f1"] = float(f1[present].mean()) if present.any() else math.nan
    rare = rare_classes(support)
    out["val_rare_recall"] = float(np.mean(recall[rare])) if rare else math.nan
    return out


def rare_labels(row: dict[str, float], label_values: tuple[int, ...] | list[int]) -> list[int]:
    """The label values `val_rare_recall` of a history row averages over."""
    support = np.asarray([row.get(f"val_support_{v}", 0.0) for v in label_values], dtype=np.float64)
    return [int(label_values[i]) for i in rare_classes(support)]


def chance_macro_f1(support: np.ndarray, n_classes: int | None = None) -> float:
    """Expected macro-F1 (over the classes present) of the better of two label-blind guessers: one with a
    uniform prior (each row gets one of `n_classes`, default the length of `support`, at random: a present
    class of share s has precision s and recall 1/K, F1 = 2s / (K s + 1); on K balanced classes 1/K), and
    one that always answers the commonest class (F1 2s/(1+s) for it, 0 for the rest; on a skewed kind it
    beats the uniform guesser). A model that does not beat both has learnt nothing from its inputs. NaN
    without support."""
    support = np.asarray(support, dtype=np.float64)
    total = support.sum()
    k = n_classes or len(support)
    present = support > 0
    if total <= 0 or k < 1:
        return math.nan
    share = support[present] / total
    uniform = float(np.mean(2 * share / (k * share + 1)))
    top = float(share.max())
    commonest = 2 * top / (1 + top) / len(share)
    return max(uniform, commonest)


def val_classes_present(row: dict[str, Any]) -> list[str]:
    """The `val_support_<label>` keys of a history row with support: one alone means a constant guesser scores
    1.0 on the validation rows, so no model can be judged against them."""
    return [k for k in row if k.startswith("val_support_") and float(row[k] or 0) > 0]


def chance_of(row: dict[str, float], label_values: tuple[int, ...] | list[int]) -> float:
    """`chance_macro_f1` of a history row's validation support."""
    support = np.asarray([row.get(f"val_support_{v}", 0.0) for v in label_values], dtype=np.float64)
    return chance_macro_f1(support)
