"""DistributedDataParallel on a "byteps" group against the same model on gloo, in the same processes.

Both copies start from the same weights and see the same data; after every backward their gradients must
agree within helpers.PAIR_TOL (with two ranks the sums are in fact exact: x/2 + y/2 has one rounding either way), and
after the last step every rank must hold bit-identical parameters.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.helpers import run_ranks, train_pair
from torch_bps.process_group import BackendBPS, implementation

CONFIGS = {
    "buffers": dict(),
    "unused_parameters": dict(find_unused_parameters=True),
    "static_graph": dict(static_graph=True),
    "bucket_view_small_buckets": dict(gradient_as_bucket_view=True, bucket_cap_mb=0.002),  # several buckets
}


def _ddp_configs(rank, world, gloo):
    bps = dist.group.WORLD
    assert isinstance(implementation(bps), BackendBPS)
    return {name: train_pair(rank, world, gloo, bps, kw, with_unused=name == "unused_parameters")
            for name, kw in CONFIGS.items()}  # fmt: skip


@pytest.mark.timeout(180)
def test_ddp_on_byteps_matches_gloo():
    results = run_ranks(_ddp_configs, 2, timeout=160)
    # Two ranks: a + b rounds the same whichever side adds, so byteps and gloo agree to the bit.
    assert results == [dict.fromkeys(CONFIGS, 0.0)] * 2


def _torch_hooks(rank, world, gloo):
    bps = dist.group.WORLD
    worst = {}
    # fp16_compress_hook: the sum travels as float16 (divided first by the hook, so no overflow)
    hooks = {"byteps": (bps, default_hooks.fp16_compress_hook), "gloo": (gloo, default_hooks.fp16_compress_hook)}
    worst["fp16"] = train_pair(rank, world, gloo, bps, {}, False, hooks, tol=dict(rtol=1e-3, atol=1e-3))

    # PowerSGD: its callbacks launch all_reduces and block on them (the deadlock trap); rank-1 compression
    # from iteration 2, error feedback and warm start, the same random seed on both groups.
    def state(group):
        return powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                           use_error_feedback=True, warm_start=True, random_seed=7)  # fmt: skip

    hooks = {"byteps": (state(bps), powerSGD_hook.powerSGD_hook), "gloo": (state(gloo), powerSGD_hook.powerSGD_hook)}
    worst["powerSGD"] = train_pair(rank, world, gloo, bps, {}, False, hooks, tol=dict(rtol=1e-4, atol=1e-5))
    # Its callbacks block on nested all_reduces: no deadlock is what finishing proves. Whether one ran on a
    # completion thread (and the pool had to grow) depends on timing: a future already complete when PowerSGD
    # attaches its callback runs it on the caller's thread, and on a loaded machine every one may (a peak of 1).
    # test_client's test_callbacks_run_off_the_io_thread_and_may_block holds the growth to account with the order
    # fixed.
    # the bps_hook on a "byteps" group reuses the group's Runtime
    import torch_bps

    hooks = {"byteps": (torch_bps.BpsHookState(bps), torch_bps.bps_hook), "gloo": (gloo, default_hooks.allreduce_hook)}
    worst["bps_hook"] = train_pair(rank, world, gloo, bps, {"bucket_cap_mb": 0.002}, False, hooks)
    return worst


@pytest.mark.timeout(180)
def test_torch_comm_hooks_on_byteps_group():
    """torch's PowerSGD and fp16 hooks with a "byteps" group: same results as on gloo, and no deadlock."""
    results = run_ranks(_torch_hooks, 2, timeout=160)
    for r in results:
        assert {"fp16", "powerSGD", "bps_hook"} <= set(r)
        assert [r["fp16"], r["powerSGD"], r["bps_hook"]] == [0.0] * 3, r  # two ranks: sums exact in any order


def _join_uneven(rank, world, gloo):
    from torch.distributed.algorithms.join import Join

    params = {}
    for name, group in (("byteps", dist.group.WORLD), ("gloo", gloo)):
        torch.manual_seed(0)
        model = DDP(nn.Linear(8, 4), process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        # Uneven inputs: rank r has 3 + 2r batches. Join shadows the finished ranks' all_reduces; with
        # divide_by_initial_world_size=False DDP's reducer asks the Work of Join's all_reduce for its future.
        with Join([model], divide_by_initial_world_size=False):
            for _ in range(3 + 2 * rank):
                opt.zero_grad()
                model(torch.randn(4, 8, generator=gen)).pow(2).sum().backward()
                opt.step()
        params[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    return params


@pytest.mark.timeout(120)
def test_join_with_uneven_inputs_matches_gloo():
    results = [{k: torch.tensor(v) for k, v in r.items()} for r in run_ranks(_join_uneven, 2, timeout=100)]
    for r in results:
        torch.testing.assert_close(r["byteps"], r["gloo"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(results[0]["byteps"], results[1]["byteps"], rtol=0, atol=0)
