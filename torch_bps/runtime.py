"""A group's Runtime: from a c10d store to a running push/pull engine, with no scheduler process, and its lifetime.

Workers meet through the store torch already gives the backend (torchrun's), in a namespace of ours
(rendezvous.py): rank 0 draws the job id, dedicated servers come from `BPS_SERVERS` or register themselves in the
store, and each machine's local rank 0 starts an embedded colocated server when the placement needs one (with
no dedicated servers: always, which gives all-reduce-equivalent traffic with zero configuration). The
embedded server stops with the job: at close, after every rank is done with it, or on its own when the
process that started it dies.

Every group (the default group, each new_group, the DDP hook) gets its own Runtime and job namespace, kept in
the process's one registry (`_RUNTIMES`; `acquire` and `release` for runtimes.py's leases). Groups other than the
default one reuse the servers of the process's default Runtime if there is one; subgroups treat every rank as its
own machine (no local reduction).
May import: torch, torch_bps.address, config, errors, futures, rendezvous, topology, registry, security, client, local,
engine, timeline, agreement, failover, wire; device.comm when a device's local stage opens.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import subprocess
import threading
import time

import torch
import torch.distributed as dist

from torch_bps import rendezvous
from torch_bps.address import accepts
from torch_bps.config import Config, transport_options
from torch_bps.engine.compress import Compressor
from torch_bps.engine.exchange import Exchange
from torch_bps.engine.partition import KeyBook
from torch_bps.engine.pipeline import PushPullEngine
from torch_bps.engine.placement import Placement, receive_buffers, server_weights
from torch_bps.engine.precision import travels_as, wire_dtype
from torch_bps.errors import BpsTimeoutError, ConfigError, ServerError, TransportError
from torch_bps.futures import completer
from torch_bps.registry import claim_standby, connect, registered, release_standby
from torch_bps.rendezvous import start_server as _start_server  # noqa: F401 - tests/server start one through here
from torch_bps.security import ClientCredentials
from torch_bps.timeline.recorder import Recorder
from torch_bps.topology import Launch, Topology
from torch_bps.wire import Mode

log = logging.getLogger("torch_bps")

# The process's one registry of Runtimes: every open one by its group's name (create adds it, close takes it out), and
# how many leases (runtimes.Lease: bps_hook, BackupWorkers, AsyncTraining) hold each that `acquire` made.
_RUNTIMES: dict[str, Runtime] = {}
_HOLDERS: dict[str, int] = {}
_REGISTRY_LOCK = threading.Lock()  # _RUNTIMES' holders, _NAME_LOCKS and _MADE
_NAME_LOCKS: dict[str, threading.Lock] = {}  # one per name: making a Runtime is a rendezvous, which blocks
# Runtimes of each name made by this process: every rank makes a group's runtimes in the same order (as torch names
# its groups), so the count tells a later runtime's keys in the store from an earlier one's (its job id, "closed").
_MADE: collections.Counter[str] = collections.Counter()


class Runtime:
    """One group's connection to the summation service. Create with `Runtime.create`."""

    def __init__(self, name: str, config: Config, topology: Topology, store: dist.Store, local_channels,
                 server_proc: subprocess.Popen | None, addresses: list[str], colocated: list[str],
                 dedicated: list[str], launch: Launch, *, secret: str, with_dedicated: bool):  # fmt: skip
        self.name = name
        self.launch = launch
        self.config = config
        self.topology = topology
        self.rank = topology.rank
        self.world_size = topology.world_size
        self.addresses = addresses  # the client's servers, in placement order
        self._colocated, self._dedicated = colocated, dedicated  # subgroups reuse these servers
        self._store = store
        self._engine: PushPullEngine | None = None  # the engine and its client: `create` makes them (_start)
        self._client = None
        self._local_channels = local_channels
        self._device_channels: list = []  # DeviceLocalComm channels opened (open_device_channels)
        self._server_proc = server_proc
        self._secret = secret  # the job's secret, which its credentials derive from
        # Bytes go to dedicated servers, which sets the default credit (Config.credit). Chosen once: clients a
        # failover makes keep it.
        self._with_dedicated = with_dedicated
        self._failed = False  # a collective failed: the job is broken, close waits for nobody
        self._fallback_procs: list[subprocess.Popen] = []  # colocated servers a failover started
        self._fallback_colocated: list[str] = []  # and their addresses
        self._ahead: rendezvous.EmbeddedServer | None = None  # this machine's next fallback server, started ahead
        self._timeline = None
        self._closed = False
        self._close_lock = threading.Lock()
        # Held by both front doors (the "byteps" group, bps_hook) from a collective's path choice and staging to its
        # launch: threads launching at once (DDP's, a hook's callbacks) keep one order per launch. Reentrant: a
        # sparse all_reduce launches several.
        self.launch_lock = threading.RLock()

    def _start(self, engine: PushPullEngine, client) -> None:
        """Take the engine `create` made, and its client (the router's first one, with failover)."""
        self._engine, self._client = engine, client
        who = self.rank if self.launch.rank is None else self.launch.rank
        self._timeline = Recorder.create(self.config.trace, client, who, self.name)

    @classmethod
    def create(
        cls,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        name: str = "default",
        config: Config | None = None,
        timeout: float | None = None,
    ) -> Runtime:
        """Meet the other ranks through `store`, connect to (or start) the servers, return the Runtime.

        Example: `rt = Runtime.create(store, rank, world_size); rt.push_pull(grad).wait()`.
        """
        config = config or Config.resolve()
        timeout = timeout or config.connect_timeout
        launch = Launch.from_env()
        topology = _topology(name, rank, world_size, launch)
        _check_backups(config, topology)
        with _REGISTRY_LOCK:
            _MADE[name] += 1
            made = _MADE[name]
        ns = dist.PrefixStore(f"torch_bps/{name}/{launch.attempt}/{made}", rendezvous.raw_store(store))
        job_id = rendezvous.agree_job_id(ns, rank, timeout)
        store_host = rendezvous.store_host(store, launch)
        secret, colocated, dedicated, server_proc = rendezvous.find_servers(
            name, store_host, store, ns, topology, config, timeout, _RUNTIMES.get("default")
        )
        weights = server_weights(colocated, dedicated, config.placement)
        addresses = [s.address for s in weights]
        hierarchical = config.local_reduce and topology.local_size > 1
        worker, num_workers = (topology.node_rank, topology.num_nodes) if hierarchical else (rank, world_size)
        with_dedicated = any(s.dedicated for s in weights)
        failover = config.failover and num_workers > 1 and with_dedicated
        channels = _local_comms(ns, topology, job_id, config, launch.run_id) if hierarchical else None
        rt = cls(name, config, topology, ns, channels, server_proc, addresses, colocated, dedicated, launch,
                 secret=secret, with_dedicated=with_dedicated)  # fmt: skip
        # With failover the engine sends through the Router, which makes and owns its clients (the first one here).
        router = rt._router(weights, worker, num_workers, store_host, job_id, timeout) if failover else None
        client = router.client if router is not None else _client(
            config, addresses, job_id, worker, num_workers, _client_credentials(config, secret, weights),
            connect_timeout=timeout, dedicated=with_dedicated, weights=weights)  # fmt: skip
        engine = PushPullEngine(client, _key_book(weights, config, topology, channels), local_channels=channels,
                                local_rank=topology.local_rank, timeout=config.timeout, router=router,
                                alone=client.num_workers == 1, wire_dtype=wire_dtype(config.wire_dtype),
                                compressor=Compressor(config.compressor) if config.compressor else None)  # fmt: skip
        rt._start(engine, client)
        if rank == 0:
            rendezvous.log_split(name, topology, colocated, dedicated, weights)
        _RUNTIMES[name] = rt
        atexit.register(rt.close)
        return rt

    def _router(self, weights, worker: int, num_workers: int, store_host: str, job_id: int, timeout: float):
        """The failover router of this group's engine (torch_bps/failover.py), with what its agreement needs; it
        makes the job's client of `weights` (job `job_id`) and each failover's."""
        from torch_bps.agreement import Agreement, answering
        from torch_bps.failover import Router

        config, topology = self.config, self.topology
        # In this runtime's namespace, which no later runtime of the group shares (a later one reading these
        # failover/<epoch>/ keys would join a failover of this one's)
        store = dist.PrefixStore("agreement", self._store)

        def make_client(servers, new_job_id, on_link_down, connect_timeout=None):
            credentials = _client_credentials(config, self._secret, servers)
            return _client(config, [s.address for s in servers], new_job_id, worker, num_workers, credentials,
                           connect_timeout or timeout,
                           dedicated=self._with_dedicated, weights=servers, failover=True,
                           on_link_down=on_link_down)  # fmt: skip

        def registry():
            return (
                connect(config.registry, config.failover_timeout)
                if config.registry
                else rendezvous.raw_store(self._store)
            )

        def standby(count: int) -> list[str]:
            used = {s.address for s in weights}
            free = [a for a in config.standby_servers if a not in used][:count]
            if len(free) < count and config.num_servers:
                free += claim_standby(registry(), config.num_servers, used | set(free), count - len(free),
                                      config.standby_wait, f"{job_id:#x}")  # fmt: skip
            return free

        def release(addresses: list[str]) -> None:
            if addresses and config.num_servers:  # as `standby`: only registry claims are given back
                release_standby(registry(), addresses, f"{job_id:#x}")

        def colocated_ahead() -> None:
            if topology.local_rank == 0 and not self._colocated and self._ahead is None:
                host = rendezvous.bind_address(rendezvous.advertised_host(config, store_host))
                self._ahead = rendezvous.EmbeddedServer(config, host, self._secret)

        def start_colocated(prefix: str) -> list[str]:
            proc, addresses = rendezvous.colocated_servers(dist.PrefixStore(prefix, store), topology, config,
                                                           config.failover_timeout, store_host, self._secret,
                                                           self._ahead)  # fmt: skip
            self._ahead = None
            if proc is not None:
                self._fallback_procs.append(proc)
            self._fallback_colocated = addresses
            return addresses

        def available() -> tuple[list[str], list[str]]:
            """The servers a rebalance may place keys on: the colocated ones, and every dedicated one (started with,
            standby, registered) that answers HELLO now."""
            dedicated = list(dict.fromkeys([*self._dedicated, *config.standby_servers]))
            if config.num_servers:
                dedicated += [a for a in registered(registry()) if a not in dedicated]
            dedicated = answering(self._answers, dedicated)
            # Colocated servers a failover started stand in for dedicated ones only while none answers.
            return self._colocated or ([] if dedicated else self._fallback_colocated), dedicated

        def own_keys(every_slice: bool = False) -> dict[int, tuple[int, int]]:
            return self._engine.own_keys(every_slice)  # the engine, made after its router, before any failover

        agreement = Agreement(store, self.rank, self.world_size, config.failover_timeout, config.placement,
                              own_keys, make_client, standby, start_colocated, available, self._answers,
                              hello_timeout=config.heartbeat_timeout, colocated_ahead=colocated_ahead,
                              release=release)  # fmt: skip
        return Router(weights, agreement, self.name, job_id=job_id)

    def _answers(self, address: str) -> bool:
        # A connection first: a HELLO to a server killed or cut off waits its whole timeout (ZeroMQ retries), and a
        # registry collects many such servers.
        if not accepts(address, 1.0):
            log.info("torch_bps[%s]: server %s does not accept a connection", self.name, address)
            return False
        try:
            self.solo_client(address, connect_timeout=2.0).close()
            return True
        except (TransportError, BpsTimeoutError, ServerError) as e:
            log.info("torch_bps[%s]: server %s does not answer: %s", self.name, address, e)
            return False

    def rebalance(self) -> dict | None:
        """See torch_bps.rebalance."""
        return self._engine.router.rebalance() if self._engine.router is not None else None

    def run(self, tensors: list[torch.Tensor], done, *, priority: int = 0, pull_only: bool = False,
            mode: Mode = Mode.SUM) -> None:  # fmt: skip
        """Sum each tensor (1-D, contiguous, CPU) in place over every rank of the group as one collective, then
        call `done(error or None)` on a completion thread (see torch_bps.engine.pipeline; `pull_only` there).
        `mode` Mode.MODEL: add each tensor to its running total on the servers and pull the total back into it
        (asynchronous training: docs/protocol.md)."""

        def finish(error: BaseException | None) -> None:
            if error is not None:
                self._failed = True
                self._explain(error)
            done(error)

        items = tensors if mode == Mode.SUM else [Exchange(t, mode) for t in tensors]
        self._engine.run(items, self._timeline.wrap(tensors, finish), priority=priority, pull_only=pull_only)

    def run_copied(self, tensor: torch.Tensor, copier, done, *, sliced: bool = False, prepare=None) -> None:
        """Sum a device tensor in place one partition at a time through `copier` (device.pinned.PartitionPipeline), then
        `done(error or None)`; see PushPullEngine.run_copied (`sliced`, `prepare`: the device local stage), and
        `cannot_copy` for what it takes."""

        def finish(error: BaseException | None) -> None:
            if error is not None:
                self._failed = True
                self._explain(error)
            done(error)

        self._engine.run_copied(tensor, copier, self._timeline.wrap([tensor], finish), sliced=sliced, prepare=prepare)

    def cannot_copy(self, tensor: torch.Tensor, sliced: bool = False) -> str | None:
        """Why `run_copied` cannot take `tensor` (None: it can)."""
        return self._engine.cannot_copy(tensor, sliced)

    def travels_as(self, tensor: torch.Tensor) -> torch.dtype:
        """The dtype a sum of `tensor` travels in (Config.wire_dtype casts fp32)."""
        return travels_as(tensor, Mode.SUM, self._engine.wire_dtype)

    @property
    def alone(self) -> bool:
        """This machine is the whole job: its local stages make every sum, nothing goes to a server."""
        return self._engine.alone

    def open_device_channels(self, device: torch.device, capacity_bytes: int = 64 << 20):
        """The machine's local ranks' channels on `device` (reduce-scatter, all-gather: device/comm.py), or None:
        one local rank per worker, Config.device_local off, or devices that cannot share memory (the CPU-assisted
        path; the log says which). Collective among the machine's local ranks, each at its first collective on the
        device; closed with the runtime."""
        # Off: no rendezvous at all (every local rank reads the same setting, so none waits for the others).
        if self._local_channels is None or not self.config.device_local:
            return None
        from torch_bps.device.comm import open_local_stage

        t = self.topology
        channels = [open_local_stage(self._store, t.local_rank, t.local_size, f"{t.node_rank}-{stage}", device,
                                     capacity_bytes=capacity_bytes, timeout=self.config.timeout)
                    for stage in ("rs", "ag")]  # fmt: skip
        if None in channels:
            for channel in channels:
                if channel is not None:
                    channel.close()
            return None
        self._device_channels.extend(channels)
        return tuple(channels)

    def post(self, fn) -> None:
        """Run `fn()` on the client's completion pool, which starts another thread when its tasks block: where a
        collective's Future is completed, since its callbacks may wait for a later collective (PowerSGD)."""
        self._client.post(fn)

    def take_behind(self) -> int:
        """Backup workers: how many rounds past one this worker pulled had already closed, since the last call."""
        return self._client.take_behind()

    def push_pull(self, tensor: torch.Tensor, *, priority: int = 0) -> torch.futures.Future:
        """Sum `tensor` (1-D, contiguous, CPU) in place over every rank of the group; the future holds it."""
        future = torch.futures.Future()
        self.run([tensor], completer(future, tensor), priority=priority)
        return future

    @property
    def colocated(self) -> list[str]:
        """Each machine's embedded server ("host:port", by machine), or [] when none runs."""
        return list(self._colocated)

    @property
    def dedicated(self) -> list[str]:
        """The dedicated servers' addresses."""
        return list(self._dedicated)

    def server_stats(self, server: int) -> dict[str, int]:
        """The counters of this group's server `server` (index into `addresses`). Blocks."""
        return self._client.server_stats(server)

    def solo_client(self, address: str, connect_timeout: float | None = None):
        """A client of a one-worker job of its own on one of this group's servers, with this job's credentials:
        it measures the path to that server alone (torch_bps.doctor). Close it after use."""
        config = self.config
        embedded = address in self._colocated or address in self._fallback_colocated
        held = self._secret if embedded else config.pool_credential  # dedicated: started with, standby, registered
        auth = False if config.auth == "off" else ClientCredentials.for_servers(self._secret, [held], config.auth)
        job_id = int.from_bytes(os.urandom(8), "little")
        return _client(config, [address], job_id, 0, 1, auth, connect_timeout, dedicated=self._with_dedicated)

    def _explain(self, error: BaseException) -> None:
        """Say, in the error, which ranks a server's "worker i" is, and whose process an embedded server was."""
        if not hasattr(error, "add_note"):
            return
        if isinstance(error, (ServerError, BpsTimeoutError)):  # the servers' errors name workers by index
            if self._local_channels is not None:
                L, me = self.topology.local_size, self.topology.node_rank
                error.add_note(f"torch_bps[{self.name}]: the servers' worker i is machine i (global ranks "
                               f"i*{L} .. i*{L}+{L - 1}); this is rank {self.rank}, machine {me}")  # fmt: skip
            else:
                error.add_note(f"torch_bps[{self.name}]: the servers' worker i is rank i of this group")
        for node, address in enumerate(self._colocated):
            if isinstance(error, TransportError) and address in str(error):
                error.add_note(f"torch_bps[{self.name}]: server {address} is the embedded server of machine {node}, "
                               "run by its local rank 0: if it is gone, so is probably that rank")  # fmt: skip

    def close(self) -> None:
        """Leave the job. The rank that started an embedded server waits for every rank to leave first."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if _RUNTIMES.get(self.name) is self:
            del _RUNTIMES[self.name]
        try:
            self._store.add("closed", 1)
            # After a failure the job is broken and some ranks may be dead: wait for nobody.
            if (self._server_proc is not None or self._fallback_procs) and not self._failed:
                deadline = time.monotonic() + self.config.connect_timeout
                while self._store.add("closed", 0) < self.world_size and time.monotonic() < deadline:
                    time.sleep(0.05)
        except Exception as e:  # the store's host may be gone already: nothing left to wait for
            log.debug("close of %s: store unavailable (%s)", self.name, e)
        self._engine.close()
        if self._engine.router is not None:
            self._engine.router.close()
        self._timeline.close()
        self._client.close()
        for channel in [*(self._local_channels or ()), *self._device_channels]:
            channel.close()
        for proc in [self._server_proc, *self._fallback_procs, self._ahead and self._ahead.proc]:
            if proc is None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def acquire(name: str, group: dist.ProcessGroup, config: Config | None) -> Runtime:
    """The open Runtime of job namespace `name`, held once more; made (a rendezvous of `group`) if none is held."""
    with _REGISTRY_LOCK:
        named = _NAME_LOCKS.setdefault(name, threading.Lock())
    with named:
        with _REGISTRY_LOCK:
            runtime = _RUNTIMES.get(name)
            if runtime is not None and _HOLDERS.get(name):
                _HOLDERS[name] += 1
                return runtime
        # Any store of the job will do: the Runtime strips torch's prefixes, keeps to its own namespace.
        store = dist.distributed_c10d._get_default_store()
        runtime = Runtime.create(store, group.rank(), group.size(), name=name, config=config)
        with _REGISTRY_LOCK:
            _HOLDERS[name] = 1
        return runtime


def release(name: str, runtime: Runtime) -> None:
    """Let go of one hold `acquire` took; the last one closes the Runtime."""
    with _REGISTRY_LOCK:
        if _RUNTIMES.get(name) is runtime and _HOLDERS.get(name):
            _HOLDERS[name] -= 1
            if _HOLDERS[name]:
                return
            del _HOLDERS[name]
    runtime.close()


def _topology(name: str, rank: int, world_size: int, launch: Launch) -> Topology:
    """The group's machines: torchrun's for the default group (or the whole job's first group), else every rank its
    own machine."""
    whole_job = launch.world_size in (None, world_size)
    if name == "default" or (_RUNTIMES.get("default") is None and whole_job):
        return Topology.from_env(rank, world_size)
    return Topology.one_per_machine(rank, world_size)


def _local_comms(ns: dist.Store, topology: Topology, job_id: int, config: Config, run_id: str):
    """The machine's two shared-memory channels (reduce-scatter, all-gather) among its local ranks."""
    from torch_bps.local import LocalComm

    node = f"{job_id:x}-{topology.node_rank}"
    # 16 MiB each: bigger tensors go through in chunks, and two channels stay well inside a container's default
    # 64 MiB /dev/shm.
    return tuple(
        LocalComm(
            ns,
            topology.local_rank,
            topology.local_size,
            f"{node}-{stage}",
            timeout=config.timeout,
            capacity_bytes=16 << 20,
            job=run_id,
        )
        for stage in ("rs", "ag")
    )


def _check_backups(config: Config, topology: Topology) -> None:
    """Refuse backup workers the job cannot have, before any server starts."""
    b = config.backup_workers
    workers = topology.num_nodes if config.local_reduce and topology.local_size > 1 else topology.world_size
    if b and b >= workers:
        raise ConfigError(f"BPS_BACKUP_WORKERS={b} with {workers} workers: at least one worker must push every round")
    if b and config.failover and (config.servers or config.num_servers):
        raise ConfigError(f"BPS_BACKUP_WORKERS={b} and server failover do not combine yet: set BPS_FAILOVER=0")


def _key_book(weights, config: Config, topology: Topology, local_channels) -> KeyBook:
    """How tensors are cut into keys and placed: one slice per local rank when the machine reduces locally."""
    slices = local_channels[0].slice_range if local_channels is not None else None
    return KeyBook(
        Placement(weights),
        config.partition_bytes,
        (lambda n: [slices(n, i) for i in range(topology.local_size)]) if slices else (lambda n: [(0, n)]),
        min_partition_bytes=config.partition_floor(),
        middle_factor=config.middle_partition_factor,
    )


def _client(config: Config, addresses: list[str], job_id: int, worker: int, num_workers: int, auth,
            connect_timeout: float | None = None, *, dedicated: bool, weights=(), **failover):  # fmt: skip
    """A Client with this config's timeouts, credit and socket buffers: the one place they are passed on.
    `dedicated`: the job's bytes go to dedicated servers (its default credit depends on it). `weights`: the
    servers' placement (engine.placement.Server), which sizes each one's receive buffer by its share."""
    from torch_bps.client import Client  # the C++ extension: imported when first needed

    return Client(addresses, job_id, worker, num_workers, timeout=config.timeout,
                  connect_timeout=connect_timeout or config.connect_timeout,
                  heartbeat_interval=config.heartbeat_interval, heartbeat_timeout=config.heartbeat_timeout, auth=auth,
                  credit_bytes=config.credit(dedicated=dedicated), auto_credit=config.auto_credit,
                  server_credit_bytes=config.server_credit_bytes,
                  socket_buffer_bytes=config.socket_buffer_bytes, **transport_options(config.transport),
                  receive_buffer_bytes=receive_buffers(config.socket_buffer_bytes, weights) if weights else (),
                  backups=config.backup_workers, window=config.backup_window if config.backup_workers else 2,
                  staleness=config.staleness, **failover)  # fmt: skip


def _client_credentials(config: Config, secret: str, weights) -> ClientCredentials | bool:
    """Credentials for the servers in placement order: embedded ones from the job's secret, dedicated ones
    from the pool credential."""
    if config.auth == "off":
        return False
    if any(s.dedicated for s in weights) and not config.pool_credential:
        raise ConfigError(
            "dedicated servers need the pool credential their operator gave them: set BPS_POOL_CREDENTIAL "
            "(or BPS_AUTH=off if they run with --auth off, on a trusted network)"
        )
    held = [config.pool_credential if s.dedicated else secret for s in weights]
    return ClientCredentials.for_servers(secret, held, config.auth)
