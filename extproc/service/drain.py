"""The drain: reads and discards an oversized upload, then answers 413.

Why it exists: when a reply is complete before the request, Envoy's HTTP/1 codec closes
the connection with unread data, the kernel sends RST, and the client loses the 413 it
had not read yet (clients send the whole body before reading). Envoy has no lingering
close. So the generated config routes a request whose ``content-length`` is over the
body cap here instead (ext_proc disabled on that route), Envoy streams the body through,
this handler reads it in chunks and throws them away, and the 413 arrives after the
request is complete, on a connection the client can read.

Bounded by the policy: past ``gateway.drain_max_bytes`` (a content-length over it is
refused at once) or ``gateway.drain_timeout_s`` the handler answers 413 without reading
on and closes the connection; that client may then see a reset, which is the point of
the bound. Nothing is buffered: aiohttp's reader holds at most its high-water mark.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import ClientPayloadError, web
from aiohttp.http_exceptions import HttpProcessingError

from extproc.envoy.headers import LIMIT_HEADER
from extproc.openai_api.errors import error_body

if TYPE_CHECKING:
    from extproc.runtime.runtime import Runtime

REASON = "body_too_large"
_CHUNK = 256 * 1024


def _reply(size: str, limit: int, *, close: bool) -> web.Response:
    message = f"Request body is {size}; the limit is {limit} bytes."
    resp = web.Response(
        status=413,
        body=error_body(message, "invalid_request_error", REASON, None),
        headers={"content-type": "application/json", "x-sluice-reason": REASON,
                 # The OpenAI SDKs read this before their own retry rules.
                 "x-should-retry": "false"},
    )
    if close:
        resp.force_close()
    return resp


def drain_handler(runtime: Runtime):  # noqa: ANN201 - an aiohttp handler
    async def drain(request: web.Request) -> web.Response:
        gw = runtime.policy.gateway
        m = runtime.metrics
        header = request.headers.get(LIMIT_HEADER, "")
        limit = int(header) if header.isdigit() else gw.max_body_bytes
        length = request.content_length
        size = f"{length} bytes" if length is not None else "too large"
        m.rejected(REASON, 413)  # no sluice_requests: the ext_proc never saw it
        if length is not None and length > gw.drain_max_bytes:
            m.drained_upload("over_drain_limit")
            return _reply(size, limit, close=True)
        read, outcome = 0, "drained"
        try:
            async with asyncio.timeout(gw.drain_timeout_s):
                while True:
                    chunk = await request.content.read(_CHUNK)
                    if not chunk:
                        break
                    read += len(chunk)
                    if read > gw.drain_max_bytes:
                        outcome = "over_drain_limit"
                        break
        except TimeoutError:
            outcome = "timeout"
        except (ConnectionError, ClientPayloadError, HttpProcessingError):
            outcome = "client_gone"  # the upload ended early: the answer goes nowhere
        m.drained_upload(outcome, read)
        return _reply(size, limit, close=outcome != "drained")

    return drain
