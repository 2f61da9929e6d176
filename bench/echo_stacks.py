"""Ways to serve the picker's ext_proc stream from Python, each behind its own Envoy, measured
side by side: extproc CPU and Envoy CPU per SSE event.

    python -m bench.echo_stacks                      # every candidate, ~12 minutes
    python -m bench.echo_stacks --only aio-gen sync  # some of them

Under ``FULL_DUPLEX_STREAMED`` bodies (GIE's reference Envoy) every SSE event is one
ext_proc message in and one out, so what a server spends per message is the picker's cost
per event. Each candidate here runs the same minimal picker (``Mini``: the request-headers
answer held until the body is in and then naming the endpoint, every body chunk echoed as
wire bytes, nothing admitted), so the rows differ only in how the stream is served:

* the stack: grpc.aio with the async-generator handler (what Sluice served first), grpc.aio
  with ``context.read()``/``context.write()``, the synchronous grpcio server (a thread per
  stream from a pool), grpclib (pure Python, h2), and ``extproc.wire.h2grpc`` (HTTP/2 read
  and written on the event loop; what the picker port now runs), with an SSE chunk answered
  in the read callback (``own``) or every message through the stream's task (``own-task``),
  and in two processes on one port (``own-uvloop-x2``: SO_REUSEPORT, an Envoy with 2 workers,
  CPU summed over both);
* the codec: ``pb`` (``FromString`` in, messages built and ``SerializeToString`` out, the
  generated stubs' path), ``wire`` (``FromString`` in, echoes written as wire bytes), ``raw``
  (bytes in, an SSE chunk's message read by hand, the rest parsed as before);
* the event loop (asyncio's or uvloop's), gRPC channel arguments and ``GRPC_EXPERIMENTS``.

CPU is each process's CPU time over a round minus its idle rate, as in ``bench.picker_cost``;
all candidates of a group stream at the same time, and every group carries the baseline
(``aio-gen``) so its rows can be read as ratios against a baseline of the same run. The
Envoys are GIE's reference config without TLS and without the picker's health check (a
candidate needs no health service); ``--tls`` keeps the TLS.

The serving side of one candidate:

    python -m bench.echo_stacks serve --stack sync --codec raw --port 9002 --dest 127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.envoy import picker_protocol as pp

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
METHOD = f"/{SERVICE}/Process"


# -- the minimal picker, the same in every candidate --------------------------------------

def _headers_answer(dest: str) -> pb.ProcessingResponse:
    a = pb.ProcessingResponse()
    common = a.request_headers.response
    h = common.header_mutation.set_headers.add()
    h.header.key, h.header.raw_value = pp.DESTINATION, dest.encode()
    common.clear_route_cache = True
    a.dynamic_metadata.fields[pp.NAMESPACE].struct_value.fields[pp.DESTINATION].string_value = dest
    return a


_CONTINUE = {"response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
             "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
             "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse())}
_WIRE_CONTINUE = {k: v.SerializeToString() for k, v in _CONTINUE.items()}


def _echo_message(field_no: int, chunk: bytes, eos: bool) -> pb.ProcessingResponse:
    a = pb.ProcessingResponse()
    body = a.request_body if field_no == pp.REQUEST_BODY_FIELD else a.response_body
    sr = body.response.body_mutation.streamed_response
    sr.body, sr.end_of_stream = chunk, eos
    return a


class Mini:
    """One stream of the minimal picker: answers in the order Envoy needs them."""

    def __init__(self, dest: str, wire: bool) -> None:
        self.wire = wire
        self.head: Any = _headers_answer(dest).SerializeToString() if wire else _headers_answer(dest)
        self.cont: dict[str, Any] = _WIRE_CONTINUE if wire else _CONTINUE
        self.chunks: list[bytes] = []

    def echo(self, field_no: int, chunk: bytes, eos: bool) -> Any:
        return pp.echo(field_no, chunk, eos) if self.wire else _echo_message(field_no, chunk, eos)

    def answer(self, req: pb.ProcessingRequest) -> list[Any]:
        phase = req.WhichOneof("request")
        if phase == "response_body":
            b = req.response_body
            return [self.echo(pp.RESPONSE_BODY_FIELD, b.body, b.end_of_stream)]
        if phase == "request_headers":
            return [self.head] if req.request_headers.end_of_stream else []
        if phase == "request_body":
            b = req.request_body
            self.chunks.append(b.body)
            if not b.end_of_stream:
                return []
            body, self.chunks = b"".join(self.chunks), []
            return [self.head, self.echo(pp.REQUEST_BODY_FIELD, body, True)]
        got = self.cont.get(phase or "")
        return [] if got is None else [got]

    def answer_raw(self, data: bytes) -> list[Any]:
        """``answer`` for a message still in wire form: an SSE chunk's is read by hand."""
        got = pp.response_chunk(data)
        if got is not None:
            return [pp.echo(pp.RESPONSE_BODY_FIELD, got[0], got[1])]
        return self.answer(pb.ProcessingRequest.FromString(data))


