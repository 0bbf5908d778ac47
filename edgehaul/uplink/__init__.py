"""Uplink stage, on each node: the shaped link (token bucket, priorities), bundle transfer with
multipart resume and end-to-end checks, and the retry queue (cap, expiry).

Imports the shared formats and `edgehaul.platform`; the spool it drains is any object with the
`SpoolSource` methods (`edgehaul.edge.spool.Spool` in production).
"""
