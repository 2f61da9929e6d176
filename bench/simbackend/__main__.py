"""python -m bench.simbackend --port 8000 [--kv-blocks ... --mode preempt|oom ...]"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from dataclasses import fields
from typing import Any

from .app import create_app
from .config import MODES, SCHEDULING_POLICIES, SimConfig
from .server import start_site


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.simbackend", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    d = SimConfig()

    def setting(flag: str, help: str | None = None, **kw: Any) -> None:
        # Default and type from SimConfig's field (--kv-blocks: kv_blocks): a float field
        # needs a float default, or its flag would parse as int.
        default = getattr(d, flag[2:].replace("-", "_"))
        p.add_argument(flag, type=type(default), default=default, help=help, **kw)

    setting("--model", "served model name (requests may use any)")
    setting("--kv-blocks")
    setting("--block-size", "tokens per KV block")
    setting("--max-num-seqs")
    setting("--max-model-len")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="prompt tokens per prefill step (default: max-model-len)",
    )
    p.add_argument("--chunked-prefill", action="store_true",
                   help="vLLM V1 scheduling: prompts in chunks of max-num-batched-tokens mixed with decode")
    p.add_argument("--enable-prefix-caching", dest="prefix_caching", action=argparse.BooleanOptionalAction,
                   default=False, help="vLLM's automatic prefix caching: cached prompt blocks skip prefill "
                   "(--no-enable-prefix-caching: off, the default here)")
    setting("--watermark", "fraction of blocks kept free at admission")
    setting(
        "--scheduling-policy",
        "vLLM's: fcfs, or priority (the request's priority field, lower first, "
        "orders the waiting queue and picks whom to preempt)",
        choices=SCHEDULING_POLICIES,
    )
    setting(
        "--mode", "out of KV: preempt the newest sequence, or fail everything (oom)", choices=MODES
    )
    setting("--time-scale", "10 runs everything ten times faster")
    setting("--ttft-ms", "fixed cost of a prefill step")
    setting("--prefill-ms-per-1k-tokens")
    setting("--tokens-per-s", "decode speed of a sequence running alone")
    setting("--decode-ms-per-seq", "added to a decode step per sequence in the batch")
    setting("--decode-ms-per-1k-kv-tokens", "added to a decode step per 1000 KV tokens the batch attends to")
    setting("--oom-pause-s", "admission pause after a simulated OOM (mode oom)")
    setting("--default-max-tokens")
    setting("--embedding-dim")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    names = {f.name for f in fields(SimConfig)}
    return SimConfig(**{k: v for k, v in vars(args).items() if k in names})


async def serve(config: SimConfig, host: str, port: int) -> None:
    runner, bound = await start_site(create_app(config), host, port)
    print(f"simbackend listening on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"simbackend: {exc}") from None
    asyncio.run(serve(config, args.host, args.port))


if __name__ == "__main__":
    main()