# -- the stacks ---------------------------------------------------------------------------

def _serializer(codec: str) -> Any:
    if codec == "pb":
        return lambda m: m.SerializeToString()
    return None  # answers are bytes already


def _deserializer(codec: str) -> Any:
    return None if codec == "raw" else pb.ProcessingRequest.FromString


def _answers(s: Mini, codec: str, req: Any) -> list[Any]:
    return s.answer_raw(req) if codec == "raw" else s.answer(req)


def aio_handlers(stack: str, codec: str, dest: str) -> Any:
    import grpc

    async def gen(request_iterator: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        s = Mini(dest, codec != "pb")
        async for req in request_iterator:
            for a in _answers(s, codec, req):
                yield a

    async def rw(request_iterator: Any, context: Any) -> None:
        s = Mini(dest, codec != "pb")
        eof = grpc.aio.EOF
        read, write = context.read, context.write
        while (req := await read()) is not eof:
            for a in _answers(s, codec, req):
                await write(a)

    fn = gen if stack == "aio-gen" else rw
    return grpc.method_handlers_generic_handler(SERVICE, {"Process": grpc.stream_stream_rpc_method_handler(
        fn, request_deserializer=_deserializer(codec), response_serializer=_serializer(codec))})


def sync_handlers(codec: str, dest: str) -> Any:
    import grpc

    def process(request_iterator: Iterator[Any], context: Any) -> Iterator[Any]:
        s = Mini(dest, codec != "pb")
        for req in request_iterator:
            yield from _answers(s, codec, req)

    return grpc.method_handlers_generic_handler(SERVICE, {"Process": grpc.stream_stream_rpc_method_handler(
        process, request_deserializer=_deserializer(codec), response_serializer=_serializer(codec))})


def own_handlers(dest: str, fast: bool) -> dict[str, Any]:
    from extproc.wire.h2grpc.calls import Call, streaming

    async def run(call: Call) -> None:
        s = Mini(dest, True)
        while (data := await call.read()) is not None:
            for a in s.answer_raw(data):
                call.write(a)

    def echo(call: Call, data: bytes) -> bool:
        got = pp.response_chunk(data)
        if got is None:
            return False
        call.write(pp.echo(pp.RESPONSE_BODY_FIELD, got[0], got[1]))
        return True

    return {METHOD: streaming(run, echo if fast else None)}


async def serve_own(args: argparse.Namespace) -> None:
    from extproc.wire import tls as sluice_tls
    from extproc.wire.h2grpc.server import Server, ssl_context

    server = Server(own_handlers(args.dest, args.stack == "own"))
    ctx = ssl_context(*sluice_tls.self_signed()) if args.tls else None
    await server.start("127.0.0.1", args.port, ctx, reuse_port=args.reuse_port)
    print("serving", flush=True)
    await _until_term()
    await server.stop(0)


def channel_options(opts: list[str]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [("grpc.max_concurrent_streams", 100000), ("grpc.so_reuseport", 0)]
    for o in opts:
        k, _, v = o.partition("=")
        out.append((k, int(v) if v.lstrip("-").isdigit() else v))
    return out


def _credentials(tls: bool) -> Any:
    if not tls:
        return None
    from extproc.wire import tls as sluice_tls

    return sluice_tls.server_credentials(None, None)


def serve_sync(args: argparse.Namespace) -> None:
    import grpc

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.threads)
    server = grpc.server(pool, options=channel_options(args.opt), maximum_concurrent_rpcs=args.threads)
    server.add_generic_rpc_handlers([sync_handlers(args.codec, args.dest)])
    creds = _credentials(args.tls)
    addr = f"127.0.0.1:{args.port}"
    server.add_insecure_port(addr) if creds is None else server.add_secure_port(addr, creds)
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("serving", flush=True)
    stop.wait()
    server.stop(0)


async def serve_aio(args: argparse.Namespace) -> None:
    import grpc

    server = grpc.aio.server(options=channel_options(args.opt))
    server.add_generic_rpc_handlers([aio_handlers(args.stack, args.codec, args.dest)])
    creds = _credentials(args.tls)
    addr = f"127.0.0.1:{args.port}"
    server.add_insecure_port(addr) if creds is None else server.add_secure_port(addr, creds)
    await server.start()
    print("serving", flush=True)
    await _until_term()
    await server.stop(0)


async def serve_grpclib(args: argparse.Namespace) -> None:
    from grpclib.const import Cardinality, Handler
    from grpclib.encoding.base import CodecBase
    from grpclib.server import Server

    codec, dest = args.codec, args.dest

    class Codec(CodecBase):
        __content_subtype__ = "proto"

        def encode(self, message: Any, message_type: Any) -> bytes:
            return message if isinstance(message, bytes) else message.SerializeToString()

        def decode(self, data: bytes, message_type: Any) -> Any:
            return data if codec == "raw" else pb.ProcessingRequest.FromString(data)

    async def process(stream: Any) -> None:
        s = Mini(dest, codec != "pb")
        async for req in stream:
            for a in _answers(s, codec, req):
                await stream.send_message(a)

    class Svc:
        def __mapping__(self) -> dict[str, Handler]:
            return {METHOD: Handler(process, Cardinality.STREAM_STREAM, object, object)}

    server = Server([Svc()], codec=Codec())
    ssl = None
    if args.tls:
        import ssl as ssl_mod

        from extproc.wire import tls as sluice_tls

        cert, key = sluice_tls.self_signed()
        d = Path(tempfile.mkdtemp(prefix="echo-tls-"))
        (d / "c.pem").write_bytes(cert)
        (d / "k.pem").write_bytes(key)
        ssl = ssl_mod.create_default_context(ssl_mod.Purpose.CLIENT_AUTH)
        ssl.load_cert_chain(d / "c.pem", d / "k.pem")
        ssl.set_alpn_protocols(["h2"])
    await server.start("127.0.0.1", args.port, ssl=ssl)
    print("serving", flush=True)
    await _until_term()
    server.close()


async def _until_term() -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


def serve(args: argparse.Namespace) -> int:
    if args.stack == "sync":
        serve_sync(args)
        return 0
    main = (serve_grpclib(args) if args.stack == "grpclib" else serve_own(args) if args.stack.startswith("own")
            else serve_aio(args))
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)
    return 0


