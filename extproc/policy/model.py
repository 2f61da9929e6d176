"""The policy as data: the frozen dataclasses that ``build_policy`` returns.

Pure and dependency-free so the parsers, the data plane and the console can all
share one definition; ``extproc.policy.schema`` re-exports every name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from extproc.policy.breaker_config import BreakerConfig
from extproc.policy.budget import Budget, Price
from extproc.policy.model_edge import DEFAULT_KEY_PATTERN, EdgeSettings

__all__ = ["AdaptiveSettings", "Backend", "Budget", "Price", "Endpoint", "BreakerOverride",
           "BreakerSettings", "Degrade", "EdgeSettings", "Gateway", "Limits", "Model", "Policy",
           "Tenant", "Tier", "WatermarkSettings", "hash_key", "KV_RESERVATIONS", "PROBES",
           "TPM_PRECHARGES", "ENGINE_PRIORITIES", "DEFAULT_KEY_PATTERN"]

KV_RESERVATIONS = ("worst_case", "learned")
PROBES = ("completions", "chat", "embeddings", "health")
ENGINE_PRIORITIES = ("off", "vllm", "sglang")
TPM_PRECHARGES = ("max_tokens", "learned")
_BREAKER = BreakerConfig()  # the defaults BreakerSettings takes
_BREAKER_FIELDS = frozenset(f.name for f in fields(BreakerConfig)) - {"max_cooldown_s"}


def hash_key(api_key: str) -> str:
    """The form in which the policy stores an API key."""
    return "sha256:" + hashlib.sha256(api_key.encode()).hexdigest()


@dataclass(frozen=True)
class Gateway:
    max_body_bytes: int = 1 << 20
    unknown_paths: str = "reject"  # or "passthrough"
    strip_api_key: bool = True
    default_max_tokens: int = 1024
    failure_mode_allow: bool = False
    message_timeout_ms: int = 5000
    image_token_estimate: int = 765
    shadow: tuple[str, ...] = ()
    # Oversized uploads (content-length over max_body_bytes) are read and discarded by the
    # drain so the client can read its 413; these bound what one upload may cost.
    drain_max_bytes: int = 64 << 20
    drain_timeout_s: float = 30.0
    # Edge hygiene in the generated Envoy config.
    request_headers_timeout_s: float = 10.0  # time to receive all request headers
    request_timeout_s: float = 120.0  # time to receive the whole request (not the response)
    max_connections: int = 1024  # open downstream connections on the listener
    trusted_proxy_hops: int = 0  # proxies in front of Envoy whose X-Forwarded-For is trusted
    # Envoy's gRPC health checks of the extproc replicas (and its outlier detection):
    # a replica failing this many checks, or streams in a row, gets no new streams.
    extproc_health_interval_s: float = 1.0
    extproc_unhealthy_threshold: int = 2
    # Where TPM/RPM buckets live: "memory" (this process) or a Redis URL shared by
    # every replica. $SLUICE_REDIS_URL, when set, wins (a deployment detail).
    state: str = "memory"
    state_fail_closed: bool = False  # Redis unreachable: refuse instead of a local share
    # "access_log": no response message reaches extproc, Envoy's gRPC access log brings
    # the status, first byte, served address and usage; "usage_trailers": Envoy reads the
    # usage, extproc gets the response headers and one trailers message; "streamed": every
    # response chunk goes through extproc (per-chunk inspection)
    response_processing: str = "usage_trailers"
    edge: EdgeSettings = field(default_factory=EdgeSettings)
    currency: str = "USD"  # what budgets' cost and models' prices are counted in
    # The longest a response may take once the request went upstream (0: no limit); Envoy
    # ends a longer one with 504. Under access_log it bounds a settle's wait for its entry.
    response_timeout_s: float = 600.0
    # Under access_log: how often each Envoy worker sends its entries (docs/round-trips.md:
    # shorter spreads the settles thinner, each flush costs Envoy and Sluice a message).
    access_log_flush_ms: int = 10


@dataclass(frozen=True)
class WatermarkSettings:
    """KV-cache watermark feedback (seed article: 85 % high, 70 % low)."""

    high: float = 0.85
    low: float = 0.70
    floor: float = 0.6
    smoothing: float = 0.5  # EWMA weight of a new sample
    recover_per_s: float = 0.05
    stale_after_s: float = 5.0
    waiting_threshold: float = 8.0
    scrape_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high <= 1:
            raise ValueError(f"need 0 < low < high <= 1 (low={self.low}, high={self.high})")
        if not 0 < self.floor <= 1:
            raise ValueError(f"floor must be in (0, 1], got {self.floor}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")


@dataclass(frozen=True)
class BreakerSettings:
    """The breaker tunables a policy may set. Their defaults and bounds are the breaker's
    own (``BreakerConfig``, extproc.policy.breaker_config): a bad value fails at load,
    with its place in the policy, because constructing one builds its ``config()``."""

    window_s: float = _BREAKER.window_s
    min_requests: int = _BREAKER.min_requests
    error_ratio: float = _BREAKER.error_ratio
    consecutive_failures: int = _BREAKER.consecutive_failures
    latency_slo_s: float | None = _BREAKER.latency_slo_s
    cooldown_s: float = _BREAKER.cooldown_s
    max_cooldown_s: float = _BREAKER.max_cooldown_s
    ramp_steps: tuple[float, ...] = tuple(_BREAKER.ramp_steps)
    ramp_step_s: float = _BREAKER.ramp_step_s
    trip_on_preemption: bool = _BREAKER.trip_on_preemption
    preemption_threshold: float = _BREAKER.preemption_threshold
    own_probe_after_s: float = _BREAKER.own_probe_after_s
    # What Sluice's own probe of the backend asks (extproc.backends.probe): a one-token
    # "completions" or "chat" completion, an "embeddings" of one word, or GET /health.
    probe: str = "completions"
    # Failure attribution (extproc.policy.tenant_breakers): a failure counts for this
    # breaker once this many tenants fail (1: always), else for its tenant's own breaker;
    # at most max_tenant_breakers tenants tracked here.
    min_failing_tenants: int = 2
    max_tenant_breakers: int = 1000

    def __post_init__(self) -> None:
        if self.min_failing_tenants < 1:
            raise ValueError("min_failing_tenants must be >= 1")
        if self.max_tenant_breakers < 1:
            raise ValueError("max_tenant_breakers must be >= 1")
        if self.probe not in PROBES:
            raise ValueError(f"probe must be one of {', '.join(PROBES)}")
        if not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in self.ramp_steps):
            raise ValueError("ramp_steps must be numbers")
        self.config()  # the breaker's own checks, at load

    def config(self) -> BreakerConfig:
        """The breaker these settings make; the breaker's other tunables keep its defaults.
        A ``cooldown_s`` above ``max_cooldown_s`` raises the maximum to it."""
        return BreakerConfig(**{f.name: getattr(self, f.name) for f in fields(self) if f.name in _BREAKER_FIELDS},
                             max_cooldown_s=max(self.max_cooldown_s, self.cooldown_s))


@dataclass(frozen=True)
class AdaptiveSettings:
    """The latency-driven concurrency limit (``extproc.policy.concurrency``); it runs on a
    backend only while some tier sets ``ttft_p99_ms`` or ``itl_p99_ms``."""

    enabled: bool = True
    floor: int = 2
    window_s: float = 1.0
    min_samples: int = 4
    quantile: float = 0.99
    tolerance: float = 0.8
    smoothing: float = 0.5
    min_gradient: float = 0.5
    risk_hold_s: float = 5.0


@dataclass(frozen=True)
class PlacementSettings:
    """How a pool places requests beyond the picking score (``extproc.policy.placement``)."""

    # Prefer the endpoint that last served the request's prompt prefix (its engine's
    # prefix cache likely holds it) while it has room; off by default.
    prefix_affinity: bool = False
    prefix_block_bytes: int = 1024  # the prompt is keyed in blocks of this many bytes
    prefix_max_bytes: int = 16384  # at most this many leading bytes are hashed per request
    affinity_min_headroom: float = 0.2  # below this free fraction after placement, the score decides
    affinity_max_entries: int = 100_000  # block keys remembered per pool (LRU)
    affinity_ttl_s: float = 600.0  # a key is forgotten this long after it was last served

    def __post_init__(self) -> None:
        if self.prefix_block_bytes < 64:
            raise ValueError("prefix_block_bytes must be >= 64")
        if self.prefix_max_bytes < self.prefix_block_bytes:
            raise ValueError("prefix_max_bytes must be >= prefix_block_bytes")
        if not 0 <= self.affinity_min_headroom < 1:
            raise ValueError("affinity_min_headroom must be in [0, 1)")
        if self.affinity_max_entries < 1 or self.affinity_ttl_s <= 0:
            raise ValueError("affinity_max_entries must be >= 1 and affinity_ttl_s > 0")


@dataclass(frozen=True)
class Degrade:
    """A tier's degradation ladder, by the backend's capacity scale (1.0 = no pressure)."""

    clamp_max_tokens: int = 0  # 0: never clamp
    clamp_below_scale: float = 0.0
    fallback_below_scale: float = 0.0  # route to the model's fallback_model
    shed_below_scale: float = 0.0  # answer 503 instead of queueing


@dataclass(frozen=True)
class Model:
    name: str
    context_window: int
    encoding: str = "cl100k_base"
    default_max_tokens: int | None = None
    fallback_model: str | None = None
    # A breaker for this model's route alone, besides the backend's: one broken model
    # (a bad adapter, a crashing tokenizer) need not take its backend's others down.
    breaker: BreakerSettings | None = None
    price: Price | None = None  # per token, in nanos (extproc.policy.budget); None: free


@dataclass(frozen=True)
class Endpoint:
    """One engine replica of a pool: where it listens, where it reports, what it holds.

    ``kv_capacity_tokens`` and ``max_concurrency`` are resolved at parse time (the
    endpoint's own value, else the backend's), so they are never None for a budget
    the backend sets.
    """

    host: str
    port: int
    metrics_url: str | None = None
    kv_capacity_tokens: int | None = None
    max_concurrency: int = 64

    @property
    def key(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Backend:
    name: str
    host: str
    port: int
    max_concurrency: int
    models: tuple[Model, ...]
    metrics_url: str | None = None
    # KV-cache size in tokens. When set, a request is admitted only while the
    # worst-case footprints (prompt + n x max_tokens) of everything in flight fit
    # in it, scaled by the watermark: the cache cannot be overcommitted.
    kv_capacity_tokens: int | None = None
    kv_block_size: int = 16
    # Worst-case footprints overstate what requests really use (most stop well before
    # max_tokens). >1 admits that many times the cache in reservations and relies on
    # the watermark feedback to cut admission when real usage climbs.
    kv_overcommit: float = 1.0
    engine: str = "vllm"
    metric_names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    watermark: WatermarkSettings = field(default_factory=WatermarkSettings)
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    # What a request's KV footprint reserves per completion: max_tokens ("worst_case")
    # or the learned length of recent completions ("learned", never above max_tokens).
    kv_reservation: str = "worst_case"
    # Which quantile of recent completion lengths "learned" reserves (and pre-charges).
    learned_quantile: float = 0.95
    # What the TPM pre-charge reserves per completion; the TPM contract holds only
    # with "max_tokens" (the default): "learned" charges the excess at settle instead.
    tpm_precharge: str = "max_tokens"
    adaptive_concurrency: AdaptiveSettings = field(default_factory=AdaptiveSettings)
    # A pool: the engine replicas serving this backend's models (extproc.backends.endpoints). Empty
    # for the simple case (one ``address``). With endpoints, ``max_concurrency`` and
    # ``kv_capacity_tokens`` above are the pool's sums: the admission budget.
    endpoints: tuple[Endpoint, ...] = ()
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    # What one engine endpoint costs per hour (nanos), for the cost per million tokens served.
    gpu_hour_cost_nanos: int | None = None
    # Each request's tier priority written into the upstream body's ``priority`` field, in
    # the engine's sign: "vllm" (lower runs first; needs --scheduling-policy priority, or
    # vLLM answers 400), "sglang" (higher runs first), "off" (nothing written).
    engine_priority: str = "off"

    @property
    def is_pool(self) -> bool:
        return bool(self.endpoints)


@dataclass(frozen=True)
class Tier:
    name: str
    priority: int
    tpm: int
    rpm: int
    burst_tokens: int  # bucket capacity; defaults to one minute's worth
    max_concurrency: int  # per tenant
    guaranteed_slots: int = 0  # per backend, reserved for this tier
    burst_slots: int | None = None  # most shared-pool slots this tier may hold
    max_queue_wait_ms: int = 0
    max_queue_depth: int = 0
    queue_weight: int = 1
    degrade: Degrade = field(default_factory=Degrade)
    shadow: tuple[str, ...] = ()
    # Latency SLOs (p99, milliseconds): time to first token after admission, and the
    # mean time between tokens of a stream. Either drives the adaptive concurrency limit.
    ttft_p99_ms: int | None = None
    itl_p99_ms: int | None = None
    budget: Budget | None = None  # every tenant's of this tier, unless it sets its own
    # KV shares (extproc.policy.kv_shares), fractions of each backend's (pool endpoint's) KV
    # budget: kept for this tier while it has demand, and the most it holds above that.
    # A tier with a guarantee may take it back from lower tiers (extproc.policy.revoke).
    kv_guaranteed: float = 0.0
    kv_burst: float | None = None
    # Its requests in flight may be ended to give room to a higher tier (a stream ends with
    # an error event and is billed what it produced); off by default.
    revocable: bool = False


@dataclass(frozen=True)
class Tenant:
    name: str
    tier: str
    key_hashes: tuple[str, ...]
    tpm: int | None = None
    rpm: int | None = None
    max_concurrency: int | None = None
    budget: Budget | None = None  # None: the tier's; a Budget without limits: none at all


@dataclass(frozen=True)
class BreakerOverride:
    """An operator's manual trip or reset; ``until`` is wall-clock epoch seconds."""

    backend: str
    state: str  # "open" | "closed"
    reason: str
    until: float | None = None
    by: str = ""
    at: float | None = None
    model: str | None = None  # a model route's breaker instead of the backend's
    endpoint: str | None = None  # one pool endpoint's breaker (host:port): ejects it from picking


