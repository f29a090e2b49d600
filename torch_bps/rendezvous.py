"""Meeting the other ranks and finding the servers: the job id and secret agreed through the c10d store, dedicated
servers from `BPS_SERVERS` and the registry, and the embedded server each machine's local rank 0 starts when the
placement needs one (a child process, `python -m torch_bps.server`, which ends with the job).

May import: torch, torch_bps.address, config, errors, registry, security, timeline, topology, engine.placement.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta

import torch.distributed as dist

from torch_bps.address import parse_listening
from torch_bps.config import Config
from torch_bps.engine.placement import t_opt
from torch_bps.errors import BpsTimeoutError, TransportError
from torch_bps.registry import connect, registered_servers
from torch_bps.security import JOB_SECRET_ENV, new_secret
from torch_bps.timeline.recorder import TimelineSpec
from torch_bps.topology import Launch, Topology

log = logging.getLogger("torch_bps")


def raw_store(store: dist.Store) -> dist.Store:
    """Strip torch's PrefixStores ("default_pg/0/cpu/...") to reach the job's TCPStore."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def find_servers(name: str, store_host: str, store: dist.Store, ns: dist.Store, topology: Topology, config: Config,
                 timeout: float, base=None):  # fmt: skip
    """Return (the job's secret, colocated addresses, dedicated addresses, the embedded server this rank started or
    None): a group other than the default one reuses the default Runtime's servers and secret (its embedded servers
    accept the default group's key only); else dedicated ones come from BPS_SERVERS and the registry, and each
    machine starts an embedded one when the placement needs it."""
    if base is not None and name != "default":
        return base._secret, base._colocated, base._dedicated, None
    secret = agree_secret(ns, topology.rank, timeout)
    dedicated = list(config.servers)
    if config.num_servers:
        registry = connect(config.registry, timeout) if config.registry else raw_store(store)
        dedicated += registered_servers(registry, config.num_servers, timeout, where=config.registry)
    needs_colocated = config.placement == "colocated" or (
        config.placement == "optimal" and len(dedicated) < topology.num_nodes
    )
    if not needs_colocated:
        return secret, [], dedicated, None
    server_proc, colocated = colocated_servers(ns, topology, config, timeout, store_host, secret)
    return secret, colocated, dedicated, server_proc


def agree_job_id(ns: dist.Store, rank: int, timeout: float) -> int:
    if rank == 0:
        ns.set("job_id", str(int.from_bytes(os.urandom(8), "little")))
    wait(ns, ["job_id"], timeout, "the job id from rank 0")
    return int(ns.get("job_id"))


def agree_secret(ns: dist.Store, rank: int, timeout: float) -> str:
    """The job's secret, drawn by rank 0: every worker's credentials and its embedded servers' derive from it."""
    if rank == 0:
        ns.set("secret", new_secret())
    wait(ns, ["secret"], timeout, "the job's secret from rank 0")
    return ns.get("secret").decode()


def wait(store: dist.Store, keys: list[str], timeout: float, what: str) -> None:
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as e:
        raise BpsTimeoutError(f"waited {timeout}s in the job store for {what} (keys {keys})") from e


def colocated_servers(ns: dist.Store, topo: Topology, config: Config, timeout: float, store_host: str, secret: str,
                      ahead: EmbeddedServer | None = None):  # fmt: skip
    """Local rank 0 of every machine starts its embedded server (or takes `ahead`, one it started earlier that still
    runs); everyone learns every machine's address."""
    proc = None
    if topo.local_rank == 0:
        host = advertised_host(config, store_host)
        server = ahead
        if server is None or server.proc.poll() is not None:
            server = EmbeddedServer(config, bind_address(host), secret)
        proc, port = server.proc, server.port(timeout)
        ns.set(f"colocated/{topo.node_rank}", f"{host}:{port}")
    keys = [f"colocated/{i}" for i in range(topo.num_nodes)]
    wait(ns, keys, timeout, f"the embedded servers of {topo.num_nodes} machine(s)")
    return proc, [ns.get(k).decode() for k in keys]


class EmbeddedServer:
    """A summation server process this worker starts (`python -m torch_bps.server`); `port` waits for it to listen.
    Started, it needs a few seconds (it imports torch: 2 s alone, 15-27 s for 4 at once on a loaded 2-core machine),
    which is why a failover's fallback takes one started ahead (runtime.py)."""

    def __init__(self, config: Config, bind: str, secret: str):
        # Listens only on the interface the other machines reach it at; reads frames up to a partition's size.
        # No lease: it serves one job and ends with it, so a job pausing for long (evaluation) is never forgotten.
        max_frame = max(16 << 20, config.partition_bytes)
        cmd = [sys.executable, "-m", "torch_bps.server", "--host", bind, "--port", "0", "--exit-with-parent",
               "--heartbeat-timeout", str(config.heartbeat_timeout),
               "--heartbeat-interval", str(config.heartbeat_interval), "--max-frame-bytes", str(max_frame),
               "--job-lease", "1e9", "--auth", config.auth]  # fmt: skip
        if config.trace:
            cmd += ["--trace", TimelineSpec.parse(config.trace).directory]
        # The secret goes by environment, which only this user can read, never on the command line.
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, JOB_SECRET_ENV: secret})
        self._line = [""]
        self._reader = threading.Thread(target=lambda: self._line.__setitem__(0, self.proc.stdout.readline()),
                                        daemon=True)  # fmt: skip
        self._reader.start()

    def port(self, timeout: float) -> int:
        """The port it listens on, once it says so; it is killed if it has not within `timeout` seconds."""
        self._reader.join(timeout)
        if not (listening := parse_listening(self._line[0])):
            self.proc.kill()
            raise TransportError(f"the embedded summation server did not start within {timeout}s "
                                 f"(printed {self._line[0]!r})")  # fmt: skip
        return listening[0]


def start_server(config: Config, timeout: float, bind: str, secret: str) -> tuple[subprocess.Popen, int]:
    server = EmbeddedServer(config, bind, secret)
    return server.proc, server.port(timeout)


def store_host(store: dist.Store, launch: Launch) -> str:
    return getattr(raw_store(store), "host", "") or launch.master_addr or "127.0.0.1"


def advertised_host(config: Config, store_host: str) -> str:
    if config.host:
        return config.host
    try:  # the interface that routes to the store's host is one the other machines can reach
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(store_host), 9))  # UDP connect: picks a route, sends nothing
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def bind_address(host: str) -> str:
    """Return the IP address to listen on for an advertised host (ZeroMQ binds addresses, not names)."""
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise TransportError(f"cannot resolve {host!r}, the address this machine's embedded server advertises") from e


def log_split(name, topo: Topology, colocated, dedicated, weights) -> None:
    n, k = len(colocated), len(dedicated)
    x = sum(s.weight for s in weights if s.dedicated)
    per_mb = t_opt(max(n, topo.num_nodes), k, 1 << 20, 1.25e9) * 1e3
    log.info(
        "torch_bps[%s]: %d machine(s), %d colocated + %d dedicated server(s); %.1f%% of bytes to dedicated servers; "
        "expected t_opt %.3f ms per MB of gradients at 10 Gbit/s",
        name, topo.num_nodes, n, k, 100 * x, per_mb,
    )  # fmt: skip
