"""Prometheus metrics, one registry per runtime so tests can run several side by side.

The request path (admission, stream, settle, repick, drain, latency) says what happened
through the intent methods below (``admitted``, ``rejected``, ``settled``, ...; listed in
``INTENTS``), each the one place its event is counted; ``tests.metrics_fake`` records
them for assertions. The monitor's and the scrape's gauges are set on the metric
objects directly (``child``/``forget``): one call site each, nothing to gain.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, generate_latest

from extproc.runtime.metric_buffers import BufferedRegistry, CounterBuffer, HistogramBuffer

QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# Time to first token: a short prompt on an idle GPU answers in tens of ms; a 32 k prompt
# or a deep queue takes seconds.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
# Inter-token latency: 10-50 ms per token is the normal range of a decoding batch.
ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
# Response end -> settled from Envoy's access log: its flush interval (10 ms by default) plus the batch's trip.
SETTLE_LAG_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 10.0)
PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
NO_TENANT = "-"  # the tenant label of a request refused before its key was known
# The request path's events, one method each (tests.metrics_fake records these).
INTENTS = ("admitted", "rejected", "bypassed", "settled", "released", "charged_refused", "shadowed",
           "queue_waited", "phase", "placed", "repicked", "tokenized", "latency", "completion_estimated",
           "drained_upload", "spent", "log_settled", "log_entry_unmatched", "log_settle_expired")


class Metrics:
    def __init__(self) -> None:
        r = self.registry = BufferedRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # Per tenant, for /debug/state and the console (not label sets on a metric).
        self.tenant_rejections: defaultdict[str, Tally[str]] = defaultdict(Tally)
        self.tenant_degradations: defaultdict[str, Tally[str]] = defaultdict(Tally)
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
        self.tokens_refused = Counter("sluice_tokens_charged_refused",
                                      "Prompt tokens charged for requests refused after counting them.",
                                      ["tenant", "reason"], registry=r)
        self.tokenize_seconds = Counter("sluice_tokenize_seconds", "Time spent counting prompt tokens.",
                                        ["tenant"], registry=r)
        self.bucket_tokens = Gauge("sluice_bucket_tokens_remaining", "Tokens left in a tenant's TPM bucket.",
                                   ["tenant"], registry=r)
        self.in_flight = Gauge("sluice_in_flight_requests", "Admitted requests not yet settled.", registry=r)
        self.settles = Counter("sluice_settles", "Settles by how the stream ended.", ["how"], registry=r)
        self.charges = Counter("sluice_settle_charges",
                               "Settles by what the charge rests on (extproc.policy.charge.Basis: "
                               "reported, counted, estimated, failed, not_sent).", ["basis"],
                               registry=r)
        self.phase_seconds = Histogram("sluice_extproc_phase_seconds", "Time spent handling one ext_proc message.",
                                       ["phase"], buckets=PHASE_BUCKETS, registry=r)
        self.policy_reloads = Counter("sluice_policy_reloads", "Policy reload attempts by result.", ["result"],
                                      registry=r)
        self.policy_ok = Gauge("sluice_policy_valid", "1 when the last policy load succeeded.", registry=r)
        self.state_store_up = Gauge("sluice_state_store_up", "1 while the TPM/RPM state store answers "
                                    "(always 1 for in-process state).", registry=r)
        # Backpressure
        self.slots_in_use = Gauge("sluice_slots_in_use", "Concurrency slots held, by backend, pool and tier.",
                                  ["backend", "pool", "tier"], registry=r)
        self.slots_effective = Gauge("sluice_slots_effective", "Slot budget after watermark scaling.",
                                     ["backend"], registry=r)
        self.scale = Gauge("sluice_capacity_scale", "Effective capacity factor from the KV watermark (1 = full).",
                           ["backend"], registry=r)
        self.kv_usage = Gauge("sluice_backend_kv_usage", "Last scraped KV-cache usage (0..1).", ["backend"],
                              registry=r)
        self.backend_waiting = Gauge("sluice_backend_requests_waiting", "Last scraped engine queue length.",
                                     ["backend"], registry=r)
        self.scrape_errors = Counter("sluice_backend_scrape_errors", "Failed metric scrapes.", ["backend"],
                                     registry=r)
        self.metrics_problem = Gauge("sluice_backend_metrics_problem",
                                     "1 while a backend's metrics_url answers but cannot be used (problem: "
                                     "not_prometheus, http_404, no_engine_metrics, ...).",
                                     ["backend", "problem"], registry=r)
        self.breaker_state = Gauge("sluice_breaker_state", "1 for the breaker's current state.",
                                   ["backend", "state"], registry=r)
        self.breaker_transitions = Counter("sluice_breaker_transitions", "Breaker state changes.",
                                           ["backend", "from_state", "to_state", "cause"], registry=r)
        self.probes = Counter("sluice_backend_probes",
                              "Sluice's own probes of a backend (extproc.service.prober): why "
                              "(half_open, blame) and how they went.", ["backend", "why", "result"],
                              registry=r)
        self.tenant_breakers = Gauge("sluice_tenant_breakers", "Tenant breakers on a backend, by state.",
                                     ["backend", "state"], registry=r)
        self.tenant_breaker_trips = Counter("sluice_tenant_breaker_trips",
                                            "Times a tenant's own failures opened its breaker on a backend.",
                                            ["backend", "tenant"], registry=r)
        self.queue_depth = Gauge("sluice_queue_depth", "Requests waiting for a slot.", ["backend", "tier"],
                                 registry=r)
        # KV shares, revocation and fair share (docs/long-context.md), set by the monitor's refresh.
        self.kv_reserved = Gauge(
            "sluice_kv_reserved_tokens",
            "KV footprints reserved, by backend and tier.",
            ["backend", "tier"],
            registry=r,
        )
        self.kv_guaranteed = Gauge(
            "sluice_kv_guaranteed_tokens",
            "The KV tokens kept for a tier while it has "
            "demand (its kv_guaranteed of the backend's budget now).",
            ["backend", "tier"],
            registry=r,
        )
        self.revocations = Counter(
            "sluice_revocations",
            "Admitted requests revoked to give a higher tier KV room, "
            "by the victim's tier and kind (unanswered: a 503; streaming: an error event).",
            ["backend", "tier", "kind"],
            registry=r,
        )
        self.revoked_work = Counter(
            "sluice_revoked_work_tokens",
            "Work thrown away by revocations (prompt tokens "
            "prefilled plus tokens generated), by the victim's tier.",
            ["backend", "tier"],
            registry=r,
        )
        self.fair_difference = Gauge(
            "sluice_fair_share_service_difference",
            "The largest gap between the "
            "fair-share counters (input + 2 x output tokens) of a tier's tenants waiting "
            "together.",
            ["backend", "tier"],
            registry=r,
        )
        self.fair_jain = Gauge(
            "sluice_fair_share_jain",
            "Jain's fairness index of the recent service of a tier's "
            "tenants waiting together (1: equal).",
            ["backend", "tier"],
            registry=r,
        )
        self.queue_wait = Histogram("sluice_queue_wait_seconds", "Time requests waited for a slot, by result.",
                                    ["tier", "result"], buckets=QUEUE_BUCKETS, registry=r)
        self.degraded = Counter("sluice_degraded", "Requests admitted in a degraded form.", ["tier", "kind"],
                                registry=r)
        self.shadow = Counter("sluice_shadow_decisions", "Rejections a shadowed rule would have made.",
                              ["rule", "tier"], registry=r)
        # Oversized uploads read and discarded so the client sees its 413 (extproc/service/drain.py)
        self.drained = Counter("sluice_drained_uploads", "Oversized uploads answered 413 by the drain, by outcome.",
                               ["outcome"], registry=r)
        self.drained_bytes = Counter("sluice_drained_bytes", "Bytes of oversized uploads read and discarded.",
                                     registry=r)
        # Usage and spend (docs/budgets.md), priced at settle; labels bounded by the policy's
        # tenants and models. The budget gauges are set by the monitor (extproc.service.monitor).
        self.usage_tokens = Counter("sluice_usage_tokens", "Tokens used by requests that reached a backend, as "
                                    "the engine reported them: kind prompt, completion, cached_prompt (part of "
                                    "prompt).", ["tenant", "model", "kind"], registry=r)
        self.usage_requests = Counter("sluice_usage_requests", "Requests that reached a backend and settled.",
                                      ["tenant", "model"], registry=r)
        self.spend = Counter("sluice_spend", "Spend priced at settle, in gateway.currency.", ["tenant", "model"],
                             registry=r)
        self.budget_limit = Gauge("sluice_budget_limit", "A tenant's budget per period, by unit (tokens, cost in "
                                  "gateway.currency).", ["tenant", "unit"], registry=r)
        self.budget_used = Gauge("sluice_budget_used", "Spent and reserved in the tenant's current budget period, "
                                 "as this replica knows it.", ["tenant", "unit"], registry=r)
        self.budget_used_ratio = Gauge("sluice_budget_used_ratio", "The larger used share of a tenant's budget "
                                       "units this period (1 = spent).", ["tenant"], registry=r)
        self.budget_alert = Gauge("sluice_budget_alert", "1 while the tenant's use this period is at or past the "
                                  "alert threshold (a fraction of the budget).", ["tenant", "threshold"], registry=r)

        # Latency, per backend and tier (observed at settle, see extproc/request/observe.py)
        self.ttft = Histogram("sluice_ttft_seconds", "Time to first token, from admission (slot granted) to the "
                              "first response byte.", ["backend", "tier"], buckets=TTFT_BUCKETS, registry=r)
        self.ttft_arrival = Histogram("sluice_ttft_from_arrival_seconds", "Time to first token from the "
                                      "request's arrival (tokenizing and queue wait included).",
                                      ["backend", "tier"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("sluice_inter_token_seconds", "Mean time between output tokens of a response "
                             "(stream duration after the first token / (output tokens - 1)).",
                             ["backend", "tier"], buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram("sluice_request_duration_seconds", "Arrival to the end of the response, for "
                                  "responses that ended normally.", ["backend", "tier"], buckets=DURATION_BUCKETS,
                                  registry=r)
        self.concurrency_limit = Gauge("sluice_adaptive_concurrency_limit", "The latency-driven concurrency "
                                       "limit (the backend's max_concurrency while no SLO is set).", ["backend"],
                                       registry=r)
        self.completion_estimate = Gauge("sluice_completion_estimate_tokens", "The learned completion length "
                                         "reserved per choice, by tier and model.", ["tier", "model"], registry=r)
        # A pool's endpoints (extproc.backends.endpoints): where requests were placed and what each holds.
        self.endpoint_picks = Counter("sluice_endpoint_picks", "Requests placed on a pool endpoint.",
                                      ["backend", "endpoint"], registry=r)
        self.endpoint_repicks = Counter("sluice_endpoint_repicks", "Pool requests Envoy sent to another endpoint "
                                        "than Sluice's pick because the pick refused the connection (to_endpoint "
                                        "\"unknown\": an address not in the pool).",
                                        ["backend", "from_endpoint", "to_endpoint"], registry=r)
        self.prefix_affinity = Counter("sluice_prefix_affinity", "Pool placements by prefix affinity: hit (the "
                                       "endpoint that last served the prefix), spill (it had no room), miss "
                                       "(no known prefix).", ["backend", "result"], registry=r)
        self.endpoint_in_flight = Gauge("sluice_endpoint_in_flight_requests", "Requests placed on a pool endpoint "
                                        "and not yet finished.", ["backend", "endpoint"], registry=r)
        self.endpoint_kv_reserved = Gauge("sluice_endpoint_kv_reserved_tokens", "KV footprints reserved on a pool "
                                          "endpoint.", ["backend", "endpoint"], registry=r)
        self.pool_endpoints = Gauge("sluice_pool_endpoints", "A pool's endpoints by state: "
                                    "total, usable (may be picked) and unreadable (scraped, but "
                                    "the metrics could not be used).", ["backend", "state"],
                                    registry=r)
        self.settle_lag = Histogram("sluice_settle_lag_seconds", "From the end of a response to its settle "
                                    "from Envoy's access log.", buckets=SETTLE_LAG_BUCKETS, registry=r)
        self.log_entries = Counter("sluice_access_log_entries", "Access-log entries received, by outcome: settled, "
                                   "late (its request had settled by expiry), unknown (no such request here).",
                                   ["outcome"], registry=r)
        self.log_awaiting = Gauge("sluice_access_log_awaiting", "Forwarded requests whose settle waits for their "
                                  "access-log entry.", registry=r)
        self.log_expired = Counter("sluice_access_log_expired", "Forwarded requests settled by expiry: no "
                                   "access-log entry came within response_timeout_s and a margin.", registry=r)
        self.endpoint_usable = Gauge("sluice_endpoint_usable", "1 while a pool endpoint may be picked (breaker "
                                     "not open, metrics fresh, not draining).", ["backend", "endpoint"], registry=r)

    # -- the request path's events ----------------------------------------------------
    def admitted(self, tenant: str, tier: str, cost: int, tokens_remaining: int, degraded: Iterable[str] = ()) -> None:
        """A request got its pre-charge and slot and goes to the backend (in flight until ``released``)."""
        c = self.child
        c(self.requests, tenant, "admitted").inc()
        c(self.tokens_precharged, tenant).inc(cost)
        self.in_flight.inc()
        c(self.bucket_tokens, tenant).set(tokens_remaining)
        for kind in degraded:
            c(self.degraded, tier, kind).inc()
            self.tenant_degradations[tenant][kind] += 1

    def rejected(self, reason: str, status: int, tenant: str | None = None) -> None:
        """A request refused with ``status``: the one place a rejection is counted.

        ``tenant`` is the key's tenant, ``NO_TENANT`` for a request Sluice refused before
        knowing it, None for one the ext_proc never saw (the drain): that is not a request
        of ``sluice_requests``."""
        self.child(self.rejections, reason, str(status)).inc()
        if tenant is None:
            return
        self.child(self.requests, tenant, reason).inc()
        if tenant != NO_TENANT:
            self.tenant_rejections[tenant][reason] += 1

    def bypassed(self, tenant: str, outcome: str) -> None:
        """A request that needs no admission: ``passthrough`` (an unknown path let through)
        or ``models`` (the model list, answered by Sluice)."""
        self.child(self.requests, tenant, outcome).inc()

    def settled(self, how: str, tenant: str, charged: int, reserved: int, basis: str = "") -> None:
        """An admitted request settled ``how``: charged what it used (on ``basis``), the rest
        of its reservation refunded (or the excess over it charged)."""
        c = self.child
        c(self.settles, how).inc()
        if basis:
            c(self.charges, basis).inc()
        c(self.tokens_charged, tenant).inc(charged)
        if charged <= reserved:
            c(self.tokens_refunded, tenant).inc(reserved - charged)
        else:
            c(self.tokens_excess, tenant).inc(charged - reserved)

    def released(self) -> None:
        """An ``admitted`` request is no longer in flight."""
        self.in_flight.dec()

    def charged_refused(self, tenant: str, reason: str, tokens: int) -> None:
        """A prompt refused after it was counted, charged as spent (extproc.request.settle)."""
        self.child(self.tokens_refused, tenant, reason).inc(tokens)

    def shadowed(self, rule: str, tier: str) -> None:
        """A rule in shadow mode would have refused or degraded a request."""
        self.child(self.shadow, rule, tier).inc()

    def queue_waited(self, tier: str, result: str, seconds: float) -> None:
        self.child(self.queue_wait, tier, result).observe(seconds)

    def phase(self, phase: str, seconds: float) -> None:
        """Time spent answering one ext_proc message."""
        self.child(self.phase_seconds, phase).observe(seconds)

    def placed(self, backend: str, endpoint: str, affinity: str | None) -> None:
        """A pool request placed on ``endpoint``; ``affinity`` the prefix result (hit, spill, miss) if any."""
        self.child(self.endpoint_picks, backend, endpoint).inc()
        if affinity is not None:
            self.child(self.prefix_affinity, backend, affinity).inc()

    def repicked(self, backend: str, from_endpoint: str, to_endpoint: str) -> None:
        """Envoy served a pool request elsewhere than the pick (extproc.request.repick)."""
        self.child(self.endpoint_repicks, backend, from_endpoint, to_endpoint).inc()

    def tokenized(self, tenant: str, seconds: float) -> None:
        self.child(self.tokenize_seconds, tenant).inc(seconds)

    def latency(self, backend: str, tier: str, ttft: float, from_arrival: float, duration: float | None = None,
                itl: float | None = None) -> None:
        """A forwarded request's latencies (extproc.request.observe); duration and ITL only when it ended normally."""
        c = self.child
        c(self.ttft, backend, tier).observe(ttft)
        c(self.ttft_arrival, backend, tier).observe(from_arrival)
        if duration is not None:
            c(self.duration, backend, tier).observe(duration)
        if itl is not None:
            c(self.itl, backend, tier).observe(itl)

    def completion_estimated(self, tier: str, model: str, tokens: float) -> None:
        self.child(self.completion_estimate, tier, model).set(tokens)

    def drained_upload(self, outcome: str, read: int = 0) -> None:
        """An oversized upload the drain answered (extproc.service.drain), ``read`` bytes discarded."""
        if read:
            self.drained_bytes.inc(read)
        self.child(self.drained, outcome).inc()

    def spent(self, tenant: str, model: str, prompt: int, completion: int, cached: int, nanos: int) -> None:
        """A request that reached a backend settled having used this much (docs/budgets.md)."""
        c = self.child
        c(self.usage_requests, tenant, model).inc()
        c(self.usage_tokens, tenant, model, "prompt").inc(prompt)
        c(self.usage_tokens, tenant, model, "completion").inc(completion)
        if cached:
            c(self.usage_tokens, tenant, model, "cached_prompt").inc(cached)
        if nanos:
            c(self.spend, tenant, model).inc(nanos / 1e9)

    def log_settled(self, lag_s: float) -> None:
        """A forwarded request settled from its access-log entry, ``lag_s`` after its response ended."""
        self.child(self.log_entries, "settled").inc()
        self.settle_lag.observe(max(0.0, lag_s))

    def log_entry_unmatched(self, late: bool) -> None:
        """An access-log entry no waiting request took: ``late`` (the request had settled by
        expiry) or unknown here. Ignored: a request is never billed twice."""
        self.child(self.log_entries, "late" if late else "unknown").inc()

    def log_settle_expired(self) -> None:
        """A forwarded request whose access-log entry never came settled by expiry."""
        self.log_expired.inc()

    # -- the metric objects ------------------------------------------------------------
    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: labels() costs ~3 us, a dict lookup ~0.1 us. A
        counter's or a histogram's comes buffered (extproc.runtime.metric_buffers).

        Label values here are bounded by the policy (tenants, tiers, reasons, phases).
        """
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = metric.labels(*labels)
            if isinstance(metric, Counter):
                c = CounterBuffer(c)
                self.registry.add(c)
            elif isinstance(metric, Histogram):
                c = HistogramBuffer(c)
                self.registry.add(c)
            self._children[key] = c
        return c

    def forget(self, metric: Any, *labels: str) -> None:
        """Remove one labelled series, and its cached child (which would write to nowhere)."""
        c = self._children.pop((id(metric), labels), None)
        if isinstance(c, (CounterBuffer, HistogramBuffer)):
            self.registry.drop(c.child)
        metric.remove(*labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)
