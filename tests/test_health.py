"""extproc/wire/health.py: grpc.health.v1 on the real grpc.aio server, and the drain's wait."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from bench.procs import free_port
from extproc.service.server import start_server
from extproc.wire.health import (
    NOT_SERVING,
    SERVING,
    Health,
    HealthCheckRequest,
    HealthCheckResponse,
)
from tests.waiting import eventually_async

CHECK = "/grpc.health.v1.Health/Check"


async def _check(channel: grpc.aio.Channel, service: str = "") -> int:
    call = channel.unary_unary(CHECK, request_serializer=HealthCheckRequest.SerializeToString,
                               response_deserializer=HealthCheckResponse.FromString)
    return (await call(HealthCheckRequest(service=service), timeout=5)).status


def test_the_messages_have_the_standard_wire_format() -> None:
    # field 1 (string) and field 1 (enum varint), as in grpc/health/v1/health.proto
    assert HealthCheckRequest(service="x").SerializeToString() == b"\x0a\x01x"
    assert HealthCheckResponse(status=NOT_SERVING).SerializeToString() == b"\x08\x02"
    assert HealthCheckResponse.FromString(b"\x08\x01").status == SERVING


def test_check_answers_serving_then_not_serving_and_the_drain_waits_for_the_checker() -> None:
    async def run() -> None:
        health = Health()
        port = free_port()
        server = await start_server(pb_grpc.ExternalProcessorServicer(), "127.0.0.1", port, health=health)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                assert await _check(ch) == SERVING
                assert await _check(ch, "envoy.service.ext_proc.v3.ExternalProcessor") == SERVING
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _check(ch, "no.such.Service")
                assert err.value.code() == grpc.StatusCode.NOT_FOUND

                seen: list[int] = []

                async def checker() -> None:  # an Envoy checking every 0.1 s
                    while len(seen) < 50:
                        seen.append(await _check(ch))
                        await asyncio.sleep(0.1)

                task = asyncio.create_task(checker())
                await eventually_async(lambda: seen, 5, "the checker has checked once: a live checker")
                waited = await health.drain(interval_s=0.5, threshold=2)
                told = seen.count(NOT_SERVING)
                task.cancel()
                # returned once the checker had its two NOT_SERVING answers, well before the bound (1.5 s)
                assert told >= 2, seen
                assert waited < 1.4, waited
                assert await _check(ch) == NOT_SERVING
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_the_drain_does_not_wait_without_a_live_checker() -> None:
    now = [100.0]
    h = Health(clock=lambda: now[0])
    assert asyncio.run(h.drain(1.0, 2)) == 0.0  # nobody ever checked
    h = Health(clock=lambda: now[0])
    h.peers["ipv4:127.0.0.1:1"] = (now[0] - 1.4, 0)  # checked 1.4 intervals ago: still counted
    h.peers["ipv4:127.0.0.1:2"] = (now[0] - 1.6, 0)  # quiet for longer: gone (Envoy stopped)
    h.peers["ipv4:127.0.0.1:3"] = (now[0], 2)  # has seen NOT_SERVING twice
    assert h.waiting_for(1.0, 2) == ["ipv4:127.0.0.1:1"]
    assert h.waiting_for(1.0, 3) == ["ipv4:127.0.0.1:1", "ipv4:127.0.0.1:3"]


def test_the_drain_is_bounded_when_a_checker_never_comes_back() -> None:
    h = Health()
    h.peers["ipv4:127.0.0.1:1"] = (time.monotonic() + 60, 0)  # "checks" forever, never sees NOT_SERVING
    started = time.monotonic()
    waited = asyncio.run(h.drain(0.05, 2))
    assert h.status == NOT_SERVING
    assert waited >= 0.14 and time.monotonic() - started < 2.0, waited  # (2 + 1) x 0.05 s


def test_silent_checkers_are_forgotten() -> None:
    class Ctx:
        def __init__(self, peer: str) -> None:
            self._peer = peer

        def peer(self) -> str:
            return self._peer

    now = [0.0]
    h = Health(clock=lambda: now[0])
    for i in range(64):
        asyncio.run(h.Check(HealthCheckRequest(), Ctx(f"ipv4:127.0.0.1:{i}")))  # type: ignore[arg-type]
    now[0] = 100.0
    asyncio.run(h.Check(HealthCheckRequest(), Ctx("ipv4:127.0.0.1:999")))  # type: ignore[arg-type]
    assert list(h.peers) == ["ipv4:127.0.0.1:999"]
