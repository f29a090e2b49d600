"""The device local stage on the device: two processes on GPU 0 share buffers through CUDA IPC, reduce-scatter with
the fused Triton sum, scale and cast, and all-gather, after a slow producer stream; against a torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.gpu.common import requires
from tests.helpers import run_ranks

DEVICE = "cuda:0" if torch.cuda.is_available() else None
pytestmark = [*requires(DEVICE), pytest.mark.timeout(120)]


def _data(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank * 31 + n)
    return torch.randint(-60, 60, (n,), generator=g).float()  # sums, halves and bf16 casts are exact


def _local_stage(rank, world, gloo, device):
    from torch_bps.device.comm import DeviceLocalComm, open_local_stage
    from triton_kernels import sum_scale_cast_reference

    store = dist.distributed_c10d._get_default_store()
    comm = open_local_stage(store, rank, world, "gpu-node", device, capacity_bytes=1 << 20, timeout=60)
    assert isinstance(comm, DeviceLocalComm), "two processes on one GPU must take the device path"
    failures = []
    stream = torch.cuda.Stream(device=device)
    for n in (5, 100_003, 3 << 20):  # the largest takes several rounds of the 1 MiB buffer
        x = _data(rank, n).to(device)
        lo, hi = comm.slice_range(n)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(10**7)
            x.add_(0)  # a write queued behind the sleep: the stage must wait for the caller's stream
            got = comm.reduce_scatter(x, scale=0.5, out_dtype=torch.bfloat16)
            got_cpu = got.cpu()
        want = sum_scale_cast_reference([_data(r, n)[lo:hi] for r in range(world)], 0.5, torch.bfloat16)
        if not torch.equal(got_cpu, want):
            failures.append(f"reduce_scatter n={n}")
        comm.reduce_scatter(x, out=x[lo:hi])
        comm.all_gather(x[lo:hi], x)
        if not torch.equal(x.cpu(), sum(_data(r, n) for r in range(world))):
            failures.append(f"reduce_scatter + all_gather n={n}")
    comm.close()
    return failures


def test_device_local_stage_between_two_processes_on_one_gpu():
    results = run_ranks(_local_stage, 2, DEVICE, backend="gloo", timeout=100)
    assert results == [[], []], results
