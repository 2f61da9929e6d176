"""Envoy's alpha token-usage extraction, behind one module: config in, usage out.

``response_processing: usage_trailers`` (the default) lets Envoy, not Python, read every
SSE event of a response. ``envoy.filters.http.ai_protocol_manager`` (alpha in Envoy
1.40) runs in each backend cluster's upstream filter chain, finds the ``usage`` object
of an OpenAI chat-completions response (the last SSE event, or the JSON body),
publishes it as typed filter metadata ``envoy.data.ai.v3.TokenUsage`` in namespace
``envoy.ai.token_usage`` and adds empty trailers at a clean end of stream
(``usage_signal: SYNTHESIZE_TRAILERS``). Sluice's ext_proc filter asks for response
trailers and forwards that namespace, so it gets *one* message per response carrying
the usage, whatever the response's length.

Neither xds-protos nor envoy-data-plane carries these types (envoy-data-plane's
``AiProtocolManager`` is an empty class), so:

- the filter config is a plain dict, spliced into the rendered bootstrap
  (``install``); ``envoy --mode validate`` checks it (tests/test_envoy_usage.py);
- ``TokenUsage`` is decoded with a message class built here from the field numbers
  that the 1.40 binary's own descriptor gives (``TOKEN_USAGE_FIELDS``); the test reads
  that descriptor out of the binary and fails if a field moved or was renamed.

Also here, because only this path needs it: the Lua filter that removes the usage
chunk Sluice asked the backend for on the client's behalf (``stream_options.
include_usage``), once ``ai_protocol_manager`` has read it. It acts only on 200 event
streams whose request set ``hide_usage`` in Sluice's dynamic metadata, and returns at
once for all others (an error body passes through untouched).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, message_factory, wrappers_pb2

AI_FILTER = "envoy.filters.http.ai_protocol_manager"
AI_FILTER_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ai_protocol_manager.v3.AiProtocolManager"
UPSTREAM_CODEC = "envoy.filters.http.upstream_codec"
UPSTREAM_CODEC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"
USAGE_NAMESPACE = "envoy.ai.token_usage"
TOKEN_USAGE = "envoy.data.ai.v3.TokenUsage"
LUA_FILTER = "envoy.filters.http.lua"
LUA_TYPE = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"
HIDE_USAGE_KEY = "hide_usage"  # in Sluice's dynamic metadata namespace ("sluice")

# What this module relies on in envoy/data/ai/v3/token_usage.proto, as the 1.40 binary
# has it: name -> (number, type). input/output/total are google.protobuf.UInt64Value.
TOKEN_USAGE_FIELDS: dict[str, tuple[int, str]] = {
    "input_tokens": (3, ".google.protobuf.UInt64Value"),
    "output_tokens": (4, ".google.protobuf.UInt64Value"),
    "total_tokens": (5, ".google.protobuf.UInt64Value"),
    "extraction_status": (9, ".envoy.data.ai.v3.TokenUsage.ExtractionStatus"),
}
EXTRACTION_COMPLETE = 1  # TokenUsage.ExtractionStatus.COMPLETE; PARTIAL = 2, FAILED = 3

# The AiProtocolManager fields the config below uses (name -> number), for the same check.
AI_CONFIG_FIELDS: dict[str, dict[str, int]] = {
    "AiProtocolManager": {"response_handling": 2},
    "ResponseHandling": {"token_usage": 1},
    "TokenUsageExtraction": {"include_unconfigured_routes": 1, "default_llm_protocol": 2,
                             "metadata_namespace": 3, "limits": 4, "usage_signal": 5},
    "TokenUsageExtractionLimits": {"max_sse_event_size": 1, "max_json_body_size": 2,
                                   "max_parsed_sse_events": 3},
}


def _token_usage_class() -> type:
    """A message class for TokenUsage in a private pool (never clashes with xds-protos)."""
    pool = descriptor_pool.DescriptorPool()
    pool.Add(descriptor_pb2.FileDescriptorProto.FromString(wrappers_pb2.DESCRIPTOR.serialized_pb))
    f = descriptor_pb2.FileDescriptorProto(name="sluice/envoy_token_usage.proto", package="envoy.data.ai.v3",
                                           syntax="proto3", dependency=["google/protobuf/wrappers.proto"])
    m = f.message_type.add(name="TokenUsage")
    e = m.enum_type.add(name="ExtractionStatus")
    for name, number in (("EXTRACTION_STATUS_UNSPECIFIED", 0), ("COMPLETE", 1), ("PARTIAL", 2), ("FAILED", 3)):
        e.value.add(name=name, number=number)
    for name, (number, type_name) in TOKEN_USAGE_FIELDS.items():
        kind = (descriptor_pb2.FieldDescriptorProto.TYPE_ENUM if type_name.endswith("ExtractionStatus")
                else descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE)
        m.field.add(name=name, number=number, type=kind, type_name=type_name,
                    label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(TOKEN_USAGE))


TokenUsage = _token_usage_class()


@dataclass(frozen=True)
class EnvoyUsage:
    input_tokens: int | None
    output_tokens: int | None
    total_tokens: int | None
    complete: bool


def usage_from_metadata(request: pb.ProcessingRequest) -> EnvoyUsage | None:
    """The TokenUsage forwarded with this message (response trailers), or None."""
    packed = request.metadata_context.typed_filter_metadata.get(USAGE_NAMESPACE)
    return None if packed is None else usage_from_any(packed)


def usage_from_any(packed: any_pb2.Any) -> EnvoyUsage | None:
    """The TokenUsage in ``packed`` (typed filter metadata ``envoy.ai.token_usage``, as
    ext_proc forwards it and the access log carries it), or None for another type."""
    if not packed.type_url.endswith("/" + TOKEN_USAGE):
        return None
    u = TokenUsage.FromString(packed.value)

    def get(name: str) -> int | None:
        return getattr(u, name).value if u.HasField(name) else None

    return EnvoyUsage(get("input_tokens"), get("output_tokens"), get("total_tokens"),
                      u.extraction_status == EXTRACTION_COMPLETE)


# -- Envoy config ----------------------------------------------------------------------
def ai_filter(max_json_body_bytes: int = 8 << 20, trailers: bool = True) -> dict[str, Any]:
    """``trailers``: add trailers at a clean end, which bring ext_proc the usage
    (``usage_trailers``); without them the metadata alone is written, which the access
    log carries (``access_log``; observed on 1.40)."""
    return {
        "name": AI_FILTER,
        "typed_config": {
            "@type": AI_FILTER_TYPE,
            "response_handling": {"token_usage": {
                # Every route: Sluice's routes are not configured per protocol.
                "include_unconfigured_routes": True,
                # Chat completions; /v1/completions has the same usage object.
                "default_llm_protocol": "OPENAI_CHAT_COMPLETIONS",
                "metadata_namespace": USAGE_NAMESPACE,
                **({"usage_signal": "SYNTHESIZE_TRAILERS"} if trailers else {}),
                "limits": {
                    "max_json_body_size": max_json_body_bytes,
                    "max_sse_event_size": 1 << 20,
                    # Too low a count gives extraction_status FAILED on long streams.
                    "max_parsed_sse_events": 1 << 30,
                },
            }},
        },
    }


def upstream_http_filters(trailers: bool = True) -> list[dict[str, Any]]:
    """The backend clusters' upstream filter chain (HttpProtocolOptions.http_filters).

    Upstream, the filter sees the response before the listener's ext_proc does; it is
    the placement with which response headers SEND still got its trailers reliably.
    """
    return [ai_filter(trailers=trailers), {"name": UPSTREAM_CODEC, "typed_config": {"@type": UPSTREAM_CODEC_TYPE}}]


# Drops `data: {..."choices":[],"usage":{...}}` events: the usage-only chunk. Events can
# straddle body chunks, so an unfinished trailing event is held back until it completes;
# one larger than 1 MiB is passed on as is. Whitespace-tolerant, like JSON.
HIDE_USAGE_LUA = r"""
local function is_usage(event)
  return event:find('"choices"%s*:%s*%[%s*%]') ~= nil and event:find('"usage"%s*:%s*{') ~= nil
