"""One place for configuration: environment variables and keywords resolved once into a dataclass.

Keywords win over environment variables, which win over defaults. Every BPS_* variable a worker reads is listed
in `Config`'s fields below and read here only; resolve with `Config.resolve(**keywords)` and pass the result
explicitly. What runs without a resolved Config (a bare `Client`) reads single fields with `from_environment`.
May import: the standard library, torch_bps.address and torch_bps.errors only.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from torch_bps.address import split_host_port
from torch_bps.errors import ConfigError

# Where the credit of bytes in flight per worker starts (the C++ client schedules within it and, unless
# BPS_CREDIT_BYTES fixes it, sizes it from its acknowledged pushes: cpp_ext/client/credit_sizer.h). It must keep the
# uplink busy, and each step pays for it once: a step's first sums come back after about credit / link rate. No
# fixed size serves every link, which is why the client sizes it; 2 MiB keeps a fast link busy from the start.
DEFAULT_CREDIT_BYTES = 2 << 20
# The smallest partition (torch_bps.engine.partition.KeyBook.partition_size says how it was chosen), unless
# socket buffers are set (Config.partition_floor).
DEFAULT_MIN_PARTITION_BYTES = 128 << 10
# The floor's floor when the socket buffers set it: under this, messages cost more CPU than fill and drain.
SMALLEST_PARTITION_BYTES = 16 << 10


def default_credit_bytes(middle_partition_factor: int, dedicated: bool) -> int:
    """Return the credit when BPS_CREDIT_BYTES is not set: DEFAULT_CREDIT_BYTES, times the middle factor when the
    job's bytes go to dedicated servers.

    Why: the credit is counted in bytes but buys whole partitions in flight; F times bigger middle partitions
    in the same 2 MiB leave each dedicated server with F times fewer pushes queued, and it idles between them.
    With colocated servers only, a bigger credit does not shorten the step on the emulated cluster.

    Example: default_credit_bytes(2, dedicated=True) == 4 << 20; default_credit_bytes(2, dedicated=False) == 2 << 20
    """
    return DEFAULT_CREDIT_BYTES * (middle_partition_factor if dedicated else 1)


def _parse_servers(value: str) -> tuple[str, ...]:
    servers = tuple(s.strip() for s in value.split(",") if s.strip())
    for s in servers:
        _check_address(s, "BPS_SERVERS")
    return servers


def _check_address(value: str, name: str) -> None:
    try:
        split_host_port(value)
    except ValueError as e:
        raise ConfigError(f"{e} ({name})") from None


# tcp: the stream, but never a server's local one (a unix socket); unix: the local one without its shared memory
TRANSPORTS = ("zmq", "stream", "tcp", "unix")
DEFAULT_TRANSPORT = "stream"


def parse_transport(value: str) -> str:
    """Return a transport name (BPS_TRANSPORT), checked: ConfigError naming it if it is not one of TRANSPORTS."""
    if value not in TRANSPORTS:
        raise ConfigError(f"transport {value!r} is unknown: use stream (the default), tcp, unix or zmq")
    return value


def transport_options(transport: str) -> dict[str, bool]:
    """The Client keywords a transport name stands for: stream, local_stream, shared_memory."""
    return {
        "stream": transport != "zmq",
        "local_stream": transport in ("stream", "unix"),
        "shared_memory": transport == "stream",
    }


# The dtype fp32 sums travel in (Config.wire_dtype): "fp32" sends every tensor as its own dtype.
WIRE_DTYPES = ("fp32", "bf16", "fp16")


def parse_wire_dtype(value: str) -> str:
    """Return a wire dtype name (BPS_WIRE_DTYPE), checked: ConfigError if it is not one of WIRE_DTYPES."""
    if value not in WIRE_DTYPES:
        raise ConfigError(f"wire dtype {value!r} is unknown: use fp32 (the default: each tensor's own), bf16 or fp16")
    return value


def _parse_staleness(value: str) -> int | None:
    if value.lower() in ("inf", "none", "async"):
        return None
    return int(value)


def parse_compressor(value: str) -> str:
    """Return a compressor spec (BPS_COMPRESSOR), checked: "", "onebit", "topk:RATIO" or "randomk:RATIO"."""
    name, _, ratio = value.partition(":")
    try:
        ok = value == "" or (name == "onebit" and not ratio) or (name in ("topk", "randomk") and 0 < float(ratio) <= 1)
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"compressor {value!r} is unknown: use onebit, topk:RATIO or randomk:RATIO, 0 < RATIO <= 1")
    return value


def _parse_names(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _parse_auth(value: str) -> str:
    if value not in ("token", "curve", "off"):
        raise ValueError("use token (the default), curve or off")
    return value


def _parse_bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean (1/0, true/false)")


@dataclass(frozen=True)
class Config:
    """Settings of a worker. Field -> environment variable: upper-case with the BPS_ prefix."""

    servers: tuple[str, ...] = field(default=(), metadata={"env": "BPS_SERVERS", "parse": _parse_servers})
    # A request with no reply within this many seconds fails, naming server, key and round; a sum still
    # waiting then for workers that have not pushed fails naming them (a stalled rank).
    timeout: float = field(default=300.0, metadata={"env": "BPS_TIMEOUT", "parse": float})
    # A peer (server, or a worker as seen by a server) silent this long after a heartbeat counts as lost:
    # stopped, hung in the kernel, or cut off. A killed process closes its connections and is known at once.
    heartbeat_timeout: float = field(default=10.0, metadata={"env": "BPS_HEARTBEAT_TIMEOUT", "parse": float})
    heartbeat_interval: float = field(default=1.0, metadata={"env": "BPS_HEARTBEAT_INTERVAL", "parse": float})
    # How long to wait for every server to answer HELLO.
    connect_timeout: float = field(default=30.0, metadata={"env": "BPS_CONNECT_TIMEOUT", "parse": float})
    # Dedicated servers may instead register themselves in the job's store (`bps-server --register`):
    # workers then wait for this many registrations.
    num_servers: int = field(default=0, metadata={"env": "BPS_NUM_SERVERS", "parse": int})
    # Where those registrations are: "host:port" of a TCPStore both the workers and `bps-server --register`
    # reach. Empty: the job's own store (MASTER_ADDR:MASTER_PORT), which a server can only find under a
    # static rendezvous; under torchrun's c10d rendezvous give the rendezvous endpoint to both sides.
    registry: str = field(default="", metadata={"env": "BPS_REGISTRY", "parse": str})
    # "optimal" (the paper's split between dedicated and colocated servers), "dedicated" or "colocated".
    placement: str = field(default="optimal", metadata={"env": "BPS_PLACEMENT", "parse": str})
    partition_bytes: int = field(default=4_096_000, metadata={"env": "BPS_PARTITION_BYTES", "parse": int})
    # Tensors are cut finer than partition_bytes so every server gets many partitions (the pipeline fills
    # and drains sooner), but never below this: each message costs CPU (torch_bps.engine.partition).
    # 0: partition_floor() chooses.
    min_partition_bytes: int = field(default=0, metadata={"env": "BPS_MIN_PARTITION_BYTES", "parse": int})
    # A tensor's middle partitions are this many times the size of its first and last ones (up to
    # partition_bytes): fewer messages, the same fill and drain (torch_bps.engine.partition). 1: all one size.
    middle_partition_factor: int = field(default=1, metadata={"env": "BPS_MIDDLE_PARTITION_FACTOR", "parse": int})
    # Bytes of pushes in flight (not yet acknowledged); the rest wait in priority order. 0: sized by the client
    # from its pushes (auto_credit), starting at default_credit_bytes(middle_partition_factor, dedicated).
    credit_bytes: int = field(default=0, metadata={"env": "BPS_CREDIT_BYTES", "parse": int})
    # Bytes of pushes in flight toward any one server; 0: no limit but credit_bytes.
    server_credit_bytes: int = field(default=0, metadata={"env": "BPS_SERVER_CREDIT_BYTES", "parse": int})
    # SO_SNDBUF / SO_RCVBUF of each worker -> server connection: they bound that connection's bytes in flight
    # both ways, and so what n connections can pile into one link's queue. 0: the kernel's autotuned buffers.
    socket_buffer_bytes: int = field(default=0, metadata={"env": "BPS_SOCKET_BUFFER_BYTES", "parse": int})
    # "stream": beside each ZeroMQ connection, a plain TCP stream the server offers (auth token or off, never
    # curve) carries the requests, read and written by the client's IO thread itself: no hand-off to ZeroMQ's own
    # I/O thread and no wake-up per message (docs/protocol.md, "The stream transport"). A server that offers none
    # is reached over ZeroMQ; a server on this machine over its local stream, a unix socket (no TCP stack on the
    # bytes a colocated server sums) whose big frames go through shared memory (cpp_ext/transport/shared_ring.h).
    # "unix": the local stream without shared memory. "tcp": the stream, never the local one. "zmq": ZeroMQ only.
    transport: str = field(default=DEFAULT_TRANSPORT, metadata={"env": "BPS_TRANSPORT", "parse": parse_transport})
    # What fp32 tensors summed through the servers travel as: "bf16" or "fp16" halve the bytes on every worker link;
    # the servers add 16-bit pushes in fp32 and round once, and every worker applies the same rounded sum
    # (torch_bps/engine/precision.py). "fp32": every tensor as its own dtype. Gathers and integers are never cast.
    wire_dtype: str = field(default="fp32", metadata={"env": "BPS_WIRE_DTYPE", "parse": parse_wire_dtype})
    # Gradient compression with error feedback on both sides (torch_bps/engine/compress.py, docs/protocol.md
    # "Compressed keys"): "onebit", "topk:RATIO" or "randomk:RATIO"; "" none. Lossy, so it applies only to the DDP
    # buckets bps_hook sends (any group, "byteps" included), never to a plain collective.
    compressor: str = field(default="", metadata={"env": "BPS_COMPRESSOR", "parse": parse_compressor})
    # Gradients smaller than this (biases, norms) stay uncompressed: a codec's fixed costs outweigh its savings there.
    compress_min_bytes: int = field(default=65536, metadata={"env": "BPS_COMPRESS_MIN_BYTES", "parse": int})
    # Parameters whose name contains one of these (comma-separated) stay uncompressed (names known to
    # BpsHookState(module=...)).
    compress_exclude: tuple[str, ...] = field(default=(), metadata={"env": "BPS_COMPRESS_EXCLUDE",
                                                                    "parse": _parse_names})  # fmt: skip
    # Reduce among a machine's local ranks before the network (one push per machine).
    local_reduce: bool = field(default=True, metadata={"env": "BPS_LOCAL_REDUCE", "parse": _parse_bool})
    # CUDA tensors with several local ranks sum among them on the device (device/paths.py) when the devices can map
    # each other's memory. Off: they take the host path (staged whole, summed by the host local stages), as when
    # CUDA IPC is refused; one GPU then proves both paths, and a user can step around the device stage.
    device_local: bool = field(default=True, metadata={"env": "BPS_DEVICE_LOCAL", "parse": _parse_bool})
    # The address other machines reach this one's embedded server at; default: the interface that
    # routes to MASTER_ADDR.
    host: str = field(default="", metadata={"env": "BPS_HOST", "parse": str})
    # "token": only workers that prove the job's secret (or the pool credential) get in, not encrypted;
    # "curve": the same, and every connection encrypted (CurveZMQ; for networks you do not control);
    # "off": plain connections anyone who reaches a server's port can use. See torch_bps/security.py.
    auth: str = field(default="token", metadata={"env": "BPS_AUTH", "parse": _parse_auth})
    # The secret a pool of dedicated servers was given by its operator (bps-server's BPS_POOL_CREDENTIAL):
    # needed to use dedicated servers with auth on. Embedded servers need none: their job's secret comes
    # from the rendezvous store.
    pool_credential: str = field(default="", repr=False, metadata={"env": "BPS_POOL_CREDENTIAL", "parse": str})
    # "DIR" or "DIR,START:END": a timeline of collectives START..END-1 (default 0..49) into DIR, one Chrome-trace
    # file per worker and per embedded server (torch_bps/timeline/recorder.py). Empty: none.
    trace: str = field(default="", metadata={"env": "BPS_TRACE", "parse": str})

    # A lost dedicated server is failed over (torch_bps/failover.py): its keys move to a standby server, else to
    # the servers that remain, else to colocated ones (each machine's started at the job's first failover, idle till
    # then), and training goes on. Off: it fails the collective.
    failover: bool = field(default=True, metadata={"env": "BPS_FAILOVER", "parse": _parse_bool})
    # How long each step of a failover's agreement waits for every rank (a rank silent that long is lost).
    failover_timeout: float = field(default=60.0, metadata={"env": "BPS_FAILOVER_TIMEOUT", "parse": float})
    # Standby servers for failover, besides those registered beyond BPS_NUM_SERVERS.
    standby_servers: tuple[str, ...] = field(
        default=(), metadata={"env": "BPS_STANDBY_SERVERS", "parse": _parse_servers}
    )
    # How long a failover waits for a standby server to register when none is free (0: take what remains).
    standby_wait: float = field(default=0.0, metadata={"env": "BPS_STANDBY_WAIT", "parse": float})
    # Backup workers b (torch_bps.backup.BackupWorkers): a gradient round closes once n - b workers pushed it, and
    # the rest are dropped; a worker up to backup_window - 1 rounds behind catches up by pulling what it missed.
    backup_workers: int = field(default=0, metadata={"env": "BPS_BACKUP_WORKERS", "parse": int})
    backup_window: int = field(default=4, metadata={"env": "BPS_BACKUP_WINDOW", "parse": int})
    # Asynchronous training (torch_bps.asynchronous.AsyncTraining): a worker's pull waits until every worker pushed
    # the round `staleness` rounds before its own; None ("inf"): it never waits for the others.
    staleness: int | None = field(default=0, metadata={"env": "BPS_STALENESS", "parse": _parse_staleness})

    def partition_floor(self) -> int:
        """Return the smallest partition: min_partition_bytes if set; else DEFAULT_MIN_PARTITION_BYTES, or the socket
        buffer if one is set and smaller (not under SMALLEST_PARTITION_BYTES).

        Why: socket buffers are set where a link's queue is small for its connections (about queue /
        (3 x connections)), and there the partitions' size paces the step: each worker's credit keeps a partition
        in flight toward every server, so partitions no bigger than the buffer keep the bytes in flight within
        what the queue holds, at the price of more messages (more CPU). A floor near the buffer's size is where
        that trade paid on the emulated cluster (docs/benchmarks.md). With the kernel's buffers nothing changes: on
        fast links messages cost more than fill and drain.
        """
        if self.min_partition_bytes:
            return self.min_partition_bytes
        if self.socket_buffer_bytes:
            return max(SMALLEST_PARTITION_BYTES, min(DEFAULT_MIN_PARTITION_BYTES, self.socket_buffer_bytes))
        return DEFAULT_MIN_PARTITION_BYTES

    def credit(self, *, dedicated: bool) -> int:
        """Return the credit of bytes in flight per worker: credit_bytes, else the default for this cut and servers.

        Args:
            dedicated: the job places bytes on dedicated servers (k > 0), not only on colocated ones.
        """
        return self.credit_bytes or default_credit_bytes(self.middle_partition_factor, dedicated)

    @property
    def auto_credit(self) -> bool:
        """The client sizes the credit itself (BPS_CREDIT_BYTES unset): `credit()` is where it starts."""
        return self.credit_bytes == 0

    @classmethod
    def resolve(cls, **keywords) -> Config:
        """Build a Config from keywords, then BPS_* environment variables, then defaults.

        Example: `Config.resolve(servers=("10.0.0.5:9000",), timeout=60)`.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(keywords) - names
        if unknown:
            raise ConfigError(f"unknown torch_bps setting(s): {sorted(unknown)}; known: {sorted(names)}")
        values = {}
        for f in dataclasses.fields(cls):
            value = keywords.get(f.name)
            if value is not None:
                if f.name == "compress_exclude" and isinstance(value, str):
                    value = _parse_names(value)
                if f.name in ("servers", "standby_servers"):
                    value = _parse_servers(value) if isinstance(value, str) else _parse_servers(",".join(value))
                values[f.name] = value
            else:
                values[f.name] = _from_environment(f)
        config = cls(**values)
        config._check()
        return config

    def _check(self) -> None:
        timeouts = (self.timeout, self.connect_timeout, self.heartbeat_timeout, self.heartbeat_interval,
                    self.failover_timeout)  # fmt: skip
        if not all(t > 0 for t in timeouts):
            raise ConfigError(
                f"timeouts must be positive (timeout={self.timeout}, connect={self.connect_timeout}, heartbeat "
                f"interval={self.heartbeat_interval}, heartbeat timeout={self.heartbeat_timeout})"
            )
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ConfigError(
                f"heartbeat_interval={self.heartbeat_interval} must be below heartbeat_timeout={self.heartbeat_timeout}"
            )
        if self.partition_bytes < 64 or self.min_partition_bytes < 0 or 0 < self.min_partition_bytes < 64:
            raise ConfigError(
                f"partition_bytes={self.partition_bytes}, min_partition_bytes={self.min_partition_bytes}: at least 64 "
                "(min_partition_bytes 0: chosen by partition_floor())"
            )
        if self.middle_partition_factor < 1:
            raise ConfigError(f"middle_partition_factor={self.middle_partition_factor}: at least 1 (1: one size)")
        if self.credit_bytes < 0:
            raise ConfigError(f"credit_bytes={self.credit_bytes} must be positive (or 0: the default)")
        if self.server_credit_bytes < 0 or not 0 <= self.socket_buffer_bytes < 1 << 31:
            raise ConfigError(
                f"server_credit_bytes={self.server_credit_bytes}, socket_buffer_bytes={self.socket_buffer_bytes}: "
                "use 0 (no limit, the kernel's buffers) or a positive byte count"
            )
        if self.placement not in ("optimal", "dedicated", "colocated"):
            raise ConfigError(f"placement={self.placement!r}: use optimal, dedicated or colocated")
        parse_transport(self.transport)
        parse_compressor(self.compressor)
        if self.wire_dtype not in WIRE_DTYPES:
            raise ConfigError(f"wire_dtype={self.wire_dtype!r}: use fp32 (the default), bf16 or fp16")
        if self.auth not in ("token", "curve", "off"):
            raise ConfigError(f"auth={self.auth!r}: use token (the default), curve or off")
        if self.registry:
            _check_address(self.registry, "BPS_REGISTRY")
        if not self.standby_wait >= 0:
            raise ConfigError(f"standby_wait={self.standby_wait} must not be negative")
        if self.num_servers < 0:
            raise ConfigError(f"num_servers={self.num_servers} must not be negative")
        if self.backup_workers < 0 or not 2 <= self.backup_window <= 64:
            raise ConfigError(f"backup_workers={self.backup_workers} must not be negative and backup_window="
                              f"{self.backup_window} must be in [2, 64] (BPS_BACKUP_WORKERS, "
                              "BPS_BACKUP_WINDOW)")  # fmt: skip
        if self.staleness is not None and self.staleness < 0:
            raise ConfigError(f"staleness={self.staleness} must not be negative (BPS_STALENESS; inf: asynchronous)")
        if self.staleness != 0 and self.backup_workers:
            raise ConfigError(f"backup_workers={self.backup_workers} and staleness={self.staleness}: a job has one or "
                              "the other (BPS_BACKUP_WORKERS, BPS_STALENESS)")  # fmt: skip


def from_environment(name: str):
    """Return Config's field `name` as its BPS_* variable sets it (parsed as `Config.resolve` parses it), else the
    field's default. For what runs without a resolved Config: a bare `Client`, a test's raw peer.

    Example: `from_environment("transport")` is "stream" unless BPS_TRANSPORT says otherwise.
    """
    return _from_environment(_FIELDS[name])


def _from_environment(f: dataclasses.Field):
    raw = os.environ.get(f.metadata["env"])
    if raw is None or raw == "":
        return f.default  # every field has a plain default
    try:
        return f.metadata["parse"](raw)
    except (ValueError, ConfigError) as e:
        raise ConfigError(f"{f.metadata['env']}={raw!r}: {e}") from None


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
