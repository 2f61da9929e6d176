"""An ext_proc server that changes nothing: the floor Sluice's own work is measured from.

It answers every ProcessingRequest with an empty response of the matching kind
(CONTINUE, no mutations), using the same server and upb protobuf classes from
``xds-protos`` as Sluice (``--stack``: ``extproc.wire.h2grpc``, Sluice's default, or
grpc.aio). The processing mode is Envoy's side of the contract
(``extproc.envoy.bootstrap``'s, for the chosen ``response_processing``), so Envoy sends
this server exactly the messages it sends Sluice, and (Envoy + Sluice) − (Envoy + this)
is Sluice's policy work. It answers every message at once (the request headers too,
which Sluice answers only once the body is in: the same messages, none waiting), and
takes Envoy's access log (``response_processing: access_log``) and drops it, so Envoy's
side costs the same in front of both.

    python -m bench.passthrough_extproc --grpc 127.0.0.1:50052
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from extproc.service.server import STACKS, start_h2, start_server
from extproc.wire.access_log import AccessLogReceiver
from extproc.wire.h2grpc.server import Server as H2Server
from extproc.wire.peer import PeerStream

# One prebuilt answer per message kind; gRPC serializes it on each send.
ANSWERS: dict[str, pb.ProcessingResponse] = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}


class PassThrough(pb_grpc.ExternalProcessorServicer):
    async def Process(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for answer in self.answers(PeerStream(request_iterator)):
            yield answer

    async def answers(self, peer: PeerStream) -> AsyncIterator[pb.ProcessingResponse]:
        while (request := await peer.next()) is not None:
            answer = ANSWERS.get(request.WhichOneof("request") or "")
            if answer is not None:
                yield answer


async def serve(host: str, port: int, stack: str = "h2") -> None:
    # The same servers as Sluice's (extproc.service.server), so only the handler differs.
    logs = AccessLogReceiver(lambda entries: None)
    server: grpc.aio.Server | H2Server
    if stack == "h2":
        server = await start_h2(PassThrough(), host, port, access_logs=logs)
    else:
        server = await start_server(PassThrough(), host, port, access_logs=logs)
    print(f"pass-through ext_proc listening on {host}:{port} ({stack})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.passthrough_extproc", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grpc", default="127.0.0.1:50052", help="host:port to listen on")
    ap.add_argument("--stack", choices=STACKS, default="h2", help="what serves the port, as serve --grpc-stack")
    args = ap.parse_args(argv)
    host, _, port = args.grpc.rpartition(":")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(host or "127.0.0.1", int(port), args.stack))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
