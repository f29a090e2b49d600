"""Training the same model with DDP on two process groups side by side, for the tests that compare a torch_bps path
with gloo: both copies start from the same weights and see the same data; their gradients must agree within a
tolerance every step, and every rank must end with bit-identical parameters."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

TOL = dict(rtol=1e-5, atol=1e-6)
STEPS = 4


class BNNet(nn.Module):
    """Buffers (BatchNorm running stats, broadcast by DDP every forward) and an unused branch."""

    def __init__(self, with_unused: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)
        self.unused = nn.Linear(32, 4) if with_unused else None

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.bn(self.fc1(x))))))


def train_pair(rank, world, gloo, bps_group, ddp_kwargs, with_unused, hooks=None, tol=TOL):
    """Train one model on each group for STEPS steps; compare gradients every step. Returns the max deviation."""
    torch.manual_seed(0)
    base = BNNet(with_unused)
    models = {"byteps": DDP(copy.deepcopy(base), process_group=bps_group, **ddp_kwargs),
              "gloo": DDP(copy.deepcopy(base), process_group=gloo, **ddp_kwargs)}  # fmt: skip
    if hooks is not None:
        for name, (state, hook) in hooks.items():
            models[name].register_comm_hook(state, hook)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    worst = 0.0
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        for name, m in models.items():
            opts[name].zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
        for (pn, pb), pg_ in zip(models["byteps"].named_parameters(), models["gloo"].parameters(), strict=True):
            if pb.grad is None or pg_.grad is None:
                assert pb.grad is None and pg_.grad is None, f"{pn}: grad on one side only"
                continue
            torch.testing.assert_close(pb.grad, pg_.grad, **tol, msg=lambda m, pn=pn, s=step: f"step {s} {pn}: {m}")
            worst = max(worst, (pb.grad - pg_.grad).abs().max().item())
        for o in opts.values():
            o.step()
    # every rank holds the same parameters (buffers differ until the next forward's broadcast: BN statistics)
    state = torch.cat([p.detach().reshape(-1) for p in models["byteps"].parameters()])
    everyone = [torch.empty_like(state) for _ in range(world)]
    dist.all_gather(everyone, state, group=gloo)
    assert all(torch.equal(everyone[0], s) for s in everyone), "parameters differ across ranks"
    return worst
