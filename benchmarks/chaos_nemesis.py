"""The nemesis of benchmarks/chaos.py: the site it strikes (processes on hosts, loopback or network namespaces),
the run's summation servers, a seeded schedule of faults and the thread per fault that plays it, and the hostile
peers it starts as processes (`python -m benchmarks.chaos_nemesis hostile|hog|registry ADDRESS`).

Faults (`KINDS` by workload):
  kill         a server SIGKILLed, a replacement started (it registers: the next failover claims it)
  stop_short   a server SIGSTOPped for a third of the heartbeat timeout (no failover needed)
  stop_long    a server SIGSTOPped for twice the heartbeat timeout (failed over; it is retired, and replaced)
  drain        a server SIGTERMed (a rolling update's drain), a replacement started
  link_down    a server host's link down for twice the heartbeat timeout, then up (retired, replaced)
  link_flap    a server host's link down for a third of the heartbeat timeout, then up (no failover needed)
  link_slow    a server host's link cut to a tenth of the rate for a while
  worker_kill  a rank (never rank 0, which hosts the job's store) SIGKILLed: backup workload only, at most b times
               (backup workers and failover do not combine: that workload loses no server)
  hostile      a peer with the pool credential sends a server garbage frames and replays one frame 100 times
  hog          another job fills its memory quota on a server, holds it a while, and leaves
and, last, where the workload cannot survive losing a server by design (`FINAL`: backup workers, failover off):
  every_server every server SIGKILLed, the standby too, none replaced: every rank must fail with TransportError
Link faults need network namespaces (root, iproute2: benchmarks/cluster/netns.py); without them every host is
127.0.0.1 and the link faults are skipped.

May import: the standard library, torch (the registry's store), benchmarks.attacks, benchmarks.cluster and
torch_bps.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.cluster import netns, procs  # noqa: E402
from torch_bps.address import parse_listening  # noqa: E402

TOKEN_ENV = "BPS_CHAOS_RUN"  # every process a run starts carries its token: what is left behind is found by it
SERVER_FAULTS = ("kill", "stop_short", "stop_long", "drain", "hostile", "hog")
LINK_FAULTS = ("link_down", "link_flap", "link_slow")
# Backup workers and server failover do not combine (runtime._check_backups refuses it): under BackupWorkers the
# nemesis loses no server before its last fault, it kills a worker, stalls a server or its link briefly, and sends
# hostile peers.
KINDS = {"ddp": SERVER_FAULTS + LINK_FAULTS, "async": SERVER_FAULTS + LINK_FAULTS,
         "backup": ("stop_short", "link_flap", "link_slow", "hostile", "hog", "worker_kill")}  # fmt: skip
# Where losing a server is fatal by design (failover off), the schedule ends with every server lost, and every rank
# must end with the documented error, naming a lost server (README, "Settings": BPS_FAILOVER=0 fails at once).
FINAL = {"backup": "every_server"}
EXPECTED_ERROR = "TransportError"
MB = 1 << 20
PEER = [sys.executable, "-m", "benchmarks.chaos_nemesis"]  # the peers below, as processes on a host of the site


@dataclass
class Settings:
    """One run's knobs (the worker's BPS_* and the servers' options follow from them)."""

    workload: str = "ddp"
    seed: int = 1
    seconds: float = 60.0
    workers: int = 4
    servers: int = 3  # dedicated; one standby more
    gap: float = 6.0  # mean seconds between faults (exponential: faults overlap)
    kinds: tuple[str, ...] = ()  # () : every kind the workload and the site allow
    timeout: float = 10.0  # BPS_TIMEOUT: a hang is no step for twice this
    heartbeat: float = 3.0  # heartbeat timeout, workers' and servers'
    max_memory: int = 256 * MB  # each server's --max-memory-bytes
    job_quota: int = 32 * MB  # each server's --job-quota-bytes: what a hog may hold
    rate_mbit: float = 1000.0  # namespaces' link rate
    backups: int = 1
    step_sleep: float = 0.02  # per step: leaves the 2 cores' CPU to replacements starting
    rebalance_every: int = 0  # ddp, async: steps between the job's rebalances (0: none)
    netns: bool = True  # use namespaces where they are available


