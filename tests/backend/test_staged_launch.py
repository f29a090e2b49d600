"""launch_on_device between real processes: a tensor summed one partition at a time through a PartitionPipeline (CPU
tensors, a recording stand-in for torch.cuda) and the Runtime, beside ordinary collectives, against the plain sum."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers import run_ranks

pytestmark = pytest.mark.timeout(120)


def _data(rank: int, n: int, salt: int) -> torch.Tensor:
    return (torch.arange(n) % 11 * (rank + 1) + salt).float()


def _staged_sums(rank, world, gloo):
    import torch_bps
    from tests.helpers import DEVICE, RecordingOps
    from torch_bps.device.paths import PartitionPath
    from torch_bps.device.pinned import PartitionPipeline
    from torch_bps.pg.work import launch_on_device

    rt = torch_bps.implementation(dist.group.WORLD).runtime
    ops = RecordingOps()
    pipe = PartitionPipeline(DEVICE, rt.config.partition_bytes, 2, ops=ops, timeout=60)
    n = 3 * rt.config.partition_bytes // 4 + 5  # several partitions, the last a few elements
    failures, run_copied, wire = [], rt.run_copied, set()

    def recorded(tensor, *args, **kwargs):  # the dtype the tensor travels in
        wire.add(str(tensor.dtype))
        return run_copied(tensor, *args, **kwargs)

    rt.run_copied = recorded
    for step in range(3):
        staged, plain = _data(rank, n, step), _data(rank, n, step + 10)
        path = PartitionPath(pipe)
        work = launch_on_device(rt, "allreduce", staged, path, [staged], average=False, where="in a test", timeout=60)
        dist.all_reduce(plain)  # launched behind it, on the same runtime
        work.wait()
        for t, salt in ((staged, step), (plain, step + 10)):
            if not torch.equal(t, sum(_data(r, n, salt) for r in range(world))):
                failures.append(f"step {step} salt {salt}")
    copies = sum(e[:3] == ("copy", "side", "d2h") for e in ops.log)
    pipe.close()
    return failures, copies, pipe.pool.made, wire


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_launch_staged_sums_through_the_runtime_beside_ordinary_collectives(wire):
    # bf16 on the wire: cast before the staging, back after it; the data's sums are integers below 256 (exact).
    results = run_ranks(_staged_sums, 2, env={"BPS_WIRE_DTYPE": wire}, timeout=100)
    for failures, copies, made, travelled in results:
        assert failures == [] and made == 2
        assert copies >= 3 * 2, f"a copy to the host per partition: {copies}"
        assert travelled == {{"fp32": "torch.float32", "bf16": "torch.bfloat16"}[wire]}


def _backend_all_reduce_staged(rank, world, gloo):
    import torch_bps
    from tests.helpers import DEVICE, RecordingOps
    from torch_bps.device import paths
    from torch_bps.device.pinned import PartitionPipeline

    impl = torch_bps.implementation(dist.group.WORLD)
    ops = RecordingOps()
    pipe = PartitionPipeline(DEVICE, impl.runtime.config.partition_bytes, 2, ops=ops, timeout=60)
    # As for a CUDA tensor: the backend's own choice, with CPU tensors standing in (the recorder copies at once).
    paths.choose = lambda runtime, t, op="SUM", compressed=False: (
        paths.PartitionPath(pipe) if op in ("SUM", "AVG") and t.dim() == 1 else None
    )
    n = 3 * impl.runtime.config.partition_bytes // 4 + 5
    failures = []
    for op in ("SUM", "AVG"):
        t = _data(rank, n, 1)
        dist.all_reduce(t, getattr(dist.ReduceOp, op))
        want = sum(_data(r, n, 1) / (world if op == "AVG" else 1) for r in range(world))
        if not torch.equal(t, want):
            failures.append(op)
    copies = sum(e[:3] == ("copy", "side", "d2h") for e in ops.log)
    pipe.close()
    return failures, copies


def test_the_backends_all_reduce_takes_the_staging_pipeline_it_is_given():
    for failures, copies in run_ranks(_backend_all_reduce_staged, 2, timeout=100):
        assert failures == []
        assert copies >= 2 * 2, f"a copy to the host per partition: {copies}"
