"""Standard Webhooks signing: the one way the product signs a request (a node's forwarder, tests, scripts)
and computes the signature the gateway checks. The HMAC itself is the `standardwebhooks` library's."""

from __future__ import annotations

import base64
import binascii
import os
import time
import uuid
from datetime import UTC, datetime

from standardwebhooks.webhooks import Webhook

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
SECRET_PREFIX = "whsec_"


def new_secret(nbytes: int = 32) -> str:
    """A fresh sender key in the Standard Webhooks form `whsec_<base64>`."""
    return SECRET_PREFIX + base64.b64encode(os.urandom(nbytes)).decode()


def secret_bytes(secret: str | bytes) -> bytes:
    """The key's bytes; a `whsec_` key must be valid base64 (the library would decode junk silently)."""
    if isinstance(secret, bytes):
        return secret
    raw = secret.removeprefix(SECRET_PREFIX)
    try:
        return base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("a sender key must be 'whsec_' followed by base64") from None


def sign(secret: str | bytes, msg_id: str, timestamp: str, body: bytes) -> str:
    """One `webhook-signature` entry (`v1,<base64>`) for `body`; `timestamp` is integer unix seconds."""
    return Webhook(secret_bytes(secret)).sign(msg_id, datetime.fromtimestamp(int(timestamp), UTC), body)


def digest(secret: str | bytes, msg_id: str, timestamp: str, body: bytes) -> bytes:
    """The raw 32-byte v1 signature of `sign`, for a constant-time comparison."""
    return base64.b64decode(sign(secret, msg_id, timestamp, body).removeprefix("v1,"))


def signed_headers(secret: str | bytes, body: bytes, *, msg_id: str | None = None,
                   now: float | None = None) -> dict[str, str]:
    """Headers of a signed request (any Standard Webhooks library makes the same)."""
    msg_id = msg_id or f"msg_{uuid.uuid4().hex}"
    ts = str(int(time.time() if now is None else now))
    return {"content-type": "application/json", ID_HEADER: msg_id, TIMESTAMP_HEADER: ts,
            SIGNATURE_HEADER: sign(secret, msg_id, ts, body)}
