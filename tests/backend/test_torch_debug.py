"""What torch records and checks about a "byteps" group: its name ("byteps", in DDP's logging data too), its
sequence numbers, and TORCH_DISTRIBUTED_DEBUG=DETAIL's collective fingerprint checks, in real processes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.helpers import run_ranks
from torch_bps.process_group import implementation

DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
MISMATCH = "Detected mismatch between collectives"


def _seq() -> int:
    return dist.group.WORLD._get_sequence_number_for_group()


def _matched(rank, world, gloo):
    """Every kind of collective, DDP included, under the wrapper: results as gloo's, the same numbers everywhere."""
    pg = dist.group.WORLD
    assert isinstance(pg._get_backend(torch.device("cpu")), dist.distributed_c10d._ProcessGroupWrapper)
    assert implementation() is not None  # found behind the wrapper
    start = _seq()
    t = torch.arange(6, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=1)
    gathered = [torch.empty(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([rank, 10 * rank]))
    out = torch.empty(world * 2)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank)))
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(world * 2, dtype=torch.float32))
    dist.barrier()
    assert _seq() - start == 6, "one sequence number per collective"

    # The reference averages gradients over gloo by hand: DDP itself on a gloo group segfaults in torch 2.13 under
    # DETAIL (in DistributedDataParallel's constructor, with no "byteps" group in the process at all).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    ref = copy.deepcopy(model)
    ddp = DDP(model)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * world + rank))
        for m in (ddp, ref):
            m.zero_grad()
            m(x).square().mean().backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad.div_(world), group=gloo)  # DDP's order: divide, then sum
        with torch.no_grad():
            for m in (ddp, ref):
                for p in m.parameters():
                    p -= 0.1 * p.grad
    same = all(torch.equal(a, b) for a, b in zip(ddp.parameters(), ref.parameters(), strict=True))
    # plain lists: a tensor goes back through the queue as a file descriptor the finished rank no longer shares
    return t.tolist(), b.tolist(), [g.tolist() for g in gathered], out.tolist(), rs.tolist(), same, _seq()


def test_detail_checks_pass_on_matched_collectives():
    results = run_ranks(_matched, 2, env=DETAIL)
    t, b, gathered, out, rs, same, _ = results[0]
    assert t == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]
    assert b == [1.0, 1.0, 1.0]
    assert gathered == [[0, 0], [1, 10]]
    assert out == [0.0, 0.0, 1.0, 1.0]
    assert rs == [0.0, 2.0]
    assert all(r[5] for r in results), "DDP on byteps under DETAIL drifted from DDP on gloo"
    assert results[0][6] == results[1][6]


def _mismatched(rank, world, gloo, kind):
    """One rank's collective differs from the other's; both must hear of it, and the group must go on."""
    if kind == "op":
        call = (lambda: dist.all_reduce(torch.ones(3))) if rank == 0 else (lambda: dist.broadcast(torch.ones(3), 0))
    else:  # same op, another shape
        call = lambda: dist.all_reduce(torch.ones(3 + rank))  # noqa: E731
    with pytest.raises(RuntimeError, match=MISMATCH) as caught:
        call()
    # The check runs before the collective: nothing reached the servers, and the next matched one works.
    t = torch.ones(2)
    dist.all_reduce(t)
    return str(caught.value), t.tolist()


@pytest.mark.parametrize("kind", ["op", "shape"])
def test_detail_catches_a_mismatched_collective(kind):
    results = run_ranks(_mismatched, 2, kind, env=DETAIL)
    for message, t in results:
        assert ("OpType=BROADCAST" in message) if kind == "op" else ("TensorShape=[4]" in message), message
        assert t == [2.0, 2.0]


def _numbers(rank, world, gloo):
    pg = dist.group.WORLD
    assert pg.name() == dist.get_backend() == "byteps"
    logged = DDP(nn.Linear(2, 2))._get_ddp_logging_data()["backend_name"]
    start = _seq()  # DDP's constructor ran collectives too
    dist.all_reduce(torch.ones(1))
    # point-to-point is not counted (ranks make different numbers of them), as with NCCL
    t = torch.zeros(1)
    (dist.send if rank == 0 else dist.recv)(t, 1 - rank)
    dist.barrier()
    return logged, start, _seq()


def test_name_and_sequence_numbers_without_debug():
    results = run_ranks(_numbers, 2)
    assert {r[0] for r in results} == {"byteps"}, "DDP's logging data names the backend"
    assert results[0][1:] == results[1][1:]
    assert results[0][2] - results[0][1] == 2
