"""Run by tests/e2e/test_rendezvous.py under torchrun: one all_reduce on "byteps", then print the servers it used."""

from __future__ import annotations

import torch
import torch.distributed as dist

import torch_bps

if __name__ == "__main__":
    dist.init_process_group("byteps")
    t = torch.full((1000,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    world = dist.get_world_size()
    assert torch.equal(t, torch.full((1000,), world * (world + 1) / 2)), t
    print(f"rank {dist.get_rank()} servers {','.join(torch_bps.implementation().runtime.addresses)}", flush=True)
    dist.destroy_process_group()
