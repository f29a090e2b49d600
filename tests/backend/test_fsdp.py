"""FSDP2 (`fully_shard`, CPU) on "byteps" against gloo, in one job of 2 spawned ranks: training, a DCP save,
an async save on the default group, a resume from it, and FSDP2's full-state-dict broadcast from rank 0.

These are the clients that failed when the backend was a Python ProcessGroup with no device registered
("Default device not found", "A CPU backend must be enabled for async save").
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from tests.helpers import run_ranks

# Sums differ from gloo's only in where the average is divided (FSDP2 asks each backend differently).
TOL = dict(rtol=1e-5, atol=1e-6)


def _model(seed: int, mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _steps(model, opt, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _state(model, opt) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _train_save_resume(rank: int, group, checkpoints: str) -> tuple[list[float], list[torch.Tensor]]:
    # byteps runs every DCP call on the default group (None), the path that needs a registered CPU backend.
    pg = None if group is dist.group.WORLD else group
    mesh = DeviceMesh.from_group(group, "cpu")
    model = _model(0, mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = _steps(model, opt, rank, range(3))
    saved = _full(model)
    dcp.save(_state(model, opt), checkpoint_id=f"{checkpoints}/sync", process_group=pg)
    dcp.async_save(_state(model, opt), checkpoint_id=f"{checkpoints}/async", process_group=pg).result(timeout=120)
    for name in ("sync", "async"):  # resume a fresh model from either checkpoint: the same bits come back
        model2 = _model(1, mesh)
        opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
        _steps(model2, opt2, rank, range(1))  # an optimizer state to overwrite
        state = _state(model2, opt2)
        dcp.load(state, checkpoint_id=f"{checkpoints}/{name}", process_group=pg)
        set_model_state_dict(model2, state["model"])
        set_optimizer_state_dict(model2, opt2, state["optim"])
        assert all(torch.equal(a, b) for a, b in zip(_full(model2), saved, strict=True)), f"resumed from {name}"
    losses += _steps(model2, opt2, rank, range(3, 5))
    more = _steps(model, opt, rank, range(3, 5))
    assert losses[3:] == more, f"training resumed from the checkpoint diverged: {losses[3:]} != {more}"
    # FSDP2's full state dict, held by rank 0 only, broadcast into a fresh model
    full = get_model_state_dict(model2, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert bool(full) == (rank == 0)
    model3 = _model(2, mesh)
    set_model_state_dict(model3, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    final = _full(model3)
    assert all(torch.equal(a, b) for a, b in zip(final, _full(model2), strict=True)), "broadcast_from_rank0"
    return losses, final


def _fsdp_job(rank: int, world: int, gloo, checkpoints: str):
    ours = _train_save_resume(rank, dist.group.WORLD, f"{checkpoints}/byteps")
    ref = _train_save_resume(rank, gloo, f"{checkpoints}/gloo")
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(ref[0]), **TOL)
    for a, b in zip(ours[1], ref[1], strict=True):
        torch.testing.assert_close(a, b, **TOL)
    return ours[0]


@pytest.mark.timeout(300)
def test_fsdp2_training_checkpoint_and_resume_match_gloo(tmp_path):
    losses = run_ranks(_fsdp_job, 2, str(tmp_path), timeout=280)
    assert losses[0][-1] < losses[0][0]  # it learns
