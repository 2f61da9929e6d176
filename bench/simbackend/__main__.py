"""python -m bench.simbackend --port 8000 [--kv-blocks ... --mode preempt|oom ...]"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from dataclasses import fields

from .app import create_app
from .config import MODES, SimConfig
from .server import start_site


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.simbackend", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    d = SimConfig()
    p.add_argument("--model", default=d.model, help="served model name (requests may use any)")
    p.add_argument("--kv-blocks", type=int, default=d.kv_blocks)
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="prompt tokens per prefill step (default: max-model-len)",
    )
    p.add_argument(
        "--watermark",
        type=float,
        default=d.watermark,
        help="fraction of blocks kept free at admission",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default=d.mode,
        help="out of KV: preempt the newest sequence, or fail everything (oom)",
    )
    p.add_argument(
        "--time-scale", type=float, default=d.time_scale, help="10 runs everything ten times faster"
    )
    p.add_argument("--ttft-ms", type=float, default=d.ttft_ms, help="fixed cost of a prefill step")
    p.add_argument("--prefill-ms-per-1k-tokens", type=float, default=d.prefill_ms_per_1k_tokens)
    p.add_argument(
        "--tokens-per-s",
        type=float,
        default=d.tokens_per_s,
        help="decode speed of a sequence running alone",
    )
    p.add_argument(
        "--decode-ms-per-seq",
        type=float,
        default=d.decode_ms_per_seq,
        help="added to a decode step per sequence in the batch",
    )
    p.add_argument(
        "--oom-pause-s",
        type=float,
        default=d.oom_pause_s,
        help="admission pause after a simulated OOM (mode oom)",
    )
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens)
    p.add_argument("--embedding-dim", type=int, default=d.embedding_dim)
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
