"""Sparse all_reduce on "byteps" against gloo's, in the same ranks: the coalesced sum, bit for bit, refusals that
reach every rank, DDP with nn.Embedding(sparse=True), and the servers' bytes: the rows touched, not the dense size.

Values are small integers (or halves), so any sum of them is exact and the order of addition cannot matter.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_bps
from tests.helpers import run_ranks
from torch_bps.pg import sparse


def _sparse(rank: int, sizes: list[int], sparse_dim: int, rows: list[list[int]], dtype=torch.float32):
    """A sparse tensor whose index columns are `rows` (repeats allowed: uncoalesced), values from the rank."""
    indices = torch.tensor(rows, dtype=torch.int64).t().reshape(sparse_dim, len(rows))
    g = torch.Generator().manual_seed(rank * 100 + len(rows))
    shape = (len(rows), *sizes[sparse_dim:])
    values = torch.randint(-8, 8, shape, generator=g).to(dtype) / (2 if dtype.is_floating_point else 1)
    return torch.sparse_coo_tensor(indices, values, sizes)


def _cases(rank: int) -> list[tuple[str, torch.Tensor, str]]:
    """(name, tensor, op): shapes of 1 to 3 sparse and 0 to 2 dense dimensions, rows shared and not, empty.
    No complex tensor: torch's dist.all_reduce hands a backend a real view of a sparse complex tensor, which is a copy,
    so neither gloo nor "byteps" can write the caller's tensor."""
    r = rank
    return [
        ("1 sparse dim", _sparse(r, [10], 1, [[r], [r + 1], [7], [r]]), "SUM"),  # rank's rows repeat: uncoalesced
        ("2 dense dims", _sparse(r, [6, 2, 3], 1, [[5 - r], [0]]), "SUM"),
        ("3 sparse dims", _sparse(r, [4, 4, 5, 2], 3, [[r, 1, 4], [0, 3, r], [2, 2, 2]]), "SUM"),
        ("float64", _sparse(r, [12, 4], 1, [[r * 3], [8]], torch.float64), "SUM"),
        ("int64", _sparse(r, [9, 4], 1, [[r * 2], [1]], torch.int64), "SUM"),
        ("AVG float", _sparse(r, [8, 2], 1, [[r], [3]]), "AVG"),
        ("empty on rank 0", _sparse(r, [8, 2], 1, [[r]] if r else []), "SUM"),
        ("empty everywhere", _sparse(r, [8, 2], 1, []), "SUM"),
        ("one row of a big table", _sparse(r, [100_000, 16], 1, [[99_999 - r]]), "SUM"),
    ]


def _compare_with_gloo(rank, world, gloo):
    for name, t, op in _cases(rank):
        ours, theirs = t.clone(), t.clone()
        reduce_op = getattr(dist.ReduceOp, op)
        dist.all_reduce(ours, reduce_op)
        if op == "AVG":  # gloo's sparse all_reduce takes SUM only; floats are divided first, as a dense AVG's
            theirs = theirs / world
            dist.all_reduce(theirs, dist.ReduceOp.SUM, group=gloo)
        else:
            dist.all_reduce(theirs, reduce_op, group=gloo)
        assert ours.is_coalesced(), name
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
        theirs = theirs.coalesce()
        assert torch.equal(ours._indices(), theirs._indices()), (name, ours._indices(), theirs._indices())
        assert torch.equal(ours._values(), theirs._values()), (name, ours._values(), theirs._values())
    return True


@pytest.mark.parametrize("world, local", [(2, 1), (3, 1), (4, 2)])  # local: ranks per machine, reducing locally first
def test_sparse_all_reduce_is_the_coalesced_sum_gloo_gives(world, local):
    results = run_ranks(_compare_with_gloo, world, env={"LOCAL_WORLD_SIZE": str(local)}, timeout=200)
    assert results == [True] * world


def _refusals(rank, world, gloo):
    caught = {}
    for what, t in [
        ("size", _sparse(rank, [4 + rank, 2], 1, [[0]])),
        ("dtype", _sparse(rank, [4, 2], 1, [[0]], torch.float64 if rank else torch.float32)),
        ("range", _sparse(rank, [4, 2], 1, [[4 if rank else 0]])),
    ]:
        with pytest.raises(ValueError) as e:
            dist.all_reduce(t)
        caught[what] = str(e.value)
    with pytest.raises(ValueError, match="MAX of a sparse tensor"):
        dist.all_reduce(_sparse(rank, [4, 2], 1, [[0]]), dist.ReduceOp.MAX)
    t = _sparse(rank, [4, 2], 1, [[rank]])  # the group still works after the refusals
    dist.all_reduce(t)
    assert torch.equal(t.to_dense(), sum(_sparse(r, [4, 2], 1, [[r]]).to_dense() for r in range(world)))
    return caught


