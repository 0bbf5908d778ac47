"""Test doubles of the product's interfaces, for tests and benchmarks only (never shipped)."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

from edgehaul.bundles import BundleManifest
from edgehaul.uplink.link import priority_key


@dataclass
class MemoryEntry:
    bundle_id: str
    tier: str
    max_value: float
    created_at: str
    manifest: BundleManifest
    nbytes: int


class MemorySource:
    """An in-memory source for benchmarks and transfer tests: (bytes, manifest) pairs, acked away."""

    def __init__(self) -> None:
        self._items: dict[str, tuple[bytes, MemoryEntry]] = {}
        self._lock = threading.Lock()
        self.acked: dict[str, str] = {}

    def put(self, data: bytes, manifest: BundleManifest) -> None:
        e = MemoryEntry(manifest.bundle_id, manifest.tier, manifest.max_value, manifest.created_at, manifest, len(data))
        with self._lock:
            self._items[manifest.bundle_id] = (data, e)

    def pending(self) -> list[MemoryEntry]:
        with self._lock:
            es = [e for _, e in self._items.values()]
        return sorted(es, key=lambda e: priority_key(e.tier, e.max_value, e.created_at))

    def read(self, bundle_id: str) -> bytes:
        with self._lock:
            return self._items[bundle_id][0]

    def ack(self, bundle_id: str, *, remote_key: str, sha256: str) -> None:
        with self._lock:
            data, _ = self._items.pop(bundle_id)
            if hashlib.sha256(data).hexdigest() != sha256:
                raise ValueError(f"ack of {bundle_id} with the wrong sha256")
            self.acked[bundle_id] = remote_key

    def __len__(self) -> int:
        return len(self._items)