# -- the site: processes on hosts, loopback or network namespaces
class Host:
    def __init__(self, name: str, ip: str = "127.0.0.1", ns_host=None):
        self.name, self.ip, self.ns_host = name, ip, ns_host


class Site:
    """Hosts to start processes on. Loopback: every host is 127.0.0.1 and has no link to fault."""

    link_faults = False

    def __init__(self, workers: int, servers: int, logdir: str, token: str):
        self.workers = [Host(f"w{i}") for i in range(workers)]
        self.servers = [Host(f"s{j}") for j in range(servers)]
        self.logdir, self.token, self.procs = logdir, token, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def spawn(self, name: str, host: Host, argv: list[str], env: dict | None = None) -> procs.Proc:
        stem = os.path.join(self.logdir, f"{name.replace(' ', '_')}-{time.monotonic_ns()}")
        full = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1", TOKEN_ENV: self.token, **(env or {})}
        with open(stem + ".out", "w") as out, open(stem + ".err", "w") as err:
            popen = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=full, cwd=REPO,
                                     start_new_session=True)  # fmt: skip
        proc = procs.Proc(name, host.name, popen, stem + ".out", stem + ".err")
        self.procs.append(proc)
        return proc

    def port(self, host: Host) -> int:
        """A port free on `host` (loopback: the kernel's pick, free a moment ago)."""
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    def registry(self, address: str):
        """The job's registry at `address`: a TCPStore the servers register in (loopback: in this process)."""
        from datetime import timedelta

        import torch.distributed as dist

        host, port = address.rsplit(":", 1)
        return dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))

    def close(self) -> None:
        for p in self.procs:
            _signal(p.pid, signal.SIGCONT)
            p.kill()


