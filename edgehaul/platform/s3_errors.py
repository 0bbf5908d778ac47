"""The one rule for S3 errors: which are worth another attempt, and how many attempts there are in all.

Every stage and every task's `retry_condition_fn` asks `is_retryable`; nothing else classifies S3
errors. The attempt budget is bounded end to end:

- the boto3 client (`ObjectStore.client`) makes up to `CLIENT_MAX_ATTEMPTS` attempts of each request
  in botocore's standard mode (throttling, 5xx and dropped connections, with backoff);
- a Prefect task retries (`TASK_RETRIES`) only an error that is retryable *and* that the client did not
  already retry to its limit, so a request is tried at most `CLIENT_MAX_ATTEMPTS` times by the client,
  and a task only re-runs for failures no single request retry covers (a stream cut mid-read, a killed
  training process).

Throttling (`SlowDown`, `Throttling*`, HTTP 429, 503) is retryable everywhere; access, signature,
missing-bucket and digest errors never are: they need a person, not a retry.
"""

from __future__ import annotations

import logging
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError

CLIENT_MAX_ATTEMPTS = 3
TASK_RETRIES = 2
TASK_RETRY_DELAYS_S: list[float] = [2.0, 10.0]

# Server-side conditions a later attempt can get past.
RETRYABLE_CODES = frozenset({
    "RequestTimeout", "SlowDown", "Throttling", "ThrottlingException", "ServiceUnavailable", "InternalError",
    "RequestLimitExceeded", "TooManyRequests", "OperationAborted", "RequestTimeTooSkewed",
    "500", "502", "503", "504",
})
# Conditions no retry fixes, whatever the HTTP status says.
PERMANENT_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket", "InvalidBucketName",
    "BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "InvalidArgument", "InvalidStorageClass",
    "NotImplemented", "PreconditionFailed", "InvalidRequest", "EntityTooLarge",
})
DIGEST_CODES = frozenset({"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch"})

log = logging.getLogger(__name__)


def error_code(exc: BaseException) -> str:
    """The S3 error code of a ClientError ('' for anything else)."""
    if isinstance(exc, ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def http_status(exc: BaseException) -> int:
    if isinstance(exc, ClientError):
        return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return 0


def client_attempts(exc: BaseException) -> int:
    """How many attempts the boto3 client already made of the failed request (1 when unknown)."""
    if isinstance(exc, ClientError):
        return 1 + int(exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0)
    return 1


def is_retryable(exc: BaseException | None) -> bool:
    """Whether an error is safe and useful to retry: dropped connections, 5xx, throttling.

    Walks the cause chain (a stage may wrap the S3 error); an exception that carries its own verdict
    as a boolean `retryable` attribute (e.g. `UplinkError`) decides for itself.
    """
    seen = 0
    while exc is not None and seen < 8:
        verdict = getattr(exc, "retryable", None)
        if isinstance(verdict, bool):
            return verdict
        if isinstance(exc, BotoConnectionError | HTTPClientError | ConnectionError | TimeoutError):
            return True
        if isinstance(exc, ClientError):
            code = error_code(exc)
            if code in PERMANENT_CODES:
                return False
            status = http_status(exc)
            return code in RETRYABLE_CODES or status >= 500 or status == 429
        if isinstance(exc, BotoCoreError):
            return False
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def worth_a_task_retry(exc: BaseException) -> bool:
    """Retryable, and not already retried to its limit by the client (which would only multiply attempts)."""
    return is_retryable(exc) and client_attempts(exc) < CLIENT_MAX_ATTEMPTS


def retry_condition(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn` for every task that does S3 or network I/O."""
    try:
        exc = state.result(raise_on_failure=False)
    except Exception as e:  # the result could not be read: judge that error
        exc = e
    if not isinstance(exc, BaseException):
        return False
    what = error_code(exc) or type(exc).__name__
    if worth_a_task_retry(exc):
        log.warning("retrying %s after %s: a later attempt can get past it", getattr(task, "name", "task"), what)
        return True
    why = f"the client already tried it {client_attempts(exc)} times" if is_retryable(exc) else "not retryable"
    log.error("not retrying %s after %s: %s", getattr(task, "name", "task"), what, why)
    return False


# `@task(**IO_RETRY, ...)`: the task-level half of the budget, the same for every task doing S3 I/O.
IO_RETRY: dict[str, Any] = {
    "retries": TASK_RETRIES, "retry_delay_seconds": TASK_RETRY_DELAYS_S, "retry_condition_fn": retry_condition,
}
