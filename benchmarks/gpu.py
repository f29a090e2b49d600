"""Benchmark the CUDA path: staging, the Triton local reduce, all-reduce and a DDP step, each beside a baseline
measured in the same run.

- staging: a CUDA tensor's trip to the summation service and back (`torch_bps.device.pinned.DeviceStaging`: a copy
  into pinned host memory on a side stream, then the copy back), against the device's raw pinned copy rates.
- partition_staging: `PartitionPipeline` (per partition through a bounded pinned pool, a service that answers at
  once) against a raw pinned copy of the same bytes each way (target: >= 0.9).
- local_reduce: `triton_kernels.sum_scale_cast` (N inputs summed in fp32, cast once, one pass) against torch
  on the device (chained adds: N - 1 passes; the reference: sum of the stacked inputs, then cast) and against a
  device-to-device copy of one input. GB/s count the input bytes read; `*_traffic_gbs` count every byte read and
  written, the kernel's against the copy's (target: >= 0.8).
- device_local_stage: `torch_bps.device.comm.DeviceLocalComm` between `world` processes on GPU 0 (CUDA IPC): a
  reduce-scatter (fp32 in, bf16 out, AVG) and an all-gather.
- allreduce: `dist.all_reduce` on "byteps" with CUDA tensors (ranks as machines of their own; and as one machine,
  k = 0, whose local stages run on the device: device/paths.py) against the same on CPU tensors and against
  gloo with CUDA tensors; `world` processes share GPU 0.
- ddp: one training step of an MLP with DDP on the device, over "byteps" as one machine (k = 0: the local stages
  on the device) and as machines of one rank (an embedded server each), over gloo (no service), and without DDP in
  one process. The yardstick (docs/gpu.md): "byteps" as one machine against the same processes on the same GPU
  running the same DDP model with torch's no-communication hook (`noop_hook`), within 1.15x. NCCL cannot be the
  baseline here: it refuses two ranks on one GPU.

Usage: python benchmarks/gpu.py [--quick] [--device cuda|cpu] [--json out.json]
`--device cpu` is a dry run of the script (the staging and kernel sections need CUDA and are left out).
May import: torch, triton_kernels, torch_bps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import spawn_ranks  # noqa: E402

MB = 1 << 20
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_seconds(fn, iters: int, device: str, warmup: int = 2) -> float:
    """Median wall time of fn() over `iters` runs, each ended by a device synchronize."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_staging(sizes_mb: list[int], iters: int) -> list[dict]:
    return [_staging_row(size, iters) for size in sizes_mb]


def _staging_row(size: int, iters: int) -> dict:
    from torch_bps.device.pinned import DeviceStaging

    n = size * MB // 4
    dev = torch.randn(n, device="cuda")
    host = torch.empty(n, pin_memory=True)
    d2h = _median_seconds(lambda: host.copy_(dev, non_blocking=True), iters, "cuda")
    h2d = _median_seconds(lambda: dev.copy_(host, non_blocking=True), iters, "cuda")
    staged = DeviceStaging(dev, load=True)
    stage_in = _median_seconds(lambda: DeviceStaging(dev, load=True), iters, "cuda")
    stage_back = _median_seconds(staged.write_back, iters, "cuda")
    ok = torch.equal(staged.flat, dev.cpu())

    def gbs(seconds: float) -> float:
        return size * MB / seconds / 1e9

    print(f"staging {size:4d} MB: D2H raw {gbs(d2h):6.1f} GB/s, staged {gbs(stage_in):6.1f} GB/s "
          f"({d2h / stage_in:.2f}); H2D raw {gbs(h2d):6.1f}, write-back {gbs(stage_back):6.1f} "
          f"({h2d / stage_back:.2f})", flush=True)  # fmt: skip
    return {"size_mb": size, "raw_d2h_gbs": gbs(d2h), "staging_d2h_gbs": gbs(stage_in),
            "staging_vs_raw_d2h": d2h / stage_in, "raw_h2d_gbs": gbs(h2d), "write_back_h2d_gbs": gbs(stage_back),
            "write_back_vs_raw_h2d": h2d / stage_back, "staged_bytes_correct": ok}  # fmt: skip