class NamespaceSite(Site):
    """Hosts in network namespaces joined by shaped links (benchmarks/cluster/topology.py)."""

    link_faults = True

    def __init__(self, workers: int, servers: int, logdir: str, token: str, rate_mbit: float):
        from benchmarks.cluster.topology import Cluster

        self.cluster = Cluster(n_workers=workers, n_servers=servers, rate_mbit=rate_mbit, subnet="10.78.0")
        self.cluster.__enter__()
        self.rate = rate_mbit
        self.workers = [Host(h.name, h.ip, h) for h in self.cluster.workers]
        self.servers = [Host(h.name, h.ip, h) for h in self.cluster.servers]
        self.logdir, self.token, self.procs = logdir, token, []
        self.ports: dict[str, int] = {}

    def port(self, host: Host) -> int:
        """The next port on `host`: a namespace of its own, nothing else listens there."""
        self.ports[host.name] = self.ports.get(host.name, 29600) + 1
        return self.ports[host.name]

    def spawn(self, name: str, host: Host, argv: list[str], env: dict | None = None) -> procs.Proc:
        env = {TOKEN_ENV: self.token, "BPS_HOST": host.ip, "GLOO_SOCKET_IFNAME": "bps0", **(env or {})}
        proc = procs.start(name, host.name, host.ns_host.netns, argv, env, self.logdir)
        self.procs.append(proc)
        return proc

    def registry(self, address: str) -> procs.Proc:
        """The registry in the first worker's namespace (this process is outside every namespace): a process."""
        proc = self.spawn("registry", self.workers[0], [*PEER, "registry", address])
        wait_line(proc, lambda line: line if line.startswith("registry listening") else None, 60, "the registry")
        return proc

    def link(self, host: Host, up: bool) -> None:
        netns.ip("link", "set", "bps0", "up" if up else "down", netns=host.ns_host.netns)

    def slow(self, host: Host, factor: float | None) -> None:
        self.cluster.set_rate(host.ns_host, None if factor is None else self.rate * factor)

    def close(self) -> None:
        super().close()
        self.cluster.close()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def wait_line(proc: procs.Proc, parse, timeout: float, what: str):
    """Poll `proc`'s stdout until `parse(line)` answers; return that, or raise naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in proc.stdout().splitlines():
            if (got := parse(line)) is not None:
                return got
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise TimeoutError(f"{what} ({proc.name} on {proc.host}) not ready within {timeout:.0f} s: {proc.stderr_tail()}")


# -- the servers
@dataclass(eq=False)
class Server:
    host: Host
    proc: procs.Proc
    address: str
    retired: bool = False  # lost to the job (stopped or cut too long, drained): a target no more


class Pool:
    """The run's servers: starts them (each registers in the registry), replaces lost ones, samples their memory."""

    def __init__(self, site: Site, s: Settings, registry: str, record):
        self.site, self.s, self.registry, self.record = site, s, registry, record
        self.lock = threading.Lock()
        self.servers: list[Server] = []
        self.peak: dict[str, tuple[int, int]] = {}  # address -> (RSS at start, peak RSS)

    def start(self, host: Host) -> Server:
        return self.ready(self.launch(host))

    def launch(self, host: Host) -> procs.Proc:
        """Start a server on `host`; `ready` waits for it to listen (servers import torch: seconds of CPU each)."""
        s = self.s
        argv = [sys.executable, "-m", "torch_bps.server", "--host", host.ip, "--port", str(self.site.port(host)),
                "--register", self.registry, "--heartbeat-timeout", str(s.heartbeat), "--heartbeat-interval",
                str(s.heartbeat / 6), "--max-memory-bytes", str(s.max_memory), "--job-quota-bytes", str(s.job_quota),
                "--drain-timeout", str(2 * s.timeout), "--lost-job-lease", "5"]  # fmt: skip
        return self.site.spawn(f"server {host.name}", host, argv, {"OMP_NUM_THREADS": "1"})

    def ready(self, proc: procs.Proc) -> Server:
        port, _ = wait_line(proc, parse_listening, 120, "a summation server")
        host = next(h for h in self.site.servers if h.name == proc.host)
        server = Server(host, proc, f"{host.ip}:{port}")
        with self.lock:
            self.servers.append(server)
            self.peak[server.address] = (_rss(proc.pid), _rss(proc.pid))
        return server

    def live(self) -> list[Server]:
        with self.lock:
            return [v for v in self.servers if not v.retired and v.proc.poll() is None]

    def sample(self) -> None:
        with self.lock:
            for v in self.servers:
                if v.proc.poll() is None and (rss := _rss(v.proc.pid)):
                    start, peak = self.peak[v.address]
                    self.peak[v.address] = (start, max(peak, rss))

    def stop_all(self) -> None:
        for v in self.servers:
            _signal(v.proc.pid, signal.SIGCONT)
            v.proc.kill(grace_s=3.0)


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


# -- the nemesis
def schedule(s: Settings, kinds: tuple[str, ...]) -> list[tuple[float, str]]:
    """(seconds after the job's first step, kind) of every fault, drawn from the seed; gaps are exponential, so
    faults overlap (a stop lasts up to 2x the heartbeat timeout; the mean gap is less). A fault of `FINAL` among
    `kinds` comes last, a heartbeat timeout before the job's end."""
    rng = random.Random(s.seed)
    final = [k for k in kinds if k in FINAL.values()]
    kinds = tuple(k for k in kinds if k not in final)
    t, out = 0.0, []
    while kinds:
        t += rng.expovariate(1 / s.gap)
        if t > s.seconds - 2 * s.heartbeat:  # the last fault has time to be recovered from
            break
        out.append((round(t, 2), rng.choice(kinds)))
    return out + [(round(s.seconds - s.heartbeat, 2), k) for k in final]


