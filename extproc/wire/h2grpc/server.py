"""The listening socket: gRPC methods served on it, a graceful stop, and TLS offering h2."""

from __future__ import annotations

import asyncio
import ssl

from extproc.wire.h2grpc.connection import Connection
from extproc.wire.h2grpc.stream import Handler


class Server:
    """gRPC methods (``/package.Service/Method`` -> handler) on one listening socket."""

    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers
        self.connections: set[Connection] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                    reuse_port: bool = False) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Connection(self.handlers, self.connections), host, port,
                                                ssl=ssl_context, reuse_port=reuse_port or None, backlog=1024)
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, grace: float | None) -> None:
        """Stop listening; let the streams under way finish within ``grace``; cancel the rest
        (None: at once, as grpc.aio's ``stop(None)``)."""
        grace = grace or 0.0
        if self._server is not None:
            self._server.close()
        for c in list(self.connections):
            c.begin_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while any(c.streams for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for c in list(self.connections):
            c.abort()
        await asyncio.sleep(0)


def ssl_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """A TLS server context offering h2 (Envoy's upstream TLS connects with or without ALPN)."""
    import os
    import tempfile

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    fd, path = tempfile.mkstemp(prefix="sluice-tls-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(key_pem + b"\n" + cert_pem)
        ctx.load_cert_chain(path)
    finally:
        os.unlink(path)
    return ctx
