"""Standard Webhooks signing: the one way the product signs a request (a node's forwarder, tests, scripts)
and computes the signature the gateway checks. The HMAC is the `standardwebhooks` library's; tests check
that its `Webhook.verify` accepts what `signed_headers` makes."""

from __future__ import annotations

import base64
import binascii
import os
import time
import uuid

from standardwebhooks.webhooks import hmac_data

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


def digest(secret: str | bytes, msg_id: str, timestamp: str, body: bytes) -> bytes:
    """The raw 32-byte v1 signature over `id.timestamp.body`, the timestamp as the header carries it (so a
    malformed one can still be signed, to test that it is refused), for a constant-time comparison."""
    return hmac_data(secret_bytes(secret), f"{msg_id}.{timestamp}.".encode() + body)


def sign(secret: str | bytes, msg_id: str, timestamp: str, body: bytes) -> str:
    """One `webhook-signature` entry (`v1,<base64>`) for `body`."""
    return "v1," + base64.b64encode(digest(secret, msg_id, timestamp, body)).decode()


def signed_headers(secret: str | bytes, body: bytes, *, msg_id: str | None = None,
                   now: float | None = None) -> dict[str, str]:
    """Headers of a signed request (any Standard Webhooks library makes the same)."""
    msg_id = msg_id or f"msg_{uuid.uuid4().hex}"
    ts = str(int(time.time() if now is None else now))
    return {"content-type": "application/json", ID_HEADER: msg_id, TIMESTAMP_HEADER: ts,
            SIGNATURE_HEADER: sign(secret, msg_id, ts, body)}