class Nemesis:
    """Plays the schedule: each fault in a thread of its own, recorded with when it struck (`t`), when its effect
    ended (`cleared`: the kill sent, the server continued, the link up, the peer gone) and when its thread ended
    (`end`: replacements started)."""

    def __init__(self, site: Site, pool: Pool, ranks: list, s: Settings, record):
        self.site, self.pool, self.ranks, self.s, self.record = site, pool, ranks, s, record
        self.rng = random.Random(s.seed + 1)
        self.threads: list[threading.Thread] = []
        self.worker_kills = 0
        self.stopping = threading.Event()

    def inject(self, kind: str) -> None:
        """Strike a live server (its host, its link) chosen from the seed, in a thread of its own."""
        live = self.pool.live()
        if not live:
            self.record({"fault": kind, "t": time.time(), "skipped": "no live server"})
            return
        victim = self.rng.choice(live)
        thread = threading.Thread(target=self._fault, args=(kind, victim), name=f"nemesis-{kind}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def _fault(self, kind: str, v: Server) -> None:
        s, hb, started = self.s, self.s.heartbeat, time.time()
        entry = {"fault": kind, "t": started, "target": v.address}
        try:
            if kind == "kill":
                v.retired = True
                _signal(v.proc.pid, signal.SIGKILL)
                entry["cleared"] = time.time()
                self.pool.start(v.host)
            elif kind == "drain":
                v.retired = True
                _signal(v.proc.pid, signal.SIGTERM)
                entry["cleared"] = time.time()
                self.pool.start(v.host)
            elif kind in ("stop_short", "stop_long"):
                long = kind == "stop_long"
                v.retired = v.retired or long
                _signal(v.proc.pid, signal.SIGSTOP)
                replacement = self.pool.launch(v.host) if long else None  # the next failover claims it
                self._sleep(2 * hb if long else hb / 3, started)
                _signal(v.proc.pid, signal.SIGCONT)
                entry["cleared"] = time.time()
                if replacement is not None:
                    v.proc.kill(grace_s=1.0)  # it lost its job; a retired server is no target and no load
                    self.pool.ready(replacement)
            elif kind == "link_down":
                v.retired = True
                replacement = self.pool.launch(v.host)
                self.site.link(v.host, up=False)
                self._sleep(2 * hb, started)
                self.site.link(v.host, up=True)
                entry["cleared"] = time.time()
                v.proc.kill(grace_s=1.0)
                self.pool.ready(replacement)
            elif kind == "link_flap":
                self.site.link(v.host, up=False)
                self._sleep(hb / 3, started)
                self.site.link(v.host, up=True)
                entry["cleared"] = time.time()
            elif kind == "link_slow":
                self.site.slow(v.host, 0.1)
                self._sleep(self.rng.uniform(hb, 3 * hb), started)
                self.site.slow(v.host, None)
                entry["cleared"] = time.time()
            elif kind == "hostile":
                p = self.site.spawn("hostile", self.site.workers[-1], [*PEER, "hostile", v.address])
                entry["exit"] = self._wait(p, 60)
                entry["cleared"] = time.time()
            elif kind == "hog":
                hold = self.rng.uniform(hb, 3 * hb)
                p = self.site.spawn("hog", self.site.workers[-1], [*PEER, "hog", v.address, "--seconds", str(hold)])
                entry["exit"] = self._wait(p, 60 + hold)
                entry["cleared"] = time.time()
                entry["held"] = p.stdout().strip()[-200:]
            elif kind == "every_server":  # where losing one is fatal by design: the job must end, named
                lost = self.pool.live()
                for server in lost:
                    server.retired = True
                    _signal(server.proc.pid, signal.SIGKILL)
                entry.update(cleared=time.time(), targets=[server.address for server in lost], expect=EXPECTED_ERROR)
            elif kind == "worker_kill":
                victims = [r for r in self.ranks[1:] if r.poll() is None]
                if self.worker_kills >= s.backups or not victims:
                    entry["skipped"] = f"{self.worker_kills} rank(s) killed already, backups={s.backups}"
                else:
                    self.worker_kills += 1
                    rank = self.rng.choice(victims)
                    entry["target"] = rank.name
                    _signal(rank.pid, signal.SIGKILL)
                    entry["cleared"] = time.time()
            if kind in ("hostile", "hog") and v.retired:
                entry["note"] = "the target was lost to another fault meanwhile"
            elif kind in ("hostile", "hog") and (v.proc.poll() is not None or entry["exit"]):
                entry["error"] = f"the {kind} peer exited {entry['exit']}, the server {v.proc.poll()} (None: alive)"
        except Exception as e:  # noqa: BLE001 - recorded: the checker counts it as a fault not recovered
            entry["error"] = f"{type(e).__name__}: {e}"
        entry["end"] = time.time()
        self.record(entry)

    def _wait(self, p: procs.Proc, timeout: float) -> int | None:
        try:
            return p.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            return None

    def _sleep(self, seconds: float, since: float) -> None:
        time.sleep(max(0.0, since + seconds - time.time()))

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))


