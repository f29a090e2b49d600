"""torch_bps/device/paths.py between real processes: machines of two local ranks whose local stages run "on the device"
(DeviceLocalComm's CPU stand-in: /dev/shm buffers, no streams), each rank staging only its slice through a
PartitionPipeline (a recording stand-in for torch.cuda) to real servers, beside ordinary collectives; and a
stage's lifetime, which its runtime's sets."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers import run_ranks
from torch_bps.device import paths
from torch_bps.device.paths import DeviceLocalPath

pytestmark = pytest.mark.timeout(180)

CAPACITY = 16 << 10  # bytes per channel: a slice of a few thousand fp32 takes several device rounds


def _data(rank: int, n: int, salt: int) -> torch.Tensor:
    return (torch.arange(n) % 11 * (rank + 1) + salt).float()  # every sum and the halving below are exact


def _stage(rt, ops):
    from tests.helpers import DEVICE
    from torch_bps.device.comm import DeviceLocalComm
    from torch_bps.device.paths import DeviceLocalStage
    from torch_bps.device.pinned import PartitionPipeline

    store, t = dist.distributed_c10d._get_default_store(), rt.topology
    channels = [DeviceLocalComm(store, t.local_rank, t.local_size, f"test-{t.node_rank}-{c}", "cpu",
                                capacity_bytes=CAPACITY, timeout=60) for c in ("rs", "ag")]  # fmt: skip
    streams = []

    def recorded(call, name):  # which stream each local stage ran under
        def run(*args, **kwargs):
            streams.append((name, ops.current_stream(DEVICE)))
            return call(*args, **kwargs)

        return run

    channels[0].reduce_scatter = recorded(channels[0].reduce_scatter, "reduce_scatter")
    channels[1].all_gather = recorded(channels[1].all_gather, "all_gather")
    pipe = PartitionPipeline(DEVICE, rt.config.partition_bytes, 2, ops=ops, timeout=60)
    return DeviceLocalStage(rt, DEVICE, channels, pipe, ops=ops), channels, pipe, streams


def _sums(rank, world, gloo):
    import torch_bps
    from tests.helpers import RecordingOps
    from torch_bps.pg.work import launch_on_device

    rt = torch_bps.implementation(dist.group.WORLD).runtime
    ops = RecordingOps()
    stage, channels, pipe, streams = _stage(rt, ops)
    path = DeviceLocalPath(stage)
    run_copied, wire = rt.run_copied, set()

    def recorded(tensor, *args, **kwargs):  # the dtype each slice travels in
        wire.add(str(tensor.dtype))
        return run_copied(tensor, *args, **kwargs)

    rt.run_copied = recorded
    n = 3 * rt.config.partition_bytes // 2 + 5  # every slice several partitions, the last a few elements
    failures, outcome = [], {}
    for step in range(3):
        op = ("SUM", "AVG")[step % 2]
        staged, plain = _data(rank, n, step), _data(rank, n, step + 10)
        work = launch_on_device(rt, "allreduce", staged, path, [staged], average=op == "AVG", where="in a test",
                             timeout=60)  # fmt: skip
        dist.all_reduce(plain)  # launched behind it, on the same runtime: the host local stages
        work.wait()
        want = sum(_data(r, n, step) for r in range(world)) / (world if op == "AVG" else 1)
        want_plain = sum(_data(r, n, step + 10) for r in range(world))
        for name, t, w in (("staged", staged, want), ("plain", plain, want_plain)):
            if not torch.equal(t, w):
                failures.append(f"step {step} {op} {name}: {(t - w).abs().max()}")
    # Through the backend's own all_reduce, as a CUDA tensor would go.
    paths.choose = lambda runtime, t, op="SUM", compressed=False: (
        path if op in ("SUM", "AVG") and t.dim() == 1 else None
    )
    t = _data(rank, n, 5)
    dist.all_reduce(t, dist.ReduceOp.AVG)
    if not torch.equal(t, sum(_data(r, n, 5) for r in range(world)) / world):
        failures.append("backend all_reduce AVG")
    outcome["staged"] = sum(e[3] for e in ops.log if e[:3] == ("copy", "side", "d2h"))
    outcome["slice"] = 4 * channels[0].slice_range(n)[1] - 4 * channels[0].slice_range(n)[0]
    outcome["streams"], outcome["wire"] = set(streams), wire
    stage.close()
    pipe.close()
    return failures, outcome


@pytest.mark.parametrize(("machines", "wire"), [(2, "fp32"), (2, "bf16"), (1, "fp32")],
                         ids=["two-machines", "two-machines-bf16-wire", "one-machine-alone"])  # fmt: skip
def test_each_rank_stages_only_its_slice_summed_on_the_device_and_every_rank_gets_the_whole_sum(machines, wire):
    # The data's sums are integers below 256: exact in bf16. Partitions of 32 KiB: each slice (~100 KB) is several.
    env = {
        "LOCAL_WORLD_SIZE": "2",
        "BPS_WIRE_DTYPE": wire,
        "BPS_PARTITION_BYTES": "32768",
        "BPS_MIN_PARTITION_BYTES": "16384",
    }
    results = run_ranks(_sums, 2 * machines, env=env, timeout=160)
    for rank, (failures, outcome) in enumerate(results):
        assert failures == [], f"rank {rank}: {failures}"
        want = {("reduce_scatter", "side"), ("all_gather", "side")}
        assert outcome["streams"] == want, "both local stages run on the side stream, never the caller's"
        travels = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[wire]
        assert outcome["wire"] == (set() if machines == 1 else {travels}), "slices travel in the wire dtype"
        # 4 collectives; alone, nothing goes to a server: nothing is staged at all.
        want = 0 if machines == 1 else 4 * outcome["slice"] // 4
        assert outcome["staged"] == want, f"rank {rank} staged {outcome['staged']} elements, its slices {want}"


def _mismatch(rank, world, gloo):
    import torch_bps
    from tests.helpers import RecordingOps
    from torch_bps.local import LocalInputError
    from torch_bps.pg.work import launch_on_device

    rt = torch_bps.implementation(dist.group.WORLD).runtime
    # Tensors that are not on a GPU never share device memory: the machine takes the CPU-assisted path.
    assert rt.open_device_channels(torch.device("cpu")) is None
    stage, _, pipe, _ = _stage(rt, RecordingOps())
    path = DeviceLocalPath(stage)
    t = torch.ones(100 + rank)  # the local ranks disagree on the size
    work = launch_on_device(rt, "allreduce", t, path, [t], average=False, where="in a test", timeout=60)
    try:
        work.wait()
    except LocalInputError as e:
        return str(e)
    finally:
        stage.close()
        pipe.close()
    return "no error"


def test_local_ranks_that_disagree_both_get_a_clear_error():
    for message in run_ranks(_mismatch, 2, env={"LOCAL_WORLD_SIZE": "2"}, timeout=100):
        assert "local ranks disagree" in message and "numel=100" in message and "numel=101" in message, message


def _refused_once(rank, world, gloo):
    """Each machine's local rank 1 has its client refuse its first batch (as a closed client does); then two
    collectives on every rank: (error type, message, seconds) or ("ok", exact, seconds) per collective."""
    import time

    import torch_bps
    from tests.helpers import RecordingOps
    from torch_bps.errors import BpsError
    from torch_bps.pg.work import launch_on_device

    rt = torch_bps.implementation(dist.group.WORLD).runtime
    stage, _, pipe, _ = _stage(rt, RecordingOps())
    path = DeviceLocalPath(stage)
    client = rt._engine.client
    if rt.topology.local_rank == 1:  # on both machines: nobody pushes the keys of local rank 1's slice this round
        submit = client.push_pull_batch

        def refuse(*args, **kwargs):
            client.push_pull_batch = submit
            raise BpsError("planted: the client refused the batch")

        client.push_pull_batch = refuse
    n = 3 * rt.config.partition_bytes // 2 + 5
    outcomes = []
    for step in range(2):
        t, started = _data(rank, n, step), time.monotonic()
        try:
            launch_on_device(rt, "allreduce", t, path, [t], average=False, where="in a test", timeout=60).wait()
            outcomes.append(("ok", torch.equal(t, sum(_data(r, n, step) for r in range(world))), 0.0))
        except Exception as e:  # noqa: BLE001 - reported to the test, which decides
            outcomes.append((type(e).__name__, str(e), time.monotonic() - started))
    stage.close()
    pipe.close()
    return outcomes


def test_a_local_rank_whose_network_stage_fails_fails_its_peers_at_once():
    """Local rank 1's collective fails before its all-gather: it keeps its error, and local rank 0, its own sum back,
    fails at the all-gather at once, naming it, instead of waiting until the channel's timeout (60 s); the
    channels stay usable and the next collective sums exactly on every rank."""
    env = {"LOCAL_WORLD_SIZE": "2", "BPS_PARTITION_BYTES": "32768", "BPS_MIN_PARTITION_BYTES": "16384"}
    for rank, (first, second) in enumerate(run_ranks(_refused_once, 4, env=env, timeout=160)):
        kind, message, took = first
        if rank % 2:
            assert kind == "BpsError" and "planted: the client refused the batch" in message, (rank, first)
        else:
            assert kind == "LocalPeerFailedError", (rank, first)
            assert "all_gather call #1 round 1/" in message, (rank, message)
            assert "local rank(s) [1] came with nothing to give" in message, (rank, message)
        assert took < 10, (rank, first)
        assert second == ("ok", True, 0.0), (rank, second)


def test_a_runtime_keeps_its_decision_per_device_and_its_stage_closes_when_the_runtime_goes(monkeypatch):
    import gc
    import types

    from tests.helpers import DEVICE, RecordingOps
    from torch_bps.device import pinned

    monkeypatch.setattr(pinned, "_ops", RecordingOps())
    opened = []

    class Runtime:  # what stage_for reads of a Runtime
        config = types.SimpleNamespace(partition_bytes=4096)

        def open_device_channels(self, dev):
            opened.append(dev)
            return None if dev.index == 1 else (object(), object())  # cuda:1: the CPU-assisted path

    runtime = Runtime()
    stage = paths.stage_for(runtime, DEVICE)
    assert paths.stage_for(runtime, DEVICE) is stage and isinstance(stage, paths.DeviceLocalStage)
    assert paths.stage_for(runtime, torch.device("cuda", 1)) is None
    assert paths.stage_for(runtime, torch.device("cuda", 1)) is None
    assert opened == [DEVICE, torch.device("cuda", 1)], "channels are opened once per device, whatever the answer"
    del runtime
    gc.collect()
    assert stage.closed, "the stage outlived its runtime"


def _peer_killed(rank: int, port: int, environ: dict, results) -> None:
    """One machine of two local ranks; local rank 1 dies by SIGKILL after one collective, rank 0 launches another."""
    import datetime
    import os
    import signal
    import time
    import traceback

    os.environ.clear()
    os.environ.update(environ, LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                      BPS_TIMEOUT="60")  # fmt: skip
    try:
        import torch_bps
        from tests.helpers import RecordingOps
        from torch_bps.pg.work import launch_on_device

        dist.init_process_group("byteps", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))  # fmt: skip
        rt = torch_bps.implementation(dist.group.WORLD).runtime
        stage, _, pipe, _ = _stage(rt, RecordingOps())
        path = DeviceLocalPath(stage)
        t = torch.ones(5000)
        launch_on_device(rt, "allreduce", t, path, [t], average=False, where="in a test", timeout=60).wait()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)
        start = time.monotonic()
        try:
            launch_on_device(rt, "allreduce", t, path, [t], average=False, where="in a test", timeout=60).wait()
            results.put(("no error", "", time.monotonic() - start))
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.put((type(e).__name__, str(e) + "".join(getattr(e, "__notes__", [])), time.monotonic() - start))
    except BaseException:  # noqa: BLE001
        results.put(("crash", traceback.format_exc(), 0.0))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)  # the job is broken: no teardown


def test_a_local_peer_killed_fails_the_device_stage_fast_naming_it():
    import os

    from tests.helpers import _free_port, rank_context

    ctx = rank_context()
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_peer_killed, args=(r, port, dict(os.environ), results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        kind, message, took = results.get(timeout=90)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert kind not in ("no error", "crash"), message
    assert "local rank 1" in message and "device local stage" in message, message
    assert took < 20, f"{took:.1f} s: a dead peer must not cost the 60 s timeout"


def _ddp(rank, world, gloo):
    """DDP on "byteps" with its buckets through the device stage (stand-ins), and DDP on gloo, from one
    initialisation on the same batches: the largest parameter difference after 5 steps of SGD with momentum."""
    import copy

    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torch_bps
    from tests.helpers import RecordingOps

    rt = torch_bps.implementation(dist.group.WORLD).runtime
    stage, _, pipe, _ = _stage(rt, RecordingOps())
    path = DeviceLocalPath(stage)
    paths.choose = lambda runtime, t, op="SUM", compressed=False: (
        path if op in ("SUM", "AVG") and t.is_floating_point() else None
    )
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    models = {"byteps": DDP(copy.deepcopy(base), bucket_cap_mb=0.1),
              "gloo": DDP(copy.deepcopy(base), process_group=gloo, bucket_cap_mb=0.1)}  # fmt: skip
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in models.items()}
    for step in range(5):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(32, 32, generator=g), torch.randn(32, 8, generator=g)
        for name, m in models.items():
            opts[name].zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opts[name].step()
    staged = sum(e[3] for e in stage._copier._ops.log if e[:3] == ("copy", "side", "d2h"))
    stage.close()
    pipe.close()
    worst = max((a - b).abs().max().item() for a, b in zip(*(m.parameters() for m in models.values()), strict=True))
    return worst, staged


def test_ddp_through_the_device_stage_trains_as_gloo_does():
    results = run_ranks(_ddp, 4, env={"LOCAL_WORLD_SIZE": "2"}, timeout=160)
    for rank, (worst, staged) in enumerate(results):
        assert worst < 1e-5, f"rank {rank}: parameters differ from gloo's by {worst:.3g}"
        assert staged > 0, f"rank {rank}: no bucket went through the device stage"


def _route(rank, world, gloo):
    """How often the machine's device channels are opened, by setting: (switch on, switch off) of `open_device_channels`
    with the opening itself counted (on CPU a real one is refused: tensors off a GPU share no device memory)."""
    import dataclasses
    import types

    import torch_bps
    from torch_bps.device import comm as device

    rt = torch_bps.implementation(dist.group.WORLD).runtime
    opened = []
    device.open_local_stage = lambda *args, **kwargs: opened.append(args) or types.SimpleNamespace(close=lambda: None)
    results = []
    for config in (dataclasses.replace(rt.config, device_local=True), rt.config):  # the job's: BPS_DEVICE_LOCAL=0
        rt.config, before = config, len(opened)
        channels = rt.open_device_channels(torch.device("cpu"))
        results.append((config.device_local, channels is not None, len(opened) - before))
    return results


def test_bps_device_local_0_takes_the_host_path_without_opening_the_device_stage():
    # With it off no channel is opened (no rendezvous, nothing mapped): route() then answers None, the host path.
    env = {"LOCAL_WORLD_SIZE": "2", "BPS_DEVICE_LOCAL": "0"}
    assert run_ranks(_route, 2, env=env, timeout=100) == [[(True, True, 2), (False, False, 0)]] * 2


def _then_waits(rank, world, gloo):
    """A `then` callback of one device-stage collective launches a second one and waits for it with no timeout, as
    PowerSGD's callbacks do: (chained result equals, second sum equals), or a failure naming the hang."""
    import time

    import torch_bps
    from tests.helpers import RecordingOps
    from torch_bps.pg.work import launch_on_device

    rt = torch_bps.implementation(dist.group.WORLD).runtime
    stage, _, pipe, _ = _stage(rt, RecordingOps())
    path = DeviceLocalPath(stage)
    n = 3000  # several rounds of the channels' 16 KiB
    first, second = _data(rank, n, 1), _data(rank, n, 2)

    def then(fut):
        work = launch_on_device(rt, "allreduce", second, path, [second], average=False, where="in a callback",
                                timeout=60)  # fmt: skip
        work.get_future().wait()  # no timeout, as PowerSGD: only a thread free to complete it ends this wait
        return fut.value()

    chained = launch_on_device(rt, "allreduce", first, path, [first], average=False, where="in a test",
                               timeout=60).get_future().then(then)  # fmt: skip
    deadline = time.monotonic() + 20
    while not chained.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not chained.done():
        return "hung: the callback's collective never completed"
    result = (torch.equal(chained.value()[0], sum(_data(r, n, 1) for r in range(world))),
              torch.equal(second, sum(_data(r, n, 2) for r in range(world))))  # fmt: skip
    stage.close()
    pipe.close()
    return result


def test_a_then_callback_that_waits_for_a_later_device_collective_does_not_hang():
    # One machine of two local ranks: the device local stages alone make the sum, and their gather thread is the one
    # the callback's collective needs.
    assert run_ranks(_then_waits, 2, env={"LOCAL_WORLD_SIZE": "2"}, timeout=60) == [(True, True)] * 2
