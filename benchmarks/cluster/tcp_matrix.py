"""A byteps runner with no byteps in it: plain TCP moving a push/pull step's bytes (workers/tcp_matrix.c).

Where torch_bps's step lands against t_opt mixes what the links and TCP allow with what our protocol adds
(partitions, credit, acknowledgements, the engine). This runner keeps only the first: the same hosts, the same
connections (one per worker and server), the same socket buffers and the paper's split of the bytes, and plain
TCP carrying them. Its x t_opt is what TCP's own sharing of the links gives these bytes; with `--tcp-pace` every
connection is held to the rate t_opt needs instead.

    python -m benchmarks.cluster -n 8 --rate 250 --size-mb 32 --ks 4 --repeats 1 --no-ddp --runner tcp-free

May import: the standard library, benchmarks.cluster (its errors) and
benchmarks.cluster.{byteps,procs,theory}.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile

from benchmarks.cluster import BackendUnavailable, procs, theory
from benchmarks.cluster.byteps import BytepsJob, StepTime, socket_buffer_for

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "tcp_matrix.c")


def program() -> str:
    """Return the path of workers/tcp_matrix.c built with the system's C compiler (once per version of the source).

    Raises BackendUnavailable when it cannot be built here.
    """
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"bps-tcp-matrix-{digest}")
    if os.path.exists(path):
        return path
    partial = f"{path}.{os.getpid()}"
    try:
        subprocess.run(["cc", "-O2", "-Wall", "-o", partial, SOURCE], check=True, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        raise BackendUnavailable(f"cannot build {SOURCE}: {e} {detail.decode(errors='replace')[-500:]}") from e
    os.replace(partial, path)  # atomic: a concurrent run sees the whole program or none
    return path


def run_tcp_matrix(
    job: BytepsJob, mode: str = "rounds", partition_bytes: int = 128 << 10, socket_buffer_bytes: int = -1,
    port: int = 9100, pace: float = 0.0, buffers_by_share: bool = False, lead_bytes: int = 0,
) -> StepTime:  # fmt: skip
    """Measure plain TCP on the bytes of a push/pull step: `mode` "rounds" or "free" (workers/tcp_matrix.c).

    Servers stand where run_torch_bps starts them: one per dedicated host and, when the split gives them bytes,
    one on each worker host. `socket_buffer_bytes` as in run_torch_bps (-1: socket_buffer_for).
    `pace` > 0 caps every connection's rate at its bytes per step / (pace x t_opt): the rates t_opt needs, which
    TCP's sharing of a link between its connections does not give them.
    `buffers_by_share` sizes each connection's buffers (both ends) in proportion to its server's share of the bytes
    instead: socket_buffer_bytes x share x effective servers (1 / sum share^2), so that the windows share each link.
    `lead_bytes` > 0 (rounds): a server reads no worker's pushes more than that ahead of the slowest worker's, and
    the unread bytes close that worker's window: the server's receive window as a grant.
    """
    binary = program()
    n, k = len(job.workers), job.k
    port += k  # a fresh port per point, as run_torch_bps does
    if socket_buffer_bytes < 0:
        socket_buffer_bytes = socket_buffer_for(job.cluster.shaping.limit_bytes, n, k)
    hosts = list(job.servers) + list(job.workers)
    # k dedicated servers, then n colocated ones (with no bytes at k = n: x = 1)
    shares = theory.server_shares(n, k)
    step_bytes = [round(share * job.size_bytes) for share in shares]
    steps = job.warmup + job.steps
    pace_seconds = pace * theory.t_opt_s(n, k, job.size_bytes, job.cluster.shaping.rate_mbit * 1e6)
    common = ["--mode", mode, "--steps", str(steps), "--warmup", str(job.warmup), "--timeout", str(job.timeout_s),
              "--partition-bytes", str(partition_bytes), "--pace-seconds", str(pace_seconds),
              "--lead-bytes", str(lead_bytes)]  # fmt: skip
    effective = theory.effective_servers(n, k)
    buffers = [int(socket_buffer_bytes * share * effective) if buffers_by_share else socket_buffer_bytes
               for share in shares]  # fmt: skip
    servers = []
    try:
        for i, (host, nbytes) in enumerate(zip(hosts, step_bytes, strict=True)):
            if nbytes == 0:
                continue
            remote = n if i < k else n - 1  # a colocated server's own worker pushes to it over no link
            argv = [binary, "serve", "--port", str(port), "--workers", str(remote),
                    "--bytes", str(nbytes), *common, "--socket-buffer-bytes", str(buffers[i])]  # fmt: skip
            servers.append(job.cluster.spawn(f"tcp server {host.name}", host, argv))
        for proc in servers:
            procs.wait_for_line(proc, "tcp_matrix serving", 60.0)
        workers = []
        for w, host in enumerate(job.workers):
            targets = [f"{h.ip}:{port}:{b}:{buffers[i]}" for i, (h, b) in enumerate(zip(hosts, step_bytes, strict=True))
                       if b and h is not host]  # fmt: skip
            argv = [binary, "push", "--servers", ",".join(targets), *common]
            workers.append(job.cluster.spawn(f"tcp worker {w}", host, argv))
        results = procs.wait_all(workers + servers, job.timeout_s, f"plain TCP ({mode}) k={k}")
    finally:
        for proc in servers:
            proc.kill()
    cpu = {
        h.name: {**r["cpu"], "steps_s": r["steps"]} for h, r in zip(job.workers, results[: len(workers)], strict=True)
    }
    for proc, r in zip(servers, results[len(workers) :], strict=True):
        cpu[f"{proc.host} server (whole run)"] = r["cpu"]
    return StepTime(max(r["seconds_per_step"] for r in results[: len(workers)]), cpu)