# -- hostile peers, run as processes on a host of the site
def hostile(address: str) -> int:
    """Garbage frames, a header of a job never declared, then one PUSH frame replayed 100 times."""
    from benchmarks.attacks import Peer
    from torch_bps.wire import Command, Header

    rng = random.Random(address)
    p = Peer(address, 0x0BAD0000 + rng.randrange(1 << 16), 2)
    for _ in range(20):
        p.sock.send_multipart([rng.randbytes(rng.randrange(1, 200)) for _ in range(rng.randrange(1, 4))])
    p.hello()
    p.request(Command.INIT, key=7, nbytes=4096, dtype=1)
    frame = [Header(command=Command.PUSH, job_id=p.job_id, incarnation=p.incarnation, key=7, round=0, nbytes=4096,
                    length=4096, dtype=1, request_id=1).pack(), b"\1" * 4096]  # fmt: skip
    replies = 0
    for _ in range(100):
        p.sock.send_multipart(frame)
    while p.sock.poll(2000):
        p.sock.recv_multipart()
        replies += 1
    print(f"hostile: {replies} replies", flush=True)
    return 0


def hog(address: str, seconds: float) -> int:
    """A job of its own that pushes rounds that never close (one worker of two) until the server refuses it."""
    from benchmarks.attacks import Peer
    from torch_bps.wire import Command

    p = Peer(address, 0x0706_0000 + random.randrange(1 << 16), 2)
    p.hello()
    held = 0
    for key in range(4096):
        if p.request(Command.INIT, key=key, nbytes=MB, dtype=7).status:
            break
        if p.request(Command.PUSH, b"\1" * MB, key=key, round=0, nbytes=MB, length=MB, dtype=7).status:
            break
        held += MB
    print(f"hog: held {held >> 20} MiB", flush=True)
    time.sleep(seconds)
    return 0


def registry(address: str) -> int:
    """The job's registry: a TCPStore at "host:port" the servers register in, until killed."""
    from datetime import timedelta

    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    print(f"registry listening on {address}", flush=True)
    while store is not None:
        time.sleep(3600)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the nemesis's peer processes")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("hostile").add_argument("address")
    g = sub.add_parser("hog")
    g.add_argument("address")
    g.add_argument("--seconds", type=float, default=5.0)
    sub.add_parser("registry").add_argument("address")
    args = p.parse_args(argv)
    if args.command == "hostile":
        return hostile(args.address)
    if args.command == "hog":
        return hog(args.address, args.seconds)
    return registry(args.address)


if __name__ == "__main__":
    sys.exit(main())
