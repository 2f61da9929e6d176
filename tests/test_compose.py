"""docker-compose.yml, checked without a Docker engine.

Every command names something that exists in the repository and accepts the flags it
is given; ports, service names and cluster addresses agree between compose, the
compose policy and the Envoy config generated from it; every mounted path exists;
and the rendered compose files are what ``python docker/render.py`` makes today.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from extproc.envoy.eds import render as render_eds
from extproc.policyfile import load_policy
from tests.e2e.harness import envoy_binary

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docker"))
import render  # noqa: E402  (docker/render.py is a script, not a package)

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
SLUICE = sorted(name for name in SERVICES if name != "redis")  # built from this repository
REPLICAS = ("extproc", "extproc-2")
IMAGE_ROOT = "/app"


def command(service: str) -> list[str]:
    cmd = SERVICES[service]["command"]
    assert isinstance(cmd, list), f"{service}: use the exec form (a list) for command"
    return [str(c) for c in cmd]


def flag(cmd: list[str], name: str) -> str:
    assert name in cmd, f"{name} missing from {cmd}"
    return cmd[cmd.index(name) + 1]


def hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


def bind_mounts(service: str) -> dict[str, str]:
    """container path -> host path (relative to the repository) for ./ bind mounts."""
    out = {}
    for spec in SERVICES[service].get("volumes", []):
        source, target = spec.split(":")[:2]
        if source.startswith("./"):
            out[target] = source[2:]
    return out


def named_mounts(service: str) -> dict[str, str]:
    out = {}
    for spec in SERVICES[service].get("volumes", []):
        source, target = spec.split(":")[:2]
        if not source.startswith(("./", "/")):
            out[target] = source
    return out


@cache
def image_copies() -> dict[str, str]:
    """container path -> repository path for the Dockerfile's COPY lines."""
    out = {}
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        parts = line.split()
        if parts[:1] != ["COPY"] or any(p.startswith("--") for p in parts):
            continue
        *sources, dest = parts[1:]
        for src in sources:
            target = f"{IMAGE_ROOT}/{src}" if dest in ("./", ".") else f"{IMAGE_ROOT}/{dest.removeprefix('./')}"
            out[target.rstrip("/")] = src.rstrip("/")
    return out


def repo_path(service: str, container_path: str) -> Path:
    """Where a path the container sees comes from: a bind mount (longest prefix) or the image."""
    for table in (bind_mounts(service), image_copies()):
        for target in sorted(table, key=len, reverse=True):
            if container_path == target or container_path.startswith(target + "/"):
                return ROOT / table[target] / container_path[len(target) + 1:]
    raise AssertionError(f"{service}: {container_path} is neither mounted nor copied into the image")


def listen_port(service: str) -> int:
    cmd = command(service)
    if "--port" in cmd:
        return int(flag(cmd, "--port"))
    if service in REPLICAS:
        return hostport(flag(cmd, "--grpc"))[1]
    raise AssertionError(f"no listening port known for {service}")


def envoy_config() -> dict[str, Any]:
    path = repo_path("envoy", flag(command("envoy"), "-c"))
    return yaml.safe_load(path.read_text())


def endpoints(cluster: dict[str, Any]) -> list[tuple[str, int]]:
    out = []
    for lb in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]:
        sa = lb["endpoint"]["address"]["socket_address"]
        out.append((sa["address"], sa["port_value"]))
    return out


def override_header(cluster: dict[str, Any]) -> str:
    (policy,) = cluster["load_balancing_policy"]["policies"]
    (source,) = policy["typed_extension_config"]["typed_config"]["override_host_sources"]
    return source["header"]


def clusters() -> dict[str, tuple[str, int]]:
    """Cluster -> its endpoint; a pool's EDS cluster -> ("x-sluice-endpoint", 0); the
    ext_proc cluster (one endpoint per replica) is left out."""
    out = {}
    for c in envoy_config()["static_resources"]["clusters"]:
        if c.get("type") == "EDS":
            out[c["name"]] = (override_header(c), 0)
        elif c["name"] != "sluice_extproc":
            (out[c["name"]],) = endpoints(c)
    return out


def extproc_endpoints() -> list[tuple[str, int]]:
    (c,) = [c for c in envoy_config()["static_resources"]["clusters"] if c["name"] == "sluice_extproc"]
    return endpoints(c)


@pytest.fixture(scope="module")
def compose_policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """policies/ as the extproc and console containers see it (backends.yaml shadowed)."""
    d = tmp_path_factory.mktemp("compose-policy")
    for target, source in bind_mounts("extproc").items():
        if target == f"{IMAGE_ROOT}/policies":
            shutil.copytree(ROOT / source, d, dirs_exist_ok=True)
    for target, source in bind_mounts("extproc").items():
        if target.startswith(f"{IMAGE_ROOT}/policies/"):
            shutil.copy(ROOT / source, d / Path(target).name)
    return d


