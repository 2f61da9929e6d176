"""Reading a backend's Prometheus endpoint: KV-cache usage, queue, preemptions.

``parse_sample`` is pure; ``scrape_once`` does the HTTP. Metric names are policy
(vLLM, SGLang and TRT-LLM name things differently), tried in order; the first
that is present wins, so a deprecated name can follow its replacement.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "waiting": ("vllm:num_requests_waiting",),
        "running": ("vllm:num_requests_running",),
        "preemptions": ("vllm:num_preemptions_total", "vllm:num_preemptions"),
    },
    "sglang": {
        "kv_usage": ("sglang:token_usage",),
        "waiting": ("sglang:num_queue_reqs",),
        "running": ("sglang:num_running_reqs",),
        "preemptions": (),
    },
    "trtllm": {
        "kv_usage": ("trtllm_kv_cache_utilization",),
        "waiting": ("trtllm_num_requests_waiting",),
        "running": ("trtllm_num_requests_running",),
        "preemptions": (),
    },
}


@dataclass(frozen=True)
class Sample:
    ok: bool
    kv_usage: float | None = None
    waiting: float | None = None
    running: float | None = None
    preemptions: float | None = None
    error: str = ""


def parse_sample(text: str, names: dict[str, tuple[str, ...]]) -> Sample:
    values: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                values.setdefault(s.name, []).append(float(s.value))
    except ValueError as exc:
        return Sample(ok=False, error=f"unparseable metrics: {exc}")

    def pick(kind: str, combine: str) -> float | None:
        for name in names.get(kind, ()):
            if name in values:
                vs = values[name]
                # Several engines behind one endpoint: the fullest cache is the binding one.
                return max(vs) if combine == "max" else sum(vs)
        return None

    kv = pick("kv_usage", "max")
    if kv is not None and kv > 1.0:  # some exporters report percent
        kv = kv / 100.0
    return Sample(ok=kv is not None, kv_usage=kv, waiting=pick("waiting", "sum"), running=pick("running", "sum"),
                  preemptions=pick("preemptions", "sum"),
                  error="" if kv is not None else "no KV usage metric found")


async def scrape_once(session: aiohttp.ClientSession, url: str, names: dict[str, tuple[str, ...]],
                      timeout_s: float = 1.0) -> Sample:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return Sample(ok=False, error=f"HTTP {r.status}")
            text = await r.text()
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return Sample(ok=False, error=f"{type(exc).__name__}: {exc}")
    return parse_sample(text, names)
