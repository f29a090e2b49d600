"""The byteps side of the sweep: a pluggable runner slot and the default runner for torch_bps push/pull.

A runner is any callable `(BytepsJob) -> StepTime`: given the cluster, the worker hosts, the k server
hosts of this point of the sweep and the tensor size, it measures seconds per push/pull step. It raises
`BackendUnavailable` when it cannot run here (the sweep then reports byteps as unavailable and goes
on), `MeasurementError` when a run fails. `run_torch_bps` is the default; pass another to
`sweep.run(..., byteps_runner=...)` to measure a different implementation on the same network.

Example:
    def my_runner(job: BytepsJob) -> StepTime:
        procs = [job.cluster.spawn(f"w{i}", h, [...]) for i, h in enumerate(job.workers)]
        ...
        return StepTime(seconds_per_step=1.23, cpu={"w0": {...}})
May import: the standard library, benchmarks.cluster (its errors) and benchmarks.cluster.{cpu,procs,theory,topology}.
"""

from __future__ import annotations

import functools
import os
import secrets
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.cluster import BackendUnavailable, procs, theory
from benchmarks.cluster.topology import IFNAME, Cluster, Host
from torch_bps.engine import placement as library_placement

SERVER_READY = "bps-server listening"
SERVER_START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class BytepsJob:
    """One point of the sweep, as handed to a runner."""

    cluster: Cluster  # spawn processes in hosts with cluster.spawn(name, host, argv, env)
    workers: tuple[Host, ...]  # the n worker hosts (each may also run a colocated server)
    servers: tuple[Host, ...]  # the k dedicated server hosts of this point (k = len(servers))
    size_bytes: int  # gradient bytes M summed per step (fp32)
    steps: int  # timed steps
    warmup: int  # untimed steps before them
    timeout_s: float  # the whole measurement must finish within this

    @property
    def k(self) -> int:
        return len(self.servers)


# Untimed steps of every runner: torch_bps's KeyBook gives 4 concurrent calls of one size distinct keys (slots), so
# the first rounds of every slot (new keys on the servers, new plans and the garbage they leave) are over after 5.
WARMUP = 5


@dataclass(frozen=True)
class StepTime:
    """A runner's answer: mean seconds per step of the slowest worker, CPU use per host, and `paired` (the blocks
    alternated with gloo's, `paired_cpu`) when asked for."""

    seconds_per_step: float
    cpu: dict = field(default_factory=dict)
    paired: dict | None = None


BytepsRunner = Callable[[BytepsJob], StepTime]


# What `probe` runs for each front door: the client's import loads the C++ extension; the backend's asks whether
# `import torch_bps` registered "byteps". A failure's reason is the last line stderr gets.
_PROBES = {
    "client": "from torch_bps.client import Client",
    "backend": (
        "import sys, torch.distributed as dist, torch_bps\n"
        "if 'byteps' not in dist.Backend.backend_list:\n"
        "    sys.exit(\"`import torch_bps` registered no 'byteps' process group\")"
    ),
}


@functools.cache
def probe(what: str) -> str:
    """Return "" if the torch_bps front door `what` ("client"/"backend") imports here, else why not.

    Runs in a subprocess (a broken extension must not take the orchestrator down); cached per run.
    """
    argv = [sys.executable, "-c", _PROBES[what]]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=procs.REPO_ROOT)
    except subprocess.TimeoutExpired:
        return "probing torch_bps took over 120 s"
    if done.returncode == 0:
        return ""
    last = done.stderr.strip().splitlines()[-1:]  # an exception's, as its traceback ends: "ImportError: ..."
    return last[0] if last else f"probe exited {done.returncode}"


