"""Credentials in query strings: the parameters Sluice removes before a path goes upstream.

Clients (and some SDKs' ``default_query``) put API keys in the URL. Sluice reads keys only
from ``authorization`` / ``x-api-key``; a key in the query would otherwise be forwarded
to the backend as sent. The access log records paths without their query string at all.
"""

from __future__ import annotations

from urllib.parse import unquote_plus

__all__ = ["CREDENTIAL_PARAMS", "redact_query"]

# Matched case-insensitively against each parameter's decoded name.
CREDENTIAL_PARAMS = frozenset({"api_key", "api-key", "apikey", "key", "access_token", "token", "auth",
                               "authorization", "x-api-key"})


def _is_credential(piece: str) -> bool:
    return unquote_plus(piece.split("=", 1)[0]).strip().lower() in CREDENTIAL_PARAMS


def redact_query(path: str) -> str:
    """``path`` without credential parameters (the others kept as sent, in order)."""
    base, sep, query = path.partition("?")
    if not sep:
        return path
    kept = [p for p in query.split("&") if p and not _is_credential(p)]
    return f"{base}?{'&'.join(kept)}" if kept else base
