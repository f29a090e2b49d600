"""`bps-server` / `python -m torch_bps.server`: run one summation server until SIGINT or SIGTERM.

May import: the standard library, torch and torch_bps.server.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import torch

from torch_bps.server.server import SummationServer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bps-server",
        description="torch_bps summation server: workers push gradient partitions, pull back the sums.",
    )
    p.add_argument("--host", default=os.environ.get("BPS_SERVER_HOST", "0.0.0.0"), help="address to bind (default %(default)s)")
    p.add_argument(
        "--port", type=int, default=int(os.environ.get("BPS_SERVER_PORT", "9000")), help="TCP port; 0 picks a free one (default %(default)s)"
    )
    p.add_argument(
        "--engine-threads",
        type=int,
        default=int(os.environ.get("BPS_SERVER_ENGINE_THREADS", "2")),
        help="summation threads; each owns a disjoint set of keys (default %(default)s)",
    )
    p.add_argument("--log-level", default=os.environ.get("BPS_LOG_LEVEL", "WARNING"), help="DEBUG, INFO, WARNING... (default %(default)s)")
    args = p.parse_args(argv)
    if args.engine_threads < 1:
        p.error("--engine-threads must be at least 1")
    if not 0 <= args.port < 65536:
        p.error(f"--port {args.port} is not a TCP port")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s bps-server %(levelname)s %(message)s")
    # Parallelism comes from engine threads owning disjoint keys; one torch thread each avoids oversubscription.
    torch.set_num_threads(1)
    try:
        server = SummationServer(args.host, args.port, args.engine_threads)
    except Exception as e:  # e.g. the port is taken: say which
        print(f"bps-server: cannot listen on tcp://{args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    server.start()
    # Tests and launchers read this line to learn the port and incarnation.
    print(f"bps-server listening on {server.address} port {server.port} incarnation {server.incarnation:#x}", flush=True)
    server.serve_forever()
    return 0