def test_a_refused_sparse_tensor_fails_every_rank_at_once_naming_it():
    caught = run_ranks(_refusals, 2, timeout=120)
    for rank, msgs in enumerate(caught):
        assert f"size [{4 + rank}, 2]" in msgs["size"] and f"ranks [{1 - rank}]" in msgs["size"]
        assert "sparse_dim or dtype" in msgs["dtype"]
        assert "rank(s) [1]" in msgs["range"] and "outside its size [4, 2]" in msgs["range"]


class EmbeddingBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 16, sparse=True)
        self.out = nn.Linear(16, 1)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(dim=1))


def _ddp_sparse(rank, world, gloo, door):
    torch.manual_seed(0)
    base = EmbeddingBag()
    models = {"byteps": DDP(copy.deepcopy(base)), "gloo": DDP(copy.deepcopy(base), process_group=gloo)}
    if door == "bps_hook on gloo":
        models["byteps"] = DDP(copy.deepcopy(base), process_group=gloo)
        models["byteps"].register_comm_hook(torch_bps.BpsHookState(process_group=gloo), torch_bps.bps_hook)
    elif door == "bps_hook on byteps":
        models["byteps"].register_comm_hook(torch_bps.BpsHookState(), torch_bps.bps_hook)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.5) for k, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        ids = torch.randint(0, 1000, (8, 4), generator=g)
        target = torch.randn(8, 1, generator=g)
        for k, m in models.items():
            opts[k].zero_grad()
            nn.functional.mse_loss(m(ids), target).backward()
            assert m.module.emb.weight.grad.is_sparse
            opts[k].step()
    return [torch.equal(a, b) for a, b in zip(models["byteps"].parameters(), models["gloo"].parameters(), strict=True)]


@pytest.mark.parametrize("door", ["byteps group", "bps_hook on gloo", "bps_hook on byteps"])
def test_ddp_with_a_sparse_embedding_trains_bit_identically_to_gloo(door):
    for equal in run_ranks(_ddp_sparse, 2, door, timeout=150):
        assert all(equal), equal


def _server_bytes():
    from torch_bps import implementation

    client = implementation().runtime._client
    return sum(s["bytes_in"] + s["bytes_out"] for s in (client.server_stats(i) for i in range(len(client.servers))))


def _bytes_of_sums(rank, world, gloo, calls, width):
    """The servers' bytes and the gathers of each of `calls` sparse sums (rank r's rows: calls[i][r]), after one
    that declares keys."""
    table, moved, gathers, real_gather = 50_000, [], [], sparse._gather_now

    def counted(*args):
        gathers[-1] += 1
        return real_gather(*args)

    sparse._gather_now = counted
    for rows in [calls[0], *calls]:
        dist.barrier(group=gloo)
        before = _server_bytes() if rank == 0 else 0
        gathers.append(0)
        dist.barrier(group=gloo)
        dist.all_reduce(_sparse(rank, [table, width], 1, [[i] for i in rows[rank]]))
        dist.barrier(group=gloo)
        moved.append(_server_bytes() - before if rank == 0 else None)
    return list(zip(moved, gathers, strict=True))[1:]


def test_the_servers_move_the_rows_touched_not_the_table():
    world, width, meta, row = 2, 32, sparse.META_LEN * 8, 32 * 4
    calls = [
        [list(range(0, 20)), list(range(10, 35))],  # 20 and 25 rows, 35 in the union
        [list(range(0, 20)), list(range(10, 50))],  # 20 and 40: more ids than the room the last sum left
    ]
    (same, once), (more, twice) = run_ranks(_bytes_of_sums, world, calls, width, timeout=120)[0]
    assert (once, twice) == (1, 2)  # the ids of the last sum fit with the shapes; then they do not
    # A gather: each rank pushes its slot, pulls all of them. The sum: each rank pushes and pulls the union's rows.
    gather = world + world * world
    room = sparse.padded(25 + 25 // 4)
    assert same == gather * (meta + room * 8) + 2 * world * sparse.padded(35) * row, same
    assert more == gather * (meta + room * 8 + sparse.padded(40) * 8) + 2 * world * sparse.padded(50) * row, more
    assert same < 2 * world * 50_000 * row / 100  # a hundredth of a dense sum of the table
