"""One rank of the straggler measurement: a student MLP learns a fixed teacher's labels through BackupWorkers, or
through AsyncTraining with `--staleness` (an integer, or inf).

    python -m benchmarks.cluster.workers.straggler_train --rank 0 --world 4 --store 10.77.0.1:29600 \
        --backups 1 --slow-rank 3 --slow-factor 3 --steps 150

The task ships with the code: a teacher network (seeded) labels Gaussian inputs into 10 classes; every rank draws
its own training samples. Rank 0 keeps a copy of its parameters after every step and scores each on a fixed held-out
set of 2,000 once training is over, so no evaluation runs inside anyone's clock. The slow rank takes `--slow-factor`
times as long to compute each step it computes (it sleeps the extra time, measured on the step itself), so the
machine's CPU stays the others'; with `--rotate` the slow rank is step % world, each in turn. Servers: BPS_SERVERS
(dedicated hosts), BPS_FAILOVER=0. Prints one RESULT line: wall seconds, steps computed and caught up, rank 0's
accuracy curve (one point a step), the servers' per-job push counters before and after (rank 0, from `--metrics`), a
hash of the parameters (replicas must agree: with backup workers), and the held-out accuracy once every rank
finished (with AsyncTraining: of the model with every update in, pulled after a barrier).
May import: the standard library, torch, torch_bps and benchmarks.cluster.workers.common.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from datetime import timedelta

from benchmarks.cluster.workers.common import emit, job_counters, score_snapshots, store

INPUTS, CLASSES, TEST = 32, 10, 2000


def teacher_labels(x):
    """The task: a fixed random 2-layer network's argmax (the same on every rank and in every run)."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    w1 = torch.randn(INPUTS, 64, generator=gen) / INPUTS**0.5  # unit-variance pre-activations: tanh not saturated
    w2 = torch.randn(64, CLASSES, generator=gen)
    return (torch.tanh(x @ w1) @ w2).argmax(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--backups", type=int, default=0)
    p.add_argument("--staleness", default="", help="AsyncTraining with s rounds, or inf (default: BackupWorkers)")
    p.add_argument("--slow-rank", type=int, default=-1, help="-1: no straggler")
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--rotate", action="store_true", help="the slow rank changes every step (step %% world)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum")
    p.add_argument("--overlap", action="store_true", help="AsyncTraining(overlap=True)")
    p.add_argument(
        "--metrics",
        type=lambda text: text.split(","),
        default=[],
        help="the servers' Prometheus endpoints, ip:port,... (rank 0 reads the jobs' push counters)",
    )
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.utils import parameters_to_vector

    import torch_bps

    torch.set_num_threads(1)
    rendezvous = store(args.store, args.rank, args.world, args.timeout)
    dist.init_process_group("gloo", store=rendezvous, rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=args.timeout))  # fmt: skip
    torch.manual_seed(0)  # every replica starts equal
    model = torch.nn.Sequential(torch.nn.Linear(INPUTS, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, CLASSES))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=args.momentum)
    stale = args.staleness != ""
    if stale:
        staleness = None if args.staleness == "inf" else int(args.staleness)
        sync = torch_bps.AsyncTraining(model, opt, staleness=staleness, overlap=args.overlap)
    else:
        sync = torch_bps.BackupWorkers(model, opt, backups=args.backups)
    data = torch.Generator().manual_seed(100 + args.rank)
    test_x = torch.randn(TEST, INPUTS, generator=torch.Generator().manual_seed(7))
    test_y = teacher_labels(test_x)
    snapshots = [(0.0, 0, parameters_to_vector(model.parameters()).detach().clone())]  # rank 0: after each step
    counters = job_counters(args.metrics) if args.rank == 0 else None

    dist.barrier()
    start = time.perf_counter()
    computed = 0
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        if stale or sync.compute():
            began = time.perf_counter()
            x = torch.randn(args.batch, INPUTS, generator=data)
            F.cross_entropy(model(x), teacher_labels(x)).backward()
            if args.rank == (step % args.world if args.rotate else args.slow_rank):
                time.sleep((args.slow_factor - 1) * (time.perf_counter() - began))
            computed += 1
        sync.step()
        if args.rank == 0:
            snapshots.append((time.perf_counter() - start, step + 1, parameters_to_vector(model.parameters()).clone()))
    if stale:
        sync.flush()  # this rank's updates are in
    seconds = time.perf_counter() - start
    dist.barrier()
    if stale:  # every update is in: one more pull reads the model they make
        sync.flush()
    with torch.no_grad():
        final = (model(test_x).argmax(1) == test_y).float().mean().item()
    curve = []  # (seconds, step, held-out accuracy), rank 0
    if args.rank == 0:
        counters = {"before": counters, "after": job_counters(args.metrics)}
        curve = score_snapshots(model, snapshots, test_x, test_y)
    snapshots.clear()
    params = hashlib.sha256(b"".join(q.detach().numpy().tobytes() for q in model.parameters())).hexdigest()
    emit({"rank": args.rank, "seconds": seconds, "steps": args.steps, "computed": computed,
          "caught_up": 0 if stale else sync.caught_up, "curve": curve, "params": params,
          "final": final, "counters": counters})  # fmt: skip
    sync.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
