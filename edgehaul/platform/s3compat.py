"""What the product needs from an S3 server, written once so it does not depend on one server's quirks.

- ETags: `unquoted` / `quoted`, the multipart form (`multipart_etag`: md5 of the concatenated part MD5s + "-N").
- Conditional writes: `if_match(...)` sends `If-Match` (or `CopySourceIfMatch`) in a fixed order of
  forms, quoted (RFC 7232, as S3 returns it) then unquoted, and remembers per endpoint the form the
  server honoured. A server that answers 412 to one form and accepts the other (seen in the field)
  then costs one extra request per process, not a claim that is never taken over.
- `is_precondition_failed(exc)`: one rule for "the condition did not hold".
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable
from typing import Literal, TypeVar

from botocore.exceptions import ClientError

from edgehaul.platform.s3_errors import error_code, http_status

T = TypeVar("T")
EtagForm = Literal["quoted", "unquoted"]
FORMS: tuple[EtagForm, ...] = ("quoted", "unquoted")  # the fixed order in which forms are tried
PRECONDITION_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict"})
_MD5_HEX = re.compile(r"[0-9a-f]{32}")
_MPU = re.compile(r"([0-9a-f]{32})-(\d+)")


def unquoted(etag: str | None) -> str:
    return (etag or "").strip().removeprefix("W/").strip('"')


def quoted(etag: str | None) -> str:
    return f'"{unquoted(etag)}"'


def form(etag: str, f: EtagForm) -> str:
    return quoted(etag) if f == "quoted" else unquoted(etag)


def multipart_etag(part_md5s: list[bytes]) -> str:
    """S3's multipart ETag: md5 of the concatenated binary part MD5s, then "-<parts>"."""
    return f"{hashlib.md5(b''.join(part_md5s)).hexdigest()}-{len(part_md5s)}"


def multipart_etag_of(data: bytes, part_bytes: int) -> str:
    view = memoryview(data)
    return multipart_etag([hashlib.md5(view[i : i + part_bytes]).digest() for i in range(0, len(data), part_bytes)])


def is_md5(etag: str | None) -> bool:
    """Whether an ETag has the shape of a plain MD5 (single PUT without SSE-KMS on S3-compatible servers)."""
    return bool(_MD5_HEX.fullmatch(unquoted(etag).lower()))


def multipart_parts(etag: str | None) -> int | None:
    m = _MPU.fullmatch(unquoted(etag).lower())
    return int(m.group(2)) if m else None


status = http_status  # the S3 error rule's own readers (edgehaul.platform.s3_errors)
code = error_code


def is_precondition_failed(exc: BaseException) -> bool:
    return isinstance(exc, ClientError) and (code(exc) in PRECONDITION_CODES or status(exc) == 412)


def is_missing(exc: BaseException) -> bool:
    return isinstance(exc, ClientError) and (code(exc) in ("404", "NoSuchKey", "NotFound") or status(exc) == 404)


# -------------------------------------------------------------------------- If-Match, per endpoint

_lock = threading.Lock()
_honoured: dict[tuple[str, str], EtagForm] = {}  # (endpoint, "put" | "copy") -> form the server honoured


def remembered(endpoint: str | None, op: str = "put") -> EtagForm | None:
    with _lock:
        return _honoured.get((endpoint or "aws", op))


def remember(endpoint: str | None, op: str, f: EtagForm) -> None:
    with _lock:
        _honoured[(endpoint or "aws", op)] = f


def forget_all() -> None:
    """Tests: start from no knowledge (another server behind the same endpoint)."""
    with _lock:
        _honoured.clear()


def if_match(endpoint: str | None, etag: str, call: Callable[[str], T], *, op: str = "put") -> T:
    """Run `call(etag_in_some_form)` as a conditional request that holds only if the object still has `etag`.

    The remembered form goes first; otherwise quoted, then unquoted. A 412 with one form is only
    final once every form said 412 (the object really changed): a server that misreads one form
    answers 412 to an unchanged object, and the other form then succeeds and is remembered. Each try
    is itself atomic on the server, so trying a second form never writes over a changed object.
    Raises the last 412 (`is_precondition_failed`) when no form held."""
    first = remembered(endpoint, op)
    order = [first, *(f for f in FORMS if f != first)] if first else list(FORMS)
    last: ClientError | None = None
    for f in order:
        try:
            out = call(form(etag, f))
        except ClientError as e:
            if not is_precondition_failed(e):
                raise
            last = e
            continue
        if first != f:
            remember(endpoint, op, f)
        return out
    assert last is not None
    raise last
