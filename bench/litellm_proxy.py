"""Configuration (c): the LiteLLM proxy with per-key TPM, RPM and parallel-request limits.

LiteLLM lives in its own venv (``bench/.litellm-venv``, ~750 MB, gitignored), installed
on first use with ``pip install 'litellm[proxy]'``. Its Postgres-backed virtual keys
cannot run here (the DB layer downloads engine binaries at start), so the keys come
from a ``custom_auth`` module (``bench/litellm_auth.py``) that returns
``UserAPIKeyAuth(tpm_limit=..., rpm_limit=..., max_parallel_requests=...)`` with the
example policy's numbers for each tier. Models point at the simulated backend as
``hosted_vllm/`` (OpenAI-compatible); client ``x-`` headers (``x-sim-tokens``) are
forwarded so the backend generates the same lengths as in every other configuration.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

import yaml

from bench.procs import Proc
from bench.stack import Gateway

VENV = Path(__file__).resolve().parent / ".litellm-venv"
AUTH_MODULE = Path(__file__).resolve().parent / "litellm_auth.py"
INSTALL_TIMEOUT_S = 900


def litellm_binary() -> Path:
    return VENV / "bin" / "litellm"


def ensure_installed(log: Any = print) -> str | None:
    """Install LiteLLM into its venv if needed; returns why it could not, or None."""
    if litellm_binary().exists():
        return None
    log(f"installing litellm[proxy] into {VENV} (once; ~750 MB)")
    try:
        if not (VENV / "bin" / "python").exists():
            venv.EnvBuilder(with_pip=True).create(VENV)
        subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", "litellm[proxy]"],
                       check=True, timeout=INSTALL_TIMEOUT_S, capture_output=True)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        tail = detail.decode(errors="replace").strip().splitlines()[-3:] if detail else []
        return f"pip install 'litellm[proxy]' failed: {exc} {' | '.join(tail)}".strip()
    if not litellm_binary().exists():
        return "pip install 'litellm[proxy]' did not provide the litellm command"
    return None


def tier_limits(policy_doc: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per tier: the example policy's TPM, RPM and per-tenant concurrency."""
    out = {}
    for name, tier in policy_doc["tiers"].items():
        out[name] = {"tpm": int(tier["tpm"]), "rpm": int(tier["rpm"]), "max_parallel": int(tier["max_concurrency"])}
    return out


def proxy_config(backend_port: int, models: list[str]) -> dict[str, Any]:
    base = f"http://127.0.0.1:{backend_port}/v1"
    return {
        "model_list": [{"model_name": m, "litellm_params": {"model": f"hosted_vllm/{m}", "api_base": base,
                                                            "api_key": "none", "timeout": 600}}
                       for m in models],
        # A master key is required to start; nobody uses it (clients hold the tenants' keys).
        "general_settings": {"master_key": f"sk-bench-master-{secrets.token_hex(16)}",
                             "custom_auth": "litellm_auth.user_api_key_auth",
                             "forward_client_headers_to_llm_api": True},
        "litellm_settings": {"num_retries": 0, "request_timeout": 600, "telemetry": False},
        "router_settings": {"num_retries": 0},
    }


def start_proxy(gw: Gateway, backend_port: int, models: list[str], keys: dict[str, dict[str, Any]]) -> Proc:
    """Start ``litellm --config`` on ``gw.ports.proxy``; ``keys``: key -> tenant and limits."""
    d = gw.workdir / "litellm"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(yaml.safe_dump(proxy_config(backend_port, models), sort_keys=False))
    shutil.copyfile(AUTH_MODULE, d / "litellm_auth.py")
    env = {"BENCH_LITELLM_KEYS": json.dumps(keys), "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "LITELLM_LOG": "ERROR", "PYTHONUNBUFFERED": "1", "NO_PROXY": "*"}
    args = [str(litellm_binary()), "--config", str(d / "config.yaml"), "--host", "127.0.0.1",
            "--port", str(gw.ports.proxy), "--num_workers", "1"]
    proc = Proc("litellm", args, gw.workdir / "litellm.log", env=env, cwd=d)
    gw.start("proxy", proc, f"http://127.0.0.1:{gw.ports.proxy}/health/liveliness", timeout=90)
    gw.url = f"http://127.0.0.1:{gw.ports.proxy}"
    return proc


if __name__ == "__main__":  # python -m bench.litellm_proxy: install only
    why = ensure_installed()
    print(why or f"litellm ready: {litellm_binary()}")
    sys.exit(1 if why else 0)
