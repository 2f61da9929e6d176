"""The processes a benchmark runs, on random loopback ports: simulated backends, extproc,
Envoy (three shapes of one rendered bootstrap), and what /proc says about them.

Envoy shapes, all from ``extproc.envoy.bootstrap.render_bootstrap``:
  ``none``       the ext_proc filter and its cluster removed: Envoy straight to the backend
  ``ratelimit``  as ``none``, plus ``envoy.filters.http.local_ratelimit`` (one token bucket
                 for the whole listener) in front of the router
  ``sluice``     the bootstrap as rendered: Envoy + Sluice's ext_proc
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.procs import ROOT, Proc, envoy_binary, free_port, tails, wait_http
from extproc.envoy.bootstrap import (
    EXTPROC_CLUSTER,
    EXTPROC_FILTER,
    BackendRoute,
    EnvoyOptions,
    render_bootstrap,
)
from extproc.envoy.edge import KEY_GUARD_ROUTE, RATELIMIT_FILTERS, STRIP_FILTER
from extproc.policy.model import Gateway as GatewaySettings

POLICY_DIR = ROOT / "policies"
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def proc_cpu_rss(pid: int) -> tuple[float, int]:
    """(CPU seconds used, resident bytes) of a process, from /proc; (nan, 0) once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        statm = Path(f"/proc/{pid}/statm").read_text()
    except OSError:
        return math.nan, 0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK, int(statm.split()[1]) * PAGE


# ---- the pieces ------------------------------------------------------------------------
def sim_proc(workdir: Path, name: str, port: int, args: list[str]) -> Proc:
    return Proc(name, [sys.executable, "-m", "bench.simbackend", "--host", "127.0.0.1", "--port", str(port),
                       *args], workdir / f"{name}.log")


def extproc_proc(workdir: Path, policy_dir: Path, grpc_port: int, admin_port: int, tag: str = "") -> Proc:
    return Proc("extproc", [sys.executable, "-m", "extproc", "serve", "--policy", str(policy_dir),
                            "--grpc", f"127.0.0.1:{grpc_port}", "--admin", f"127.0.0.1:{admin_port}",
                            "--log-level", "WARNING"], workdir / f"extproc{tag}.log")


def example_policy(dest: Path, ports: dict[str, int], source: Path = POLICY_DIR) -> Path:
    """Copy the example policy to ``dest``, rewriting only the backends' addresses.

    ``ports`` maps backend name -> port; every other byte of every file is kept. A pool
    (``endpoints:``) becomes its first endpoint: these benchmarks run one engine per backend
    (``bench.pool`` compares placements across several).
    """
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(source.glob("*.yaml")):
        doc = yaml.safe_load(f.read_text())
        if isinstance(doc, dict) and "backends" in doc:
            for b in doc["backends"]:
                as_single_engine(b)
                port = ports[b["name"]]
                b["address"] = f"127.0.0.1:{port}"
                if b.get("metrics_url"):
                    b["metrics_url"] = f"http://127.0.0.1:{port}/metrics"
            (dest / f.name).write_text(yaml.safe_dump(doc, sort_keys=False))
        else:
            shutil.copyfile(f, dest / f.name)
    return dest


def as_single_engine(b: dict[str, Any]) -> dict[str, Any]:
    """A pool backend (``endpoints:``) as its first endpoint, in place; others unchanged."""
    if "endpoints" in b:
        first = b.pop("endpoints")[0]
        b.update({k: v for k, v in first.items() if k in ("kv_capacity_tokens", "max_concurrency")})
        b["metrics_url"] = first.get("metrics_url")
    return b


def _hcm(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def local_ratelimit_filter(rps: float) -> dict[str, Any]:
    """One token bucket for the listener: ``rps`` requests/s, a burst of one second's worth."""
    interval_ms = max(50, round(1000 / rps))  # Envoy's floor is 50 ms
    per_fill = max(1, round(rps * interval_ms / 1000))
    full = {"numerator": 100, "denominator": "HUNDRED"}
    return {
        "name": "envoy.filters.http.local_ratelimit",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
            "stat_prefix": "bench_local_rate_limiter",
            "token_bucket": {"max_tokens": max(1, math.ceil(rps)), "tokens_per_fill": per_fill,
                             "fill_interval": f"{interval_ms / 1000:.3f}s"},
            "filter_enabled": {"runtime_key": "local_rate_limit_enabled", "default_value": full},
            "filter_enforced": {"runtime_key": "local_rate_limit_enforced", "default_value": full},
        },
    }


def envoy_config(shape: str, routes: list[BackendRoute], opts: EnvoyOptions, rps: float = 0.0) -> dict[str, Any]:
    if shape == "sluice":
        return copy.deepcopy(render_bootstrap(routes, opts))
    # Without ext_proc nothing reads the usage: no usage filters either (the streamed shape).
    cfg = copy.deepcopy(render_bootstrap(routes, dataclasses.replace(opts, response_processing="streamed")))
    hcm = _hcm(cfg)
    # Envoy alone: none of Sluice's edge either (its header strip, rate limits, key guard).
    sluice_only = {EXTPROC_FILTER, STRIP_FILTER, *RATELIMIT_FILTERS}
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] not in sluice_only]
    for vhost in hcm["route_config"]["virtual_hosts"]:
        vhost["routes"] = [r for r in vhost["routes"] if r.get("name") != KEY_GUARD_ROUTE]
    res = cfg["static_resources"]
    res["clusters"] = [c for c in res["clusters"] if c["name"] != EXTPROC_CLUSTER]
    if shape == "ratelimit":
        hcm["http_filters"].insert(0, local_ratelimit_filter(rps))
    elif shape != "none":
        raise ValueError(f"unknown Envoy shape {shape!r}")
    return cfg


