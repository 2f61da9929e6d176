"""The real stack with the console in front of extproc's policy: ``harness.Stack`` plus
``python -m console serve`` on a random port, and extproc started as its replica.

extproc takes its policy from the console (long-poll of ``/api/v1/policy``) and posts
its state every second; the console reads the same policy directory as its base.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from tests.e2e.harness import Proc, Stack, free_port, wait_http

OPERATOR = ("e2e-operator", "e2e-operator-pass")


def extproc_has_console_flags() -> bool:
    out = subprocess.run([sys.executable, "-m", "extproc", "serve", "--help"], capture_output=True, text=True,
                         timeout=30).stdout
    return "--console-url" in out


@dataclass
class ConsoleStack(Stack):
    token: str = "e2e-console-token-0123456789"
    replica_id: str = "r1"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.console_port = free_port()
        self.console_db = self.workdir / "console.db"

    @property
    def console_url(self) -> str:
        return f"http://127.0.0.1:{self.console_port}"

    def start(self) -> ConsoleStack:
        self.write_policy()
        self.start_sim()
        self.start_console()
        self.start_extproc()
        self.start_envoy()
        return self

    def token_file(self) -> str:
        """The replica token in a 0600 file: neither side gets it on the command line."""
        path = self.workdir / "console-token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.token + "\n")
        return str(path)

    def start_console(self) -> None:
        name, password = OPERATOR
        p = Proc("console", [sys.executable, "-m", "console", "serve", "--db", str(self.console_db),
                             "--policy", str(self.policy_dir), "--host", "127.0.0.1",
                             "--port", str(self.console_port), "--api-token-file", self.token_file(),
                             "--reload-interval", "0.2", "--demo", "--demo-user", name,
                             "--demo-password", password], self.workdir / "console.log")
        self.procs["console"] = p.start()
        wait_http(f"{self.console_url}/healthz", proc=p.popen)

    def start_extproc(self) -> None:
        if not extproc_has_console_flags():
            raise RuntimeError("`python -m extproc serve` has no --console-url/--console-token/--replica-id yet: "
                               "the replica side of the console API is missing")
        p = Proc("extproc", [sys.executable, "-m", "extproc", "serve", "--policy", str(self.policy_dir),
                             "--grpc", f"127.0.0.1:{self.grpc_port}", "--admin", f"127.0.0.1:{self.admin_port}",
                             "--reload-interval", "0.2", "--console-url", self.console_url,
                             "--replica-id", self.replica_id, "--eds-dir", str(self.eds_dir)],
                 self.workdir / "extproc.log", env={"SLUICE_CONSOLE_TOKEN_FILE": self.token_file()})
        self.procs["extproc"] = p.start()
        wait_http(f"{self.admin_url}/healthz", proc=p.popen)

    def stop(self) -> None:
        super().stop()
        if "console" in self.procs:
            self.procs["console"].stop()
