"""A simulated vLLM backend: OpenAI API, vLLM metric names, a KV cache that runs out.

The stand-in for a GPU in end-to-end tests, the demo and the benchmarks. Endpoints:
/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses (the Responses API:
typed SSE events ending in response.completed with usage, or one response object),
GET /v1/models.

With ``--enable-prefix-caching`` (``SimConfig(prefix_caching=True)``) the engine keeps
vLLM-style automatic prefix caching: shared leading prompt blocks skip their prefill
(``prefix_cache.py``; ``vllm:prefix_cache_queries_total`` / ``_hits_total``).

In-process: ``create_app(SimConfig(...))`` (aiohttp), or ``BackgroundServer(cfg)`` as a
context manager on its own thread. CLI: ``python -m bench.simbackend --port 8000``.

Per-request programming (request headers):
  x-sim-status: 503       answer with that status and an OpenAI error body, no generation
  x-sim-delay-ms: N       no token before N ms (model time); the request still holds KV
  x-sim-tokens: N         the "model" stops after N tokens ("stop"), capped by max_tokens
  x-sim-tps: N            this request's own pace in tokens/s instead of the batch's
  x-sim-usage: none       no usage anywhere, like an old backend
  x-sim-fail-after: N     drop the connection after N tokens (mid-stream transport error)

Admin: GET/DELETE /admin/requests (recorded /v1 and other non-probe requests, newest
last, ``?path=`` filters), GET/POST /admin/config (kv_usage_override, fail_status, mode,
time_scale), GET /admin/engine (block counts, queue lengths, counters), GET
/admin/work?after=N (what the engine did for each request, by its x-request-id, and per
x-sluice-tenant totals: ``work.py``).
"""

from .app import STATE, SimState, create_app
from .config import SimConfig
from .server import BackgroundServer, start_site

__all__ = ["STATE", "BackgroundServer", "SimConfig", "SimState", "create_app", "start_site"]