def bench_partition_staging(size_mb: int, part_mb: int, slots: int, iters: int) -> dict:
    import threading

    from torch_bps.device.pinned import PartitionPipeline

    n, step = size_mb * MB // 4, part_mb * MB // 4
    dev = torch.randn(n, device="cuda")
    host = torch.empty(n, pin_memory=True)
    bounds = [(lo, min(n, lo + step)) for lo in range(0, n, step)]
    pipe = PartitionPipeline(torch.device("cuda:0"), slot_bytes=step * 4, slots=slots, timeout=60)

    def staged():
        finished = threading.Event()
        pipe.start(dev, bounds, lambda i, h, pulled: pulled(None), lambda error: finished.set())
        if not finished.wait(60):
            raise TimeoutError("PartitionPipeline did not finish within 60 s")
        torch.cuda.current_stream().wait_stream(pipe._stream)

    def raw():
        host.copy_(dev, non_blocking=True)
        dev.copy_(host, non_blocking=True)

    raw_s, staged_s = _median_seconds(raw, iters, "cuda"), _median_seconds(staged, iters, "cuda")
    pipe.close()
    row = {"size_mb": size_mb, "partition_mb": part_mb, "slots": slots,
           "raw_round_trip_gbs": 2 * size_mb * MB / raw_s / 1e9,
           "staged_round_trip_gbs": 2 * size_mb * MB / staged_s / 1e9, "staged_vs_raw": raw_s / staged_s,
           "pinned_bytes": pipe.pool.made * pipe.pool.slot_bytes}  # fmt: skip
    print("partition staging " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()), flush=True)
    return row


def _event_seconds(fn, iters: int) -> float:
    """Median device time of fn() by CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def bench_local_reduce(size_mb: int, counts: list[int], iters: int) -> list[dict]:
    return [_reduce_row(name, count, size_mb, iters) for name in DTYPES for count in counts]


def _reduce_row(dtype_name: str, count: int, size_mb: int, iters: int) -> dict:
    from triton_kernels import sum_scale_cast, sum_scale_cast_reference

    dtype = DTYPES[dtype_name]
    n = size_mb * MB // torch.empty(0, dtype=dtype).element_size()
    inputs = [torch.randn(n, device="cuda").to(dtype) for _ in range(count)]
    out, out_torch, copy_dst = (torch.empty(n, dtype=dtype, device="cuda") for _ in range(3))

    def torch_sum():  # what torch does without a fused kernel: N - 1 passes
        torch.add(inputs[0], inputs[1], out=out_torch)
        for t in inputs[2:]:
            out_torch.add_(t)

    triton_s = _event_seconds(lambda: sum_scale_cast(inputs, out), iters)
    torch_s = _event_seconds(torch_sum, iters)
    reference_s = _event_seconds(lambda: torch.stack(inputs).sum(0).to(dtype), iters)
    copy_s = _event_seconds(lambda: copy_dst.copy_(inputs[0]), iters)
    close = bool(torch.allclose(out.float(), sum_scale_cast_reference(inputs).float(), rtol=2**-7, atol=1e-3))
    read = count * size_mb * MB / 1e9
    copy_gbs = size_mb * MB / 1e9 / copy_s
    print(f"local reduce {dtype_name:8s} x{count}: triton {read / triton_s:7.1f} GB/s, torch {read / torch_s:7.1f} "
          f"GB/s ({torch_s / triton_s:.2f}x), d2d copy {copy_gbs:7.1f} GB/s", flush=True)  # fmt: skip
    return {"dtype": dtype_name, "inputs": count, "size_mb_each": size_mb, "triton_gbs": read / triton_s,
            "torch_gbs": read / torch_s, "triton_vs_torch": torch_s / triton_s, "d2d_copy_gbs": copy_gbs,
            "triton_vs_reference": reference_s / triton_s,
            "triton_traffic_gbs": (count + 1) * size_mb * MB / 1e9 / triton_s,
            "copy_traffic_gbs": 2 * copy_gbs, "triton_vs_copy_traffic": (count + 1) * copy_s / (2 * triton_s),
            "triton_matches_reference": close}  # fmt: skip


# --- multi-process parts ---------------------------------------------------------------------------------------


def _rank(rank: int, world: int, port: int, fn, backend: str, local: int, args: tuple, results) -> None:
    import traceback

    import torch.distributed as dist

    import torch_bps  # noqa: F401 - registers "byteps"

    # Machines of `local` ranks, as torchrun says: with 1 every rank is a machine of its own and the sums go through
    # the (embedded) servers; with `world` the one machine's local stages make them (k = 0).
    os.environ.update(LOCAL_RANK=str(rank % local), LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(rank // local),
                      GROUP_WORLD_SIZE=str(world // local))  # fmt: skip
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))  # fmt: skip
        out = fn(rank, world, *args)
        dist.barrier()
        results.put((rank, "ok", out))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported by the parent
        results.put((rank, "error", f"{backend}: {traceback.format_exc()}"))


def _run(fn, world: int, backend: str, *args, local: int = 1, timeout: float = 600) -> dict:
    """Run fn(rank, world, *args) in `world` spawned processes on `backend`, machines of `local` ranks; return rank
    0's result."""
    return spawn_ranks(_rank, world, fn, backend, local, args, timeout=timeout)[0]


