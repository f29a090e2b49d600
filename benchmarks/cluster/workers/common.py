"""Helpers shared by the worker programs: printing the result line, the TCPStore rendezvous, the servers' counters.

May import: the standard library, torch (lazily), and benchmarks.cluster.cpu.
"""

from __future__ import annotations

import gc
import itertools
import json
import sys
import time
from collections.abc import Callable
from datetime import timedelta


def emit(result: dict) -> None:
    """Print the one `RESULT {json}` line the orchestrator reads (see benchmarks.cluster.procs)."""
    print("RESULT " + json.dumps(result), flush=True)


def store(addr: str, rank: int, world: int, timeout_s: float):
    """Return the job's TCPStore: rank 0 hosts it on `addr` ("ip:port", inside its namespace)."""
    import torch.distributed as dist

    host, _, port = addr.rpartition(":")
    return dist.TCPStore(host, int(port), world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))


def job_counters(metrics: list[str]) -> dict[str, dict[str, int]]:
    """Return each job's pushes served and pushes dropped late (bps_job_pushes_total, bps_job_late_pushes_total),
    summed over the servers whose Prometheus endpoints are `metrics` ("ip:port"); benchmarks.metrics reads them."""
    import urllib.request

    jobs: dict[str, dict[str, int]] = {}
    for address in metrics:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
            for job, counts in parse_job_counters(reply.read().decode()).items():
                mine = jobs.setdefault(job, {"pushes": 0, "late_pushes": 0})
                for name, value in counts.items():
                    mine[name] += value
    return jobs


def parse_job_counters(text: str) -> dict[str, dict[str, int]]:
    """Each job's pushes and late pushes in one server's Prometheus text."""
    import re

    jobs: dict[str, dict[str, int]] = {}
    for name, job, value in re.findall(r'^bps_job_(pushes|late_pushes)_total\{job="(\w+)"\} (\d+)$', text, re.M):
        jobs.setdefault(job, {"pushes": 0, "late_pushes": 0})[name] = int(value)
    return jobs


def score_snapshots(model, snapshots: list, test_x, test_y) -> list[tuple[float, int, float]]:
    """Score each (seconds, step, flat parameters) snapshot of `model` on the held-out set: the accuracy curve,
    made once training is over so that no evaluation runs inside any clock (benchmarks.metrics reads it)."""
    import copy

    import torch
    from torch.nn.utils import vector_to_parameters

    scored, curve = copy.deepcopy(model), []
    with torch.no_grad():
        for seconds, step, flat in snapshots:
            vector_to_parameters(flat, scored.parameters())
            curve.append((seconds, step, (scored(test_x).argmax(1) == test_y).float().mean().item()))
    return curve


def settle() -> None:
    """Collect Python's garbage before the timed steps, as `timeit` does, in every runner alike.

    Why: the warm-up builds what the timed steps reuse (torch_bps's partition plans, one per key slot), and the
    objects it leaves behind make a full collection due soon after. Run in a worker's main thread while it hands a
    step's partitions down, that collection holds the step back: once per run, a large share of a few timed
    steps. A training job pays it once, not once in five steps.
    """
    gc.collect()


def timed_steps(step: Callable[[], None], count: int) -> list[float]:
    """Run step() count times; return each one's seconds (what slows one step shows in them: BBR's PROBE_RTT
    every 10 s did, in every runner, until the benchmark chose Reno)."""
    ends = [time.perf_counter()]
    for _ in range(count):
        step()
        ends.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(ends)]


def fail(message: str, code: int = 2) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)
