"""`bps-server` / `python -m torch_bps.server`: run one summation server until SIGINT, or SIGTERM, which drains it.

This is the server's one configuration point: its settings are the options below, whose defaults come from
environment variables (BPS_SERVER_*, BPS_AUTH...) read here only, through `_env`; so does the pool credential
(BPS_POOL_CREDENTIAL, or --credential-file), which never goes on the command line. The workers' settings are
`torch_bps.config.Config`'s.

May import: the standard library, torch, torch_bps.address, torch_bps.registry, torch_bps.security and torch_bps.server.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time

import torch

from torch_bps.address import listening_line, split_host_port
from torch_bps.security import JOB_SECRET_ENV
from torch_bps.server.auth import ServerSecurity
from torch_bps.server.limits import Limits
from torch_bps.server.metrics import MetricsEndpoint, NotReady, exposition, format_stats, query_stats
from torch_bps.server.server import SummationServer

_PROBE_S = 2.0  # how long a probe waits for the loop thread: under the probes' timeoutSeconds (deploy/k8s)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bps-server",
        description="torch_bps summation server: workers push gradient partitions, pull back the sums.",
    )
    p.add_argument(
        "--host",
        "--bind",
        dest="host",
        default=_env("BPS_SERVER_HOST"),
        help="address to listen on, required: the interface workers reach this server at (0.0.0.0: every "
        "interface); env BPS_SERVER_HOST",
    )
    _option(p, "--port", "BPS_SERVER_PORT", int, 9000, "TCP port; 0 picks a free one")
    p.add_argument(
        "--log-level",
        default=_env("BPS_LOG_LEVEL", "WARNING"),
        help="DEBUG, INFO, WARNING... (default %(default)s)",
    )
    p.add_argument(
        "--register",
        metavar="HOST:PORT",
        default=_env("BPS_REGISTER"),
        help="register this server in the TCPStore at HOST:PORT, where workers with BPS_NUM_SERVERS=k wait for k "
        "registrations: the workers' BPS_REGISTRY (under torchrun's c10d rendezvous: its --rdzv-endpoint), or their "
        "MASTER_ADDR:MASTER_PORT under a static rendezvous. Waits for that store to listen; env BPS_REGISTER",
    )
    p.add_argument(
        "--leave-with-store",
        action="store_true",
        help="with --register: drain and exit once the store stops listening (the job it belongs to ended), for "
        "servers started with one job (TorchX, a JobSet)",
    )
    p.add_argument(
        "--advertise",
        default=None,
        help="address workers reach this server at (default: --host, or this machine's name)",
    )
    _option(p, "--heartbeat-timeout", "BPS_HEARTBEAT_TIMEOUT", float, 10.0,
            "seconds a worker may stay silent after a heartbeat before it counts as lost")  # fmt: skip
    _option(p, "--heartbeat-interval", "BPS_HEARTBEAT_INTERVAL", float, 1.0, "seconds between heartbeats")
    _option(p, "--receive-buffer-bytes", "BPS_SERVER_RECEIVE_BUFFER_BYTES", int, 0,
            "SO_RCVBUF of each worker's stream, which bounds the pushes in flight toward this server; give a "
            "server its share of the workers' BPS_SOCKET_BUFFER_BYTES (engine.placement.receive_buffers; 0: the "
            "kernel's)")  # fmt: skip
    _option(p, "--drain-timeout", "BPS_SERVER_DRAIN_TIMEOUT", float, 20.0,
            "on SIGTERM, take no new job and stop once no round is in flight, or after this many seconds (the jobs "
            "fail over to the servers that remain; see server/drain.py); SIGINT stops at once")  # fmt: skip
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="exit when the process that started this server is gone; SIGTERM then stops it at once (no drain)",
    )
    auth = p.add_argument_group("authentication (see torch_bps/server/auth.py)")
    auth.add_argument(
        "--auth",
        choices=("token", "curve", "off"),
        default=_env("BPS_AUTH", "token"),
        help="token: only workers that prove they hold the pool credential get in, connections not encrypted; "
        "curve: the same, every connection encrypted (networks you do not control); off: anyone who reaches "
        "the port (a trusted network only). Env BPS_AUTH (default %(default)s)",
    )
    auth.add_argument(
        "--stream",
        choices=("on", "off"),
        default=_env("BPS_SERVER_STREAM", "on"),
        help="on: also listen for the stream transport on a second, free port, offered to workers in the HELLO "
        "reply (never under curve: streams are not encrypted); off: ZeroMQ only. Env BPS_SERVER_STREAM "
        "(default %(default)s)",
    )
    auth.add_argument(
        "--credential-file",
        metavar="PATH",
        help="file holding the pool credential (default: env BPS_POOL_CREDENTIAL); give jobs the same one",
    )
    see = p.add_argument_group("timeline and counters (see torch_bps/server/timeline.py and metrics.py)")
    see.add_argument("--trace", metavar="DIR", default=_env("BPS_SERVER_TRACE"),
                     help="record sums and queue depth into DIR/server-HOST-PORT.json (Chrome-trace JSON; merge with "
                     "the workers' files: python -m torch_bps.timeline DIR); env BPS_SERVER_TRACE")  # fmt: skip
    _option(see, "--trace-events", "BPS_SERVER_TRACE_EVENTS", int, 500_000, "events recorded at most")
    see.add_argument("--metrics-port", type=int, default=None,
                     help="serve the counters in Prometheus text format at http://METRICS_HOST:PORT/metrics (0: a free "
                     "port, printed), and the probes /healthz (the loop answers) and /readyz (it takes new jobs: "
                     "not while draining); not authenticated: it shows job ids and their byte counts")  # fmt: skip
    see.add_argument("--metrics-host", default=None, help="address the metrics port listens on (default: --host)")
    see.add_argument("--stats", metavar="HOST:PORT",
                     help="print the counters of the running server at HOST:PORT (STATS) and exit; with --auth and the "
                     "pool credential it was started with")  # fmt: skip
    see.add_argument("--stats-timeout", type=_seconds, default=10.0, metavar="SECONDS",
                     help="how long --stats waits for the server's answer (default 10)")  # fmt: skip
    limits = p.add_argument_group("memory limits (see torch_bps/server/limits.py)")
    _option(limits, "--max-frame-bytes", "BPS_SERVER_MAX_FRAME_BYTES", int, Limits.max_frame_bytes,
            "largest frame read from a peer; a bigger one drops its connection unread; must cover the workers' "
            "BPS_PARTITION_BYTES")  # fmt: skip
    _option(limits, "--max-memory-bytes", "BPS_SERVER_MAX_MEMORY_BYTES", int, 0,
            "what all jobs together may make this server hold (0: half the machine's memory)")  # fmt: skip
    _option(limits, "--job-quota-bytes", "BPS_SERVER_JOB_QUOTA_BYTES", int, 0,
            "what one job may make this server hold (0: --max-memory-bytes)")  # fmt: skip
    _option(limits, "--job-lease", "BPS_SERVER_JOB_LEASE", float, Limits.job_lease_seconds,
            "seconds without a request after which a job is forgotten")  # fmt: skip
    _option(limits, "--lost-job-lease", "BPS_SERVER_LOST_JOB_LEASE", float, Limits.lost_job_seconds,
            "seconds without a request after which a job whose workers are all lost is forgotten")  # fmt: skip
    p.set_defaults(pool_credential=_env("BPS_POOL_CREDENTIAL", ""))  # never an option: the command line is public
    args = p.parse_args(argv)
    if args.stats:
        return args
    if not args.host:
        p.error("give the address to listen on: --host ADDRESS (0.0.0.0 for every interface) or BPS_SERVER_HOST")
    if not 0 < args.heartbeat_interval < args.heartbeat_timeout:
        p.error("need 0 < --heartbeat-interval < --heartbeat-timeout")
    if not 0 <= args.port < 65536:
        p.error(f"--port {args.port} is not a TCP port")
    if args.leave_with_store and not args.register:
        p.error("--leave-with-store needs --register HOST:PORT (the store to watch)")
    if not args.drain_timeout >= 0:
        p.error(f"--drain-timeout {args.drain_timeout} must not be negative")
    if not 0 <= args.receive_buffer_bytes < 1 << 31:
        p.error(f"--receive-buffer-bytes {args.receive_buffer_bytes} is not in [0, 2^31) (0: the kernel's)")
    try:
        args.security = _security(args)
    except (OSError, ValueError) as e:
        p.error(str(e))
    args.limits = Limits(args.max_frame_bytes, args.max_memory_bytes, args.job_quota_bytes, args.job_lease,
                         lost_job_seconds=args.lost_job_lease)  # fmt: skip
    try:
        args.limits.check()
    except ValueError as e:
        p.error(str(e))
    return args


def _security(args: argparse.Namespace) -> ServerSecurity | None:
    """The server's authentication: an embedded server's job secret (from its parent, by environment),
    else the pool credential; never a secret on the command line, where every user of the machine sees it."""
    job_secret = os.environ.pop(JOB_SECRET_ENV, "")
    if args.auth == "off":
        return None
    if job_secret:
        return ServerSecurity.for_job(job_secret, args.auth)
    credential = _credential(args)
    if not credential:
        raise ValueError(
            "authentication is on and no credential was given: set BPS_POOL_CREDENTIAL (or --credential-file) to "
            "the pool credential the jobs also get (`python -m torch_bps.security` prints a new one), or --auth off "
            "on a trusted network"
        )
    return ServerSecurity.for_pool(credential, args.auth)


def _credential(args: argparse.Namespace) -> str:
    """The pool credential: --credential-file's, else BPS_POOL_CREDENTIAL's, else ""."""
    if not args.credential_file:
        return args.pool_credential
    with open(args.credential_file) as f:
        credential = f.read().strip()
    if not credential:
        raise ValueError(f"--credential-file {args.credential_file} is empty")
    return credential


def _print_stats(args: argparse.Namespace) -> int:
    """`bps-server --stats HOST:PORT`: print a running server's counters."""
    try:
        stats = query_stats(args.stats, credential=_credential(args), mechanism=args.auth, timeout=args.stats_timeout)
    except (OSError, ValueError, RuntimeError) as e:  # TimeoutError is an OSError
        print(f"bps-server --stats {args.stats}: {e}", file=sys.stderr)
        return 1
    print(format_stats(args.stats, stats), flush=True)
    return 0


