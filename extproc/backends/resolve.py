"""A pool endpoint's host name to the IP Envoy's pool cluster knows it by (its EDS set
takes no names): at once where it can (``resolve``), else later, by the monitor at every
scrape (``resolve_later``), so a name that does not resolve yet only keeps the endpoint
from being picked.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Protocol

from extproc.policy.schema import Endpoint

__all__ = ["resolve", "resolve_later"]


class Named(Protocol):
    spec: Endpoint
    ip: str | None


def resolve(host: str) -> str | None:
    """The endpoint's IP; None while the name does not resolve."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


async def resolve_later(st: Named) -> None:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(st.spec.host, st.spec.port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except OSError:
        return
    if infos:
        st.ip = str(infos[0][4][0])
