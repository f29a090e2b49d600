"""The emulated cluster: n worker hosts and k server hosts, each a network namespace, joined to one bridge.

    bps-w0-<id> [bps0 10.77.0.1]--veth--[bps-w0]\
    bps-w1-<id> [bps0 10.77.0.2]--veth--[bps-w1]-- bps-br (a bridge inside namespace bps-br-<id>)
    bps-s0-<id> [bps0 10.77.0.101]-veth--[bps-s0]/

The bridge lives in a namespace of its own and every veth is created inside our namespaces, so the
root namespace (the machine's real interfaces, routes, firewall) is never touched and the private
subnet exists only inside the run. Each link is shaped with tc tbf in both directions (host egress on
`bps0`, bridge egress on the host's port) to the same rate, like a full-duplex NIC. Each host may be given
its own TCP congestion control (a namespace's own sysctl): the machine's default may not be a datacenter's.

`Cluster` is a context manager; leaving it by any path (exception, Ctrl-C, SIGTERM, SIGHUP, interpreter
exit) kills the processes it started and deletes every namespace it created. `calibrate` measures one shaped link.
May import: the standard library, benchmarks.cluster (its errors) and benchmarks.cluster.{netns,procs}.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass

from benchmarks.cluster import NamespaceError, netns, procs

IFNAME = "bps0"  # the interface of every host, inside its own namespace (GLOO_SOCKET_IFNAME uses it)
BRIDGE = "bps-br"
_GUARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# TCP's loss signals, as /proc/net/{netstat,snmp} name them, and as the reports do.
TCP_LOSS_COUNTERS = {
    "Tcp:RetransSegs": "retransmitted segments",
    "TcpExt:TCPLossProbes": "loss probes",
    "TcpExt:TCPTimeouts": "timeouts",
    "TcpExt:TCPDSACKRecvSegs": "spurious (D-SACKed)",  # segments the receiver already had
    # A receive queue past its buffer's accounting: compacted (a copy), then packets dropped at the receiver.
    "TcpExt:TCPRcvCollapsed": "collapsed",
    "TcpExt:TCPRcvQDrop": "receive-queue drops",
    # Not a loss: a receiver advertised a zero window, its reading thread behind the bytes (small locked windows).
    "TcpExt:TCPToZeroWindowAdv": "zero windows",
    "TcpExt:TCPZeroWindowDrop": "zero-window drops",  # segments a full receive window turned away
}


@dataclass(frozen=True)
class Host:
    """One emulated machine: `name` "w0"/"s0", its namespace and its address on the cluster subnet."""

    name: str
    role: str  # "worker" or "server"
    netns: str
    ip: str


@dataclass(frozen=True)
class Shaping:
    """tc tbf settings of every link direction, derived from the rate (see `for_rate`)."""

    rate_mbit: float
    burst_bytes: int
    limit_bytes: int  # the switch port's queue (bridge -> host)
    host_limit_bytes: int  # the host's own egress queue (host -> bridge)

    @classmethod
    def for_rate(cls, rate_mbit: float, queue_ms: float = 20.0, host_queue_ms: float | None = None) -> Shaping:
        """Pick burst and queue limits so that one TCP stream reaches the rate.

        burst: a veth hands tbf GSO super-packets of up to 64 KiB; a bucket smaller than one makes tbf
        split it (CPU) or stall, so it holds at least 128 KiB, or 2 ms of traffic at high rates.
        limit: 20 ms of queue at the rate absorbs the incast of n workers pushing to one server at
        once without tail drops that would cost TCP its window (RTT here is ~0.1 ms without queueing).
        host_queue_ms (default: queue_ms) sizes the hosts' own egress queues apart: a real NIC's queue is deeper,
        and TCP small queues keep a host's flows from overflowing it, which a tbf on a veth does not.
        """
        rate_bytes = rate_mbit * 1e6 / 8
        burst = max(128 * 1024, int(rate_bytes * 0.002))
        host_ms = queue_ms if host_queue_ms is None else host_queue_ms
        return cls(
            rate_mbit, burst, burst + int(rate_bytes * queue_ms / 1000), burst + int(rate_bytes * host_ms / 1000)
        )

    def tbf_args(self, host: bool = False) -> list[str]:
        """tc's tbf arguments of a switch port, or with `host`, of a host's egress."""
        limit = self.host_limit_bytes if host else self.limit_bytes
        return ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(self.burst_bytes), "limit", str(limit)]


class Cluster:
    """Build n worker hosts and k server hosts joined by shaped links; tear everything down on exit.

    Example:
        with Cluster(n_workers=2, n_servers=1, rate_mbit=500) as c:
            p = c.spawn("probe", c.workers[0], [sys.executable, "-c", "print('RESULT {}')"])
    """

    def __init__(self, n_workers: int, n_servers: int, rate_mbit: float = 500.0, subnet: str = "10.77.0",
                 rates: dict[str, float] | None = None, tcp_congestion: str = "", queue_ms: float = 20.0,
                 host_queue_ms: float | None = None):  # fmt: skip
        """rates: host name ("w1", "s0") -> its link's rate in Mbit/s, where it differs from rate_mbit.
        queue_ms, host_queue_ms: the links' queues at the rate (Shaping.for_rate).
        tcp_congestion: every host's TCP congestion control (net.ipv4.tcp_congestion_control of its namespace);
        "": the machine's. A namespace may only choose one of the machine's tcp_allowed_congestion_control."""
        if not 1 <= n_workers <= 99 or not 0 <= n_servers <= 99:
            raise ValueError(f"need 1..99 workers and 0..99 servers, got {n_workers} and {n_servers}")
        self.run_id = netns.new_run_id()
        self._queues = (queue_ms, host_queue_ms)
        self.shaping = Shaping.for_rate(rate_mbit, *self._queues)
        self._shapings = {name: Shaping.for_rate(rate, *self._queues) for name, rate in (rates or {}).items()}
        self.bridge_ns = netns.namespace_name("br", self.run_id)
        self.workers = [self._host(f"w{i}", "worker", f"{subnet}.{1 + i}") for i in range(n_workers)]
        self.servers = [self._host(f"s{j}", "server", f"{subnet}.{101 + j}") for j in range(n_servers)]
        if unknown := set(self._shapings) - {h.name for h in self.hosts}:
            raise ValueError(f"rates name hosts this cluster does not have: {sorted(unknown)}")
        self.tcp_congestion = tcp_congestion
        self.logdir = ""
        self._created: list[str] = []
        self._procs: list[procs.Proc] = []
        self._old_handlers: dict[int, object] = {}
        self._closed = False

    def _host(self, name: str, role: str, ip: str) -> Host:
        return Host(name, role, netns.namespace_name(name, self.run_id), ip)

    @property
    def hosts(self) -> list[Host]:
        return self.workers + self.servers

    def __enter__(self) -> Cluster:
        self._install_guards()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def spawn(self, name: str, host: Host, argv: list[str], env: dict[str, str] | None = None) -> procs.Proc:
        """Start `argv` inside `host`'s namespace; it is killed at the latest when the cluster closes."""
        proc = procs.start(name, host.name, host.netns, argv, env or {}, self.logdir)
        self._procs.append(proc)
        return proc

    # -- building ---------------------------------------------------------------------------------------

    def _build(self) -> None:
        self.logdir = tempfile.mkdtemp(prefix=f"bps-cluster-{self.run_id}-")
        self._add_namespace(self.bridge_ns)
        netns.ip("link", "add", BRIDGE, "type", "bridge", netns=self.bridge_ns)
        netns.ip("link", "set", BRIDGE, "up", netns=self.bridge_ns)
        for host in self.hosts:
            self._add_host(host)

    def _add_namespace(self, name: str) -> None:
        if name in netns.list_namespaces():
            raise NamespaceError(f"namespace {name} exists already: run id collision or a leftover")
        netns.ip("netns", "add", name)
        self._created.append(name)
        netns.ip("link", "set", "lo", "up", netns=name)

    def _add_host(self, host: Host) -> None:
        self._add_namespace(host.netns)
        port = _bridge_port(host)
        # Created inside the host namespace with the peer placed straight into the bridge namespace:
        # no interface ever appears in the root namespace, not even for a moment.
        netns.ip("link", "add", IFNAME, "type", "veth", "peer", "name", port, "netns", self.bridge_ns, netns=host.netns)
        netns.ip("addr", "add", f"{host.ip}/24", "dev", IFNAME, netns=host.netns)
        netns.ip("link", "set", IFNAME, "up", netns=host.netns)
        netns.ip("link", "set", port, "master", BRIDGE, netns=self.bridge_ns)
        netns.ip("link", "set", port, "up", netns=self.bridge_ns)
        if self.tcp_congestion:
            self._set_congestion_control(host)
        self._shape(host)

    def _shape(self, host: Host) -> None:
        shaping = self._shapings.get(host.name, self.shaping)
        host_egress, port_egress = shaping.tbf_args(host=True), shaping.tbf_args()
        netns.tc("qdisc", "replace", "dev", IFNAME, "root", *host_egress, netns=host.netns)  # host -> bridge
        netns.tc("qdisc", "replace", "dev", _bridge_port(host), "root", *port_egress, netns=self.bridge_ns)  # -> host

    def set_rate(self, host: Host, rate_mbit: float | None) -> None:
        """Shape `host`'s link, both ways, at `rate_mbit` from now on (None: the cluster's rate again)."""
        if rate_mbit is None:
            self._shapings.pop(host.name, None)
        else:
            self._shapings[host.name] = Shaping.for_rate(rate_mbit, *self._queues)
        self._shape(host)

    def _set_congestion_control(self, host: Host) -> None:
        try:
            netns.ip("netns", "exec", host.netns, "sysctl", "-qw",
                     f"net.ipv4.tcp_congestion_control={self.tcp_congestion}")  # fmt: skip
        except NamespaceError as e:
            allowed = pathlib.Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
            raise NamespaceError(
                f"TCP congestion control {self.tcp_congestion!r} cannot be set in {host.netns}: a namespace of its "
                f"own may choose one of the machine's tcp_allowed_congestion_control, here {allowed} ({e})"
            ) from e

    def congestion_control(self) -> str:
        """The TCP congestion control the hosts' connections use (read in the first host's namespace)."""
        path = "/proc/sys/net/ipv4/tcp_congestion_control"
        return netns.ip("netns", "exec", self.hosts[0].netns, "cat", path).strip()

    def link_drops(self) -> dict[str, int]:
        """Return the packets each link's tbf dropped so far, per host and direction ("w0 up", "w0 down").

        Drops mean a queue overflowed (incast onto one host): TCP then backs off, and the step slows.
        """
        drops = {}
        for host in self.hosts:
            for direction, dev, space in (("up", IFNAME, host.netns), ("down", _bridge_port(host), self.bridge_ns)):
                stats = json.loads(netns.tc("-s", "-j", "qdisc", "show", "dev", dev, netns=space) or "[]")
                drops[f"{host.name} {direction}"] = sum(q.get("drops", 0) for q in stats)
        return drops

    def tcp_losses(self) -> dict[str, int]:
        """Return each host's TCP loss signals so far ("w0 timeouts"; TCP_LOSS_COUNTERS), from its namespace.

        Beside the tbf drops they say what a drop cost: a fast retransmission, a tail-loss probe, or a timeout (an
        RTO, 200 ms or more of a flow's silence); and which retransmissions were not needed, the peer reporting a
        duplicate (D-SACK): a probe fired while its segment waited in a queue, or a fast retransmission after a
        veth reordered a flow's packets between the CPUs' backlog queues. And drops no tbf counts: a receiver whose
        queue outgrew its locked buffer's accounting collapses it, then drops.
        """
        losses = {}
        for host in self.hosts:
            text = netns.ip("netns", "exec", host.netns, "cat", "/proc/net/netstat", "/proc/net/snmp")
            counters = proc_net_counters(text)
            for name, label in TCP_LOSS_COUNTERS.items():
                losses[f"{host.name} {label}"] = counters.get(name, 0)
        return losses

    # -- tearing down -----------------------------------------------------------------------------------

    def _install_guards(self) -> None:
        os.makedirs(netns.PID_DIR, exist_ok=True)
        with open(netns.pidfile_path(self.run_id), "w") as f:
            f.write(str(os.getpid()))
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            for sig in _GUARDED_SIGNALS:
                self._old_handlers[sig] = signal.signal(sig, _raise_system_exit)
        # SIGINT already raises KeyboardInterrupt, which unwinds through __exit__.

    def close(self) -> None:
        """Kill our processes, delete our namespaces, remove pid file and logs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        in_main = threading.current_thread() is threading.main_thread()
        # A second Ctrl-C or SIGTERM must not cut the clean-up short: ignore them while it runs.
        held = (
            {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, *_GUARDED_SIGNALS)} if in_main else {}
        )
        try:
            for p in self._procs:
                p.kill()
            for name in reversed(self._created):  # hosts first, the bridge namespace last
                netns.delete_namespace(name)
            left = self.leftovers()
            for name in left:  # one more try, then say so loudly rather than leak silently
                netns.delete_namespace(name)
            if self.leftovers():
                print(
                    f"WARNING: could not delete {self.leftovers()}; run `python -m benchmarks.cluster "
                    "--cleanup-leftovers`",
                    file=sys.stderr,
                )
        finally:
            try:
                os.unlink(netns.pidfile_path(self.run_id))
            except OSError:
                pass
            if self.logdir:
                shutil.rmtree(self.logdir, ignore_errors=True)
            atexit.unregister(self.close)
            for sig, handler in [*held.items(), *self._old_handlers.items()]:  # the originals last
                signal.signal(sig, handler)

    def leftovers(self) -> list[str]:
        """Return the namespaces of this run that still exist (empty once closed cleanly)."""
        return [name for name in netns.list_namespaces() if name.endswith(f"-{self.run_id}")]


def _bridge_port(host: Host) -> str:
    """The bridge-side end of `host`'s veth, in the bridge namespace (15 characters at most)."""
    return f"bps-{host.name}"