# -- the candidates and the driver --------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    name: str
    stack: str = "aio-gen"
    codec: str = "wire"
    loop: str = "asyncio"
    opts: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    threads: int = 256
    procs: int = 1  # processes on one port (SO_REUSEPORT), before an Envoy with as many workers
    code: str = ""

    def argv(self, port: int, dest: str, tls: bool) -> list[str]:
        out = [sys.executable, *ECHO_SERVER, "serve", "--stack", self.stack, "--codec", self.codec,
               "--loop", self.loop, "--port", str(port), "--dest", dest, "--threads", str(self.threads)]
        for o in self.opts:
            out += ["--opt", o]
        return out + (["--tls"] if tls else []) + (["--reuse-port"] if self.procs > 1 else [])


ECHO_SERVER = os.environ.get("ECHO_SERVER", "-m bench.echo_stacks").split()
BASELINE = "aio-gen"
CANDIDATES = {c.name: c for c in (
    Candidate("aio-gen", code="grpc.aio, async-generator handler, FromString in, echo as wire bytes (as served)"),
    Candidate("aio-gen-pb", codec="pb", code="as aio-gen, echo built as a message and SerializeToString"),
    Candidate("aio-gen-raw", codec="raw", code="as aio-gen, no deserializer: SSE chunk read from the bytes"),
    Candidate("aio-rw", stack="aio-rw", code="grpc.aio, context.read()/write() loop"),
    Candidate("aio-rw-raw", stack="aio-rw", codec="raw", code="as aio-rw, bytes in"),
    Candidate("aio-uvloop", loop="uvloop", code="as aio-gen on uvloop"),
    Candidate("aio-rw-uvloop", stack="aio-rw", codec="raw", loop="uvloop", code="as aio-rw-raw on uvloop"),
    Candidate("aio-latency", opts=("grpc.optimization_target=latency",), code="grpc.optimization_target=latency"),
    Candidate("aio-throughput", opts=("grpc.optimization_target=throughput",),
              code="grpc.optimization_target=throughput"),
    Candidate("aio-nobuf", opts=("grpc.http2.write_buffer_size=0",), code="grpc.http2.write_buffer_size=0"),
    Candidate("aio-ph2", env=(("GRPC_EXPERIMENTS", "ph2_server"),), code="GRPC_EXPERIMENTS=ph2_server"),
    Candidate("aio-eecq", env=(("GRPC_EXPERIMENTS", "event_engine_callback_cq"),),
              code="GRPC_EXPERIMENTS=event_engine_callback_cq"),
    Candidate("aio-lowat", env=(("GRPC_EXPERIMENTS", "tcp_rcv_lowat,tcp_frame_size_tuning"),),
              code="GRPC_EXPERIMENTS=tcp_rcv_lowat,tcp_frame_size_tuning"),
    Candidate("sync", stack="sync", code="grpc.server(ThreadPoolExecutor), generator over the request iterator"),
    Candidate("sync-raw", stack="sync", codec="raw", code="as sync, bytes in"),
    Candidate("sync-pb", stack="sync", codec="pb", code="as sync, the generated stubs' (de)serializers"),
    Candidate("grpclib", stack="grpclib", code="grpclib (pure Python h2) server"),
    Candidate("own", stack="own", codec="raw", code="extproc.wire.h2grpc: HTTP/2 on the event loop, SSE chunk "
              "echoed in the read callback"),
    Candidate("own-uvloop", stack="own", codec="raw", loop="uvloop", code="as own, on uvloop"),
    Candidate("own-uvloop-x2", stack="own", codec="raw", loop="uvloop", procs=2,
              code="as own-uvloop, 2 processes on one port (SO_REUSEPORT), Envoy with 2 workers"),
    Candidate("own-task", stack="own-task", codec="raw", code="as own, every message through the stream's task"),
    Candidate("grpclib-uvloop", stack="grpclib", codec="raw", loop="uvloop", code="grpclib on uvloop, bytes in"),
)}
DEFAULT_GROUPS = [["aio-gen", "aio-gen-pb", "aio-gen-raw", "aio-rw", "aio-rw-raw"],
                  ["aio-gen", "aio-uvloop", "aio-rw-uvloop", "sync", "sync-raw", "sync-pb"],
                  ["aio-gen", "aio-latency", "aio-throughput", "aio-nobuf"],
                  ["aio-gen", "aio-ph2", "aio-eecq", "aio-lowat"],
                  ["aio-gen", "grpclib", "grpclib-uvloop", "own-task", "own", "own-uvloop", "own-uvloop-x2"]]


