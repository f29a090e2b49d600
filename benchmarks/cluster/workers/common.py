"""Helpers shared by the worker programs: printing the result line, the TCPStore rendezvous.

May import: the standard library, torch (lazily) and benchmarks.cluster.cpu.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta


def emit(result: dict) -> None:
    """Print the one `RESULT {json}` line the orchestrator reads (see benchmarks.cluster.procs)."""
    print("RESULT " + json.dumps(result), flush=True)


def store(addr: str, rank: int, world: int, timeout_s: float):
    """Return the job's TCPStore: rank 0 hosts it on `addr` ("ip:port", inside its namespace)."""
    import torch.distributed as dist

    host, _, port = addr.rpartition(":")
    return dist.TCPStore(host, int(port), world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))


def fail(message: str, code: int = 2) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)