def _seconds(text: str) -> float:
    """A positive number of seconds up to a day: a wait of 0 or less would not wait, or, to ZeroMQ, wait forever,
    and an infinite or huge one overflows ZeroMQ's poll."""
    value = float(text)
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds up to a day (86400), got {text!r}")
    return value


def _env(name: str, default: str | None = None) -> str | None:
    """Return environment variable `name`, or `default` if it is unset: the one place the server reads settings
    from the environment (an embedded server's job secret is handed over apart, by `_security`)."""
    return os.environ.get(name, default)


def _option(group, flag: str, env: str, kind, default, text: str) -> None:
    """Add a numeric option whose default comes from environment variable `env`, else `default`."""
    raw = _env(env)
    group.add_argument(flag, type=kind, default=kind(raw) if raw else default,
                       help=f"{text} (env {env}; default %(default)s)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s bps-server %(levelname)s %(message)s")
    if args.stats:
        return _print_stats(args)
    # fp16 and bf16 are summed by torch's kernels on the loop thread: one thread, no pool to wake per add.
    torch.set_num_threads(1)
    _keep_freed_memory()
    try:
        server = SummationServer(
            args.host,
            args.port,
            heartbeat_interval=args.heartbeat_interval,
            heartbeat_timeout=args.heartbeat_timeout,
            limits=args.limits,
            security=args.security,
            stream=args.stream == "on",
            receive_buffer_bytes=args.receive_buffer_bytes,
        )
    except Exception as e:  # e.g. the port is taken: say which
        print(f"bps-server: cannot listen on tcp://{args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    # A server embedded in a job (--exit-with-parent) has nobody to hand its job to: SIGTERM stops it at once.
    on_term = server.stop if args.exit_with_parent else lambda: server.drain(args.drain_timeout)
    signal.signal(signal.SIGTERM, lambda *_: on_term())
    metrics = None
    if args.metrics_port is not None:
        metrics = _serve_metrics(server, args.metrics_host or args.host, args.metrics_port)
        if metrics is None:
            return 1
    if args.trace:
        server.record_timeline(args.trace, args.trace_events)
    print(listening_line(server.address, server.port, server.incarnation), flush=True)  # what launchers wait for
    if metrics is not None:
        print(f"bps-server metrics at http://{metrics.host}:{metrics.port}/metrics", flush=True)
    if args.register:
        advertise = args.advertise or (args.host if args.host not in ("0.0.0.0", "") else socket.getfqdn())
        try:
            register(args.register, f"{advertise}:{server.port}")
        except Exception as e:
            print(f"bps-server: cannot register in the store at {args.register}: {e}", file=sys.stderr)
            server.stop()
        if args.leave_with_store:
            _leave_with_store(server, args.register, args.drain_timeout)
    server.serve_forever(parent_pid=os.getppid() if args.exit_with_parent else None)
    if metrics is not None:
        metrics.stop()
    return 0


def _serve_metrics(server: SummationServer, host: str, port: int) -> MetricsEndpoint | None:
    """Start the /metrics endpoint and the probes; None (said on stderr) if it cannot listen.

    /healthz: 200 once the loop thread runs a call within _PROBE_S (a live server, draining or not); /readyz: the
    same, and 503 while it drains (it takes no new job), so that a Service stops offering it."""

    def ready() -> str:
        if not server.accepting:
            raise NotReady(f"server {server.address} is draining: it takes no new job")
        return "ready\n"

    probes = {"/healthz": lambda: server.on_loop(lambda: "ok\n", _PROBE_S),
              "/readyz": lambda: server.on_loop(ready, _PROBE_S)}  # fmt: skip
    try:
        metrics = MetricsEndpoint(
            host, port, lambda: server.on_loop(lambda: exposition(server.counters(), server.job_counters())), probes
        )
    except OSError as e:
        print(f"bps-server: cannot serve metrics on {host}:{port}: {e}", file=sys.stderr)
        return None
    metrics.start()
    return metrics


def _leave_with_store(server: SummationServer, address: str, drain_timeout: float, interval: float = 2.0) -> None:
    """Drain `server` once the store at `address` refuses connections three times in a row (from a thread)."""
    host, port = split_host_port(address)

    def watch() -> None:
        misses = 0
        while misses < 3:
            time.sleep(interval)
            try:
                socket.create_connection((host, port), timeout=interval).close()
                misses = 0
            except OSError:
                misses += 1
        logging.getLogger("torch_bps.server").info("the store at %s stopped listening: draining", address)
        server.drain(drain_timeout)

    threading.Thread(target=watch, name="bps-store-watch", daemon=True).start()


def _keep_freed_memory() -> None:
    """Make glibc reuse freed big blocks instead of unmapping them (M_MMAP_MAX=0, M_TRIM_THRESHOLD high).

    Every push arrives in a buffer ZeroMQ mallocs; past 32 MiB glibc maps each one afresh, and touching
    new pages costs more than the summation itself.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except OSError:  # not glibc: keep the defaults
        pass


def register(store_address: str, my_address: str, timeout: float = 300.0) -> None:
    """Append my_address to the list of dedicated servers in the store at store_address (see torch_bps.registry)."""
    from torch_bps.registry import connect, register_server

    register_server(connect(store_address, timeout), my_address)
