"""The "byteps" backend with CUDA tensors: every collective against gloo's result on the same data.

World 2 and 4 as processes sharing the one GPU (`tests.helpers.run_ranks`: a "byteps" default group and a gloo
group of the same ranks), emulating one machine, machines of one rank, and two machines of two (LAYOUTS), so the
local stages alone, the servers alone, and both carry CUDA tensors. The reference is
gloo on CPU copies of the same data (gloo's CPU collectives are the ones the CPU suite trusts); the data are
exact floats (`tests.helpers.exact_floats`: every sum of up to 8 is exact), so results must match bit for bit.
Each result must also stay on the device, with the caller's dtype and shape.

Dry run on CPU: TORCH_BPS_TEST_DEVICE=cpu (not a GPU result).
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.gpu.common import collective_device, on_device, requires
from tests.helpers import exact_floats, run_ranks

DEVICE = collective_device()
pytestmark = [*requires(DEVICE), pytest.mark.timeout(300)]
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INTS = (torch.int32, torch.int64, torch.uint8)
ALL = (*FLOATS, *INTS, torch.bool)
N = 1000 + 3  # not a multiple of anything: partitions and slots end mid-way


def _data(rank: int, dtype: torch.dtype, n: int = N, salt: int = 0) -> torch.Tensor:
    """This rank's CPU data: exact floats, or small integers (products of 4 stay in int8's range for uint8)."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * salt + ALL.index(dtype))
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point:
        return exact_floats((n,), dtype, g)
    return torch.randint(0, 4, (n,), generator=g).to(dtype)