def envoy_config(listen: int, admin: int, ready: int, picker: int, tls: bool) -> dict[str, Any]:
    from bench.picker_cost import gie_config

    cfg = gie_config(listen, admin, ready, picker, tls=tls)
    for cl in cfg["static_resources"]["clusters"]:
        if cl["name"] == "ext_proc":
            cl.pop("health_checks", None)
    return cfg


@dataclass
class Result:
    envoy_ns: list[float] = field(default_factory=list)
    extproc_ns: list[float] = field(default_factory=list)
    ok: int = 0
    requests: int = 0
    events: int = 0


def run_group(names: list[str], args: argparse.Namespace, workdir: Path) -> dict[str, Result]:
    from bench.picker_cost import one
    from bench.procs import Proc, ProcGroup, free_port, tcp_open, wait_until
    from bench.response_cost import cpu_ns

    g = ProcGroup(workdir)
    backend = free_port()
    try:
        g.start_proc("backend", [sys.executable, "-m", "bench.pacedbackend", "--port", str(backend)],
                     lambda: tcp_open(backend))
        listen = {n: free_port() for n in names}
        for n in names:
            c = CANDIDATES[n]
            port = free_port()
            env = dict(c.env)
            for k in range(c.procs):
                name = f"x-{n}" if k == 0 else f"x-{n}-{k}"
                proc = g.procs[name] = Proc(name, c.argv(port, f"127.0.0.1:{backend}", args.tls),
                                            workdir / f"{name}.log", env=env or None).start()
                wait_until(lambda port=port: tcp_open(port), n, proc.popen, log=proc.log)
            admin = free_port()
            g.start_envoy(f"envoy-{n}", envoy_config(listen[n], admin, free_port(), port, args.tls), admin, c.procs)
        for n in names:
            asyncio.run(asyncio.wait_for(one(listen[n], 5, 1), 30))
        pids: dict[tuple[str, str], list[int]] = {}
        for n in names:
            pids[(n, "envoy")] = [g.procs[f"envoy-{n}"].pid]
            pids[(n, "extproc")] = [p.pid for name, p in g.procs.items()
                                    if name == f"x-{n}" or name.startswith(f"x-{n}-")]

        def cpu(k: tuple[str, str]) -> int:
            return sum(cpu_ns(p) for p in pids[k])

        t0, c0 = time.monotonic(), {k: cpu(k) for k in pids}
        time.sleep(args.idle_s)
        idle = {k: (cpu(k) - c0[k]) / (time.monotonic() - t0) for k in pids}
        out = {n: Result() for n in names}
        for i in range(args.rounds):
            t0, c0 = time.monotonic(), {k: cpu(k) for k in pids}

            async def go() -> list[list[tuple[int, bool, bool, float]]]:
                return await asyncio.gather(*(asyncio.gather(*(one(listen[n], args.tokens, args.interval_ms)
                                                               for _ in range(args.streams))) for n in names))

            got = dict(zip(names, asyncio.run(go()), strict=True))
            dt = time.monotonic() - t0
            for n in names:
                r = out[n]
                r.requests += args.streams
                r.ok += sum(x[1] for x in got[n])
                r.events = args.streams * args.tokens
                for w, lst in (("extproc", r.extproc_ns), ("envoy", r.envoy_ns)):
                    k = (n, w)
                    lst.append(max(0.0, cpu(k) - c0[k] - idle[k] * dt))
            line = "  ".join(f"{n} {out[n].extproc_ns[-1] / out[n].events / 1000:.1f}/"
                             f"{out[n].envoy_ns[-1] / out[n].events / 1000:.1f}" for n in names)
            print(f"round {i + 1}: extproc/envoy µs per event  {line}", file=sys.stderr, flush=True)
        return out
    finally:
        g.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.echo_stacks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    sv = sub.add_parser("serve")
    sv.add_argument("--stack", choices=("aio-gen", "aio-rw", "sync", "grpclib", "own", "own-task"), default="aio-gen")
    sv.add_argument("--codec", choices=("pb", "wire", "raw"), default="wire")
    sv.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    sv.add_argument("--port", type=int, required=True)
    sv.add_argument("--dest", required=True)
    sv.add_argument("--threads", type=int, default=256)
    sv.add_argument("--opt", action="append", default=[])
    sv.add_argument("--tls", action="store_true")
    sv.add_argument("--reuse-port", action="store_true")
    ap.add_argument("--only", nargs="+", help="one group of these candidates (the baseline is added)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--interval-ms", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=4.0)
    ap.add_argument("--tls", action="store_true", help="keep the TLS between Envoy and the candidate")
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        return serve(args)
    groups = [[BASELINE, *[n for n in args.only if n != BASELINE]]] if args.only else DEFAULT_GROUPS
    load = os.getloadavg()
    rows: list[tuple[int, str, float, float, float, int, int]] = []
    for gi, names in enumerate(groups):
        workdir = Path(tempfile.mkdtemp(prefix="sluice-echo-stacks-"))
        print(f"group {gi + 1}: {' '.join(names)}", file=sys.stderr, flush=True)
        try:
            res = run_group(names, args, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        base = statistics.median(res[BASELINE].extproc_ns)
        for n in names:
            r = res[n]
            x, e = statistics.median(r.extproc_ns), statistics.median(r.envoy_ns)
            rows.append((gi + 1, n, x / r.events / 1000, e / r.events / 1000, x / base, r.ok, r.requests))
    print(f"{args.streams} streams × {args.tokens} events, {args.interval_ms} ms apart, per candidate; median of "
          f"{args.rounds} rounds; load average at start {load[0]:.2f} ({os.cpu_count()} cores); "
          f"{'TLS' if args.tls else 'plaintext'}\n")
    print("| group | candidate | extproc µs/event | Envoy µs/event | extproc × baseline | ok | code |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for gi, n, x, e, ratio, ok, req in rows:
        print(f"| {gi} | {n} | {x:.1f} | {e:.1f} | {ratio:.2f} | {ok}/{req} | {CANDIDATES[n].code} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
