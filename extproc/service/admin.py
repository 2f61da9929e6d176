"""The admin HTTP port: /metrics for Prometheus, /healthz, /debug/state and /debug/settled
(each settled request's charge) for tests, and /drain
(where Envoy streams oversized uploads to be discarded and answered 413)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from extproc.envoy.headers import DRAIN_PATH
from extproc.runtime.runtime import Runtime
from extproc.service.drain import drain_handler


def admin_app(runtime: Runtime) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=runtime.metrics.render(), headers={"content-type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def state(_: web.Request) -> web.Response:
        return web.json_response(runtime.status())

    async def settled(request: web.Request) -> web.Response:
        after = request.query.get("after", "0")
        if not after.isdigit():
            return web.json_response({"error": "after must be a non-negative integer"}, status=400)
        return web.json_response(runtime.settle_log.report(int(after)))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/debug/state", state)
    app.router.add_get("/debug/settled", settled)  # extproc/runtime/settle_log.py
    # Envoy sends oversized uploads here (the drain route); see extproc/service/drain.py.
    app.router.add_route("*", DRAIN_PATH, drain_handler(runtime))
    return app


async def start_admin(runtime: Runtime, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(admin_app(runtime), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