def _raise_system_exit(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def proc_net_counters(text: str) -> dict[str, int]:
    """Parse /proc/net/netstat or snmp text, a header line then a value line per group, into {"Group:Name": value}.

    Example: `proc_net_counters("Tcp: RtoMin RetransSegs\nTcp: 200 7\n")` -> {"Tcp:RtoMin": 200, "Tcp:RetransSegs": 7}.
    """
    lines = text.splitlines()
    counters = {}
    for header, values in zip(lines[::2], lines[1::2], strict=False):
        group, *names = header.split()
        for name, value in zip(names, values.split()[1:], strict=False):
            counters[f"{group}{name}"] = int(value)
    return counters


def calibrate(cluster: Cluster, seconds: float = 3.0, port: int = 5201) -> dict:
    """Calibration: stream for `seconds` from the first worker to the next host, to show the shaped link delivers
    about B; return goodput next to the rate.

    Example: `calibrate(c)` -> `{"from": "w0", "to": "w1", "mbit_s": 478.0, "ratio": 0.956, ...}`.
    The ratio is TCP goodput over the tbf rate: headers cost ~4% at MTU 1500, so ~0.95 is a link
    working as configured.
    """
    src = cluster.workers[0]
    dst = (cluster.workers[1:] + cluster.servers)[0]
    timeout = seconds + 30.0
    stream = [sys.executable, "-m", "benchmarks.cluster.workers.stream"]
    recv = cluster.spawn("stream recv", dst, [*stream, "recv", "--port", str(port), "--timeout", str(timeout)])
    send = cluster.spawn("stream send", src, [*stream, "send", "--to", f"{dst.ip}:{port}", "--seconds", str(seconds),
                                              "--timeout", str(timeout)])  # fmt: skip
    got, _ = procs.wait_all([recv, send], timeout + 10.0, "calibration stream")
    shaping = cluster.shaping
    return {
        "from": src.name,
        "to": dst.name,
        "mbit_s": round(got["mbit_s"], 1),
        "rate_mbit": shaping.rate_mbit,
        "ratio": round(got["mbit_s"] / shaping.rate_mbit, 3),
        "seconds": round(got["seconds"], 2),
        "tbf": {"burst_bytes": shaping.burst_bytes, "limit_bytes": shaping.limit_bytes},
    }
