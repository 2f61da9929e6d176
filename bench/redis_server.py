"""A throwaway Debian ``redis-server`` on a random loopback port, for tests and benches."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from bench.procs import free_port

REDIS_SERVER = "/usr/bin/redis-server"


def redis_binary() -> str:
    found = shutil.which("redis-server") or (REDIS_SERVER if Path(REDIS_SERVER).exists() else None)
    if found is None:
        raise RuntimeError("redis-server is not installed: `make test` installs it (Debian package redis-server)")
    return found


class RedisServer:
    """Started with no persistence; may be frozen (SIGSTOP), killed and started again on its port."""

    def __init__(self, workdir: Path, port: int | None = None, own_group: bool = False) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.own_group = own_group  # its own process group: a terminal's Ctrl-C does not reach it
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], stdout=log, stderr=subprocess.STDOUT,
            process_group=0 if self.own_group else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.workdir / 'redis.log').read_text()[-2000:]}")
            if self._ping():
                return self
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