def start_servers(
    cluster: Cluster,
    hosts: list[Host],
    port: int,
    trace_dir: str = "",
    receive_buffers: list[int] | None = None,
    metrics_port: int | None = None,
) -> tuple[list[procs.Proc], list[str]]:
    """Start one `python -m torch_bps.server` per host on `port`; wait until each listens.

    `trace_dir`: each server records its timeline there (`bps-server --trace`). `receive_buffers`: each
    server's `--receive-buffer-bytes`, one per host (None: the kernel's). `metrics_port`: each server serves its
    counters at http://ip:metrics_port/metrics.
    Returns the server processes (kill them when done) and their addresses, "ip:port" per host.
    Authentication is on: the servers and every worker started after them (which inherit this process's
    environment) share one pool credential.
    """
    os.environ.setdefault("BPS_POOL_CREDENTIAL", secrets.token_urlsafe(32))
    started = [
        cluster.spawn(
            f"bps-server {h.name}",
            h,
            [sys.executable, "-m", "torch_bps.server", "--host", h.ip, "--port", str(port)]
            + (["--trace", trace_dir] if trace_dir else [])
            + (["--receive-buffer-bytes", str(receive_buffers[i])] if receive_buffers else [])
            + (["--metrics-port", str(metrics_port)] if metrics_port is not None else []),
            {"OMP_NUM_THREADS": "1"},
        )
        for i, h in enumerate(hosts)
    ]
    try:
        for proc in started:
            procs.wait_for_line(proc, SERVER_READY, SERVER_START_TIMEOUT_S)
    except BaseException:
        for proc in started:
            proc.kill()
        raise
    return started, [f"{h.ip}:{port}" for h in hosts]


def shared_fraction(result: dict) -> float | None:
    """Of the bytes on a worker's local streams (both ways, the whole run), the share that went through shared
    memory; None without a local stream."""
    streams = zip(result.get("stream_bytes", []), result.get("local_streams", []), strict=True)
    local = [sum(b) for b, on in streams if on]
    return round(sum(result.get("shared_bytes", [])) / sum(local), 3) if sum(local) else None


