"""A nemesis and a checker: random faults, at random moments and overlapping, while a job trains.

`run` starts a registry, k dedicated summation servers and a standby (failover on), and n = 4 ranks of a workload
(benchmarks/cluster/workers/chaos_train.py: ddp, backup or async), then plays a seeded schedule of faults:
  kill         a server SIGKILLed, a replacement started (it registers: the next failover claims it)
  stop_short   a server SIGSTOPped for a third of the heartbeat timeout (no failover needed)
  stop_long    a server SIGSTOPped for twice the heartbeat timeout (failed over; it is retired, and replaced)
  drain        a server SIGTERMed (a rolling update's drain), a replacement started
  link_down    a server host's link down for twice the heartbeat timeout, then up (retired, replaced)
  link_slow    a server host's link cut to a tenth of the rate for a while
  worker_kill  a rank (never rank 0, which hosts the job's store) SIGKILLed: backup workload only, at most b times
               (backup workers and failover do not combine: that workload loses no server)
  hostile      a peer with the pool credential sends a server garbage frames and replays one frame 100 times
  hog          another job fills its memory quota on a server, holds it a while, and leaves
Link faults need network namespaces (root, iproute2: benchmarks/cluster/netns.py); without them every host is
127.0.0.1 and the link faults are skipped, which the run says. Everything that happens goes to the run's record
(JSON lines): the ranks' steps, each fault, servers' peak memory, the fault-free baseline's verdict (ddp) and what
was left behind. `check` reads a record and prints the table; it fails (exit 1) on a lost or duplicated update,
replicas that differ, a hang (no step for more than 2x the timeout), memory past the bound, or leftovers.

    python -m benchmarks.chaos run --workload ddp --seed 1 --minutes 5 --record results/chaos-ddp.jsonl
    python -m benchmarks.chaos check results/chaos-ddp.jsonl

May import: the standard library, torch (the baseline's parameters), benchmarks.attacks, benchmarks.cluster and
torch_bps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.cluster import netns, procs  # noqa: E402
from torch_bps.address import parse_listening  # noqa: E402

TOKEN_ENV = "BPS_CHAOS_RUN"  # every process a run starts carries its token: what is left behind is found by it
SERVER_FAULTS = ("kill", "stop_short", "stop_long", "drain", "hostile", "hog")
LINK_FAULTS = ("link_down", "link_slow")
# Backup workers and server failover do not combine (runtime._check_backups refuses it): under BackupWorkers the
# nemesis loses no server, it kills a worker, stalls a server or its link briefly, and sends hostile peers.
KINDS = {"ddp": SERVER_FAULTS + LINK_FAULTS, "async": SERVER_FAULTS + LINK_FAULTS,
         "backup": ("stop_short", "link_slow", "hostile", "hog", "worker_kill")}  # fmt: skip
MB = 1 << 20


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
        proc = self.spawn("registry", self.workers[0], [sys.executable, "-m", "benchmarks.chaos", "registry", address])
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
    faults overlap (a stop lasts up to 2x the heartbeat timeout; the mean gap is less)."""
    rng = random.Random(s.seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(1 / s.gap)
        if t > s.seconds - 2 * s.heartbeat:  # the last fault has time to be recovered from
            return out
        out.append((round(t, 2), rng.choice(kinds)))


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
            elif kind == "link_slow":
                self.site.slow(v.host, 0.1)
                self._sleep(self.rng.uniform(hb, 3 * hb), started)
                self.site.slow(v.host, None)
                entry["cleared"] = time.time()
            elif kind == "hostile":
                p = self.site.spawn("hostile", self.site.workers[-1], [sys.executable, "-m", "benchmarks.chaos",
                                                                        "hostile", v.address])  # fmt: skip
                entry["exit"] = self._wait(p, 60)
                entry["cleared"] = time.time()
            elif kind == "hog":
                hold = self.rng.uniform(hb, 3 * hb)
                p = self.site.spawn("hog", self.site.workers[-1], [sys.executable, "-m", "benchmarks.chaos", "hog",
                                                                   v.address, "--seconds", str(hold)])  # fmt: skip
                entry["exit"] = self._wait(p, 60 + hold)
                entry["cleared"] = time.time()
                entry["held"] = p.stdout().strip()[-200:]
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


# -- the run
class Record:
    def __init__(self, path: str):
        self.path, self.lock = path, threading.Lock()

    def __call__(self, entry: dict) -> None:
        with self.lock, open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def rank_env(s: Settings, rank: int, master: str, registry: str) -> dict:
    """A rank's environment; `master`: the job store's "host:port"."""
    host, port = master.rsplit(":", 1)
    return {"MASTER_ADDR": host, "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": str(s.workers),
            "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1", "BPS_LOCAL_REDUCE": "0",
            "BPS_NUM_SERVERS": str(s.servers), "BPS_REGISTRY": registry, "BPS_PLACEMENT": "dedicated",
            "BPS_FAILOVER": "0" if s.workload == "backup" else "1", "BPS_TIMEOUT": str(s.timeout),
            "BPS_FAILOVER_TIMEOUT": str(3 * s.timeout),
            "BPS_HEARTBEAT_TIMEOUT": str(s.heartbeat), "BPS_HEARTBEAT_INTERVAL": str(s.heartbeat / 6),
            "BPS_STANDBY_WAIT": str(s.heartbeat)}  # fmt: skip


def run(s: Settings, record_path: str) -> int:
    """Run one workload under the nemesis, recording everything to `record_path`; return the checker's verdict."""
    os.environ.setdefault("BPS_POOL_CREDENTIAL", secrets.token_urlsafe(32))
    token, logdir = secrets.token_hex(6), tempfile.mkdtemp(prefix="bps-chaos-")
    shm_before = set(os.listdir("/dev/shm"))
    open(record_path, "w").close()
    record = Record(record_path)
    why = netns.unavailable_reason() if s.netns else "namespaces not asked for (--no-netns)"
    kinds = s.kinds or KINDS[s.workload]
    if why:
        kinds = tuple(k for k in kinds if k not in LINK_FAULTS)
    record({"meta": {**s.__dict__, "kinds": list(kinds), "link_faults_skipped": why, "token": token}})
    print(f"chaos: {s.workload}, seed {s.seed}, {s.seconds:.0f} s, faults {', '.join(kinds)}"
          + (f" (link faults skipped: {why})" if why else ""), flush=True)  # fmt: skip
    site = NamespaceSite(s.workers, s.servers + 1, logdir, token, s.rate_mbit) if not why else \
        Site(s.workers, s.servers + 1, logdir, token)  # fmt: skip
    run_id = getattr(getattr(site, "cluster", None), "run_id", None)
    result: dict = {}
    try:
        result = _run_on(site, s, kinds, record, record_path)
    finally:
        site.close()
        result["leftovers"] = leftovers(token, run_id, shm_before, [p.pid for p in site.procs])
        record({"result": result})
    return check(record_path)


def _run_on(site: Site, s: Settings, kinds, record: Record, record_path: str) -> dict:
    w0 = site.workers[0]
    registry, master = f"{w0.ip}:{site.port(w0)}", f"{w0.ip}:{site.port(w0)}"
    pool = Pool(site, s, registry, record)
    pool.store = site.registry(registry)  # held while the run lasts
    for proc in [pool.launch(host) for host in site.servers]:  # the first k to register are the job's, then a standby
        pool.ready(proc)
    worker = [sys.executable, "-m", "benchmarks.cluster.workers.chaos_train", "--workload", s.workload, "--record",
              record_path, "--seconds", str(s.seconds), "--backups", str(s.backups), "--step-sleep",
              str(s.step_sleep)]  # fmt: skip
    out = record_path + ".params.pt"
    ranks = [site.spawn(f"rank {r}", h, worker + (["--out", out] if r == 0 else []),
                        rank_env(s, r, master, registry)) for r, h in enumerate(site.workers)]  # fmt: skip
    nemesis = Nemesis(site, pool, ranks, s, record)
    began = _first_step(record_path, ranks, 300)
    plan = schedule(s, kinds)
    deadline = began + s.seconds + 20 * s.timeout  # the job stops on its own; past this, it hung
    while any(r.poll() is None for r in ranks) and time.time() < deadline:
        now = time.time() - began
        while plan and plan[0][0] <= now:
            nemesis.inject(plan.pop(0)[1])
        pool.sample()
        time.sleep(0.2)
    hung = [r.name for r in ranks if r.poll() is None]
    nemesis.join(60)
    exits = {r.name: r.poll() for r in ranks}
    for r in ranks:
        r.kill()
    result = {"exits": exits, "hung_ranks": hung, "errors": {r.name: r.stderr_tail(8) for r in ranks
                                                             if exits[r.name] not in (0, -9)}}  # fmt: skip
    if s.workload == "ddp" and not hung and exits.get("rank 0") == 0:
        result["baseline"] = baseline(site, s, pool, record_path, out)
    result["memory"] = {a: {"start": st, "peak": pk} for a, (st, pk) in pool.peak.items()}
    pool.stop_all()
    return result


def _first_step(record_path: str, ranks: list, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(record_path) as f:
            if any('"step": 0' in line for line in f):
                return time.time()
        if any(r.poll() is not None for r in ranks):
            break
        time.sleep(0.2)
    raise TimeoutError(f"the ranks did not complete a first step within {timeout:.0f} s: "
                       + "; ".join(f"{r.name}: {r.stderr_tail(5)}" for r in ranks))  # fmt: skip


def baseline(site: Site, s: Settings, pool: Pool, record_path: str, chaos_out: str) -> dict:
    """Run the ddp workload again, as many steps, with no fault (servers given, failover off); compare bits."""
    import torch

    steps = _steps_done(record_path)
    addresses = [v.address for v in pool.live()][: s.servers]
    base_record, out = record_path + ".baseline", record_path + ".baseline.pt"
    worker = [sys.executable, "-m", "benchmarks.cluster.workers.chaos_train", "--workload", "ddp", "--record",
              base_record, "--steps", str(steps)]  # fmt: skip
    master = f"{site.workers[0].ip}:{site.port(site.workers[0])}"
    env = {"BPS_SERVERS": ",".join(addresses), "BPS_FAILOVER": "0", "BPS_NUM_SERVERS": "0", "BPS_REGISTRY": ""}
    ranks = [site.spawn(f"baseline rank {r}", h, worker + (["--out", out] if r == 0 else []),
                        {**rank_env(s, r, master, ""), **env})
             for r, h in enumerate(site.workers)]  # fmt: skip
    results = procs.wait_all(ranks, 60 + 2 * steps, "the fault-free baseline")
    chaos, base = torch.load(chaos_out), torch.load(out)
    differ = [n for n in base if not torch.equal(chaos[n], base[n])]
    return {"steps": steps, "baseline_steps": results[0]["steps"], "differ": differ}


def _steps_done(record_path: str) -> int:
    with open(record_path) as f:
        done = [e for e in map(json.loads, f) if e.get("event") == "done" and e.get("rank") == 0]
    return done[0]["steps"]


def leftovers(token: str, run_id: str | None, shm_before: set[str], pids: list[int]) -> dict:
    """What the run left behind: its processes (by token), its namespaces, new /dev/shm segments of its processes
    (a segment's name carries its maker's pid: another job's on this machine are not this run's)."""
    time.sleep(1.0)  # processes on their way out
    marker = f"{TOKEN_ENV}={token}".encode()
    left = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if name.isdigit() and marker in f.read().split(b"\0"):
                    with open(f"/proc/{name}/cmdline", "rb") as c:
                        cmd = c.read().replace(b"\0", b" ").decode(errors="replace")
                    left.append(f"{name}: {cmd[:120]}")
        except OSError:
            continue
    spaces = [n for n in netns.list_namespaces() if run_id and n.endswith(run_id)] if run_id else []
    shm = sorted(n for n in set(os.listdir("/dev/shm")) - shm_before if any(f"_{pid}_" in n for pid in pids))
    return {"processes": left, "namespaces": spaces, "shm": shm}


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


# -- the checker
def load(path: str) -> tuple[dict, list, list, dict]:
    meta, steps, faults, result = {}, [], [], {}
    with open(path) as f:
        for e in map(json.loads, f):
            if "meta" in e:
                meta = e["meta"]
            elif "fault" in e:
                faults.append(e)
            elif "result" in e:
                result = e["result"]
            elif "step" in e:
                steps.append(e)
    return meta, steps, faults, result


def verdict(path: str) -> dict:
    """Everything the table says, from the record at `path`."""
    meta, steps, faults, result = load(path)
    n, timeout = meta["workers"], meta["timeout"]
    by_rank = {r: [e for e in steps if e["rank"] == r and e["step"] >= 0] for r in range(n)}
    done = {e["rank"]: e for e in steps if e.get("event") == "done"}
    t0 = [e["t"] for e in by_rank[0]]
    out: dict = {"workload": meta["workload"], "seed": meta["seed"], "seconds": meta["seconds"],
                 "link_faults_skipped": meta["link_faults_skipped"], "steps": len(t0)}  # fmt: skip
    kinds: dict[str, list[int]] = {}
    recoveries, errors, unfinished = [], [], 0
    for fault in faults:
        if "skipped" in fault or not t0 or fault["t"] > t0[-1]:  # none, or after the job's last step
            continue
        counted = kinds.setdefault(fault["fault"], [0, 0])
        counted[0] += 1
        after = [t for t in t0 if t > fault.get("cleared", fault["t"])]
        if "error" in fault:
            errors.append(f"{fault['fault']} {fault.get('target')}: {fault['error']}")
        elif after:
            counted[1] += 1
            recoveries.append(after[0] - fault.get("cleared", fault["t"]))
        else:
            unfinished += 1  # it cleared after the job's last step: nothing left to recover
    out["faults"] = kinds
    out["fault_errors"] = errors
    out["cleared_after_end"] = unfinished
    out["recovery_s"] = (statistics.median(recoveries), max(recoveries)) if recoveries else None
    out["slow_recoveries"] = sum(r > 2 * timeout for r in recoveries)
    gaps = [b - a for a, b in zip(t0, t0[1:], strict=False)]
    out["longest_gap_s"] = max(gaps, default=0.0)
    out["hangs"] = sum(g > 2 * timeout for g in gaps) + len(result.get("hung_ranks", []))
    # Every rank's steps in order, and replicas alike at every step every live rank recorded.
    out_of_order = [r for r, es in by_rank.items() if [e["step"] for e in es] != list(range(len(es)))]
    crcs: dict[int, set] = {}
    for e in steps:
        if e["step"] >= 0 and meta["workload"] != "async":  # asynchronous replicas differ by design
            crcs.setdefault(e["step"], set()).add(e["crc"])
    out["out_of_order_ranks"] = out_of_order
    out["replicas_differ_at"] = sorted(step for step, c in crcs.items() if len(c) > 1)[:5]
    lost = dup = 0
    if meta["workload"] == "async":
        for r, e in done.items():
            counted, powers = round(-e["model"][r]), -e["model"][n + r]  # a whole number of updates, if exact
            lost += max(0, e["acked"] - counted) + (powers < e["powers"])
            dup += max(0, counted - e["acked"]) + (powers > e["powers"])
    out["lost"], out["duplicated"] = lost, dup
    base = result.get("baseline")
    out["baseline"] = ("bit-identical" if not base["differ"] else f"differs in {base['differ']}") if base else None
    killed = {name for name, code in result.get("exits", {}).items() if code == -9}
    out["failed_ranks"] = {k: v for k, v in result.get("exits", {}).items() if v not in (0, -9)}
    out["killed_ranks"] = sorted(killed)
    memory = result.get("memory", {})
    growth = max((m["peak"] - m["start"] for m in memory.values()), default=0)
    out["memory_growth_mib"], out["memory_bound_mib"] = growth / MB, meta["max_memory"] / MB
    out["left_behind"] = {k: v for k, v in result.get("leftovers", {}).items() if v}
    failures = []
    if out["lost"] or out["duplicated"]:
        failures.append("updates lost or duplicated")
    if out["hangs"]:
        failures.append("hangs")
    if out["out_of_order_ranks"] or out["replicas_differ_at"]:
        failures.append("replicas differ or rounds out of order")
    if base is not None and base["differ"] or meta["workload"] == "ddp" and base is None:
        failures.append("final parameters differ from the fault-free run's (or it did not run)")
    if out["failed_ranks"] or out["fault_errors"]:
        failures.append("a rank or a fault failed")
    if growth > meta["max_memory"]:
        failures.append("server memory past its bound")
    if out["left_behind"]:
        failures.append("left behind")
    if meta["workload"] == "async" and len(done) < n:
        failures.append("a rank did not report its model")
    out["failures"] = failures
    return out


def table(v: dict) -> str:
    rec = v["recovery_s"]
    rows = [
        ("workload, seed, seconds", f"{v['workload']}, {v['seed']}, {v['seconds']:.0f}"),
        ("steps (rank 0)", str(v["steps"])),
        ("faults by kind (injected/recovered)",
         ", ".join(f"{k} {a}/{b}" for k, (a, b) in sorted(v["faults"].items())) or "none"),
        ("faults in all; cleared after the last step",
         f"{sum(a for a, _ in v['faults'].values())} of {len(v['faults'])} kinds; {v['cleared_after_end']}"),
        ("link faults", "skipped: " + v["link_faults_skipped"] if v["link_faults_skipped"] else "on (namespaces)"),
        ("fault cleared to the next step, median / max", f"{rec[0]:.2f} s / {rec[1]:.2f} s" if rec else "n/a"),
        ("recoveries slower than 2x the timeout", str(v["slow_recoveries"])),
        ("longest step gap; hangs", f"{v['longest_gap_s']:.2f} s; {v['hangs']}"),
        ("updates lost / duplicated", f"{v['lost']} / {v['duplicated']}"),
        ("replicas differ at steps; ranks out of order", f"{v['replicas_differ_at']}; {v['out_of_order_ranks']}"),
        ("final parameters vs fault-free run", v["baseline"] or "n/a"),
        ("ranks killed by the nemesis; ranks failed", f"{v['killed_ranks']}; {v['failed_ranks']}"),
        ("server memory growth, peak vs bound", f"{v['memory_growth_mib']:.1f} MiB vs {v['memory_bound_mib']:.0f} MiB"),
        ("left behind", json.dumps(v["left_behind"]) if v["left_behind"] else "nothing"),
        ("verdict", "FAIL: " + "; ".join(v["failures"]) if v["failures"] else "ok"),
    ]  # fmt: skip
    width = max(len(a) for a, _ in rows)
    lines = [f"| {a:<{width}} | {b} |" for a, b in rows]
    lines += [f"  fault error: {e}" for e in v["fault_errors"][:10]]
    return "\n".join(lines)


def check(path: str) -> int:
    v = verdict(path)
    print(table(v), flush=True)
    return 1 if v["failures"] else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="a workload under the nemesis, then the checker's table")
    r.add_argument("--workload", choices=sorted(KINDS), default="ddp")
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--minutes", type=float, default=1.0)
    r.add_argument("--gap", type=float, default=Settings.gap, help="mean seconds between faults")
    r.add_argument("--kinds", default="", help="comma-separated subset of the kinds (default: all that apply)")
    r.add_argument("--no-netns", action="store_true", help="loopback even where namespaces are available")
    r.add_argument("--record", default="", help="the record's path (default: a file in a fresh temporary folder)")
    c = sub.add_parser("check", help="the table of a run's record")
    c.add_argument("record")
    h = sub.add_parser("hostile")
    h.add_argument("address")
    g = sub.add_parser("hog")
    g.add_argument("address")
    g.add_argument("--seconds", type=float, default=5.0)
    st = sub.add_parser("registry")
    st.add_argument("address")
    args = p.parse_args(argv)
    if args.command == "check":
        return check(args.record)
    if args.command == "hostile":
        return hostile(args.address)
    if args.command == "hog":
        return hog(args.address, args.seconds)
    if args.command == "registry":
        return registry(args.address)
    s = Settings(workload=args.workload, seed=args.seed, seconds=args.minutes * 60, gap=args.gap,
                 kinds=tuple(k for k in args.kinds.split(",") if k), netns=not args.no_netns)  # fmt: skip
    path = args.record or os.path.join(tempfile.mkdtemp(prefix="bps-chaos-record-"), "record.jsonl")
    print(f"record: {path}", flush=True)
    return run(s, path)


if __name__ == "__main__":
    sys.exit(main())
