"""The endpoint picker's ports, as gateways and kubelets expect a picker's (GIE's conventions).

* ext_proc on 9002, TLS by default with a certificate generated at start
  (``extproc.wire.tls``), plaintext on request; gRPC health on the same port;
* gRPC health alone on 9003 (plaintext: kubelet's gRPC probes do not speak TLS), with the
  services ``liveness``, ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor``;
* Prometheus metrics on 9090 (the same registry as the admin port's ``/metrics``).

The stream loop here is ``server.ExternalProcessor``'s, for ``PickerStream``: every way a
stream ends reaches ``settle()``. Its answers may be protobuf messages or echoes already
in wire form, so the method is registered with a serializer that passes bytes through.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CONTENT_TYPE_LATEST

from extproc.policy.reasons import Ending
from extproc.request.picker import Answer, PickerOptions, PickerStream
from extproc.runtime.runtime import Runtime
from extproc.service.server import SERVER_OPTIONS
from extproc.wire import tls
from extproc.wire.health import PICKER_SERVICES, Health
from extproc.wire.peer import PeerStream

log = logging.getLogger("sluice.picker")

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def _serialize(answer: Answer) -> bytes:
    return answer if isinstance(answer, bytes) else answer.SerializeToString()


class PickerProcessor:
    def __init__(self, runtime: Runtime, options: PickerOptions) -> None:
        self.rt, self.options = runtime, options

    async def process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Answer]:
        peer = PeerStream(request_iterator)
        stream = PickerStream(self.rt, peer, self.options)
        how = Ending.DISCONNECT
        try:
            while (request := await peer.next()) is not None:
                phase = request.WhichOneof("request")
                if phase == "response_body":  # the one message per SSE event: straight through
                    yield stream.answer(phase, request)[0]
                    continue
                if phase == "request_body":
                    async for a in stream.request_body(request):
                        yield a
                elif phase == "request_trailers":
                    async for a in stream.request_trailers():
                        yield a
                else:
                    for a in stream.answer(phase or "unknown", request):
                        yield a
                if stream.finished:
                    how = Ending.REJECTED
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            how = Ending.ERROR
            log.exception("picker stream failed")
            raise
        finally:
            peer.cancel()
            stream.settle(how)  # a no-op after a settle at the end of the response

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Process": grpc.stream_stream_rpc_method_handler(
                self.process, request_deserializer=pb.ProcessingRequest.FromString,
                response_serializer=_serialize),
        })


@dataclass(frozen=True)
class PickerPorts:
    grpc: tuple[str, int] = ("0.0.0.0", 9002)
    health: tuple[str, int] | None = ("0.0.0.0", 9003)
    metrics: tuple[str, int] | None = ("0.0.0.0", 9090)
    plaintext: bool = False
    cert_file: str | None = None
    key_file: str | None = None
    options: PickerOptions = PickerOptions()


@dataclass
class PickerServers:
    grpc: grpc.aio.Server
    health_server: grpc.aio.Server | None
    metrics: web.AppRunner | None
    health: Health

    async def stop(self, grace: float) -> None:
        await self.grpc.stop(grace=grace)
        if self.health_server is not None:
            await self.health_server.stop(grace=0)
        if self.metrics is not None:
            await self.metrics.cleanup()


def picker_health() -> Health:
    return Health(services=PICKER_SERVICES)


def _bind(server: grpc.aio.Server, host: str, port: int, creds: grpc.ServerCredentials | None) -> None:
    address = f"{host}:{port}"
    bound = server.add_insecure_port(address) if creds is None else server.add_secure_port(address, creds)
    if bound == 0:
        raise OSError(f"cannot bind the picker on {address}")


async def start_picker(runtime: Runtime, ports: PickerPorts, health: Health | None = None) -> PickerServers:
    health = health or picker_health()
    server = grpc.aio.server(options=[*SERVER_OPTIONS, ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers([PickerProcessor(runtime, ports.options).handler(), health.handler()])
    creds = None if ports.plaintext else tls.server_credentials(ports.cert_file, ports.key_file)
    _bind(server, *ports.grpc, creds)
    await server.start()
    health_server = None
    if ports.health is not None:
        health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_server.add_generic_rpc_handlers([health.handler()])
        _bind(health_server, *ports.health, None)
        await health_server.start()
    metrics = await _start_metrics(runtime, *ports.metrics) if ports.metrics is not None else None
    return PickerServers(server, health_server, metrics, health)


async def _start_metrics(runtime: Runtime, host: str, port: int) -> web.AppRunner:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=runtime.metrics.render(), headers={"content-type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
