"""all_gather, reduce_scatter and broadcast on "byteps" as FSDP uses them: bit-exact against gloo (NaN payloads,
integers, bool), the exact bytes the servers see (STATS: each shard up once, down once per rank that needs it),
and a rank killed mid-gather failing the others with an error naming key and round, fast."""

from __future__ import annotations

import os
import queue
import re
import signal
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.helpers import ServerProcess, _free_port, exact_floats, rank_context, run_ranks

pytestmark = pytest.mark.timeout(240)

N = 300_001  # elements per rank: several partitions, with shard edges inside them
# float32 bit patterns an addition would not keep: signalling NaN (quieted to 0x7fc00001 by x + -0.0),
# NaN payloads and signs, infinities, -0.0, a denormal.
F32_BITS = [0x7F800001, 0xFFBFFFFF, 0x7FC00123, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001]
F16_BITS = [0x7C01, 0xFE00, 0x7D55, 0x8000, 0x0001]  # fp16 signalling NaN, payloads, -0.0, a denormal


def _payloads(rank: int) -> dict[str, torch.Tensor]:
    """One tensor per dtype for this rank: special bit patterns and values that differ per rank."""
    g = torch.Generator().manual_seed(rank)
    f32 = torch.cat([torch.tensor(F32_BITS, dtype=torch.int64).to(torch.int32).view(torch.float32),
                     torch.randn(N, generator=g)])  # fmt: skip
    return {
        "float32": f32,
        "float16": torch.tensor(F16_BITS * 7, dtype=torch.int32).to(torch.int16).view(torch.float16),
        "int64": torch.randint(-(2**62), 2**62, (1001,), generator=g),
        "uint8": torch.randint(0, 256, (77,), dtype=torch.uint8, generator=g),
        "complex64": torch.randn(33, dtype=torch.complex64, generator=g),
    }


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.contiguous(), b.contiguous()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _server_bytes() -> tuple[int, int]:
    """(bytes_in, bytes_out) summed over the job's servers, by STATS."""
    from torch_bps import implementation

    client = implementation().runtime._client
    stats = [client.server_stats(i) for i in range(len(client.servers))]
    return sum(s["bytes_in"] for s in stats), sum(s["bytes_out"] for s in stats)


def _traffic(rank, gloo, fn) -> tuple[int, int]:
    """The servers' (bytes_in, bytes_out) caused by fn() on every rank (rank 0 reads them; 0, 0 elsewhere)."""
    dist.barrier(group=gloo)
    before = _server_bytes() if rank == 0 else (0, 0)
    dist.barrier(group=gloo)
    fn()
    dist.barrier(group=gloo)  # every rank's pulls were answered
    after = _server_bytes() if rank == 0 else (0, 0)
    dist.barrier(group=gloo)  # no rank pushes its next collective before rank 0 has read
    return after[0] - before[0], after[1] - before[1]


def _gathers_match_gloo(rank: int, world: int, gloo) -> dict[str, tuple[int, int]]:
    """Every data-movement collective on byteps vs gloo, bit for bit; returns the bytes each moved (rank 0)."""
    traffic = {}
    for name, x in _payloads(rank).items():
        n = x.numel()
        # all_gather_into_tensor: FSDP2's parameter all-gather, with the input a slice of the output as FSDP2 has it.
        out = torch.empty(world * n, dtype=x.dtype)
        out[rank * n : (rank + 1) * n] = x
        ref = torch.empty_like(out)
        dist.all_gather_into_tensor(ref, x, group=gloo)
        traffic[f"all_gather_into_tensor {name}"] = _traffic(
            rank, gloo, lambda out=out, n=n: dist.all_gather_into_tensor(out, out[rank * n : (rank + 1) * n])
        )
        assert _same_bits(out, ref), f"all_gather_into_tensor {name}"
        # all_gather into a list, non-contiguous inputs and outputs
        outs = [torch.full((2 * n,), 7, dtype=x.dtype)[::2] for _ in range(world)]
        refs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(refs, x, group=gloo)
        doubled = torch.stack([x, x], 1)[:, 0]  # x, not contiguous
        traffic[f"all_gather {name}"] = _traffic(rank, gloo, lambda outs=outs, d=doubled: dist.all_gather(outs, d))
        assert all(_same_bits(o, r) for o, r in zip(outs, refs, strict=True)), f"all_gather {name}"
        # broadcast from the last rank
        t = x.clone() if rank == world - 1 else torch.zeros_like(x)
        ref = t.clone()
        dist.broadcast(ref, src=world - 1, group=gloo)
        traffic[f"broadcast {name}"] = _traffic(rank, gloo, lambda t=t: dist.broadcast(t, src=world - 1))
        assert _same_bits(t, ref), f"broadcast {name}"
    flags = torch.tensor([True, False, rank % 2 == 0, True])  # bool: moved as bytes (gloo has no bool gather)
    out = torch.empty(world * 4, dtype=torch.bool)
    dist.all_gather_into_tensor(out, flags)
    assert out.tolist() == sum(([True, False, r % 2 == 0, True] for r in range(world)), []), out
    b = flags.clone() if rank == 0 else torch.zeros(4, dtype=torch.bool)
    dist.broadcast(b, src=0)
    assert b.tolist() == [True, False, True, True]
    return traffic


