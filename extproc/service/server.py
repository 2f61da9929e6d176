"""The grpc.aio ExternalProcessor: receive, dispatch to the stream's processor, send.

The stream loop owns exactly one thing: making sure the stream's processor hears when
the ext_proc stream ends, however it ends (``StreamProcessor.end``: it settles, or leaves
a forwarded request to its access-log entry). Envoy signals a client disconnect only by
closing the stream without the end-of-stream body message (``context.cancelled()``
stays False), so "stream over before end-of-stream" is the disconnect signal.

The same gRPC server takes Envoy's access log (``extproc.wire.access_log``) when
``response_processing`` is ``access_log``, and the health checks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.policy.reasons import Ending
from extproc.request.log_settle import LogSettles
from extproc.request.revoking import CHUNK_WAIT_S
from extproc.request.stream import StreamProcessor
from extproc.runtime.runtime import Runtime
from extproc.wire import access_log
from extproc.wire import messages as msg
from extproc.wire.h2grpc.calls import Call, streaming, unary
from extproc.wire.h2grpc.server import Server as H2Server
from extproc.wire.health import SERVICE as HEALTH_SERVICE
from extproc.wire.health import Health
from extproc.wire.peer import PeerStream, h2_peer

log = logging.getLogger("sluice.server")

# What _next returns instead of a message: the backend revoked the request, or a revoked
# stream's next chunk did not come in time (extproc.request.revoking).
WAKE, LATE = object(), object()


async def _next(peer: PeerStream, stream: StreamProcessor) -> pb.ProcessingRequest | None | object:
    """Envoy's next message; for a request that can be revoked, or the revocation first."""
    rv = stream.revoker
    if rv is None or rv.done or stream.settled:
        return await peer.next()  # the usual path: no task, no timer
    ahead = peer.closed_signal()  # reads the next message ahead
    if rv.order is None:
        done, _ = await asyncio.wait({ahead, rv.wake}, return_when=asyncio.FIRST_COMPLETED)
        return await peer.next() if ahead in done else WAKE
    done, _ = await asyncio.wait({ahead}, timeout=CHUNK_WAIT_S)
    return await peer.next() if done else LATE


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, runtime: Runtime, log_settles: LogSettles | None = None) -> None:
        self.rt = runtime
        self.log_settles = log_settles

    async def Process(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[msg.Answer]:
        async for response in self.answers(PeerStream(request_iterator)):
            yield response

    async def answers(self, peer: PeerStream) -> AsyncIterator[msg.Answer]:
        """The stream loop, whatever serves the port: each message's answers, in order."""
        stream = StreamProcessor(self.rt, peer, self.log_settles)
        how = Ending.DISCONNECT
        try:
            while (request := await _next(peer, stream)) is not None:
                if request is WAKE or request is LATE:
                    rv = stream.revoker
                    assert rv is not None
                    revoked = rv.answer_now() if request is WAKE else rv.late()
                    if revoked is not None:
                        yield revoked
                        return
                    continue
                assert isinstance(request, pb.ProcessingRequest)
                phase = request.WhichOneof("request") or "unknown"
                if phase == "request_body":
                    async for response in stream.handle_body(request):
                        yield response
                elif (response := stream.handle(phase, request)) is not None:
                    yield response
                if stream.revoker is not None and stream.revoker.pending is not None:
                    yield stream.revoker.pending  # a revoked stream's end, after its last chunk
                    return
                if stream.finished:
                    how = Ending.REJECTED
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            how = Ending.ERROR
            log.exception("ext_proc stream failed")
            raise
        finally:
            peer.cancel()
            # A settle at end-of-stream already happened; this is then a no-op.
            stream.end(how)


# Bodies up to the policy's cap travel in one message; Envoy multiplexes every HTTP
# stream over a few HTTP/2 connections, so the stream limit must not bind first.
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_concurrent_streams", 100000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Envoy streams a request's body without waiting for the headers' answer; grpc core's
    # bandwidth probe grows a stream's window to megabytes, so a request refused from its
    # headers had its whole upload sent on. Off, the window stays at 64 KiB, as h2grpc
    # keeps its own small (STREAM_WINDOW; tests/e2e/test_refused_uploads.py).
    ("grpc.http2.bdp_probe", 0),
]


