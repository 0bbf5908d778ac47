"""The one S3 retry rule (edgehaul.platform.s3_errors): what is retried, and the bounded budget."""

from __future__ import annotations

from botocore.exceptions import ClientError, EndpointConnectionError
from hypothesis import given
from hypothesis import strategies as st

from edgehaul.platform import s3_errors
from edgehaul.training.launch import LaunchError
from edgehaul.uplink.link import LinkDown
from edgehaul.uplink.transfer import UplinkError


def s3_error(code: str, status: int, client_retries: int = 0) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"},  # type: ignore[typeddict-item]
                        "ResponseMetadata": {"HTTPStatusCode": status, "RetryAttempts": client_retries}}, "GetObject")


def test_throttling_and_5xx_are_retried_access_and_digest_errors_are_not() -> None:
    for code, status in (("SlowDown", 503), ("Throttling", 400), ("TooManyRequests", 429), ("InternalError", 500),
                         ("Whatever", 502), ("", 429)):
        assert s3_errors.is_retryable(s3_error(code, status)), code
    for code, status in (("AccessDenied", 403), ("NoSuchBucket", 404), ("BadDigest", 400),
                         ("SignatureDoesNotMatch", 403), ("InvalidStorageClass", 400)):
        assert not s3_errors.is_retryable(s3_error(code, status)), code


def test_connection_errors_link_down_and_killed_training_are_retried() -> None:
    assert s3_errors.is_retryable(EndpointConnectionError(endpoint_url="http://x"))
    assert s3_errors.is_retryable(LinkDown(endpoint_url="http://x", why="outage"))
    assert s3_errors.is_retryable(LaunchError("killed"))
    assert s3_errors.is_retryable(ConnectionResetError())
    assert not s3_errors.is_retryable(ValueError("bad input"))


def test_a_wrapped_error_is_judged_by_its_cause_and_an_own_verdict_wins() -> None:
    try:
        try:
            raise s3_error("SlowDown", 503)
        except ClientError as e:
            raise RuntimeError("commit failed") from e
    except RuntimeError as outer:
        assert s3_errors.is_retryable(outer)
    assert not s3_errors.is_retryable(UplinkError("checksum rejected 3 times", retryable=False))
    assert s3_errors.is_retryable(UplinkError("landed bytes differ, re-send", retryable=True))


@given(code=st.sampled_from(sorted(s3_errors.PERMANENT_CODES)), status=st.integers(400, 599),
       retries=st.integers(0, 10))
def test_a_permanent_code_is_never_retried_whatever_the_status(code: str, status: int, retries: int) -> None:
    assert not s3_errors.is_retryable(s3_error(code, status, retries))
    assert not s3_errors.worth_a_task_retry(s3_error(code, status, retries))


@given(retries=st.integers(0, 10))
def test_tasks_do_not_multiply_the_clients_attempts(retries: int) -> None:
    """Bounded end to end: a request the client already tried to its limit is not re-run by the task."""
    exc = s3_error("SlowDown", 503, retries)
    assert s3_errors.worth_a_task_retry(exc) is (1 + retries < s3_errors.CLIENT_MAX_ATTEMPTS)


def test_the_object_store_client_uses_the_same_budget() -> None:
    from pydantic import SecretStr

    from edgehaul.blocks import ObjectStore

    store = ObjectStore(endpoint_url="http://127.0.0.1:1", access_key_id=SecretStr("a"), secret_access_key=SecretStr("b"))
    c = store.client()
    assert c.meta.config.retries["total_max_attempts"] == s3_errors.CLIENT_MAX_ATTEMPTS