def _reduce_scatters_match_gloo(rank: int, world: int, gloo) -> dict[str, tuple[int, int]]:
    """reduce_scatter_tensor and reduce_scatter (SUM of exactly summable values) vs gloo, bit for bit."""
    traffic = {}
    g = torch.Generator().manual_seed(100 + rank)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        x = exact_floats((world * N,), dtype, g) if dtype.is_floating_point else torch.randint(-99, 99, (world * N,))
        out, ref = torch.empty(N, dtype=dtype), torch.empty(N, dtype=dtype)
        dist.reduce_scatter_tensor(ref, x, group=gloo)
        traffic[f"reduce_scatter_tensor {dtype}"] = _traffic(
            rank, gloo, lambda x=x, o=out: dist.reduce_scatter_tensor(o, x)
        )
        assert _same_bits(out, ref), f"reduce_scatter_tensor {dtype}"
        kept = x.clone()
        outs, refs = torch.empty(N, dtype=dtype), torch.empty(N, dtype=dtype)
        dist.reduce_scatter(outs, list(x.chunk(world)))
        dist.reduce_scatter(refs, list(x.chunk(world)), group=gloo)
        assert _same_bits(outs, refs) and _same_bits(x, kept), f"reduce_scatter {dtype} (inputs untouched)"
    return traffic


def _everything(rank, world, gloo):
    return {**_gathers_match_gloo(rank, world, gloo), **_reduce_scatters_match_gloo(rank, world, gloo)}


def _expected(name: str, world: int) -> tuple[int, int]:
    """A parameter server's ideal: each shard up once, down once per rank that needs it (the root: nothing)."""
    op, what = name.split(" ", 1)
    if op == "reduce_scatter_tensor":
        shard = N * {"torch.float32": 4, "torch.bfloat16": 2, "torch.int64": 8}[what]
        return world * world * shard, world * shard
    x = _payloads(0)[what]
    size = x.numel() * x.element_size()
    if op == "broadcast":
        return size, (world - 1) * size
    return world * size, world * world * size


@pytest.mark.parametrize("world", [2, 4])
def test_flat_bit_exact_and_exact_bytes_on_the_wire(world):
    """One rank per worker (BPS_LOCAL_REDUCE=0): the servers see exactly the parameter-server ideal."""
    results = run_ranks(_everything, world, env={"BPS_LOCAL_REDUCE": "0"}, timeout=220)
    measured = results[0]
    for name, got in measured.items():
        assert got == _expected(name, world), f"{name} at world {world}: (in, out) {got} != {_expected(name, world)}"
    print({k: v for k, v in measured.items() if "float32" in k})


@pytest.mark.parametrize("world, local", [(3, 3), (4, 2)])
def test_bit_exact_through_the_local_stages(world, local):
    """Several ranks per machine (one machine of 3; two of 2): the local stages move bytes exactly too. A job of
    one machine sends nothing to a server: its local stages alone make every result."""
    traffic = run_ranks(_everything, world, env={"LOCAL_WORLD_SIZE": str(local)}, timeout=220)[0]
    moved = [name for name, got in traffic.items() if got != (0, 0)]
    if local == world:
        assert moved == [], moved
    else:
        assert len(moved) == len(traffic), set(traffic) - set(moved)


def _killed_mid_gather(rank: int, world: int, port: int, server: str, environ: dict, results) -> None:
    os.environ.clear()  # the test process's, as a spawned process would have (helpers.rank_context)
    os.environ.update(environ, BPS_SERVERS=server, BPS_TIMEOUT="60", BPS_LOCAL_REDUCE="0")
    try:
        import torch_bps  # noqa: F401 - registers the backend

        dist.init_process_group("byteps", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))  # fmt: skip
        x = torch.arange(4 * N, dtype=torch.float32) + rank
        out = torch.empty(world * x.numel())
        dist.all_gather_into_tensor(out, x)  # round 0 of every key: fine
        if rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # before pushing its shard of round 1
        time.sleep(0.5)
        start = time.monotonic()
        try:
            dist.all_gather_into_tensor(out, x)
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.put((rank, type(e).__name__, str(e) + "".join(getattr(e, "__notes__", [])),
                         time.monotonic() - start))  # fmt: skip
        else:
            results.put((rank, "no error", "", time.monotonic() - start))
    except BaseException:  # noqa: BLE001
        results.put((rank, "crash", traceback.format_exc(), 0.0))
    finally:
        results.close()
        results.join_thread()  # the queue's feeder thread must flush before _exit
        os._exit(0)  # no teardown: rank 0 hosts the store, and the job is broken anyway


def test_a_rank_killed_mid_gather_fails_the_others_naming_key_and_round():
    world = 3
    server = ServerProcess()
    ctx = rank_context()
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_killed_mid_gather, args=(r, world, port, server.address, dict(os.environ), results))
             for r in range(world)]  # fmt: skip
    try:
        for p in procs:
            p.start()
        outcomes = {}
        deadline = time.monotonic() + 120
        while len(outcomes) < world - 1 and time.monotonic() < deadline:
            try:
                rank, kind, message, took = results.get(timeout=1)
            except queue.Empty:
                continue
            outcomes[rank] = (kind, message, took)
        assert sorted(outcomes) == list(range(world - 1)), outcomes
        for rank, (kind, message, took) in outcomes.items():
            assert kind == "ServerError", (rank, kind, message)
            # The second all-gather of this size runs on the next slot's keys: their round 0.
            assert re.search(rf"pull of job 0x[0-9a-f]+ key \d+ round 0 by worker {rank}", message), message
            assert f"worker {world - 1} of job" in message and "disconnected before pushing it" in message, message
            assert took < 15, f"rank {rank} took {took:.1f} s to fail"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        server.stop()
