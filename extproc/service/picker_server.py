"""The endpoint picker's ports, as gateways and kubelets expect a picker's (GIE's conventions).

* ext_proc on 9002, TLS by default with a certificate generated at start
  (``extproc.wire.tls``), plaintext on request; gRPC health on the same port;
* gRPC health alone on 9003 (plaintext: kubelet's gRPC probes do not speak TLS), with the
  services ``liveness``, ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor``;
* Prometheus metrics on 9090 (the same registry as the admin port's ``/metrics``).

Under ``FULL_DUPLEX_STREAMED`` every SSE event is a message in and an echo out, so the
serving stack is most of the picker's cost per event. 9002 is therefore served by
``extproc.wire.h2grpc`` (HTTP/2 on the event loop: an event's message is read, echoed and
written in one callback) rather than grpc.aio, which spends ~4× the CPU per message
(``bench.echo_stacks``, docs/benchmarks.md); ``--picker-stack grpcio`` serves it on
grpc.aio as before. Either way the stream loop is ``PickerProcessor.answers``: every way a
stream ends reaches ``settle()``, and its answers may be protobuf messages or echoes already
in wire form.
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

from extproc.envoy import picker_protocol as pp
from extproc.policy.reasons import Ending
from extproc.request.picker import Answer, PickerOptions, PickerStream
from extproc.runtime.runtime import Runtime
from extproc.service.server import SERVER_OPTIONS, SERVICE
from extproc.wire import messages as msg
from extproc.wire import tls
from extproc.wire.h2grpc.calls import Call, unary
from extproc.wire.h2grpc.server import Server as H2Server
from extproc.wire.h2grpc.server import ssl_context
from extproc.wire.h2grpc.stream import Handler, Stream
from extproc.wire.health import PICKER_SERVICES, Health
from extproc.wire.health import SERVICE as HEALTH_SERVICE
from extproc.wire.peer import PeerStream, h2_peer

log = logging.getLogger("sluice.picker")


class PickerProcessor:
    def __init__(self, runtime: Runtime, options: PickerOptions) -> None:
        self.rt, self.options = runtime, options

    def stream(self, peer: PeerStream) -> PickerStream:
        return PickerStream(self.rt, peer, self.options)

    async def answers(self, peer: PeerStream, stream: PickerStream) -> AsyncIterator[Answer]:
        """The stream loop: each message's answers, in order; ``settle()`` however it ends."""
        how = Ending.DISCONNECT
        try:
            while (request := await peer.next()) is not None:
                phase = request.WhichOneof("request")
                if phase == "response_body":  # the one message per SSE event: straight through
                    b = request.response_body
                    for a in stream.response_chunk(b.body, b.end_of_stream):
                        yield a
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

    async def process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext | None) -> AsyncIterator[Answer]:
        """The grpc.aio form (``--picker-stack grpcio``)."""
        peer = PeerStream(request_iterator)
        async for a in self.answers(peer, self.stream(peer)):
            yield a

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Process": grpc.stream_stream_rpc_method_handler(
                self.process, request_deserializer=pb.ProcessingRequest.FromString,
                response_serializer=msg.serialize),
        })

    def h2_handler(self) -> Handler:
        return lambda st: _H2Stream(self, st).call


class _H2Stream:
    """One picker stream on h2grpc. The loop runs in the call's task; an SSE chunk that comes
    while the loop waits for Envoy's next message is answered in the read callback instead
    (``fast``), with exactly what the loop would do for it, and the task is not woken."""

    __slots__ = ("proc", "stream", "call")

    def __init__(self, proc: PickerProcessor, st: Stream) -> None:
        self.proc = proc
        self.stream: PickerStream | None = None
        self.call = Call(st, self.run, self.fast)

    async def run(self, call: Call) -> None:
        peer = h2_peer(call)
        stream = self.stream = self.proc.stream(peer)
        async for a in self.proc.answers(peer, stream):
            call.write(msg.serialize(a))

    def fast(self, call: Call, data: bytes) -> bool:
        stream = self.stream
        if stream is None or not stream.responding:  # before the response: the loop decides
            return False
        got = pp.response_chunk(data)
        if got is None:
            return False
        try:
            answers = stream.response_chunk(*got)
        except Exception:
            log.exception("picker stream failed")
            stream.settle(Ending.ERROR)
            raise  # the call ends with an error status and its task is cancelled
        for a in answers:
            call.write(msg.serialize(a))
        return True


STACKS = ("h2", "grpcio")


@dataclass(frozen=True)
class PickerPorts:
    grpc: tuple[str, int] = ("0.0.0.0", 9002)
    health: tuple[str, int] | None = ("0.0.0.0", 9003)
    metrics: tuple[str, int] | None = ("0.0.0.0", 9090)
    plaintext: bool = False
    cert_file: str | None = None
    key_file: str | None = None
    options: PickerOptions = PickerOptions()
    stack: str = "h2"  # what serves 9002: extproc.wire.h2grpc, or grpc.aio


@dataclass
class PickerServers:
    grpc: grpc.aio.Server | H2Server
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


async def _start_h2(runtime: Runtime, ports: PickerPorts, health: Health) -> H2Server:
    server = H2Server({
        f"/{SERVICE}/Process": PickerProcessor(runtime, ports.options).h2_handler(),
        f"/{HEALTH_SERVICE}/Check": unary(health.check_wire),
    })
    ctx = None if ports.plaintext else ssl_context(*tls.certificate(ports.cert_file, ports.key_file))
    host, port = ports.grpc
    try:
        await server.start(host, port, ctx)
    except OSError as exc:
        raise OSError(f"cannot bind the picker on {host}:{port}: {exc}") from exc
    return server


async def _start_grpcio(runtime: Runtime, ports: PickerPorts, health: Health) -> grpc.aio.Server:
    server = grpc.aio.server(options=[*SERVER_OPTIONS, ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers([PickerProcessor(runtime, ports.options).handler(), health.handler()])
    creds = None if ports.plaintext else tls.server_credentials(ports.cert_file, ports.key_file)
    _bind(server, *ports.grpc, creds)
    await server.start()
    return server


async def start_picker(runtime: Runtime, ports: PickerPorts, health: Health | None = None) -> PickerServers:
    health = health or picker_health()
    if ports.stack not in STACKS:
        raise ValueError(f"unknown picker stack {ports.stack!r} (one of {', '.join(STACKS)})")
    start = _start_h2 if ports.stack == "h2" else _start_grpcio
    server: grpc.aio.Server | H2Server = await start(runtime, ports, health)
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