def _check(what: str, got: torch.Tensor, expected: torch.Tensor, device: str, failures: list[str]) -> None:
    if not on_device(got, device):
        failures.append(f"{what}: result on {got.device}, expected {device}")
        return
    if got.dtype != expected.dtype or got.shape != expected.shape:
        failures.append(f"{what}: {got.dtype} {tuple(got.shape)}, expected {expected.dtype} {tuple(expected.shape)}")
        return
    a, b = got.cpu(), expected
    same = torch.equal(_bits(a), _bits(b)) if a.is_floating_point() else torch.equal(a, b)  # NaNs bit for bit
    if not same:
        bad = (_bits(a) != _bits(b)).nonzero().flatten()[:3].tolist() if a.is_floating_point() else "?"
        failures.append(f"{what}: differs from gloo (first differing elements {bad})")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _reductions(rank, world, gloo, device):
    """all_reduce with every op on every dtype, and AVG; reduce; all_reduce_coalesced."""
    failures: list[str] = []
    ops = {"SUM": dist.ReduceOp.SUM, "MIN": dist.ReduceOp.MIN, "MAX": dist.ReduceOp.MAX,
           "PRODUCT": dist.ReduceOp.PRODUCT}  # fmt: skip
    bit_ops = {"BAND": dist.ReduceOp.BAND, "BOR": dist.ReduceOp.BOR, "BXOR": dist.ReduceOp.BXOR}
    for dtype in ALL:
        chosen = {"SUM": ops["SUM"]} if dtype == torch.bool else ops
        if dtype in INTS:
            chosen = {**ops, **bit_ops}
        for name, op in chosen.items():
            if name == "PRODUCT" and dtype.is_floating_point and dtype != torch.float64:
                continue  # products of exact floats are not exact in 16 bits; float64 covers the path
            ref = _data(rank, dtype)
            dist.all_reduce(ref, op=op, group=gloo)
            t = _data(rank, dtype).to(device)
            dist.all_reduce(t, op=op)
            _check(f"all_reduce {name} {dtype}", t, ref, device, failures)
    for dtype in FLOATS:  # AVG: gloo has none; its SUM divided by the world size (a power of two: exact)
        ref = _data(rank, dtype)
        dist.all_reduce(ref, group=gloo)
        t = _data(rank, dtype).to(device)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        _check(f"all_reduce AVG {dtype}", t, ref / world, device, failures)
    if device.startswith("cuda") and int(os.environ["LOCAL_WORLD_SIZE"]) > 1:  # these took the device local stage
        from torch_bps import implementation
        from torch_bps.device.paths import stage_for

        if stage_for(implementation().runtime, torch.device(device)) is None:
            failures.append("the local stages took the host path: processes on one GPU must share its memory (IPC)")
    # Non-contiguous and complex on the device: staged through a copy / seen as real pairs.
    base = _data(rank, torch.float32, 2 * N).to(device)
    strided = base[::2]
    ref = _data(rank, torch.float32, 2 * N)[::2].contiguous()
    dist.all_reduce(ref, group=gloo)
    dist.all_reduce(strided)
    _check("all_reduce of a strided view", strided, ref, device, failures)
    c = torch.complex(_data(rank, torch.float32), _data(rank, torch.float32, salt=1))
    ref_c = torch.view_as_real(c.clone())
    dist.all_reduce(ref_c, group=gloo)
    cd = c.to(device)
    dist.all_reduce(cd)
    _check("all_reduce complex64", torch.view_as_real(cd), ref_c, device, failures)
    for root in range(world):
        ref = _data(rank, torch.float32)
        dist.reduce(ref, dst=root, group=gloo)
        t = _data(rank, torch.float32).to(device)
        before = t.clone()
        dist.reduce(t, dst=root)
        _check(f"reduce to {root}", t, ref if rank == root else before.cpu(), device, failures)
    if hasattr(dist, "all_reduce_coalesced"):  # deprecated by torch, still what some callers use
        sizes = [7, 300, N, 5]  # torch requires one dtype
        refs = [_data(rank, torch.float32, n, salt=i) for i, n in enumerate(sizes)]
        for r in refs:
            dist.all_reduce(r, group=gloo)
        ts = [_data(rank, torch.float32, n, salt=i).to(device) for i, n in enumerate(sizes)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_reduce_coalesced(ts)
        for i, (t, r) in enumerate(zip(ts, refs, strict=True)):
            _check(f"all_reduce_coalesced [{i}]", t, r, device, failures)
    # Asynchronous: several in flight, then wait; the stream the caller uses next must see the results.
    ts = [_data(rank, torch.float32, N, salt=i).to(device) for i in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in works:
        w.wait()
    doubled = [t * 2 for t in ts]  # kernels on the current stream, right after wait()
    for i in range(4):
        ref = _data(rank, torch.float32, N, salt=i)
        dist.all_reduce(ref, group=gloo)
        _check(f"async all_reduce [{i}] then a kernel", doubled[i], ref * 2, device, failures)
    return failures


def _movements(rank, world, gloo, device):
    """broadcast (NaN payloads bit-exact, every dtype), all_gather(_into_tensor), reduce_scatter(_tensor), gather,
    scatter, the object collectives, barrier."""
    failures: list[str] = []
    for dtype in ALL:
        for root in range(world):
            ref = _data(rank, dtype, salt=root)
            if dtype == torch.float32:  # a NaN with a payload, a signalling NaN, -0.0: bytes, not values
                ref[:3] = torch.tensor([0x7FC00123, 0x7F800001, -(2**31)], dtype=torch.int32).view(torch.float32)
            t = ref.clone().to(device)
            dist.broadcast(ref, src=root, group=gloo)
            dist.broadcast(t, src=root)
            _check(f"broadcast {dtype} from {root}", t, ref, device, failures)
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        ref_out = [torch.empty(N, dtype=dtype) for _ in range(world)]
        dist.all_gather(ref_out, _data(rank, dtype), group=gloo)
        out = [torch.empty(N, dtype=dtype, device=device) for _ in range(world)]
        dist.all_gather(out, _data(rank, dtype).to(device))
        for r in range(world):
            _check(f"all_gather {dtype} [{r}]", out[r], ref_out[r], device, failures)
        flat = torch.empty(world * N, dtype=dtype, device=device)
        dist.all_gather_into_tensor(flat, _data(rank, dtype).to(device))
        _check(f"all_gather_into_tensor {dtype}", flat, torch.cat(ref_out), device, failures)
    for dtype in (torch.float32, torch.float16, torch.int32):
        full = _data(rank, dtype, world * N)
        ref = full.clone()
        dist.all_reduce(ref, group=gloo)  # gloo's sum; each rank's shard of it is the reduce-scatter's result
        mine = ref[rank * N : (rank + 1) * N]
        out = torch.empty(N, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(out, full.to(device))
        _check(f"reduce_scatter_tensor {dtype}", out, mine, device, failures)
        out_list = torch.empty(N, dtype=dtype, device=device)
        dist.reduce_scatter(out_list, [c.to(device) for c in full.chunk(world)])
        _check(f"reduce_scatter {dtype}", out_list, mine, device, failures)
    for root in range(world):
        inp = _data(rank, torch.float32, salt=root)
        ref_list = [torch.empty(N) for _ in range(world)] if rank == root else None
        dist.gather(inp, ref_list, dst=root, group=gloo)
        out_list = [torch.empty(N, device=device) for _ in range(world)] if rank == root else None
        dist.gather(inp.to(device), out_list, dst=root)
        for r in range(world if rank == root else 0):
            _check(f"gather to {root} [{r}]", out_list[r], ref_list[r], device, failures)
        chunks = [_data(r, torch.float32, salt=50 + root) for r in range(world)]
        ref = torch.empty(N)
        dist.scatter(ref, chunks if rank == root else None, src=root, group=gloo)
        out = torch.empty(N, device=device)
        dist.scatter(out, [c.to(device) for c in chunks] if rank == root else None, src=root)
        _check(f"scatter from {root}", out, ref, device, failures)
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank, "x": [rank] * 3})
    if objects != [{"rank": r, "x": [r] * 3} for r in range(world)]:
        failures.append(f"all_gather_object: {objects}")
    sent = [f"from {world - 1}", math.pi] if rank == world - 1 else [None, None]
    dist.broadcast_object_list(sent, src=world - 1)
    if sent != [f"from {world - 1}", math.pi]:
        failures.append(f"broadcast_object_list: {sent}")
    dist.barrier()
    return failures


def _point_to_point(rank, world, gloo, device):
    """send/recv, batch_isend_irecv and all_to_all_single with CUDA tensors: through the backend's internal gloo
    group (CPU copies for send and recv, gloo's CUDA path for all-to-all)."""
    failures: list[str] = []
    t = _data(rank, torch.float32).to(device)
    peer = (rank + 1) % world
    got = torch.empty(N, device=device)
    if rank % 2 == 0:
        dist.send(t, dst=peer)
        dist.recv(got, src=(rank - 1) % world)
    else:
        dist.recv(got, src=(rank - 1) % world)
        dist.send(t, dst=peer)
    _check("send/recv ring", got, _data((rank - 1) % world, torch.float32), device, failures)
    got2 = torch.empty(N, device=device)
    ops = [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, got2, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    _check("batch_isend_irecv ring", got2, _data((rank - 1) % world, torch.float32), device, failures)
    if device.startswith("cuda") and rank == 1:  # a clear refusal, not a crash (on CPU it would wait for a sender)
        try:
            dist.recv(torch.empty(1, device=device), src=None)
            failures.append("recv from any source into a CUDA tensor did not raise")
        except (TypeError, RuntimeError) as e:  # as it crossed torch's C++ dispatch
            if "any source" not in str(e):
                failures.append(f"recv from any source: unexpected message {e}")
    inp = torch.arange(world * 4, dtype=torch.float32) + 100 * rank
    out = torch.empty(world * 4, device=device)
    dist.all_to_all_single(out, inp.to(device))
    ref = torch.empty(world * 4)
    dist.all_to_all_single(ref, inp, group=gloo)
    _check("all_to_all_single", out, ref, device, failures)
    return failures


def _sparse(rank, world, gloo, device):
    """Sparse all_reduce (an embedding's rows) on the device against gloo's on CPU copies: the coalesced sum."""
    failures: list[str] = []
    for dtype in (torch.float32, torch.float64):
        rows = torch.tensor([[rank, 3, 7 + rank, 3]])  # a repeated row: uncoalesced, as an embedding's gradient is
        t = torch.sparse_coo_tensor(rows, _data(rank, dtype, 4 * 5).view(4, 5), (16, 5))
        ours, ref = t.to(device), t.clone()
        dist.all_reduce(ours)
        dist.all_reduce(ref, group=gloo)
        ref = ref.coalesce()
        if not (ours.is_sparse and ours.is_coalesced() and on_device(ours, device)):
            failures.append(f"sparse {dtype}: not a coalesced sparse tensor on {device}")
            continue
        _check(f"sparse {dtype} indices", ours._indices(), ref._indices(), device, failures)
        _check(f"sparse {dtype} values", ours._values(), ref._values(), device, failures)
    return failures


# (world, LOCAL_WORLD_SIZE): how the ranks sharing the GPU are told to see themselves. A job of one machine never
# reaches a server (its local stages make every result: the real one-GPU-box case); ranks that are machines of
# their own go through the servers only; two machines of two take both the local stages and the servers.
LAYOUTS = {"2_machines_of_1": (2, 1), "1_machine_of_4": (4, 4), "2_machines_of_2": (4, 2)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("job", [_reductions, _movements, _sparse], ids=["reductions", "movements", "sparse"])
def test_collectives_on_device_match_gloo(job, layout):
    world, local = LAYOUTS[layout]
    results = run_ranks(job, world, DEVICE, env={"LOCAL_WORLD_SIZE": str(local)}, timeout=280)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures[:40])


def test_point_to_point_on_device_matches_gloo():
    """Separate: gloo itself carries these tensors, and a rank gloo crashes must not take the others' tests down."""
    results = run_ranks(_point_to_point, 2, DEVICE, timeout=120)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, "\n".join(failures)
