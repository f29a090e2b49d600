"""The training part: samples/s of a communication-bound MLP on the worker hosts, gloo vs the "byteps" backend,
wrapped in DDP or (`DdpSpec.wrap = "fsdp"`) sharded with FSDP2's `fully_shard`.

The byteps run starts summation servers on `k` dedicated server hosts and hands them to the backend in
BPS_SERVERS; the backend's runtime adds colocated servers itself when its placement wants them (k < n;
at k = 0 they are all it has) and splits the bytes with the library's placement. It reports unavailable
until `import torch_bps` registers a "byteps" process group. Every run counts each worker link's bytes
over the timed steps; FSDP2 runs on "byteps" also count the servers' payload bytes against the ideal.
May import: the standard library, benchmarks.cluster (its errors) and benchmarks.cluster.{byteps,procs,topology}.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.cluster import BackendUnavailable, byteps, procs
from benchmarks.cluster.topology import IFNAME, Cluster, Host

WORKER = "benchmarks.cluster.workers.ddp_train"


@dataclass(frozen=True)
class DdpSpec:
    """The model and the run: `layers` x Linear(hidden, hidden), `batch` samples per rank per step.

    `wrap`: "ddp" (DistributedDataParallel) or "fsdp" (`fully_shard` on every Linear and the root); "distopt",
    "crossbarrier", "crossbarrier-nopri" (torch_bps.byteps's optimizers, on "byteps"); "alone" (no communication).
    `model`: "mlp", or "convnet" (workers/ddp_train.py; `layers` unused).
    `hook`: "" or "fp16" (DDP with torch's `fp16_compress_hook`).
    `bucket_view`: DDP's `gradient_as_bucket_view` (gradients live in its buckets: no gradient allocated per step).
    """

    wrap: str = "ddp"
    model: str = "mlp"
    hook: str = ""
    bucket_view: bool = False
    hidden: int = 2048
    layers: int = 6
    batch: int = 16
    steps: int = 5
    warmup: int = byteps.WARMUP
    timeout_s: float = 300.0

    @property
    def params(self) -> int:
        return self.layers * (self.hidden * self.hidden + self.hidden)


def run_ddp(
    cluster: Cluster, backend: str, spec: DdpSpec, store_port: int, env_of: Callable[[int, Host], dict] | None = None
) -> dict:
    """Train `spec.steps` timed steps on every worker host; return samples/s (slowest rank) and CPU use.

    `env_of(rank, host)` adds environment variables per rank.
    """
    store = f"{cluster.workers[0].ip}:{store_port}"
    n = len(cluster.workers)
    ranks = [
        cluster.spawn(
            f"ddp {backend} rank {r}",
            h,
            [
                sys.executable, "-m", WORKER, "--backend", backend, "--rank", str(r), "--world", str(n),
                "--store", store, "--hidden", str(spec.hidden), "--layers", str(spec.layers),
                "--batch", str(spec.batch), "--steps", str(spec.steps), "--warmup", str(spec.warmup),
                "--timeout", str(spec.timeout_s), "--wrap", spec.wrap, "--model", spec.model, "--hook", spec.hook,
                *(["--bucket-view"] if spec.bucket_view else []),
            ],
            {"GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1", **(env_of(r, h) if env_of else {})},
        )
        for r, h in enumerate(cluster.workers)
    ]  # fmt: skip
    results = procs.wait_all(ranks, spec.timeout_s + 30.0, f"{spec.wrap.upper()} {backend}")
    seconds = max(r["seconds"] for r in results)
    out = {
        "samples_per_s": n * spec.batch * spec.steps / seconds,
        "seconds_per_step": seconds / spec.steps,
        "params": results[0]["params"],
        "cpu": {h.name: r["cpu"] for h, r in zip(cluster.workers, results, strict=True)},
        "minor_faults_per_step": sum(r["minor_faults"] for r in results) / spec.steps,
        # Per worker link and direction, IP and TCP headers included; servers colocated on a worker count in.
        "link_bytes_per_step": {
            h.name: {d: b / spec.steps for d, b in r["link_bytes"].items()}
            for h, r in zip(cluster.workers, results, strict=True)
        },
    }
    if "server_bytes" in results[0]:
        out["server_bytes_per_step"] = results[0]["server_bytes"] / spec.steps
        out["ideal_bytes_per_step"] = results[0]["ideal_bytes"] / spec.steps
    return out


def run_ddp_byteps(
    cluster: Cluster, spec: DdpSpec, store_port: int, k: int, server_port: int = 9500, socket_buffer_bytes: int = -1
) -> dict:
    """Run `run_ddp` with the "byteps" backend, servers on the first `k` server hosts (BPS_SERVERS).

    At k = 0 BPS_SERVERS is empty and the backend starts an embedded server on every worker host.
    `socket_buffer_bytes` is the ranks' BPS_SOCKET_BUFFER_BYTES, -1: as for push/pull
    (`byteps.socket_buffer_for`: the kernel's where the links' queue holds every connection's minimum, else sized).
    """
    reason = byteps.probe("backend")
    if reason:
        raise BackendUnavailable(f'"byteps" process group is not usable: {reason}')
    hosts = cluster.servers[:k]
    server_procs, addresses = byteps.start_servers(cluster, hosts, server_port)
    n = len(cluster.workers)
    if socket_buffer_bytes < 0:
        socket_buffer_bytes = byteps.socket_buffer_for(cluster.shaping.limit_bytes, n, k)

    def env_of(rank: int, host: Host) -> dict:
        # One rank per emulated machine. Without torchrun's variables torch_bps takes all ranks for one
        # machine and reduces among them locally (shared memory is shared between namespaces), which
        # would bypass the links. BPS_HOST: the address its embedded server is reached at.
        return {
            "BPS_SERVERS": ",".join(addresses),
            "BPS_HOST": host.ip,
            "BPS_SOCKET_BUFFER_BYTES": str(socket_buffer_bytes),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank),
            "GROUP_WORLD_SIZE": str(n),
            "MASTER_ADDR": cluster.workers[0].ip,
            "MASTER_PORT": str(store_port),
        }

    try:
        return run_ddp(cluster, "byteps", spec, store_port, env_of)
    finally:
        for p in server_procs:
            p.kill()
