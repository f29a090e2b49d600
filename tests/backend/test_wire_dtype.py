"""Wire precision (BPS_WIRE_DTYPE, Config.wire_dtype): fp32 sums sent as bf16 or fp16, on both doors.

Against a torch statement of what the servers must return: each machine's fp32 input (its local ranks' fp32 sum)
rounded to the wire dtype, those summed in fp32 and rounded once, back to fp32; bit for bit. The inputs keep
every sum exact in fp32 (magnitudes in [2**-4, 4), at most 4 workers), so the order the server adds them in does
not matter, while rounding at each add, or casting before the local reduce, changes the bits. Real servers and
processes; the "byteps" backend through pg_options and the environment, bps_hook through its state's Config.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_bps
from tests.helpers import BNNet, run_ranks, start_servers, stop_servers
from torch_bps.config import Config
from torch_bps.errors import ConfigError

WIRES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SIZES = (1, 1000, 300_001)  # the last one: several partitions on each server


def _inputs(rank: int, sizes=SIZES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    out = []
    for n in sizes:
        magnitude = 2.0**-4 + torch.rand(n, generator=gen) * (4 - 2.0**-4)
        out.append(magnitude * (torch.randint(0, 2, (n,), generator=gen) * 2 - 1))
    return out


def wire_sum(pushes: list[torch.Tensor], wire: torch.dtype) -> torch.Tensor:
    """The servers' sum of fp32 tensors pushed as `wire`: each rounded to it, summed in fp32, rounded once."""
    total = pushes[0].to(wire).float()
    for t in pushes[1:]:
        total += t.to(wire).float()
    return total.to(wire).float()


