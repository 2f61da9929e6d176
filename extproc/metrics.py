"""Prometheus metrics, one registry per runtime so tests can run several side by side."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("sluice_requests", "Requests by tenant and outcome (admitted or the rejection reason).",
                                ["tenant", "outcome"], registry=r)
        self.rejections = Counter("sluice_rejections", "Rejections by reason and HTTP status.",
                                  ["reason", "status"], registry=r)
        self.tokens_precharged = Counter("sluice_tokens_precharged", "Tokens reserved at admission.",
                                         ["tenant"], registry=r)
        self.tokens_charged = Counter("sluice_tokens_charged", "Tokens actually used, charged at settle.",
                                      ["tenant"], registry=r)
        self.tokens_refunded = Counter("sluice_tokens_refunded", "Reserved tokens returned at settle.",
                                       ["tenant"], registry=r)
        self.tokens_excess = Counter("sluice_tokens_excess", "Usage above the reservation, charged at settle.",
                                     ["tenant"], registry=r)
        self.bucket_tokens = Gauge("sluice_bucket_tokens_remaining", "Tokens left in a tenant's TPM bucket.",
                                   ["tenant"], registry=r)
        self.in_flight = Gauge("sluice_in_flight_requests", "Admitted requests not yet settled.", registry=r)
        self.settles = Counter("sluice_settles", "Settles by how the stream ended.", ["how"], registry=r)
        self.phase_seconds = Histogram("sluice_extproc_phase_seconds", "Time spent handling one ext_proc message.",
                                       ["phase"], buckets=PHASE_BUCKETS, registry=r)
        self.policy_reloads = Counter("sluice_policy_reloads", "Policy reload attempts by result.", ["result"],
                                      registry=r)
        self.policy_ok = Gauge("sluice_policy_valid", "1 when the last policy load succeeded.", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
