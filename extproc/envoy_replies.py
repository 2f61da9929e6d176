"""Envoy's own replies (413 over the buffer, ext_proc failures) in Sluice's error shape.

Envoy answers some requests itself, before or instead of asking ext_proc; the
local-reply mappers below give those the OpenAI error JSON and an ``x-sluice-reason``
so clients and dashboards see one vocabulary for every rejection.
"""

from __future__ import annotations

# Every module whose messages are packed into an Any must be imported before to_dict().
from envoy_data_plane.envoy.config.accesslog.v3 import AccessLogFilter, ExtensionFilter
from envoy_data_plane.envoy.config.core.v3 import (
    HeaderValue,
    HeaderValueOption,
    HeaderValueOptionHeaderAppendAction,
    SubstitutionFormatString,
)
from envoy_data_plane.envoy.extensions.access_loggers.filters.cel.v3 import ExpressionFilter
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    LocalReplyConfig,
    ResponseMapper,
)
from envoy_data_plane.google.protobuf import Any, Struct

__all__ = ["local_reply_config"]


# Replies Envoy makes itself (not Sluice's immediate responses, whose details differ),
# rewritten to the OpenAI error shape with an x-sluice-reason like every other rejection:
# (reason, error type, message, CEL over the reply's response code details).
_ENVOY_REPLIES: tuple[tuple[str, str, str, str], ...] = (
    (
        "body_too_large",
        "invalid_request_error",
        "request body exceeds the gateway's buffer",
        "response.code_details == 'request_payload_too_large'",
    ),
    (
        "gateway_unavailable",
        "server_error",
        "admission control is unavailable",
        "response.code_details.startsWith('ext_proc_error')"
        " || response.code_details.startsWith('mismatch_between_content_length')",
    ),
)


def local_reply_config() -> LocalReplyConfig:
    mappers = []
    for reason, kind, message, expression in _ENVOY_REPLIES:
        error = {"message": message, "type": kind, "code": reason}
        mappers.append(
            ResponseMapper(
                filter=AccessLogFilter(
                    extension_filter=ExtensionFilter(
                        name="envoy.access_loggers.extension_filters.cel",
                        typed_config=Any.pack(ExpressionFilter(expression=expression)),
                    )
                ),
                headers_to_add=[
                    HeaderValueOption(
                        header=HeaderValue(key="x-sluice-reason", value=reason),
                        append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
                    )
                ],
                body_format_override=SubstitutionFormatString(
                    json_format=Struct.from_dict({"error": error}),
                    content_type="application/json",
                ),
            )
        )
    return LocalReplyConfig(mappers=mappers)
