"""Which engine metrics to read, as the engines really expose them.

A metric is named by a *selector*: a Prometheus metric name with optional label
matchers, ``name`` or ``name{label="value",...}`` (the value may be unquoted, the
spelling the Gateway API Inference Extension uses). Only ``=`` is supported: the
Triton TensorRT-LLM backend puts several quantities in one family
(``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"|"used"|"max"}``),
so a name alone would mix blocks, tokens per block and the fraction.

Each engine has a preset (:data:`PRESETS`); ``metric_names`` in the policy overrides
one kind at a time. A kind with no selector (``kv_usage`` for llama.cpp and TGI) is
simply not read: the KV signal then comes from Sluice's own reservations.

Pure: data and string parsing only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

__all__ = ["KINDS", "PRESETS", "EngineMetrics", "Selector", "engine_metrics", "parse_selector"]

KINDS = ("kv_usage", "waiting", "running", "preemptions")

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(!=|=~|!~|=)\s*")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_BARE = re.compile(r"[^,}\s\"]+")
_UNESCAPE = {"\\": "\\", '"': '"', "n": "\n"}


@dataclass(frozen=True, slots=True)
class Selector:
    """A metric name and the labels a series must carry (equality only)."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    def matches(self, name: str, labels: Mapping[str, str]) -> bool:
        return name == self.name and all(labels.get(k) == v for k, v in self.labels)

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        inner = ",".join(f'{k}="{v}"' for k, v in self.labels)
        return f"{self.name}{{{inner}}}"


