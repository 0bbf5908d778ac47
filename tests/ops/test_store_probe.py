"""The capability probe against the session's SeaweedFS, directly and behind the quirk proxy."""

from __future__ import annotations

import uuid

import pytest

from edgehaul.blocks import ObjectStore, RetentionPolicy
from edgehaul.blocks.policies import RetentionRule
from edgehaul.ops import store_probe
from edgehaul_dev import localstack
from tests.conftest import EXTERNAL_S3
from tests.s3_quirk_proxy import MODES, QuirkProxy


def _store(stack: localstack.StackState, url: str) -> ObjectStore:
    return stack.store("admin", f"p-{uuid.uuid4().hex[:10]}", inline_keys=True, endpoint=url)


@pytest.mark.integration
def test_the_probe_finds_what_each_server_does_and_flows_refuse_what_is_missing(
    stack: localstack.StackState, capsys: pytest.CaptureFixture[str]
) -> None:
    direct = {c.feature: c.present for c in store_probe.probe(_store(stack, stack.s3_endpoint))}
    missing = {f for f, ok in direct.items() if not ok}
    assert direct["put-if-none-match"], direct  # the one feature nothing replaces
    if not EXTERNAL_S3:  # the local SeaweedFS 4.48: everything but server-side Transition rules (501)
        assert missing == {"lifecycle-transition-rules"}, direct
    px = QuirkProxy(stack.s3_endpoint, {c.access_key_id: c.secret_access_key for c in stack.identities.values()},
                    MODES["other-server"]).start()
    try:
        store = _store(stack, px.url)
        checks = store_probe.probe(store)
        found = {c.feature: c.present for c in checks}
        # what the server lacks, plus what the proxy's quirks take away
        assert {f for f, ok in found.items() if not ok} == missing | {
            "put-if-match-quoted", "mpu-complete-if-none-match", "checksum-sha256-enforced", "copy-source-if-match",
            "head-missing-404", "lifecycle-size-filter",
            *(f"storage-class {c}" for c in ("STANDARD_IA", "ONEZONE_IA", "GLACIER_IR", "GLACIER", "DEEP_ARCHIVE")),
        }, found
        for kept in ("put-if-match-unquoted", "content-md5-enforced", "etag-is-md5"):  # no quirk touches these
            assert found[kept] == direct[kept], kept
        # nothing recorded yet: nothing refused on a guess
        store_probe.require(store, {"put-if-match-quoted": "a test"})
        store_probe.record(store, checks)
        policy = RetentionPolicy(rules=[RetentionRule(data_class="model_weights", cold_storage_class="GLACIER_IR")])
        with pytest.raises(store_probe.StoreCapabilityError, match="GLACIER_IR"):
            store_probe.check_policy(store, policy)
        with pytest.raises(store_probe.StoreCapabilityError, match="put-if-match-quoted"):
            store_probe.require(store, {"put-if-match-quoted": "a test"})
        # either form of If-Match is enough for the claims and the model pointer
        store_probe.require(store, {"put-if-match-quoted|put-if-match-unquoted": "publish_model"})
    finally:
        px.stop()
    assert store_probe.main(["--endpoint", stack.s3_endpoint, "--no-record", "--no-lifecycle"]) == 0
    assert "| put-if-none-match | yes |" in capsys.readouterr().out