def run_torch_bps(
    job: BytepsJob,
    placement_mode: str = "engine",
    partition_bytes: int = 4_096_000,
    port: int = 9000,
    credit_bytes: int = 0,
    socket_buffer_bytes: int = -1,
    trace_dir: str = "",
    equal_receive_buffers: bool = False,
    server_receive_buffers: bool = False,
    pairs: int = 0,
) -> StepTime:
    """Measure torch_bps push/pull with the paper's x / 1-x split of the bytes.

    Servers: one on each of the k dedicated hosts and, when the split gives them bytes (k < n), one
    colocated on each worker host. Every worker then runs workers/bps_pushpull.py. `placement_mode`
    "exact" splits to the byte (benchmarks/cluster/theory.py); "library" places 4 MB partitions
    with torch_bps.engine.placement. Either way no partition exceeds `partition_bytes` (BytePS's default
    4096000). `socket_buffer_bytes` is the workers' BPS_SOCKET_BUFFER_BYTES: -1 picks it from the links' queue
    (`socket_buffer_for`: 0 where the queue holds every connection's minimum), 0 leaves the kernel's buffers.
    Bind the keywords with functools.partial to pass it as a runner. `trace_dir`: the workers' timed steps and the
    servers are recorded into trace_dir/kK (torch_bps.timeline's files). Each worker's receive buffer toward a
    server goes by the server's share, as the library sizes it; `equal_receive_buffers`: all the socket buffer.
    `server_receive_buffers`: the servers' too (`bps-server --receive-buffer-bytes`), else the kernel's.
    `pairs`: then that many pairs of blocks of gloo all_reduce and push/pull steps, alternated in the same processes
    (`paired_cpu`).
    """
    reason = probe("client")
    if reason:
        raise BackendUnavailable(f"torch_bps.client is not usable: {reason}")
    n, k = len(job.workers), job.k
    port += k  # a fresh port per point: no wait for the previous point's sockets to close
    colocated = list(job.workers) if theory.dedicated_fraction(n, k) < 1.0 else []
    cluster = job.cluster
    trace = os.path.join(trace_dir, f"k{k}") if trace_dir else ""
    if trace:
        os.makedirs(trace, exist_ok=True)
    if socket_buffer_bytes < 0:
        socket_buffer_bytes = socket_buffer_for(cluster.shaping.limit_bytes, n, k)
    receive = None  # each server's receive buffer by its share, as the workers size theirs toward it
    if server_receive_buffers:
        weights = library_placement.server_weights(["c"] * len(colocated), ["d"] * k)
        receive = library_placement.receive_buffers(socket_buffer_bytes, weights)
    server_procs, addresses = start_servers(cluster, list(job.servers) + colocated, port, trace, receive)
    by_host = dict(zip(list(job.servers) + colocated, addresses, strict=True))
    server_list = ",".join(by_host.get(h, "-") for h in list(job.servers) + list(job.workers))
    # Worker 0 measures the servers' CPU over its timed steps, the window of every worker's own figure.
    watch = ",".join(f"{p.host} server={p.pid}" for p in server_procs)
    try:
        results = _run_workers(
            job,
            server_list,
            [
                "--placement",
                placement_mode,
                "--partition-bytes",
                str(partition_bytes),
                "--credit-bytes",
                str(credit_bytes),
                *(["--trace", trace] if trace else []),
                *(["--equal-receive-buffers"] if equal_receive_buffers else []),
                *(["--pairs", str(pairs), "--gloo-store", f"{job.workers[0].ip}:{29700 + k}"] if pairs else []),
            ],
            {"BPS_SOCKET_BUFFER_BYTES": str(socket_buffer_bytes), "GLOO_SOCKET_IFNAME": IFNAME},
            watch,
        )
    finally:
        for p in server_procs:
            p.kill()
    servers_cpu = {}  # worker 0's (`--watch`); the others watched nothing
    for r in results:
        servers_cpu.update(r["cpu"].pop("watched"))
    # Per worker host, beside its CPU: how many of its servers it reached over a stream (and a local one), its credit
    # at the end and its timed steps' seconds.
    cpu = {
        h.name: {
            **r["cpu"],
            "streams_ready": sum(r.get("streams", [])),
            "streams_local": sum(r.get("local_streams", [])),  # of them, on a server's local stream (unix socket)
            "local_shared": shared_fraction(r),
            "io_wakeups_per_step": r.get("io_wakeups_per_step"),
            "credit_bytes": r.get("scheduler", {}).get("credit_bytes"),
            "steps_s": r.get("steps"),
        }
        for h, r in zip(job.workers, results, strict=True)
    }
    cpu.update(servers_cpu)
    return StepTime(max(r["seconds_per_step"] for r in results), cpu, paired_cpu(results) if pairs else None)


def paired_cpu(results: list[dict]) -> dict:
    """Summarise the blocks of `bps_pushpull --pairs`: per block, CPU-seconds per step of the runner's processes
    (every worker process; the servers too for push/pull) and of the machine's softirq threads, and per pair the
    ratio of push/pull's to gloo's, with and without those threads.

    The workers' figure for a gloo block includes their idle torch_bps threads, and the servers sit idle through it
    (`servers_cores_in_gloo`, reported so that it shows they cost nothing then).
    """
    blocks = []
    for i, head in enumerate(results[0]["pairs"]):
        per_worker = [r["pairs"][i] for r in results]
        step = max(b["seconds_per_step"] for b in per_worker)
        workers = sum(b["cpu"]["process_cores"] for b in per_worker)
        servers = sum(c["process_cores"] for c in head["cpu"]["watched"].values())
        softirq = head["cpu"]["softirq_threads_cores"]
        processes = workers + (servers if head["runner"] == "byteps" else 0.0)
        blocks.append({
            "pair": head["pair"], "runner": head["runner"], "seconds_per_step": round(step, 4),
            "workers_cores": round(workers, 4), "servers_cores": round(servers, 4), "softirq_threads_cores": softirq,
            "cpu_s_per_step": round(processes * step, 4),
            "with_softirq_threads": round((processes + softirq) * step, 4),
        })  # fmt: skip
    pairs = {}
    for b in blocks:
        pairs.setdefault(b["pair"], {})[b["runner"]] = b
    ratios = [
        (p["byteps"]["cpu_s_per_step"] / p["gloo"]["cpu_s_per_step"],
         p["byteps"]["with_softirq_threads"] / p["gloo"]["with_softirq_threads"])
        for p in pairs.values()
    ]  # fmt: skip
    return {
        "blocks": blocks,
        "cpu_vs_gloo": [round(a, 3) for a, _ in ratios],
        "with_softirq_threads_vs_gloo": [round(b, 3) for _, b in ratios],
        "median_cpu_vs_gloo": round(statistics.median(a for a, _ in ratios), 3),
        "median_with_softirq_threads_vs_gloo": round(statistics.median(b for _, b in ratios), 3),
        "servers_cores_in_gloo": round(statistics.mean(b["servers_cores"] for b in blocks if b["runner"] == "gloo"), 4),
    }


