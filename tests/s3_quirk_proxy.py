"""An HTTP proxy in front of the session's SeaweedFS that behaves like other S3 servers do.

boto3 is pointed at the proxy; requests are forwarded byte for byte (Host header included, so the
client's SigV4 signature still verifies) unless a quirk changes them. A quirk that removes or
rewrites a signed header (a checksum, a condition) re-signs the request with the same identity's
secret, which the proxy is given like the server's own identity file: the backend then sees exactly
the request that server would have acted on. Quirks that answer by themselves (412, 400, 403) never
reach the backend. Nothing is faked on success: every 200 comes from SeaweedFS.

Quirks (as measured on another widely deployed S3 server, /work/shared/FACTS.md):
- `ignore-checksums`: x-amz-checksum-* are dropped before the server sees them (a wrong sum is
  accepted) and the claimed sum is echoed in the response, as an accepting server does;
- `ignore-content-md5`: Content-MD5 is dropped too (with `ignore-checksums`: a server that checks nothing);
- `quoted-if-match-412`: If-Match with the ETag in quotes gets 412; unquoted is honoured;
- `ignore-mpu-if-none-match`: If-None-Match on CompleteMultipartUpload is dropped;
- `ignore-copy-if-match`: every copy condition (x-amz-copy-source-if-match, -if-none-match,
  -if-modified-since, -if-unmodified-since; copy and part copy) is dropped;
- `standard-class-only`: any storage class other than STANDARD is refused (400 InvalidArgument);
- `drop-lifecycle-filters`: size filters in a PutBucketLifecycleConfiguration are removed;
- `head-403`: HEAD of a missing key answers 403 (what an identity without ListBucket gets on AWS).
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

QUIRKS = frozenset({
    "ignore-checksums", "ignore-content-md5", "quoted-if-match-412", "ignore-mpu-if-none-match",
    "ignore-copy-if-match", "standard-class-only", "drop-lifecycle-filters", "head-403",
})
# The measured other server (all quirks at once), a server that checks no integrity header at all, and
# one that copies whatever the source holds when the copy runs (no copy condition honoured).
MODES: dict[str, frozenset[str]] = {
    "seaweedfs": frozenset(),
    "other-server": QUIRKS - {"ignore-content-md5"},
    "checks-nothing": frozenset({"ignore-checksums", "ignore-content-md5"}),
    "ignores-copy-conditions": frozenset({"ignore-copy-if-match"}),
}
STATS_PATH = "/_quirk_proxy/stats"  # not a valid bucket name: never an S3 request
_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "expect"}
_CRED = re.compile(r"Credential=([^/]+)/\d{8}/([^/]+)/s3/aws4_request")
_PART_SUM = re.compile(rb"<Checksum(?:SHA256|SHA1|CRC32|CRC32C|CRC64NVME)>[^<]*</Checksum[A-Z0-9]+>")
_SIZE_FILTER = re.compile(rb"<ObjectSize(?:GreaterThan|LessThan)>\d+</ObjectSize(?:GreaterThan|LessThan)>")


def _error(code: str, message: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
            "</Error>").encode()


class QuirkProxy:
    """`QuirkProxy(backend_url, {access_key_id: secret}, quirks).start()`; `.url`; `.stats` counts what it did.

    The server runs in a child process: an in-process proxy deadlocks with clients that keep the GIL
    while they wait for the network (deltalake's `history()` does)."""

    def __init__(self, backend_url: str, secrets: dict[str, str], quirks: Iterable[str] = ()) -> None:
        unknown = set(quirks) - QUIRKS
        if unknown:
            raise ValueError(f"unknown quirks {sorted(unknown)}; known: {sorted(QUIRKS)}")
        self.quirks = frozenset(quirks)
        self._args = {"backend": backend_url, "secrets": dict(secrets), "quirks": sorted(self.quirks)}
        self._proc: subprocess.Popen[bytes] | None = None
        self._port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> QuirkProxy:
        root = Path(__file__).resolve().parents[1]
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.s3_quirk_proxy"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, cwd=root)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(self._args).encode())
        self._proc.stdin.close()  # secrets over a pipe, never on the command line
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"quirk proxy did not start (exit {self._proc.wait()})")
        self._port = int(line)
        return self

    @property
    def stats(self) -> Counter[str]:
        with urllib.request.urlopen(f"{self.url}{STATS_PATH}", timeout=10) as r:
            return Counter(json.loads(r.read()))

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=10)


