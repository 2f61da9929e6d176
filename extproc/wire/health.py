"""The standard gRPC health service (``grpc.health.v1.Health/Check``) on extproc's server.

Envoy's ext_proc cluster checks it (``envoy_clusters.extproc_health``): a replica
that stops answering SERVING is taken out of the balancing within
``interval × unhealthy_threshold``, and one that dies is ejected at its first failed
streams by outlier detection. On SIGTERM the replica answers NOT_SERVING first and
waits until each Envoy checking it has seen that ``unhealthy_threshold`` times (or has
gone quiet), so no new ext_proc stream lands on it while it drains.

The two messages are built here from a descriptor in a private pool (no generated
module is installed, and a private pool cannot clash with ``grpcio-health-checking``
should it be). ``Watch`` is not served (UNIMPLEMENTED): Envoy and the usual probes call
``Check``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = [
    "LIVENESS",
    "NOT_SERVING",
    "PICKER_SERVICES",
    "READINESS",
    "SERVICE",
    "SERVING",
    "Health",
    "HealthCheckRequest",
    "HealthCheckResponse",
]

SERVICE = "grpc.health.v1.Health"
# What Envoy asks by default ("": the whole server) and the service it checks for.
SERVICES = ("", "envoy.service.ext_proc.v3.ExternalProcessor")
# What an Inference Extension picker answers besides (its kubelet probes and gateways ask
# these): liveness is SERVING while the process answers at all, even while it drains;
# readiness follows the status, as the ext_proc service does.
LIVENESS, READINESS = "liveness", "readiness"
PICKER_SERVICES = (*SERVICES, LIVENESS, READINESS)
UNKNOWN, SERVING, NOT_SERVING = 0, 1, 2
NOT_FOUND_CODE = grpc.StatusCode.NOT_FOUND.value[0]
_MAX_PEERS, _FORGET_S = 64, 60.0


def _messages() -> tuple[Any, Any]:
    f = descriptor_pb2.FileDescriptorProto(name="sluice/grpc_health_v1.proto", package="grpc.health.v1",
                                           syntax="proto3")
    fd = descriptor_pb2.FieldDescriptorProto
    req = f.message_type.add(name="HealthCheckRequest")
    req.field.add(name="service", number=1, type=fd.TYPE_STRING, label=fd.LABEL_OPTIONAL)
    resp = f.message_type.add(name="HealthCheckResponse")
    status = resp.enum_type.add(name="ServingStatus")
    for name, number in (("UNKNOWN", 0), ("SERVING", 1), ("NOT_SERVING", 2), ("SERVICE_UNKNOWN", 3)):
        status.value.add(name=name, number=number)
    resp.field.add(name="status", number=1, type=fd.TYPE_ENUM, label=fd.LABEL_OPTIONAL,
                   type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return (message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")),
            message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")))


HealthCheckRequest, HealthCheckResponse = _messages()


class Health:
    """SERVING until ``drain``; counts the checks each peer (an Envoy's connection) made."""

    def __init__(self, clock: Any = time.monotonic, services: tuple[str, ...] = SERVICES,
                 status: int = SERVING) -> None:
        self.status = status
        self.services = services
        self.clock = clock
        # peer -> (time of its last check, NOT_SERVING answers it has had)
        self.peers: dict[str, tuple[float, int]] = {}

    def check(self, service: str, peer: str) -> int | None:
        """The status to answer ``peer`` about ``service``; None for a service not served."""
        if service not in self.services:
            return None
        if service == LIVENESS:
            return SERVING
        now = self.clock()
        _, told = self.peers.get(peer, (0.0, 0))
        self.peers[peer] = (now, told + (self.status == NOT_SERVING))
        if len(self.peers) > _MAX_PEERS:  # checkers reconnect from new ports: forget the silent ones
            self.peers = {p: v for p, v in self.peers.items() if now - v[0] < _FORGET_S}
        return self.status

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802 - gRPC name
        status = self.check(request.service, context.peer())
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return HealthCheckResponse(status=status)

    def check_wire(self, request: bytes, peer: str) -> tuple[int, bytes | None, str]:
        """``Check`` on wire bytes, for a server without grpcio (extproc.wire.h2grpc):
        (gRPC status, response, message)."""
        service = HealthCheckRequest.FromString(request).service
        status = self.check(service, peer)
        if status is None:
            return NOT_FOUND_CODE, None, f"unknown service {service!r}"
        return 0, HealthCheckResponse(status=status).SerializeToString(), ""

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Check": grpc.unary_unary_rpc_method_handler(
                self.Check, request_deserializer=HealthCheckRequest.FromString,
                response_serializer=HealthCheckResponse.SerializeToString),
        })

    def waiting_for(self, interval_s: float, threshold: int) -> list[str]:
        """Peers that still check (within 1.5 intervals) and have not yet seen NOT_SERVING ``threshold`` times."""
        now = self.clock()
        return [p for p, (at, told) in self.peers.items() if now - at <= 1.5 * interval_s and told < threshold]

    async def drain(self, interval_s: float, threshold: int) -> float:
        """Answer NOT_SERVING; return once every live checker has seen it ``threshold`` times.

        Bounded by ``(threshold + 1) × interval_s``; returns at once when no checker is
        around (no health checking configured, or Envoy already gone). Returns the wait.
        """
        self.status = NOT_SERVING
        started = self.clock()
        deadline = started + (threshold + 1) * interval_s
        while self.waiting_for(interval_s, threshold) and self.clock() < deadline:
            await asyncio.sleep(min(0.05, interval_s / 4))
        return self.clock() - started
