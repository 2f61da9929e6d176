"""A TCP proxy that holds every byte for a while each way: distance on loopback.

    python -m bench.delay_proxy LISTEN_PORT TARGET_PORT DELAY_MS

Loopback has no round trip to speak of, so a cost paid per round trip (a flow-control
window given back a little at a time) does not show there; between an Envoy and a Sluice
on different nodes it does. Bytes keep their order; each chunk read goes on ``DELAY_MS``
later. asyncio's timers wake on the millisecond, so a delay under 1 ms is about 1 ms.
"""

from __future__ import annotations

import asyncio
import sys


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    loop = asyncio.get_running_loop()
    try:
        while data := await reader.read(1 << 20):
            loop.call_later(delay, writer.write, data)
    except ConnectionError:
        pass
    finally:
        loop.call_later(delay, writer.close)


async def serve(listen: int, target: int, delay: float) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, up_writer, delay), _pump(up_reader, writer, delay))

    server = await asyncio.start_server(handle, "127.0.0.1", listen)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    asyncio.run(serve(int(args[0]), int(args[1]), float(args[2]) / 1000))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
