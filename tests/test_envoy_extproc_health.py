"""The ext_proc cluster's health checks and outlier detection in the generated Envoy config."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench.procs import envoy_binary
from extproc.envoy.bootstrap import (
    EXTPROC_CLUSTER,
    BackendRoute,
    EnvoyOptions,
    gateway_options,
    render_bootstrap,
    write_config,
)
from extproc.policy.schema import PolicyError, build_policy
from tests.test_edge_policy import doc

BACKENDS = (BackendRoute("sim", "127.0.0.1", 8000),)
MORE = (("127.0.0.1", 50052), ("127.0.0.1", 50053))


def extproc(opts: EnvoyOptions) -> dict[str, Any]:
    (c,) = [c for c in render_bootstrap(BACKENDS, opts)["static_resources"]["clusters"] if c["name"] == EXTPROC_CLUSTER]
    return c


def test_the_replicas_are_grpc_health_checked_and_outlier_detected() -> None:
    c = extproc(EnvoyOptions(extproc_more=MORE))
    assert len(c["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 3
    (hc,) = c["health_checks"]
    assert hc == {"timeout": "1s", "interval": "1s", "no_traffic_interval": "1s", "unhealthy_threshold": 2,
                  "healthy_threshold": 1, "grpc_health_check": {}}
    od = c["outlier_detection"]
    assert od["split_external_local_origin_errors"] is True
    assert (od["consecutive_local_origin_failure"], od["enforcing_consecutive_local_origin_failure"]) == (2, 100)
    assert (od["consecutive_gateway_failure"], od["enforcing_consecutive_gateway_failure"]) == (2, 100)
    assert od["max_ejection_percent"] == 100 and od["interval"] == "1s"
    assert not any("5_xx" in k for k in od)  # betterproto2's spelling of *_5xx, which Envoy would refuse
    # one endpoint: checked the same way
    assert extproc(EnvoyOptions())["health_checks"] == [hc]


def test_the_gateway_settings_reach_the_cluster() -> None:
    gw = build_policy(doc({"extproc_health_interval_s": 0.5, "extproc_unhealthy_threshold": 3})).gateway
    assert (gw.extproc_health_interval_s, gw.extproc_unhealthy_threshold) == (0.5, 3)
    c = extproc(EnvoyOptions(**gateway_options(gw)))  # type: ignore[arg-type]
    (hc,) = c["health_checks"]
    assert (hc["interval"], hc["timeout"], hc["unhealthy_threshold"]) == ("0.500s", "0.500s", 3)
    assert c["outlier_detection"]["consecutive_local_origin_failure"] == 3
    defaults = build_policy(doc()).gateway
    assert (defaults.extproc_health_interval_s, defaults.extproc_unhealthy_threshold) == (1.0, 2)
    with pytest.raises(PolicyError) as exc:
        build_policy(doc({"extproc_health_interval_s": 0.01, "extproc_unhealthy_threshold": 0}))
    assert "extproc_health_interval_s" in str(exc.value) and "extproc_unhealthy_threshold" in str(exc.value)


@pytest.mark.e2e
def test_envoy_validates_the_health_checked_cluster(tmp_path: Path) -> None:
    path = write_config(tmp_path / "envoy.yaml", BACKENDS, EnvoyOptions(extproc_more=MORE))
    done = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
