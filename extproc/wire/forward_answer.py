"""The answer that sends an admitted request on, written in wire form.

Every admitted request's deferred request-headers answer carries the same shape: a dozen
headers set and removed, ``clear_route_cache``, the ``x-ratelimit-*`` values as dynamic
metadata and the mode override. Built as upb messages it is Sluice's largest single piece
of work per request after admission (~25 µs, and ~3 to serialize); here the header pairs
and removals that repeat request after request are encoded once, and the answer is their
join. ``extproc.wire.messages.headers_response`` builds the same message (a test holds
the two equal); the gRPC writers pass bytes through.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from extproc.wire import messages as msg
from extproc.wire.pbwire import delimited, length, tag

_T1, _T2, _T3, _T5, _T8, _T9 = (tag(f) for f in (1, 2, 3, 5, 8, 9))
_CLEAR_ROUTE_CACHE = b"\x28\x01"  # CommonResponse.clear_route_cache = true (field 5, varint)
_CACHE_LIMIT = 4096  # header pairs kept encoded (tenant, tier, backend, endpoint: few distinct)

_SET: dict[tuple[str, str], bytes] = {}
_REMOVE: dict[tuple[str, ...], bytes] = {}
_MODES: dict[int, tuple[msg.PM, bytes]] = {}


def _set_header(key: str, value: str) -> bytes:
    """HeaderMutation.set_headers (field 1): one HeaderValueOption, overwriting. A HeaderMutation
    of that one header, serialized, is exactly that field: the builder's own, encoded once."""
    got = _SET.get((key, value))
    if got is None:
        got = msg.mutation({key: value}).SerializeToString()
        if len(_SET) < _CACHE_LIMIT:
            _SET[(key, value)] = got
    return got


def _removals(names: tuple[str, ...]) -> bytes:
    """HeaderMutation.remove_headers (field 2, repeated), as the builder writes them."""
    got = _REMOVE.get(names)
    if got is None:
        got = msg.mutation(remove=names).SerializeToString()
        if len(_REMOVE) < _CACHE_LIMIT:
            _REMOVE[names] = got
    return got


def _mode(mode: msg.PM) -> bytes:
    # The modes are module constants (extproc.wire.messages); keyed by identity, kept alive here.
    got = _MODES.get(id(mode))
    if got is None or got[0] is not mode:
        got = _MODES[id(mode)] = (mode, delimited(_T9, mode.SerializeToString()))
    return got[1]


_KEYS: dict[str, bytes] = {}


def _string_fields(values: Mapping[str, str]) -> bytes:
    """Struct.fields (field 1, a map): each value a Value.string_value (field 3). The keys
    repeat (the x-ratelimit-* names): each entry's key part is encoded once."""
    out = []
    for k, v in values.items():
        key = _KEYS.get(k)
        if key is None:
            key = delimited(_T1, k.encode()) + _T2  # MapEntry.key, then the value's field key
            if len(_KEYS) < _CACHE_LIMIT:
                _KEYS[k] = key
        vb = v.encode()
        n = len(vb)
        if n < 126 and len(key) + n < 124:  # every length one byte: the common case, formatted at once
            out.append(b"\x0a%c%s%c\x1a%c%s" % (len(key) + n + 3, key, n + 2, n, vb))
        else:
            value = _T3 + length(n) + vb
            out.append(delimited(_T1, key + length(len(value)) + value))
    return b"".join(out)


def metadata(namespaces: Mapping[str, Mapping[str, str]]) -> bytes:
    """ProcessingResponse.dynamic_metadata (field 8): a Struct of namespaces, each a Struct
    (Value.struct_value, field 5) of string values."""
    return delimited(_T8, b"".join([
        delimited(_T1, delimited(_T1, ns.encode()) + delimited(_T2, delimited(_T5, _string_fields(values))))
        for ns, values in namespaces.items()]))


def request_headers(set_headers: Mapping[str, str], remove: Iterable[str], metadata_: Mapping[str, Mapping[str, str]],
                    mode_override: msg.PM | None) -> bytes:
    """``headers_response("request_headers", set_headers, remove, clear_route_cache=True,
    metadata=metadata_, mode_override=mode_override)``, serialized."""
    names = remove if isinstance(remove, tuple) else tuple(remove)
    mutation = b"".join([_set_header(k, v) for k, v in set_headers.items()]) + _removals(names)
    common = (delimited(_T2, mutation) if mutation else b"") + _CLEAR_ROUTE_CACHE
    headers = delimited(_T1, common)  # HeadersResponse.response
    out = [_T1, length(len(headers)), headers]  # ProcessingResponse.request_headers
    if metadata_:
        out.append(metadata(metadata_))
    if mode_override is not None:
        out.append(_mode(mode_override))
    return b"".join(out)
