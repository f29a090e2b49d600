"""Dedicated servers announce themselves in a job's c10d store; workers read the list back.

The store is the raw TCPStore (torchrun's MASTER_ADDR:MASTER_PORT); keys live under "torch_bps/servers/".
May import: the standard library and torch.distributed only (the server uses it too).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

_PREFIX = "torch_bps/servers/"


def register_server(store: dist.Store, address: str) -> int:
    """Append a dedicated server's "host:port" to the store; return its index."""
    index = store.add(_PREFIX + "count", 1) - 1
    store.set(f"{_PREFIX}{index}", address)
    return index


def registered_servers(store: dist.Store, count: int, timeout: float) -> list[str]:
    """Wait (up to timeout seconds) until `count` servers registered; return their addresses in index order."""
    keys = [f"{_PREFIX}{i}" for i in range(count)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as e:
        have = store.add(_PREFIX + "count", 0)
        raise TimeoutError(
            f"waited {timeout}s for {count} dedicated servers to register in the job store (bps-server --register); "
            f"{have} did"
        ) from e
    return [store.get(k).decode() for k in keys]