@dataclass(frozen=True)
class Limits:
    """A tenant's effective limits: its tier's, with the tenant's overrides."""

    tpm: int
    rpm: int
    burst_tokens: int
    max_concurrency: int


@dataclass(frozen=True)
class Policy:
    gateway: Gateway
    backends: tuple[Backend, ...]
    tiers: Mapping[str, Tier]
    tenants: Mapping[str, Tenant]
    by_key: Mapping[str, str] = field(repr=False)  # key hash -> tenant name
    by_model: Mapping[str, tuple[Backend, Model]] = field(repr=False)
    breakers: tuple[BreakerOverride, ...] = ()
    # Derived per tenant on first use; the snapshot is immutable, so this never goes stale.
    _limits: dict[str, tuple[Tenant, Limits]] = field(default_factory=dict, repr=False, compare=False)
    _priced: list[bool] = field(default_factory=list, repr=False, compare=False)  # all_priced, once

    def limits(self, tenant: Tenant) -> Limits:
        cached = self._limits.get(tenant.name)
        if cached is None or cached[0] is not tenant:
            cached = self._limits[tenant.name] = (tenant, self._derive_limits(tenant))
        return cached[1]

    def _derive_limits(self, tenant: Tenant) -> Limits:
        tier = self.tiers[tenant.tier]
        tpm = tenant.tpm if tenant.tpm is not None else tier.tpm
        burst = tier.burst_tokens if tenant.tpm is None else max(tpm, tier.burst_tokens * tpm // max(tier.tpm, 1))
        return Limits(
            tpm=tpm,
            rpm=tenant.rpm if tenant.rpm is not None else tier.rpm,
            burst_tokens=burst,
            max_concurrency=tenant.max_concurrency if tenant.max_concurrency is not None else tier.max_concurrency,
        )

    def all_priced(self) -> bool:
        """Every model has a price: a request costs money whatever model it names."""
        if not self._priced:
            self._priced.append(all(m.price is not None and (m.price.input or m.price.output) > 0
                                    for _, m in self.by_model.values()))
        return self._priced[0]

    def budget(self, tenant: Tenant) -> Budget | None:
        """The tenant's budget: its own, else its tier's; None when it has none."""
        b = tenant.budget if tenant.budget is not None else self.tiers[tenant.tier].budget
        return b if b is not None and b.limited else None

    def tenant_for_key(self, api_key: str) -> Tenant | None:
        name = self.by_key.get(hash_key(api_key))
        return self.tenants[name] if name is not None else None

    def tier_order(self) -> list[str]:
        """Tier names, most important first."""
        return sorted(self.tiers, key=lambda t: (-self.tiers[t].priority, t))

    def shadowed(self, tier: str, rule: str) -> bool:
        return rule in self.gateway.shadow or rule in self.tiers[tier].shadow
