"""GIE's reference Envoy in front of Sluice's endpoint picker, on this machine.

    python -m bench.gie_envoy                 # after `make demo`: the picker on 127.0.0.1:9002
    python -m bench.gie_envoy --config llmd   # llm-d-router's e2e Envoy instead

Runs the Envoy config the Gateway API Inference Extension tests with (vendored under
tests/e2e/gateways/ with its source and commit) with only its addresses and ports changed
(``tests.e2e.gateway_configs.relocate``): clients on ``--listen`` (GIE's 8081), the picker over
TLS at ``--picker``, the pool an ORIGINAL_DST cluster on ``x-gateway-destination-endpoint``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import yaml

from bench.procs import envoy_binary


def main(argv: list[str] | None = None) -> int:
    from tests.e2e import gateway_configs as gc

    ap = argparse.ArgumentParser(prog="python -m bench.gie_envoy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(gc.VENDORED), default="gie")
    ap.add_argument("--listen", type=int, default=gc.LISTENER)
    ap.add_argument("--admin", type=int, default=gc.ADMIN)
    ap.add_argument("--ready", type=int, default=gc.READY)
    ap.add_argument("--picker", default="127.0.0.1:9002", help="the picker's address (serve --picker)")
    args = ap.parse_args(argv)
    host, _, port = args.picker.rpartition(":")
    if host not in ("127.0.0.1", "localhost"):
        raise SystemExit("the relocated config reaches the picker on 127.0.0.1")
    cfg = gc.relocate(gc.vendored(args.config), gc.Ports(admin=args.admin, ready=args.ready, listener=args.listen,
                                                         picker=int(port)))
    path = Path(tempfile.mkdtemp(prefix="sluice-gie-")) / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    print(f"{args.config}'s Envoy: clients on http://127.0.0.1:{args.listen}, the picker at {args.picker}; "
          f"config {path}", flush=True)
    binary = envoy_binary()
    os.execv(binary, [binary, "-c", str(path), "--disable-hot-restart", "-l", "warning", "--concurrency", "1",
                      "--service-cluster", "demo/inference-gateway", "--service-node", "demo-envoy"])


if __name__ == "__main__":
    raise SystemExit(main())
