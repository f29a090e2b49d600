"""Dedicated servers announce themselves in a store; workers read the list back.

The store is the job's raw TCPStore (torchrun's MASTER_ADDR:MASTER_PORT) or, when the servers cannot know
that address (torchrun's c10d rendezvous puts it on a random port), any TCPStore both sides reach
(`BPS_REGISTRY`, e.g. the rendezvous endpoint). Keys live under "torch_bps/servers/".
May import: the standard library, torch.distributed and torch_bps.address only (the server uses it too).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist

from torch_bps.address import split_host_port

_PREFIX = "torch_bps/servers/"


def connect(address: str, timeout: float) -> dist.TCPStore:
    """A client of the TCPStore at "host:port"; waits up to timeout seconds for it to listen."""
    host, port = split_host_port(address)
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    except Exception as e:
        raise TimeoutError(f"no TCPStore answered at {address} within {timeout}s: {e}") from e


def register_server(store: dist.Store, address: str) -> int:
    """Append a dedicated server's "host:port" to the store; return its index."""
    index = store.add(_PREFIX + "count", 1) - 1
    store.set(f"{_PREFIX}{index}", address)
    return index


def registered_servers(store: dist.Store, count: int, timeout: float, where: str = "") -> list[str]:
    """Wait (up to timeout seconds) until `count` servers registered; return their addresses in index order.
    `where`: the registry's address, for the error ("": the job's store)."""
    keys = [f"{_PREFIX}{i}" for i in range(count)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as e:
        have = store.add(_PREFIX + "count", 0)
        store_name = f"the registry at {where} (BPS_REGISTRY)" if where else "the job's store (MASTER_ADDR:MASTER_PORT)"
        hint = "" if where else (
            "; under torchrun's c10d rendezvous the servers cannot know that store's port: set BPS_REGISTRY on the "
            "workers to an address both sides reach (the rendezvous endpoint) and register the servers there"
        )  # fmt: skip
        raise TimeoutError(
            f"waited {timeout}s for {count} dedicated servers to register in {store_name} (bps-server --register); "
            f"{have} did{hint}"
        ) from e
    return [store.get(k).decode() for k in keys]


def registered(store: dist.Store) -> list[str]:
    """Every server registered so far, in index order."""
    return [store.get(f"{_PREFIX}{i}").decode() for i in range(store.add(_PREFIX + "count", 0))]


def claim_standby(store: dist.Store, skip: int, used: set[str], count: int, wait: float, owner: str) -> list[str]:
    """Claim up to `count` servers registered beyond the first `skip` (standbys) that nobody claimed and are not
    in `used`; wait up to `wait` seconds for more to register. A claim (compare_set, keyed by address) holds for
    every job sharing the registry: `owner` names the job that took it, with a mark of this call's, so that a server
    the job claimed in an earlier failover (and uses now) is not claimed again as a free standby."""
    token = f"{owner}/{os.urandom(4).hex()}"
    claimed: list[str] = []
    deadline = time.monotonic() + wait
    index = skip
    while len(claimed) < count:
        if index < store.add(_PREFIX + "count", 0):
            address = store.get(f"{_PREFIX}{index}").decode()
            index += 1
            key = f"{_PREFIX}claimed/{address}"
            if address not in used and store.compare_set(key, "", token).decode() == token:  # "": never or given back
                claimed.append(address)
        elif time.monotonic() < deadline:
            time.sleep(0.1)
        else:
            break
    return claimed


def release_standby(store: dist.Store, addresses: list[str], owner: str) -> None:
    """Give back standbys `owner` claimed (claim_standby) and did not use: one that did not answer when claimed
    (stalled, cut off, still starting) may serve a later failover, of this job or another."""
    for address in addresses:
        key = f"{_PREFIX}claimed/{address}"
        if store.check([key]) and (held := store.get(key).decode()).startswith(f"{owner}/"):
            store.compare_set(key, held, "")