end

-- Complete events of data minus the usage-only ones, and the unfinished tail.
local function split(data)
  local kept, start = {}, 1
  while true do
    local s, e = data:find("\r?\n\r?\n", start)
    if s == nil then break end
    local event = data:sub(start, e)
    if not is_usage(event) then kept[#kept + 1] = event end
    start = e + 1
  end
  return table.concat(kept), data:sub(start)
end

function envoy_on_response(handle)
  local md = handle:streamInfo():dynamicMetadata():get("sluice")
  if md == nil or md["hide_usage"] ~= "1" then return end
  -- Only an event stream has a usage chunk to drop. Anything else (a backend's JSON error
  -- for a streaming request) passes untouched: split() would hold it back as an unfinished
  -- event and the client would get an empty body.
  local ctype = handle:headers():get("content-type") or ""
  if handle:headers():get(":status") ~= "200" then return end
  if not ctype:find("text/event-stream", 1, true) then return end
  local held = ""
  for chunk in handle:bodyChunks() do
    local n = chunk:length()
    local data = chunk:getBytes(0, n)
    -- The common chunk: whole events, none with a usage object. Passed on untouched.
    if held ~= "" or data:find('"usage":{', 1, true) ~= nil or data:find('"usage": {', 1, true) ~= nil
        or data:sub(-2) ~= "\n\n" then
      local out
      out, held = split(held .. data)
      if #held > 1048576 then out, held = out .. held, "" end
      chunk:setBytes(out)
    end
  end
end
"""


def hide_usage_filter() -> dict[str, Any]:
    return {"name": LUA_FILTER, "typed_config": {
        "@type": LUA_TYPE, "default_source_code": {"inline_string": HIDE_USAGE_LUA}}}


def install(cfg: dict[str, Any], backend_clusters: set[str], hcm_filter_before: str,
            trailers: bool = True) -> dict[str, Any]:
    """Splice the usage path into a rendered bootstrap (a plain dict, snake_case).

    Adds the upstream filter chain to every backend cluster in ``backend_clusters`` and
    the Lua filter to each HTTP connection manager, right after ``hcm_filter_before``
    (the ext_proc filter: on the response path Lua then runs before it).
    """
    res = cfg["static_resources"]
    found = 0
    for cluster in res["clusters"]:
        if cluster["name"] not in backend_clusters:
            continue
        for opts in cluster.get("typed_extension_protocol_options", {}).values():
            opts["http_filters"] = upstream_http_filters(trailers)
            found += 1
    if found != len(backend_clusters):
        raise ValueError(f"expected protocol options on {len(backend_clusters)} backend clusters, found {found}")
    for listener in res["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                filters = f.get("typed_config", {}).get("http_filters")
                if filters is None:
                    continue
                at = next(i for i, h in enumerate(filters) if h["name"] == hcm_filter_before)
                filters.insert(at + 1, hide_usage_filter())
    return cfg
