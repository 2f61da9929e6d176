"""LiteLLM proxy ``custom_auth`` for the benchmark: API keys and their limits without a database.

Runs inside the LiteLLM venv (``bench/.litellm-venv``), loaded by the proxy from the
directory of its config file. ``BENCH_LITELLM_KEYS`` holds the keys as JSON:
``{"sk-...": {"tenant": "acme", "tpm": 200000, "rpm": 600, "max_parallel": 32}, ...}``:
the same tenants and limits as Sluice's policy, so LiteLLM's own per-key TPM, RPM and
parallel-request limiters enforce them.
"""

from __future__ import annotations

import json
import os

from fastapi import Request
from litellm.proxy._types import UserAPIKeyAuth

_KEYS: dict[str, dict] = json.loads(os.environ.get("BENCH_LITELLM_KEYS", "{}"))


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    key = api_key.removeprefix("Bearer ").strip()
    spec = _KEYS.get(key)
    if spec is None:
        raise Exception("unknown API key")  # LiteLLM answers 401
    return UserAPIKeyAuth(api_key=key, key_alias=spec["tenant"], user_id=spec["tenant"],
                          tpm_limit=spec.get("tpm"), rpm_limit=spec.get("rpm"),
                          max_parallel_requests=spec.get("max_parallel"))