class _Server:
    """The proxy itself (runs in the child process)."""

    def __init__(self, backend_url: str, secrets: dict[str, str], quirks: Iterable[str] = ()) -> None:
        unknown = set(quirks) - QUIRKS
        if unknown:
            raise ValueError(f"unknown quirks {sorted(unknown)}; known: {sorted(QUIRKS)}")
        self.quirks = frozenset(quirks)
        self.secrets = dict(secrets)
        u = urlsplit(backend_url)
        self.https = u.scheme == "https"
        self.backend = (u.hostname or "127.0.0.1", u.port or (443 if self.https else 80))
        self.stats: Counter[str] = Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True

    def serve(self) -> None:
        print(self._server.server_address[1], flush=True)
        self._server.serve_forever()

    def count(self, what: str) -> None:
        with self._lock:
            self.stats[what] += 1

    # ------------------------------------------------------------------------------------------
    def _read_body(self, h: BaseHTTPRequestHandler) -> bytes:
        if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(h.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    h.rfile.readline()
                    return bytes(out)
                out += h.rfile.read(size)
                h.rfile.readline()
        n = int(h.headers.get("Content-Length") or 0)
        return h.rfile.read(n) if n else b""

    def _reply(self, h: BaseHTTPRequestHandler, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        h.send_response(status)
        length = str(len(body))
        for k, v in headers:
            if k.lower() == "content-length" and h.command == "HEAD":
                length = v  # a HEAD answer has no body but says the object's size
            elif k.lower() not in _HOP and k.lower() != "content-length":
                h.send_header(k, v)
        h.send_header("Content-Length", length)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def _resign(self, method: str, path: str, headers: dict[str, str], body: bytes) -> dict[str, str]:
        m = _CRED.search(headers.get("Authorization", ""))
        if not m or m.group(1) not in self.secrets:
            raise PermissionError("request not signed by a known identity: cannot forward it changed")
        req = AWSRequest(method=method, url=f"http://{headers.get('Host', '')}{path}", data=body,
                         headers={k: v for k, v in headers.items() if k.lower() not in ("authorization", "x-amz-date")})
        S3SigV4Auth(Credentials(m.group(1), self.secrets[m.group(1)]), "s3", m.group(2)).add_auth(req)
        return dict(req.headers.items())

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        body = self._read_body(h)
        if h.path == STATS_PATH:
            with self._lock:
                return self._reply(h, 200, [("Content-Type", "application/json")], json.dumps(self.stats).encode())
        method, path = h.command, h.path
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
        lower = {k.lower(): k for k in headers}
        query = urlsplit(path).query
        q = self.quirks
        changed = False
        echo: dict[str, str] = {}

        def drop(name: str) -> None:
            nonlocal changed
            if name in lower:
                headers.pop(lower.pop(name))
                changed = True

        if "quoted-if-match-412" in q and headers.get(lower.get("if-match", ""), "").startswith('"'):
            self.count("412 quoted If-Match")
            return self._reply(h, 412, [("Content-Type", "application/xml")],
                               _error("PreconditionFailed", "At least one of the pre-conditions you specified did not hold"))
        sc = headers.get(lower.get("x-amz-storage-class", ""), "")
        if "standard-class-only" in q and sc and sc != "STANDARD":
            self.count(f"refused class {sc}")
            return self._reply(h, 400, [("Content-Type", "application/xml")], _error("InvalidArgument", ""))
        if method == "PUT" and "ignore-checksums" in q:
            for k in [k for k in lower if k.startswith("x-amz-checksum-") or k == "x-amz-sdk-checksum-algorithm"]:
                if k.startswith("x-amz-checksum-"):
                    echo[k] = headers[lower[k]]
                    self.count("checksum ignored")
                drop(k)
        if method == "POST" and "ignore-checksums" in q:
            drop("x-amz-checksum-algorithm")  # create: no checksum type recorded for the upload
            if "uploadId=" in query and _PART_SUM.search(body):
                body = _PART_SUM.sub(b"", body)  # complete: the parts' claimed sums are not compared
                changed = True
        if method == "PUT" and "ignore-content-md5" in q and "content-md5" in lower:
            self.count("Content-MD5 ignored")
            drop("content-md5")
        if method == "POST" and "uploadId=" in query and "ignore-mpu-if-none-match" in q and "if-none-match" in lower:
            self.count("complete If-None-Match ignored")
            drop("if-none-match")
        if "ignore-copy-if-match" in q:
            for k in [k for k in lower if k.startswith("x-amz-copy-source-if-")]:
                self.count("copy condition ignored")
                drop(k)
        lifecycle_put = method == "PUT" and "lifecycle" in query.split("&")
        if lifecycle_put and "drop-lifecycle-filters" in q and _SIZE_FILTER.search(body):
            self.count("lifecycle filter dropped")
            body = _SIZE_FILTER.sub(b"", body)
            for k in [k for k in lower if k.startswith("x-amz-checksum-") or k == "x-amz-sdk-checksum-algorithm"]:
                drop(k)
            headers["Content-MD5"] = base64.b64encode(hashlib.md5(body).digest()).decode()
            lower["content-md5"] = "Content-MD5"
            changed = True
        if changed:
            if "content-length" in lower:
                headers[lower["content-length"]] = str(len(body))  # signed: must be the forwarded body's
            try:
                headers = self._resign(method, path, headers, body)
            except PermissionError as e:
                return self._reply(h, 403, [("Content-Type", "application/xml")], _error("AccessDenied", str(e)))
        headers = {k: v for k, v in headers.items() if k.lower() != "content-length"} | {"Content-Length": str(len(body))}
        conn = (http.client.HTTPSConnection if self.https else http.client.HTTPConnection)(*self.backend, timeout=120)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            status, out = resp.status, list(resp.getheaders())
        finally:
            conn.close()
        if method == "HEAD" and status == 404 and "head-403" in q:
            self.count("HEAD 404 -> 403")
            status = 403
        if status == 200 and echo:
            out = [(k, v) for k, v in out if k.lower() not in echo] + list(echo.items())
        self._reply(h, status, out, data)
        return None


def _exit_with_parent(parent: int) -> None:
    # A test process killed without stop() must not leave its proxy behind.
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(0)


if __name__ == "__main__":
    a = json.loads(sys.stdin.read())
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    _Server(a["backend"], a["secrets"], a["quirks"]).serve()
