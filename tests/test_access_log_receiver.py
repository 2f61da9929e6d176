"""Envoy's access-log batches, received: settled a slice per turn of the loop, in order and
once each, on grpc.aio and on extproc.wire.h2grpc alike."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from bench.passthrough_extproc import PassThrough
from bench.procs import free_port
from extproc.service.server import start_h2
from extproc.wire import access_log
from extproc.wire.access_log import AccessLogReceiver


def batch(ids: range) -> als_pb2.StreamAccessLogsMessage:
    m = als_pb2.StreamAccessLogsMessage()
    for i in ids:
        m.http_logs.log_entry.add().request.request_id = f"r{i}"
    return m


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def turns_until_empty(rx: AccessLogReceiver, limit: int = 1000) -> int:
    n = 0
    while rx.queue or rx._scheduled:
        await asyncio.sleep(0)
        n += 1
        assert n < limit, "the receiver stopped settling"
    return n


def test_a_batch_settles_a_slice_per_turn_in_order_and_once() -> None:
    seen: list[str] = []

    def sink(entries):  # type: ignore[no-untyped-def]
        busy(100e-6)  # a settle's cost, roughly
        seen.extend(e.request.request_id for e in entries)

    async def main() -> tuple[int, int]:
        rx = AccessLogReceiver(sink)
        rx.receive(batch(range(40)))
        assert seen == []  # nothing on the receiving call itself
        await asyncio.sleep(0)
        first = len(seen)
        return first, await turns_until_empty(rx)

    first, turns = asyncio.run(main())
    assert 5 <= first < 40  # an eighth at least, not the whole batch
    assert turns >= 2
    assert seen == [f"r{i}" for i in range(40)]


def test_a_backlog_shrinks_by_an_eighth_each_turn_at_least() -> None:
    seen: list[str] = []

    async def main() -> list[int]:
        rx = AccessLogReceiver(lambda entries: seen.extend(e.request.request_id for e in entries))
        rx.queue.extend(batch(range(800)).http_logs.log_entry)  # as if received while the loop was busy
        rx.receive(batch(range(800, 801)))
        sizes = []
        while rx.queue:
            before = len(rx.queue)
            await asyncio.sleep(0)
            sizes.append(before - len(rx.queue))
            assert sizes[-1] >= (before + 7) // 8
        return sizes

    asyncio.run(main())
    assert seen == [f"r{i}" for i in range(801)]


def test_one_failing_entry_costs_the_others_nothing() -> None:
    seen: list[str] = []

    def sink(entries):  # type: ignore[no-untyped-def]
        for e in entries:
            if e.request.request_id == "r3":
                raise RuntimeError("bad entry")
            seen.append(e.request.request_id)

    async def main() -> None:
        rx = AccessLogReceiver(sink)
        rx.receive(batch(range(6)))
        await turns_until_empty(rx)

    asyncio.run(main())
    assert seen == ["r0", "r1", "r2", "r4", "r5"]


@pytest.mark.parametrize("entries", [0, 1, 300])
def test_h2_serves_the_access_log_and_the_ext_proc_stream(entries: int) -> None:
    seen: list[str] = []

    async def main() -> tuple[als_pb2.StreamAccessLogsResponse, list[str]]:
        port = free_port()
        rx = AccessLogReceiver(lambda es: seen.extend(e.request.request_id for e in es))
        server = await start_h2(PassThrough(), "127.0.0.1", port, access_logs=rx)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                async def logs():  # type: ignore[no-untyped-def]
                    for start in range(0, entries, 100):
                        yield batch(range(start, min(entries, start + 100)))
                got = await als_pb2_grpc.AccessLogServiceStub(ch).StreamAccessLogs(logs())
                assert access_log.METHOD.endswith("/StreamAccessLogs")

                async def messages():  # type: ignore[no-untyped-def]
                    yield pb.ProcessingRequest(request_headers=pb.HttpHeaders())
                    yield pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True))
                kinds = [a.WhichOneof("response") async for a in pb_grpc.ExternalProcessorStub(ch).Process(messages())]
            await turns_until_empty(rx)
            return got, kinds
        finally:
            await server.stop(None)

    got, kinds = asyncio.run(main())
    assert got == als_pb2.StreamAccessLogsResponse()
    assert seen == [f"r{i}" for i in range(entries)]
    assert kinds == ["request_headers", "request_body"]