def envoy_proc(workdir: Path, cfg: dict[str, Any], tag: str) -> Proc:
    path = workdir / f"envoy-{tag}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return Proc(f"envoy-{tag}", [envoy_binary(), "-c", str(path), "--disable-hot-restart", "-l", "warning",
                                 "--concurrency", "1"], workdir / f"envoy-{tag}.log")


@dataclass
class Ports:
    sim: int = field(default_factory=free_port)
    small: int = field(default_factory=free_port)
    grpc: int = field(default_factory=free_port)
    admin: int = field(default_factory=free_port)
    envoy: int = field(default_factory=free_port)
    envoy_admin: int = field(default_factory=free_port)
    proxy: int = field(default_factory=free_port)


@dataclass
class Gateway:
    """One configuration's processes. ``url`` is where clients send requests."""

    workdir: Path
    ports: Ports
    procs: dict[str, Proc] = field(default_factory=dict)
    url: str = ""

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)

    def start(self, key: str, proc: Proc, ready_url: str | None, timeout: float = 30.0) -> Proc:
        self.procs[key] = proc.start()
        if ready_url:
            try:
                wait_http(ready_url, timeout, proc.popen)
            except Exception:
                raise RuntimeError(f"{proc.name} did not start:\n{proc.tail()}") from None
        return proc

    def start_sim(self, key: str, port: int, args: list[str]) -> Proc:
        return self.start(key, sim_proc(self.workdir, key, port, args), f"http://127.0.0.1:{port}/health")

    def start_extproc(self, policy_dir: Path, tag: str = "") -> Proc:
        p = extproc_proc(self.workdir, policy_dir, self.ports.grpc, self.ports.admin, tag)
        return self.start("extproc", p, f"http://127.0.0.1:{self.ports.admin}/healthz")

    def start_envoy(self, cfg: dict[str, Any], tag: str) -> Proc:
        p = self.start("envoy", envoy_proc(self.workdir, cfg, tag), f"http://127.0.0.1:{self.ports.envoy_admin}/ready")
        self.url = f"http://127.0.0.1:{self.ports.envoy}"
        return p

    def start_sluice(self, doc: dict[str, Any], tag: str) -> Path:
        """extproc on the policy ``doc``, and Envoy + ext_proc in front of the backend "sim"
        at ``ports.sim``; returns the policy directory (for restarting extproc on it)."""
        policy_dir = write_policy(self.workdir / "policies", doc)
        self.start_extproc(policy_dir)
        self.start_envoy(envoy_config("sluice", [BackendRoute("sim", "127.0.0.1", self.ports.sim)],
                                      envoy_options(self.ports, doc)), tag)
        return policy_dir

    def stop(self) -> None:
        for key in ("envoy", "proxy", "extproc", "small", "sim"):
            if key in self.procs:
                self.procs[key].stop()

    def logs(self) -> str:
        return tails(self.procs.values())

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def envoy_options(ports: Ports, policy_doc: dict[str, Any] | None = None) -> EnvoyOptions:
    gw = (policy_doc or {}).get("gateway", {})
    default = GatewaySettings()
    return EnvoyOptions(listen_port=ports.envoy, admin_port=ports.envoy_admin, extproc_port=ports.grpc,
                        drain_port=ports.admin,
                        max_body_bytes=gw.get("max_body_bytes", 1 << 20),
                        message_timeout_ms=gw.get("message_timeout_ms", 5000),
                        failure_mode_allow=gw.get("failure_mode_allow", False), access_log=False,
                        # as extproc reads its policy: the two must agree on what Envoy sends
                        response_processing=gw.get("response_processing", default.response_processing),
                        response_timeout_s=gw.get("response_timeout_s", default.response_timeout_s))


def load_policy_doc(policy_dir: Path) -> dict[str, Any]:
    """The policy files merged the simple way (sections per file) for reading options."""
    doc: dict[str, Any] = {}
    for f in sorted(policy_dir.glob("*.yaml")):
        part = yaml.safe_load(f.read_text()) or {}
        for k, v in part.items():
            if isinstance(v, list):
                doc.setdefault(k, []).extend(v)
            elif isinstance(v, dict):
                doc.setdefault(k, {}).update(v)
            else:
                doc[k] = v
    return doc


def write_policy(dest: Path, doc: dict[str, Any]) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "policy.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


def example_backend(port: int) -> dict[str, Any]:
    """The example policy's main backend, alone (no fallback model), at ``port``."""
    doc = load_policy_doc(POLICY_DIR)
    be = as_single_engine(copy.deepcopy(next(b for b in doc["backends"] if b["name"] == "sim")))
    be["address"], be["metrics_url"] = f"127.0.0.1:{port}", f"http://127.0.0.1:{port}/metrics"
    for m in be["models"]:
        m.pop("fallback_model", None)
    return be


def example_gateway() -> dict[str, Any]:
    return dict(load_policy_doc(POLICY_DIR)["gateway"])
