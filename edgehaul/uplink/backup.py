"""The node's durable record of what its backup link carried, per month (the budget's meter)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any


class BackupLedger:
    """`<dir>/backup-<YYYY-MM>.json`: bytes and bundle ids sent over the backup link that month."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, month: str) -> Path:
        return self.dir / f"backup-{month}.json"

    def read(self, month: str) -> dict[str, Any]:
        p = self._path(month)
        if not p.exists():
            return {"bytes": 0, "bundles": {}}
        try:
            doc = json.loads(p.read_text())
            return {"bytes": int(doc["bytes"]), "bundles": dict(doc["bundles"])}
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{p}: unreadable backup-link ledger ({e}); fix or remove it to reset the budget") from e

    def used(self, month: str) -> int:
        return int(self.read(month)["bytes"])

    def add(self, at: datetime, receipts: Iterable[Any]) -> int:
        """Record the backup-carried receipts (by bundle id, so a re-run never counts one twice); returns bytes added."""
        month = f"{at:%Y-%m}"
        doc = self.read(month)
        added = 0
        for r in receipts:
            if r.link == "backup" and not r.already_present and r.bundle_id not in doc["bundles"]:
                doc["bundles"][r.bundle_id] = int(r.nbytes)
                added += int(r.nbytes)
        if added:
            doc["bytes"] += added
            tmp = self._path(month).with_suffix(".tmp")
            tmp.write_text(json.dumps(doc, sort_keys=True))
            os.replace(tmp, self._path(month))  # atomic: a crash leaves the old or the new ledger, never half
        return added