def test_the_services_with_health_checks() -> None:
    assert {"envoy", "console", "simbackend", "redis", *REPLICAS} <= set(SERVICES)
    for name, svc in SERVICES.items():
        check = svc.get("healthcheck", {})
        assert check.get("test") and check.get("interval"), f"{name} has no health check"
        if name == "redis":
            continue
        build = svc["build"]
        assert build["context"] == "." and (ROOT / build["dockerfile"]).is_file(), name
        assert svc["image"] == SERVICES["envoy"]["image"], "one image for every service"


def test_dockerfile_copies_exist() -> None:
    assert image_copies(), "Dockerfile copies nothing"
    for source in image_copies().values():
        assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
    assert re.search(r"^FROM python:3\.11", (ROOT / "Dockerfile").read_text(), re.M)


def _help(cmd: list[str]) -> str:
    module = cmd[2]
    sub = [cmd[3]] if len(cmd) > 3 and not cmd[3].startswith("-") else []
    done = subprocess.run([sys.executable, "-m", module, *sub, "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("service", SLUICE)
def test_command_exists_and_takes_its_flags(service: str, tmp_path: Path) -> None:
    cmd = command(service)
    if cmd[0] == "envoy":
        assert Path(envoy_binary()).exists()
        config = repo_path(service, flag(cmd, "-c"))
        assert config.is_file()
        # The pool's endpoint files are on the eds volume, written by the replicas: here an
        # empty set in a temporary directory (Envoy refuses to start without the file).
        text = config.read_text().replace(f"{render.EDS_DIR}/", f"{tmp_path}/")
        text = text.replace(f"path: {render.EDS_DIR}\n", f"path: {tmp_path}\n")
        for c in yaml.safe_load(text)["static_resources"]["clusters"]:
            if c.get("type") == "EDS":
                (tmp_path / f"{c['name']}.eds.yaml").write_text(render_eds(c["name"], ()))
        config = tmp_path / "envoy.yaml"
        config.write_text(text)
        done = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(config)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return
    assert cmd[:2] == ["python", "-m"], f"{service}: {cmd}"
    assert importlib.util.find_spec(cmd[2]) is not None, f"{service}: no module {cmd[2]}"
    text = _help(cmd)
    for arg in cmd:
        if arg.startswith("--"):
            assert arg in text, f"{service}: `python -m {cmd[2]}` does not know {arg}"


@pytest.mark.parametrize("service", SLUICE)
def test_mounted_and_referenced_paths_exist(service: str) -> None:
    for source in bind_mounts(service).values():
        assert (ROOT / source).exists(), f"{service} mounts ./{source}, which does not exist"
    for volume in named_mounts(service).values():
        assert volume in (COMPOSE.get("volumes") or {}), f"{service}: volume {volume} is not declared"
    cmd = command(service)
    for name in ("--policy", "-c"):
        if name in cmd:
            assert repo_path(service, flag(cmd, name)).exists(), f"{service}: {flag(cmd, name)}"
    if "--db" in cmd:
        parent = str(Path(flag(cmd, "--db")).parent)
        assert parent in named_mounts(service), f"{service}: the database directory {parent} is not a volume"


def test_envoy_reaches_extproc_and_the_backends_by_service_name(compose_policy_dir: Path) -> None:
    found = clusters()
    for replica in REPLICAS:
        assert hostport(flag(command(replica), "--grpc"))[0] == "0.0.0.0"
    # Envoy balances the ext_proc streams over every replica, by service name
    assert extproc_endpoints() == [(r, listen_port(r)) for r in REPLICAS]
    # oversized uploads are drained on extproc's admin port, which must listen beyond loopback
    admin_host, admin_port = hostport(flag(command("extproc"), "--admin"))
    assert admin_host == "0.0.0.0"
    assert found.pop("sluice_drain") == ("extproc", admin_port)
    policy = load_policy(compose_policy_dir)
    assert found == {b.name: ("x-sluice-endpoint", 0) if b.is_pool else (b.host, b.port) for b in policy.backends}
    assert any(b.is_pool for b in policy.backends), "the demo serves sim-llama-8b from a pool"
    places = [(b.name, e.host, e.port, e.metrics_url) for b in policy.backends if b.is_pool for e in b.endpoints]
    places += [(b.name, b.host, b.port, b.metrics_url) for b in policy.backends if not b.is_pool]
    for name, host, port, metrics_url in places:
        assert host in SERVICES, f"backend {name} points at {host}, not a service"
        assert listen_port(host) == port
        assert flag(command(host), "--host") == "0.0.0.0"
        assert SERVICES["extproc"]["depends_on"][host]["condition"] == "service_healthy"
        if metrics_url:
            url = urlsplit(metrics_url)
            assert (url.hostname, url.port) == (host, port)


def test_the_replicas_write_the_pool_endpoints_where_envoy_reads_them() -> None:
    pools = [c for c in envoy_config()["static_resources"]["clusters"] if c.get("type") == "EDS"]
    assert pools, "the demo serves sim-llama-8b from a pool"
    for c in pools:
        source = c["eds_cluster_config"]["eds_config"]["path_config_source"]
        directory = source["watched_directory"]["path"]
        assert source["path"] == f"{directory}/{c['name']}.eds.yaml"
        volume = named_mounts("envoy").get(directory)
        assert volume is not None, f"Envoy reads {directory}, which is not a volume"
        for replica in REPLICAS:
            assert flag(command(replica), "--eds-dir") == directory
            assert named_mounts(replica).get(directory) == volume, f"{replica} writes elsewhere"
            spec = next(v for v in SERVICES[replica]["volumes"] if v.startswith(f"{volume}:"))
            assert not spec.endswith(":ro"), f"{replica} cannot write {directory}"
    # A named volume starts with the image's directory, and so its owner: the image's user.
    assert (
        "/eds" in (ROOT / "Dockerfile").read_text() and "chown sluice /data /eds" in (ROOT / "Dockerfile").read_text()
    )


def test_published_ports_match_what_listens() -> None:
    listener = envoy_config()["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener["address"] == "0.0.0.0"
    published = {service: [int(p.split(":")[-1]) for p in svc.get("ports", [])] for service, svc in SERVICES.items()}
    assert listener["port_value"] in published["envoy"]
    assert listen_port("console") in published["console"]
    for replica in REPLICAS:
        assert any(p.endswith(f":{hostport(flag(command(replica), '--admin'))[1]}")
                   for p in SERVICES[replica]["ports"])
    host_ports = [p.rsplit(":", 1)[0] for r in REPLICAS for p in SERVICES[r]["ports"]]
    assert len(set(host_ports)) == len(host_ports), "each replica's admin port published on its own host port"


@pytest.mark.parametrize("replica", REPLICAS)
def test_extproc_reports_to_the_console(replica: str) -> None:
    url = urlsplit(flag(command(replica), "--console-url"))
    assert url.hostname in SERVICES and url.hostname == "console"
    assert url.port == listen_port("console")
    token = "SLUICE_CONSOLE_TOKEN"
    assert SERVICES[replica]["environment"][token] == SERVICES["console"]["environment"][token]
    deps = SERVICES[replica]["depends_on"]
    assert all(deps[s]["condition"] == "service_healthy" for s in ("console", "simbackend", "redis"))


def test_the_replicas_share_one_redis() -> None:
    redis = SERVICES["redis"]
    port = int(flag([str(c) for c in redis["command"]], "--port"))
    assert redis["image"].startswith("redis:") and "redis-cli" in redis["healthcheck"]["test"]
    assert str(port) in redis["healthcheck"]["test"]
    ids = set()
    for replica in REPLICAS:
        url = urlsplit(SERVICES[replica]["environment"]["SLUICE_REDIS_URL"])
        assert (url.scheme, url.hostname, url.port) == ("redis", "redis", port)
        ids.add(flag(command(replica), "--replica-id"))
    assert len(ids) == len(REPLICAS), "each replica its own id"
    assert set(SERVICES["envoy"]["depends_on"]) == set(REPLICAS)


@pytest.mark.parametrize("service", SLUICE)
def test_health_checks_probe_the_right_port(service: str) -> None:
    text = " ".join(SERVICES[service]["healthcheck"]["test"])
    url = urlsplit(re.search(r"http://[^'\" ]+", text).group(0))  # type: ignore[union-attr]
    if service == "envoy":
        admin = envoy_config()["admin"]["address"]["socket_address"]
        assert (url.hostname, url.port, url.path) == (admin["address"], admin["port_value"], "/ready")
    elif service in REPLICAS:
        assert url.port == hostport(flag(command(service), "--admin"))[1] and url.path == "/healthz"
    else:
        assert url.port == listen_port(service)


def test_compose_policy_is_valid_and_rendered_files_are_current(tmp_path: Path,
                                                                compose_policy_dir: Path) -> None:
    load_policy(compose_policy_dir)
    render.render(out=tmp_path)
    for name in (render.COMPOSE_BACKENDS, render.COMPOSE_ENVOY):
        assert (tmp_path / name).read_text() == (ROOT / "docker" / name).read_text(), \
            f"docker/{name} is out of date: run `python docker/render.py`"
