"""extproc reads the console token from a file (``--console-token-file``), not only argv."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench.procs import free_port
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]


def test_extproc_sends_the_token_from_its_file(tmp_path: Path) -> None:
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append(self.headers.get("Authorization", ""))
            self.send_response(503)
            self.end_headers()

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    secret = tmp_path / "token"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"tok-in-a-file\n")
    os.close(fd)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_CONSOLE_TOKEN")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "extproc", "serve", "--policy", "policies", "--grpc", f"127.0.0.1:{free_port()}",
         "--admin", f"127.0.0.1:{free_port()}", "--console-url", f"http://127.0.0.1:{server.server_port}",
         "--console-token-file", str(secret), "--replica-id", "t1"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def called() -> bool:
            assert seen or proc.poll() is None, "extproc exited without calling the console"
            return bool(seen)

        eventually(called, 30, "extproc never called the console")
        assert seen[0] == "Bearer tok-in-a-file"
        assert "tok-in-a-file" not in " ".join(map(str, proc.args))
    finally:
        proc.terminate()
        proc.wait(10)
        server.shutdown()
        server.server_close()
