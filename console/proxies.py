"""Which address a login comes from, behind reverse proxies the operator names.

The peer address is the client's unless the peer is a configured proxy
(``--trusted-proxy CIDR``). Then ``X-Forwarded-For`` is read from the right: each proxy
appends the address it received the request from, so the rightmost address that is not a
trusted proxy is the client. Anything left of it was written by the client and is never
believed (a client cannot pick the address its failed logins count against). A peer that
is not a trusted proxy has its ``X-Forwarded-For`` ignored.

Pure: the addresses in, the client's address out.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(values: Iterable[str]) -> tuple[Network, ...]:
    """``10.0.0.0/8``, ``127.0.0.1`` (one address), comma-separated or one per value."""
    out = []
    for value in values:
        for part in value.split(","):
            if part.strip():
                try:
                    out.append(ipaddress.ip_network(part.strip(), strict=False))
                except ValueError:
                    raise ValueError(
                        f"trusted proxy: {part.strip()!r} is not an address or a CIDR range"
                    ) from None
    return tuple(out)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:  # [v6]:port
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:  # v4:port
        text = text.split(":", 1)[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _trusted(
    addr: ipaddress.IPv4Address | ipaddress.IPv6Address, proxies: Sequence[Network]
) -> bool:
    return any(addr.version == net.version and addr in net for net in proxies)


def client_address(peer: str, forwarded_for: Sequence[str], proxies: Sequence[Network]) -> str:
    """The client's address: ``peer`` unless it is a trusted proxy, else the rightmost address
    of ``forwarded_for`` (every X-Forwarded-For header, in order) that is not one."""
    current = _ip(peer)
    if current is None or not proxies or not _trusted(current, proxies):
        return peer
    hops = [h for header in forwarded_for for h in header.split(",")]
    for hop in reversed(hops):
        addr = _ip(hop)
        if addr is None:
            break  # a proxy wrote garbage: believe no further, the last hop we trust stands
        current = addr
        if not _trusted(addr, proxies):
            return str(addr)
    return str(current)
