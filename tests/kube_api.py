"""The Kubernetes API's list and watch endpoints for three resources, served over real HTTP to
the real ``kubernetes`` client: the objects are Kubernetes' wire JSON (tests/fixtures/kube/),
the watch is the API server's chunked stream of ``{"type", "object"}`` lines, and the test
plays the events. Not an API server: no etcd, no admission, no RBAC, no field selectors
beyond ``metadata.name``; what Sluice's watcher does with what a server sends is what is
tested here."""

from __future__ import annotations

import copy
import json
import queue
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

FIXTURES = Path(__file__).parent / "fixtures" / "kube"
KINDS = {  # path suffix -> (list kind, api version)
    "pods": ("PodList", "v1"),
    "inferencepools": ("InferencePoolList", "inference.networking.k8s.io/v1"),
    "inferenceobjectives": ("InferenceObjectiveList", "llm-d.ai/v1alpha2"),
}


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


class KubeApi:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, dict[str, Any]]] = {k: {} for k in KINDS}
        self.version = 100
        self.watchers: dict[str, list[queue.Queue[dict[str, Any] | None]]] = {k: [] for k in KINDS}
        self.lists: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                url = urlsplit(self.path)
                kind = url.path.rstrip("/").rsplit("/", 1)[-1]
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                if kind not in KINDS:
                    self.send_error(404)
                    return
                if q.get("watch") in ("true", "1"):
                    self._watch(kind, q)
                else:
                    self._list(kind, q)

            def _list(self, kind: str, q: dict[str, str]) -> None:
                body = json.dumps(api.list_doc(kind, q.get("fieldSelector"))).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _watch(self, kind: str, q: dict[str, str]) -> None:
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                name = (q.get("fieldSelector") or "").removeprefix("metadata.name=") or None
                try:
                    for event in api.events(kind):
                        if name is not None and event["object"]["metadata"]["name"] != name:
                            continue
                        line = json.dumps(event).encode() + b"\n"
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": "default"}}],
            "users": [{"name": "test", "user": {"token": "test"}}]}))
        return path

    def list_doc(self, kind: str, field_selector: str | None) -> dict[str, Any]:
        with self.lock:
            self.lists[kind] += 1
            items = list(self.objects[kind].values())
            version = self.version
        if field_selector and field_selector.startswith("metadata.name="):
            items = [o for o in items if o["metadata"]["name"] == field_selector.split("=", 1)[1]]
        list_kind, api_version = KINDS[kind]
        return {"kind": list_kind, "apiVersion": api_version, "metadata": {"resourceVersion": str(version)},
                "items": copy.deepcopy(items)}

    def events(self, kind: str) -> Iterator[dict[str, Any]]:
        q: queue.Queue[dict[str, Any] | None] = queue.Queue()
        with self.lock:
            self.watchers[kind].append(q)
        try:
            while (event := q.get()) is not None:
                yield event
        finally:
            with self.lock:
                self.watchers[kind].remove(q)

    def put(self, kind: str, obj: dict[str, Any], event: str | None = None) -> None:
        """Store ``obj`` (ADDED or MODIFIED) and tell every watcher."""
        obj = copy.deepcopy(obj)
        name = obj["metadata"]["name"]
        with self.lock:
            self.version += 1
            obj["metadata"]["resourceVersion"] = str(self.version)
            kind_event = event or ("MODIFIED" if name in self.objects[kind] else "ADDED")
            self.objects[kind][name] = obj
            for q in self.watchers[kind]:
                q.put({"type": kind_event, "object": obj})

    def delete(self, kind: str, name: str) -> None:
        with self.lock:
            self.version += 1
            obj = self.objects[kind].pop(name)
            for q in self.watchers[kind]:
                q.put({"type": "DELETED", "object": obj})

    def watching(self, kind: str) -> int:
        with self.lock:
            return len(self.watchers[kind])

    def close(self) -> None:
        with self.lock:
            for qs in self.watchers.values():
                for q in qs:
                    q.put(None)
        self.server.shutdown()
        self.server.server_close()


def pod(name: str, ip: str, labels: dict[str, str], ready: bool = True, phase: str = "Running") -> dict[str, Any]:
    """A pod as the API server returns it (tests/fixtures/kube/pod.json), renamed and readdressed."""
    p = fixture("pod.json")
    p["metadata"]["name"] = name
    p["metadata"]["labels"] = labels
    p["status"]["phase"] = phase
    p["status"]["podIP"] = ip
    p["status"]["podIPs"] = [{"ip": ip}]
    for c in p["status"]["conditions"]:
        if c["type"] in ("Ready", "ContainersReady"):
            c["status"] = "True" if ready else "False"
    p["status"]["containerStatuses"][0]["ready"] = ready
    return p