def _machine_inputs(world: int, local: int, index: int, divisor: int = 1) -> list[torch.Tensor]:
    """Each machine's push of tensor `index`: its local ranks' inputs (each divided by `divisor`, as AVG and bps_hook
    divide first) summed in fp32, in rank order."""
    machines = []
    for m in range(world // local):
        total = _inputs(m * local)[index] / divisor
        for r in range(m * local + 1, (m + 1) * local):
            total = total + _inputs(r)[index] / divisor
        machines.append(total)
    return machines


def _differences(got: torch.Tensor, want: torch.Tensor) -> int:
    return int((got.view(torch.int32) != want.view(torch.int32)).sum())


def _both_doors(rank, world, gloo, local):
    """Per door and wire dtype: elements that differ from the reference (all_reduce SUM and AVG, reduce_scatter,
    DDP gradients through bps_hook), and whether the result differs from the plain fp32 sum (it must: the cast
    happened)."""
    report = {}
    # The environment says bf16; pg_options and the hook's Config say what each group and state uses.
    assert Config.resolve().wire_dtype == "bf16"
    for name, wire in WIRES.items():
        group = dist.new_group(backend="byteps", pg_options=Config.resolve(wire_dtype=name))
        mine = _inputs(rank)
        diffs, cast = 0, True
        for i, t in enumerate(mine):
            got = t.clone()
            dist.all_reduce(got, group=group)
            machines = _machine_inputs(world, local, i)
            diffs += _differences(got, wire_sum(machines, wire))
            cast &= not torch.equal(got, sum(machines[1:], machines[0]))
            got = t.clone()
            dist.all_reduce(got, op=dist.ReduceOp.AVG, group=group)  # divided first, then summed
            diffs += _differences(got, wire_sum(_machine_inputs(world, local, i, world), wire))
        whole = _inputs(rank, (world * 1000,))[0]
        shard = torch.empty(1000)
        dist.reduce_scatter_tensor(shard, whole, group=group)
        want = wire_sum([_machine_input(world, local, m, world * 1000) for m in range(world // local)], wire)
        diffs += _differences(shard, want[rank * 1000 : (rank + 1) * 1000])
        report[f"byteps {name}"] = (diffs, cast)

        # bps_hook over gloo: the gradient of w in sum(w . x) is x, which the hook divides by the world first.
        state = torch_bps.BpsHookState(process_group=gloo, config=Config.resolve(wire_dtype=name), name=f"hook-{name}")
        index = len(SIZES) - 1
        model = DDP(nn.Linear(SIZES[index], 1, bias=False), process_group=gloo)
        model.register_comm_hook(state, torch_bps.bps_hook)
        model(mine[index].unsqueeze(0)).sum().backward()
        grad = model.module.weight.grad.reshape(-1)
        machines = _machine_inputs(world, local, index, world)
        report[f"bps_hook {name}"] = (_differences(grad, wire_sum(machines, wire)),
                                      not torch.equal(grad, sum(machines[1:], machines[0])))  # fmt: skip
        state.close()
    return report


def _machine_input(world: int, local: int, machine: int, n: int) -> torch.Tensor:
    total = _inputs(machine * local, (n,))[0]
    for r in range(machine * local + 1, (machine + 1) * local):
        total = total + _inputs(r, (n,))[0]
    return total


@pytest.fixture(scope="module")
def two_servers():
    servers = start_servers(2)
    yield ",".join(s.address for s in servers)
    stop_servers(servers)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("local", [1, 2])
def test_16_bit_wire_sums_match_the_rounded_once_reference_on_both_doors(local, two_servers):
    # 1 local rank: 3 machines, so a sum rounded at each add differs; 2: 2 machines of 2 ranks, reduced in fp32 first.
    world = 3 if local == 1 else 4
    env = {"BPS_WIRE_DTYPE": "bf16", "BPS_SERVERS": two_servers, "BPS_PLACEMENT": "dedicated"}
    if local > 1:
        env["LOCAL_WORLD_SIZE"] = str(local)
    results = run_ranks(_both_doors, world, local, backend="gloo", env=env, timeout=220)
    want = {f"{door} {name}": (0, True) for door in ("byteps", "bps_hook") for name in WIRES}
    assert results == [want] * world


def _ddp_replicas(rank, world, gloo):
    """DDP on a "byteps" default group under bf16 wire (the environment's): parameters after training, all ranks."""
    torch.manual_seed(0)
    base = BNNet()
    models = {"byteps": DDP(copy.deepcopy(base)), "gloo": DDP(copy.deepcopy(base), process_group=gloo)}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        for name, m in models.items():
            opts[name].zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
        for o in opts.values():
            o.step()
    state = {k: torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for k, m in models.items()}
    everyone = [torch.empty_like(state["byteps"]) for _ in range(world)]
    dist.all_gather(everyone, state["byteps"], group=gloo)
    return {"identical": all(torch.equal(everyone[0], s) for s in everyone),
            "off_gloo": (state["byteps"] - state["gloo"]).abs().max().item()}  # fmt: skip


@pytest.mark.timeout(180)
def test_ddp_replicas_stay_bit_identical_under_bf16_wire():
    results = run_ranks(_ddp_replicas, 3, env={"BPS_WIRE_DTYPE": "bf16"}, timeout=160)
    for r in results:
        assert r["identical"], r
        # bf16 keeps 8 significant bits: 4 SGD steps of a small model move within a few of its ulps of fp32's.
        assert 0 < r["off_gloo"] < 1e-2, r


def _mixed(rank, world, gloo):
    group = dist.new_group(backend="byteps", pg_options=Config.resolve(wire_dtype="bf16" if rank == 0 else "fp32",
                                                                      timeout=20))  # fmt: skip
    try:
        dist.all_reduce(torch.ones(1000), group=group)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return str(e)
    return ""


@pytest.mark.timeout(120)
def test_a_job_mixing_wire_dtypes_on_a_key_is_refused_naming_both():
    errors = run_ranks(_mixed, 2, timeout=100)
    assert all(errors), errors  # nobody gets a sum
    assert any("KEY_MISMATCH" in e and "bfloat16" in e and "float32" in e for e in errors), errors


@pytest.mark.parametrize("value", ["bfloat16", "int8", "FP16", ""])
def test_a_bad_wire_dtype_is_a_config_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("BPS_WIRE_DTYPE", value)
    if not value:
        assert Config.resolve().wire_dtype == "fp32"  # empty: the default, as for every variable
        return
    with pytest.raises(ConfigError, match=rf"BPS_WIRE_DTYPE='{value}'.*bf16"):
        Config.resolve()
    monkeypatch.delenv("BPS_WIRE_DTYPE")
    with pytest.raises(ConfigError, match=r"wire_dtype="):
        Config.resolve(wire_dtype=value)
