"""The hand-written per-bundle validation cache: a record is taken only as JSON holding this
bundle's success; anything else is a miss that decodes nothing. Plain functions, a local result storage."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prefect._internal.result_records import ResultRecord, ResultRecordMetadata
from prefect.filesystems import LocalFileSystem
from prefect.serializers import PickleSerializer

from edgehaul.bundles import BundleManifest
from edgehaul.core.validation import ExpectationRow, ValidationResult
from edgehaul.core.validation_cache import ValidationCache, validation_key

MANIFEST = BundleManifest(bundle_id="b" * 32, node_id="node-a", contract="landsat_patch.v1", tier="normal", row_count=25,
                          sample_ids=[], sha256="c" * 64, nbytes=1, min_capture_time="2026-12-05T00:00:00+00:00",
                          max_capture_time="2026-12-05T00:00:00+00:00", value_sum=0.0, max_value=0.0)
OK = ValidationResult(bundle_id="b" * 32, node_id="node-a", contract="landsat_patch.v1", contract_sha256="d" * 64,
                      bundle_sha256="c" * 64, rows=25, success=True, reason="ok",
                      expectations=(ExpectationRow("expect_column_values_to_not_be_null", "sample_id", True, None, 0, ""),))
ENTRY = validation_key("c" * 64, "edgehaul-landing/node-a/2026-12-05/" + "b" * 32 + ".parquet", "etag:1", "d" * 64)


def _cache(tmp_path: Path, ttl: timedelta = timedelta(days=30)) -> ValidationCache:
    return ValidationCache(LocalFileSystem(basepath=str(tmp_path / "results")), ttl=ttl)


class _Marker:
    """Unpickling this creates a file: the stand-in for attacker code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def test_a_success_round_trips_and_a_missing_entry_is_a_miss(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    assert cache.get(ENTRY, MANIFEST) is None
    assert cache.put(ENTRY, OK)
    assert cache.get(ENTRY, MANIFEST) == OK
    rec = json.loads((tmp_path / "results" / ENTRY).read_bytes())
    assert rec["metadata"]["serializer"]["type"] == "json" and rec["metadata"]["expiration"]


def test_a_rejection_is_never_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only a successful validation is cached"):
        _cache(tmp_path).put(ENTRY, replace(OK, success=False, reason="expectations"))
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())


def test_a_pickle_record_under_the_entry_runs_no_code_and_is_a_miss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    marker = tmp_path / "attacker-code-ran"
    meta = ResultRecordMetadata(storage_key=ENTRY, serializer=PickleSerializer(picklelib="pickle"), expiration=None)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / ENTRY).write_bytes(ResultRecord(metadata=meta, result=_Marker(marker)).serialize())
    assert _cache(tmp_path).get(ENTRY, MANIFEST) is None
    assert not marker.exists()
    assert "refused (serializer 'pickle')" in caplog.text


@pytest.mark.parametrize("change", [
    {"bundle_id": "e" * 32}, {"node_id": "node-b"}, {"sha256": "f" * 64},
])
def test_a_record_of_another_bundle_or_checksum_is_a_miss(tmp_path: Path, change: dict[str, str]) -> None:
    cache = _cache(tmp_path)
    cache.put(ENTRY, OK)
    assert cache.get(ENTRY, replace(MANIFEST, **change)) is None


def test_an_expired_record_and_garbage_are_misses(tmp_path: Path) -> None:
    cache = _cache(tmp_path, ttl=timedelta(seconds=-1))
    cache.put(ENTRY, OK)
    assert cache.get(ENTRY, MANIFEST) is None
    (tmp_path / "results" / ENTRY).write_bytes(b"\x00not json")
    assert cache.get(ENTRY, MANIFEST) is None


_text = st.text(max_size=12)


@settings(max_examples=100, deadline=None)
@given(success=st.booleans(), rows=st.integers(min_value=0, max_value=10**9), reason=_text, error=_text,
       observed=st.none() | _text | st.floats(allow_nan=False, allow_infinity=False))
def test_property_only_this_bundles_success_comes_back_equal(
    tmp_path_factory: pytest.TempPathFactory, success: bool, rows: int, reason: str, error: str, observed: Any,
) -> None:
    cache = _cache(tmp_path_factory.mktemp("c"))
    v = replace(OK, success=success, rows=rows, reason=reason, error=error,
                expectations=(ExpectationRow("expect_column_mean_to_be_between", "x", success, observed, None, ""),))
    if not success:
        with pytest.raises(ValueError):
            cache.put(ENTRY, v)
    else:
        assert cache.put(ENTRY, v)
    assert cache.get(ENTRY, MANIFEST) == (v if success else None)


def test_storage_it_cannot_use_is_a_miss_said_once_not_a_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A result storage block whose profile is not on this host (a shell without the workers'
    credentials file): every read and write fails. Validation goes on without the cache, and the log says
    so once per cache, with the reason (on this path each bundle once landed in `errors` and stayed in landing)."""
    from botocore.exceptions import ProfileNotFound

    cache = _cache(tmp_path)

    def broken(*_: Any, **__: Any) -> Any:
        raise ProfileNotFound(profile="ingest")

    monkeypatch.setattr(cache, "_call", broken)
    for _ in range(3):
        assert cache.get(ENTRY, MANIFEST) is None
        assert cache.put(ENTRY, OK) is False
    said = [r.getMessage() for r in caplog.records if "validation cache: cannot" in r.getMessage()]
    assert len(said) == 2 and all("ProfileNotFound" in m and "(ingest)" in m for m in said), said