async def start_server(servicer: pb_grpc.ExternalProcessorServicer, host: str, port: int,
                       health: Health | None = None,
                       access_logs: access_log.AccessLogReceiver | None = None) -> grpc.aio.Server:
    # No SO_REUSEPORT (grpc-core's default is on: a second server on a taken port would
    # silently share it instead of failing to bind); `serve --workers N` binds N ports.
    server = grpc.aio.server(options=[*SERVER_OPTIONS, ("grpc.so_reuseport", 0)])
    # Registered by hand, not with the generated helper: answers may come in wire form.
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        "Process": grpc.stream_stream_rpc_method_handler(
            servicer.Process, request_deserializer=pb.ProcessingRequest.FromString,
            response_serializer=msg.serialize)})])
    if access_logs is not None:
        access_log.add_to_server(server, access_logs)
    # grpc.health.v1, which Envoy's ext_proc cluster checks (extproc/wire/health.py)
    server.add_generic_rpc_handlers([(health or Health()).handler()])
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot bind ext_proc gRPC on {host}:{port}")
    await server.start()
    return server


STACKS = ("h2", "grpcio")  # what serves the port: extproc.wire.h2grpc, or grpc.aio
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS = f"/{SERVICE}/Process"


class Answers(Protocol):
    def answers(self, peer: PeerStream) -> AsyncIterator[msg.Answer]: ...


class _H2Process:
    """One ext_proc stream on h2grpc: the same loop as grpc.aio's, run in the call's task."""

    __slots__ = ("proc",)

    def __init__(self, proc: Answers) -> None:
        self.proc = proc

    async def run(self, call: Call) -> None:
        async for response in self.proc.answers(h2_peer(call)):
            call.write(msg.serialize(response))


async def start_h2(processor: Answers, host: str, port: int, health: Health | None = None,
                   access_logs: access_log.AccessLogReceiver | None = None) -> H2Server:
    handlers = {PROCESS: streaming(_H2Process(processor).run),
                f"/{HEALTH_SERVICE}/Check": unary((health or Health()).check_wire)}
    if access_logs is not None:
        handlers[access_log.METHOD] = access_logs.h2_handler()
    server = H2Server(handlers)
    try:
        await server.start(host, port)
    except OSError as exc:
        raise OSError(f"cannot bind ext_proc gRPC on {host}:{port}: {exc}") from exc
    return server


async def serve(runtime: Runtime, host: str, port: int, health: Health | None = None,
                log_settles: LogSettles | None = None, stack: str = "h2") -> grpc.aio.Server | H2Server:
    """Sluice's gRPC server; with ``log_settles``, it takes Envoy's access log there too.

    ``h2`` (the default) serves the port on the event loop (extproc.wire.h2grpc): a message is
    parsed where the socket's bytes land and its answer written from the stream's task, where
    grpc.aio crosses threads and futures for each (docs/round-trips.md, "The serving stack")."""
    if stack not in STACKS:
        raise ValueError(f"unknown gRPC stack {stack!r} (one of {', '.join(STACKS)})")
    receiver = access_log.AccessLogReceiver(log_settles.consume) if log_settles is not None else None
    processor = ExternalProcessor(runtime, log_settles)
    if stack == "h2":
        return await start_h2(processor, host, port, health, receiver)
    return await start_server(processor, host, port, health, receiver)


async def run_log_expiry(log_settles: LogSettles, clock: Callable[[], float], interval_s: float = 1.0) -> None:
    """Settle, until cancelled, the forwarded requests whose access-log entry never came."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            log_settles.expire(clock())
        except Exception:  # noqa: BLE001 - a bug here must not stop the next expiries
            log.exception("access-log expiry failed")
