"""OpenAI-shaped error bodies and the rate-limit headers clients act on."""

from __future__ import annotations

import json
import math

# (HTTP status, OpenAI error type) per Sluice rejection reason.
REASONS: dict[str, tuple[int, str]] = {
    "unknown_key": (401, "invalid_request_error"),
    "unknown_path": (404, "invalid_request_error"),
    "unknown_model": (404, "invalid_request_error"),
    "body_too_large": (413, "invalid_request_error"),
    "bad_request": (400, "invalid_request_error"),
    "context_length": (400, "invalid_request_error"),
    "too_large_for_backend": (400, "invalid_request_error"),
    "tpm": (429, "rate_limit_exceeded"),
    "tpm_request_too_large": (429, "rate_limit_exceeded"),
    "rpm": (429, "rate_limit_exceeded"),
    "slots": (429, "rate_limit_exceeded"),
    "queue_full": (429, "rate_limit_exceeded"),
    "queue_timeout": (503, "server_error"),
    "breaker_open": (503, "server_error"),
    "overloaded": (503, "server_error"),
    "state_store_down": (503, "server_error"),
    "internal": (500, "server_error"),
}


def error_body(message: str, etype: str, code: str | None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": etype, "param": param, "code": code}},
                      ensure_ascii=False).encode()


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: '1s', '6m0s', '20ms'."""
    if seconds <= 0:
        return "0s"
    if not math.isfinite(seconds):
        return "0s" if math.isnan(seconds) else "1h0m0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    s = math.ceil(seconds * 10) / 10
    minutes, rest = divmod(s, 60)
    rest_s = f"{rest:.1f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{rest_s}s" if minutes else f"{rest_s}s"


def retry_after_headers(seconds: float) -> dict[str, str]:
    seconds = seconds if math.isfinite(seconds) else 3600.0  # "never" still needs a number
    return {"retry-after": str(max(1, math.ceil(seconds))), "retry-after-ms": str(max(1, math.ceil(seconds * 1000)))}