# What the kernel keeps of one TCP connection in its host's link queue however small the connection's share: TCP
# small queues let two packets wait in the qdisc, and a packet is a GSO burst of up to 64 KiB. A queue that holds
# this much for every connection through it does not drop with the kernel's buffers; a smaller one overflows.
KERNEL_QUEUE_PER_CONNECTION = 128 << 10


def uplink_connections(n: int, k: int) -> int:
    """Return the most TCP connections one host's uplink carries, counting servers with bytes (`server_shares`).

    A worker host: its pushes to every such server but its own colocated one (a local stream), and that server's
    replies to the other n - 1 workers. A dedicated server host: its replies to the n workers.
    """
    shares = theory.server_shares(n, k)
    colocated = shares[-1] > 0
    pushes = sum(share > 0 for share in shares) - colocated
    return max(pushes + (n - 1 if colocated else 0), n if k else 0)


def socket_buffer_for(link_queue_bytes: int, n: int, k: int) -> int:
    """Return socket buffer bytes per server connection such that a link's queue holds what they let fly.

    0 (the kernel's buffers) where the queue holds what the kernel keeps of each connection sharing an uplink
    anyway (KERNEL_QUEUE_PER_CONNECTION): there small buffers only cost wake-ups, CPU and step time.
    Otherwise: a worker's link carries its connection to each server and, at k < n, its colocated server's
    connections to the other workers, each with at most about the buffer's size in flight (the kernel doubles the
    value for its bookkeeping). A third more than an even share of the queue per connection fits: the flows are
    rarely all full at once.

    The share is per server that carries bytes, counted by the paper's split (`theory.server_shares`): the
    effective number of servers, 1 / sum(share^2), is about n at every k. Counting every server alike would starve
    the dedicated servers' connections, which carry most bytes, of window.
    """
    if uplink_connections(n, k) * KERNEL_QUEUE_PER_CONNECTION <= link_queue_bytes:
        return 0
    return max(4096, int(link_queue_bytes / (3 * theory.effective_servers(n, k))))


def _run_workers(job: BytepsJob, server_list: str, extra: list[str], env: dict[str, str], watch: str) -> list[dict]:
    """Run the workers; worker 0 measures the `watch` processes' CPU too (`--watch`)."""
    n, k = len(job.workers), job.k
    workers = [
        job.cluster.spawn(
            f"bps worker {i}",
            h,
            [
                sys.executable, "-m", "benchmarks.cluster.workers.bps_pushpull",
                "--worker", str(i), "--num-workers", str(n), "--k", str(k), "--servers", server_list,
                "--size-bytes", str(job.size_bytes), "--steps", str(job.steps), "--warmup", str(job.warmup),
                "--timeout", str(job.timeout_s), *extra, *(["--watch", watch] if i == 0 else []),
            ],
            {"OMP_NUM_THREADS": "1", **env},
        )
        for i, h in enumerate(job.workers)
    ]  # fmt: skip
    return procs.wait_all(workers, job.timeout_s, f"torch_bps push/pull k={k}")
