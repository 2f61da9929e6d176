"""``make demo``'s pool: prefix affinity on for sim-llama-8b, its engines caching prefixes
(bench/demo.py's engine flags, as the simulated engine's own CLI parses them), the banner
saying so; docker-compose runs the same engines."""

from __future__ import annotations

from pathlib import Path

import yaml

from bench.demo import ENGINES, Ports, banner
from bench.procs import ROOT
from bench.simbackend.__main__ import build_parser, config_from_args
from extproc.policy.schema import Backend
from extproc.policyfile import load_policy


def demo_pool() -> Backend:
    policy = load_policy(ROOT / "policies")
    backend, _ = policy.by_model["sim-llama-8b"]
    return backend


def test_the_demo_pool_has_prefix_affinity_and_its_engines_cache_prefixes() -> None:
    pool = demo_pool()
    assert pool.is_pool and pool.placement.prefix_affinity
    ports = [e.port for e in pool.endpoints]
    assert ports == [8000, 8002]
    for e in pool.endpoints:
        cfg = config_from_args(build_parser().parse_args(["--port", str(e.port), *ENGINES[e.port]]))
        assert cfg.prefix_caching, f"the engine on {e.port} runs without --enable-prefix-caching"
        assert cfg.kv_blocks * cfg.block_size == e.kv_capacity_tokens  # the policy's size is the engine's
    fallback = config_from_args(build_parser().parse_args(["--port", "8001", *ENGINES[8001]]))
    assert fallback.model == "sim-llama-1b" and not fallback.prefix_caching  # not in the pool


def test_the_banner_says_affinity_is_on_and_lists_every_engine(tmp_path: Path) -> None:
    token = tmp_path / "console-token"
    text = banner(Ports.fixed(1), 1, None, ("demo", "pw-123"), token)
    assert "prefix affinity on" in text and "--enable-prefix-caching" in text
    for port in ENGINES:
        assert f"http://127.0.0.1:{port}/metrics" in text
    assert "redis" not in text and "demo-1" in text and "demo-2" not in text
    assert "log in as demo / pw-123" in text and f"in {token}" in text
    assert "DEMO_ARGS=--show-token" in text
    three = banner(Ports.fixed(3), 3, "redis://127.0.0.1:6380/0", ("demo", "pw"), token,
                   token="tok-789")
    assert "demo-3: gRPC 127.0.0.1:50053" in three and "redis://127.0.0.1:6380/0" in three
    assert "replicas' API token: tok-789" in three


def test_the_demo_engines_accept_every_context_the_policy_lets_through() -> None:
    """A request Sluice admits to an engine is one the engine accepts: for every model the
    engines serve, each engine's max-model-len covers the context window as far as its KV
    cache can hold it (Sluice places no footprint on an endpoint whose cache it exceeds),
    and some engine of the backend covers the whole window."""
    policy = load_policy(ROOT / "policies")
    for backend in policy.backends:
        engines = [(e.port, e.kv_capacity_tokens) for e in backend.endpoints] \
            if backend.is_pool else [(backend.port, backend.kv_capacity_tokens)]
        limits = {}
        for port, capacity in engines:
            cfg = config_from_args(build_parser().parse_args(["--port", str(port), *ENGINES[port]]))
            limits[port] = cfg.max_model_len
            assert cfg.max_model_len <= cfg.kv_blocks * cfg.block_size, \
                f"{port}: vLLM would refuse to start"
            for m in backend.models:
                need = min(m.context_window, capacity or m.context_window)
                assert cfg.max_model_len >= need, \
                    f"{m.name} on {port}: engine {cfg.max_model_len} < {need}"
        for m in backend.models:
            assert max(limits.values()) >= m.context_window, \
                f"no engine of {backend.name} serves {m.name}'s window"


def test_compose_runs_the_pool_engines_with_prefix_caching_too() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    assert "--enable-prefix-caching" in services["simbackend"]["command"]
    assert "--enable-prefix-caching" in services["simbackend-2"]["command"]
    assert "--enable-prefix-caching" not in services["simbackend-small"]["command"]
    # The demo's context windows too.
    for service, port in (("simbackend", 8000), ("simbackend-2", 8002)):
        command, flags = services[service]["command"], ENGINES[port]
        assert command[command.index("--max-model-len") + 1] == \
            flags[flags.index("--max-model-len") + 1]
    rendered = yaml.safe_load((ROOT / "docker" / "backends.compose.yaml").read_text())
    (sim,) = [b for b in rendered["backends"] if b["name"] == "sim"]
    assert sim["placement"] == {"prefix_affinity": True}
