"""Envoy's own replies (413 over the buffer, ext_proc failures, timeouts) in Sluice's error shape.

Envoy answers some requests itself, before or instead of asking ext_proc; the
local-reply mappers below give those the OpenAI error JSON and an ``x-sluice-reason``
so clients and dashboards see one vocabulary for every rejection.
"""

from __future__ import annotations

from dataclasses import dataclass

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

from extproc.envoy.clusters import DRAIN_CLUSTER
from extproc.policy.reasons import Reason

__all__ = ["ENVOY_REPLIES", "EnvoyReply", "local_reply_config"]


# Replies Envoy makes itself (not Sluice's immediate responses, whose details differ),
# rewritten to the OpenAI error shape with an x-sluice-reason like every other rejection.
@dataclass(frozen=True)
class EnvoyReply:
    reason: Reason  # its status and error type are the reason's
    message: str
    expression: str  # CEL over the reply's response code details
    rewrite_status: bool = False  # answer the reason's status instead of the one Envoy chose
    headers: tuple[tuple[str, str], ...] = ()


ENVOY_REPLIES: tuple[EnvoyReply, ...] = (
    EnvoyReply(
        Reason.BODY_TOO_LARGE, "request body exceeds the gateway's buffer",
        "response.code_details == 'request_payload_too_large'",
    ),
    # ext_proc unreachable or failing answers status_on_error (503); a message_timeout
    # expiry answers 504 (details ext_proc_error_...timeout). Both mean the same thing to a
    # client, admission control did not answer, so both become 503 with Retry-After.
    EnvoyReply(
        Reason.GATEWAY_UNAVAILABLE, "admission control is unavailable",
        "response.code_details.startsWith('ext_proc_error')"
        " || response.code_details.startsWith('mismatch_between_content_length')"
        # the drain (extproc's admin port) unreachable: extproc is down
        f" || (xds.cluster_name == '{DRAIN_CLUSTER}'"
        " && response.code_details.startsWith('upstream_reset_before_response_started'))",
        rewrite_status=True, headers=(("retry-after", "1"),),
    ),
    # The edge rate limit (extproc.envoy.edge): a key, or a client address, over its rate.
    EnvoyReply(
        Reason.EDGE_RATE_LIMITED, "too many requests from this key or address",
        "response.code_details == 'local_rate_limited'", headers=(("retry-after", "1"),),
    ),
    # request_headers_timeout / request_timeout (408): a client too slow to send its request.
    EnvoyReply(
        Reason.REQUEST_TIMEOUT, "the request was not received in time",
        "response.code_details == 'request_overall_timeout'"
        " || response.code_details == 'request_header_timeout'",
    ),
)


def _header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(
        header=HeaderValue(key=key, value=value),
        append_action=HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def local_reply_config() -> LocalReplyConfig:
    mappers = []
    for reply in ENVOY_REPLIES:
        # The same four keys as every other error body (extproc.openai_api.errors.error_body).
        error = {"message": reply.message, "type": reply.reason.error_type, "param": None,
                 "code": str(reply.reason)}
        mapper = ResponseMapper(
            filter=AccessLogFilter(
                extension_filter=ExtensionFilter(
                    name="envoy.access_loggers.extension_filters.cel",
                    typed_config=Any.pack(ExpressionFilter(expression=reply.expression)),
                )
            ),
            headers_to_add=[_header("x-sluice-reason", str(reply.reason)),
                            *(_header(k, v) for k, v in reply.headers)],
            body_format_override=SubstitutionFormatString(
                json_format=Struct.from_dict({"error": error}),
                content_type="application/json",
            ),
        )
        if reply.rewrite_status:
            mapper.status_code = reply.reason.status
        mappers.append(mapper)
    return LocalReplyConfig(mappers=mappers)