def _allreduce_times(rank: int, world: int, device: str, sizes_mb: list[int], iters: int) -> dict:
    import torch.distributed as dist

    out = {}
    for size in sizes_mb:
        t = torch.ones(size * MB // 4, device=device)
        dist.barrier()
        out[size] = _median_seconds(lambda t=t: dist.all_reduce(t), iters, device)
    return out


def _device_local_stage(rank: int, world: int, size_mb: int, iters: int) -> dict:
    import torch.distributed as dist

    from torch_bps.device.comm import open_local_stage

    comm = open_local_stage(dist.distributed_c10d._get_default_store(), rank, world, "bench", "cuda:0",
                            capacity_bytes=64 * MB, timeout=120)  # fmt: skip
    if comm is None:
        return {"error": "open_local_stage chose the host path for processes on one GPU"}
    x = torch.randn(size_mb * MB // 4, device="cuda:0")
    lo, hi = comm.slice_range(x.numel())
    rs = _median_seconds(lambda: comm.reduce_scatter(x, scale=1 / world, out_dtype=torch.bfloat16), iters, "cuda")
    ag = _median_seconds(lambda: comm.all_gather(x[lo:hi], x), iters, "cuda")
    comm.close()
    return {"world": world, "size_mb": size_mb, "reduce_scatter_gbs": size_mb * MB / rs / 1e9,
            "all_gather_gbs": size_mb * MB / ag / 1e9}  # fmt: skip


def _mlp(width: int, depth: int) -> torch.nn.Module:
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def _ddp_step(
    rank: int, world: int, device: str, width: int, depth: int, batch: int, iters: int, no_communication: bool = False
) -> dict:
    """Seconds per step of DDP on the default group (world 0: the bare model, no DDP). With `no_communication`, the
    same in these processes with torch's `noop_hook` too, a second model: DDP's own work, no sum (the yardstick)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def timed(hook=None) -> tuple[float, int]:
        torch.manual_seed(0)
        model = _mlp(width, depth).to(device)
        if world > 0:
            model = DDP(model, device_ids=[0] if device.startswith("cuda") else None)
        if hook is not None:
            model.register_comm_hook(None, hook)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(batch, width, device=device)

        def step():
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

        return _median_seconds(step, iters, device, warmup=3), sum(p.numel() for p in model.parameters())

    seconds, params = timed()
    out = {"s_per_step": seconds, "parameters": params}
    if no_communication:
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

        out["no_communication_s"] = timed(noop_hook)[0]
    return {**out, "local_stage": _local_stage_path(device)} if world > 0 else out


def _local_stage_path(device: str) -> str:
    """Where this rank's local stages ran on "byteps": on the device, on the host (CPU-assisted), or none."""
    import torch_bps
    from torch_bps.device.paths import stage_for

    impl = torch_bps.implementation()
    if impl is None or impl.runtime.topology.local_size == 1:
        return "none"
    return "device" if device.startswith("cuda") and stage_for(impl.runtime, torch.device(device)) else "host"


def bench_allreduce(device: str, world: int, sizes_mb: list[int], iters: int, host: bool = True) -> list[dict]:
    """ms per all_reduce: "byteps" on `device` tensors (machines of one rank; and one machine, k = 0: the local
    stages on the device), on host tensors, and gloo on `device` tensors."""
    runs = {"byteps_device": ("byteps", device, 1), "byteps_device_one_machine": ("byteps", device, world),
            "byteps_host": ("byteps", "cpu", 1), "gloo_device": ("gloo", device, 1)}  # fmt: skip
    if not host:
        del runs["byteps_host"]
    timings = {name: _run(_allreduce_times, world, backend, dev, sizes_mb, iters, local=local)
               for name, (backend, dev, local) in runs.items()}  # fmt: skip
    rows = []
    for size in sizes_mb:
        t = {name: timings[name][size] for name in runs}
        row = {"size_mb": size, "world": world, "device": device, **{f"{k}_ms": v * 1e3 for k, v in t.items()},
               "byteps_device_vs_host": t["byteps_host"] / t["byteps_device"] if host else None,
               "byteps_vs_gloo_device": t["gloo_device"] / t["byteps_device"]}  # fmt: skip
        rows.append(row)
        print("allreduce " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
              flush=True)  # fmt: skip
    return rows


def bench_ddp(device: str, world: int, width: int, depth: int, batch: int, iters: int) -> dict:
    """One step: DDP on "byteps" as one machine (k = 0: the local stages only, on the device where the ranks share
    it) beside the same processes with the no-communication hook (the yardstick), as machines of one rank (the
    embedded servers), on gloo, and without DDP in this process alone."""
    one_machine = _run(_ddp_step, world, "byteps", device, width, depth, batch, iters, True, local=world)
    alone = _ddp_step(0, 0, device, width, depth, batch, iters)  # this process, no DDP: no communication
    byteps = _run(_ddp_step, world, "byteps", device, width, depth, batch, iters)
    gloo = _run(_ddp_step, world, "gloo", device, width, depth, batch, iters)
    row = {"world": world, "parameters": alone["parameters"], "batch_per_rank": batch,
           "no_ddp_s": alone["s_per_step"], "byteps_one_machine_s": one_machine["s_per_step"],
           "one_machine_local_stage": one_machine["local_stage"],
           "no_communication_one_machine_s": one_machine["no_communication_s"],
           "one_machine_vs_no_communication": one_machine["s_per_step"] / one_machine["no_communication_s"],
           "one_machine_vs_no_ddp": one_machine["s_per_step"] / alone["s_per_step"],
           "byteps_s": byteps["s_per_step"], "gloo_s": gloo["s_per_step"],
           "byteps_vs_gloo": gloo["s_per_step"] / byteps["s_per_step"]}  # fmt: skip
    print("ddp " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
          flush=True)  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the script")
    p.add_argument("--world", type=int, default=2, help="processes sharing GPU 0 (default 2)")
    p.add_argument("--json", metavar="PATH", help="write every row here")
    p.add_argument("--ddp-width", type=int, help="the DDP model's width (default 2048; 4096 x 6 layers: ~100 M)")
    p.add_argument("--ddp-depth", type=int, help="the DDP model's linear layers (default 6)")
    args = p.parse_args(argv)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device (use --device cpu for a dry run)", file=sys.stderr)
        return 3
    iters = 5 if args.quick else 20
    sizes = [1, 64] if args.quick else [1, 16, 64, 256]
    import triton

    report = {"device": torch.cuda.get_device_name(0) if device != "cpu" else platform.processor() or "cpu",
              "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
              "iters": iters, "world": args.world}  # fmt: skip
    width, depth = (256, 2) if device == "cpu" or args.quick else (2048, 6)
    width, depth = args.ddp_width or width, args.ddp_depth or depth
    sections = {
        "staging": lambda: bench_staging(sizes, iters),
        "partition_staging": lambda: bench_partition_staging(64, 4, 4, iters),
        "local_reduce": lambda: bench_local_reduce(16 if args.quick else 64, [2, 4, 8], iters),
        "device_local_stage": lambda: _run(_device_local_stage, args.world, "gloo", 64, iters),
    }
    if device == "cpu":
        sections = {}  # they need CUDA
    # The DDP step (the target) before the all_reduce timings; --quick leaves out all_reduce on host tensors.
    sections["ddp"] = lambda: bench_ddp(device, args.world, width, depth, 64, iters)
    sections["allreduce"] = lambda: bench_allreduce(device, args.world, [4] if args.quick else [4, 64], iters,
                                                    host=not args.quick)  # fmt: skip
    failed = []
    for name, run in sections.items():
        # A section that fails is reported and the others still run: one pass on a lent GPU gives every figure it can.
        try:
            report[name] = run()
        except Exception as e:  # noqa: BLE001 - named in the report and the exit status
            report[name] = {"error": f"{type(e).__name__}: {e}"}
            failed.append(name)
            print(f"benchmarks/gpu.py: {name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if args.json:  # after every section, whole or not at all: a run cut short still leaves what it measured
            with open(args.json + ".tmp", "w") as f:
                json.dump(report, f, indent=2)
            os.replace(args.json + ".tmp", args.json)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