def parse_selector(text: str) -> Selector:
    """``name`` or ``name{label="value",...}``; raises ValueError with the reason."""
    s = text.strip()
    m = _NAME.match(s)
    if m is None:
        raise ValueError(f"{text!r}: a selector starts with a metric name")
    name, i = m.group(), m.end()
    if i == len(s):
        return Selector(name)
    if s[i] != "{" or not s.endswith("}"):
        raise ValueError(f'{text!r}: expected name or name{{label="value",...}}')
    body, j, labels = s[i + 1:-1], 0, []
    while body[j:].strip():
        lm = _LABEL.match(body, j)
        if lm is None:
            raise ValueError(f"{text!r}: expected a label name at {body[j:]!r}")
        if lm.group(2) != "=":
            raise ValueError(f"{text!r}: only label=\"value\" matchers are supported, not {lm.group(2)}")
        j = lm.end()
        q = _QUOTED.match(body, j) or _BARE.match(body, j)
        if q is None:
            raise ValueError(f"{text!r}: expected a value for label {lm.group(1)!r}")
        value = q.group(1) if q.re is _QUOTED else q.group()
        value = re.sub(r"\\(.)", lambda e: _UNESCAPE.get(e.group(1), "\\" + e.group(1)), value)
        labels.append((lm.group(1), value))
        j = q.end()
        rest = body[j:].lstrip()
        if rest.startswith(","):
            j = len(body) - len(rest) + 1
        elif rest:
            raise ValueError(f"{text!r}: expected ',' or '}}' at {rest!r}")
    if len({k for k, _ in labels}) != len(labels):
        raise ValueError(f"{text!r}: a label is matched twice")
    return Selector(name, tuple(labels))


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What to read from one engine's exposition, and how to read its silences.

    ``prefix`` starts every metric the engine itself exports. ``eager`` engines create
    their gauges at start-up, so an exposition without any ``prefix`` metric means the
    engine's stats are switched off (vLLM ``--disable-log-stats``), not "no batch yet";
    lazy engines (SGLang, TRT-LLM, TGI, Triton) create a series at its first value.
    ``kv_unit``: ``fraction`` (0..1, every preset; a value above 1 is clamped) or
    ``auto`` (names from ``metric_names``: above 1.5 means percent). ``hints`` say,
    per problem, what is usually wrong with that engine's setup.
    """

    kv_usage: tuple[Selector, ...]
    waiting: tuple[Selector, ...]
    running: tuple[Selector, ...]
    preemptions: tuple[Selector, ...]
    prefix: str = ""
    eager: bool = False
    kv_unit: str = "fraction"
    hints: Mapping[str, str] = field(default_factory=dict)

    def of(self, kind: str) -> tuple[Selector, ...]:
        return getattr(self, kind)  # type: ignore[no-any-return]

    def hint(self, problem: str) -> str:
        return self.hints.get(problem, _GENERIC_HINTS.get(problem, ""))


_GENERIC_HINTS = {
    "not_prometheus": "the answer is not Prometheus text: check metrics_url",
    "http_404": "nothing at metrics_url: check the path (and that the engine's metrics are enabled)",
    "no_engine_metrics": "the exposition has none of the engine's metrics: check engine and metrics_url",
    "kv_metric_missing": "the engine's metrics are there but not its KV usage: set metric_names.kv_usage",
}


def _sel(*names: str) -> tuple[Selector, ...]:
    return tuple(parse_selector(n) for n in names)


# Names checked against the engines' sources and docs (see README, "KV watermark feedback").
PRESETS: dict[str, EngineMetrics] = {
    "vllm": EngineMetrics(
        kv_usage=_sel("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # 0..1 despite the name
        waiting=_sel("vllm:num_requests_waiting"),
        running=_sel("vllm:num_requests_running"),
        preemptions=_sel("vllm:num_preemptions_total", "vllm:num_preemptions"),
        prefix="vllm:", eager=True,
        hints={"no_engine_metrics": "no vllm: metric at all: vLLM runs with --disable-log-stats; "
                                    "drop that flag for KV feedback",
               "kv_metric_missing": "vllm: metrics but none of the KV names: set metric_names.kv_usage to "
                                    "the name this vLLM version uses"}),
    "sglang": EngineMetrics(
        kv_usage=_sel("sglang:token_usage"),
        waiting=_sel("sglang:num_queue_reqs"),
        running=_sel("sglang:num_running_reqs"),
        preemptions=_sel("sglang:num_retracted_requests_total"),
        prefix="sglang:",
        hints={"http_404": "SGLang serves /metrics only with --enable-metrics"}),
    "trtllm": EngineMetrics(  # trtllm-serve
        kv_usage=_sel("trtllm_kv_cache_utilization"),
        waiting=_sel("trtllm_num_requests_waiting"),
        running=_sel("trtllm_num_requests_running"),
        preemptions=(),
        prefix="trtllm_",
        hints={"not_prometheus": "trtllm-serve answers JSON at /metrics; its Prometheus text is at "
                                 "/prometheus/metrics with return_perf_metrics: true (the KV and queue "
                                 "gauges also need enable_iter_perf_stats: true)",
               "http_404": "trtllm-serve serves /prometheus/metrics only with return_perf_metrics: true"}),
    "triton": EngineMetrics(  # Triton Inference Server with the TensorRT-LLM backend
        kv_usage=_sel('nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}'),
        waiting=_sel('nv_trt_llm_request_metrics{request_type="waiting"}'),
        running=_sel('nv_trt_llm_request_metrics{request_type="scheduled"}'),
        preemptions=(),
        prefix="nv_",
        hints={"http_404": "Triton serves its metrics on the metrics port (8002 by default) at /metrics"}),
    "llamacpp": EngineMetrics(  # llama-server: no KV metric since its PR #13660
        kv_usage=(),
        waiting=_sel("llamacpp:requests_deferred"),
        running=_sel("llamacpp:requests_processing"),
        preemptions=(),
        prefix="llamacpp:", eager=True,
        hints={"http_501": "llama-server serves /metrics only with --metrics"}),
    "tgi": EngineMetrics(  # text-generation-inference: queue and batch, no KV fraction
        kv_usage=(),
        waiting=_sel("tgi_queue_size"),
        running=_sel("tgi_batch_current_size"),
        preemptions=(),
        prefix="tgi_"),
}


def engine_metrics(engine: str, overrides: Mapping[str, tuple[str, ...]]) -> EngineMetrics:
    """The preset for ``engine`` with the policy's ``metric_names`` applied kind by kind."""
    base = PRESETS[engine]
    changes: dict[str, object] = {kind: _sel(*names) for kind, names in overrides.items() if kind in KINDS}
    if "kv_usage" in changes:
        changes["kv_unit"] = "auto"  # an exporter we have not read may report percent
    return replace(base, **changes) if changes else base  # type: ignore[arg-type]
