"""Where a small collective's time goes on one machine: stamps around the engine's stages (2 ranks):

torchrun --standalone --nproc-per-node 2 docs/results/session29/stages.py
"""

import collections
import time

import torch
import torch.distributed as dist

from torch_bps import runtime


def main() -> None:
    dist.init_process_group("byteps")
    t = torch.ones(1)
    for _ in range(20):
        dist.all_reduce(t)
    eng = runtime._RUNTIMES["default"]._engine
    stamps: dict[str, float] = {}

    def wrap(name: str, label: str) -> None:
        f = getattr(eng, name)

        def g(*args, **kwargs):
            stamps[label + ">"] = time.perf_counter()
            result = f(*args, **kwargs)
            stamps[label + "<"] = time.perf_counter()
            return result

        setattr(eng, name, g)

    wrap("_local_reduce_scatter", "rs")
    wrap("_local_all_gather", "ag")
    x = torch.ones(256)
    spans = collections.defaultdict(list)
    for i in range(300):
        dist.barrier()
        stamps.clear()
        future = torch.futures.Future()

        def done(error, future=future) -> None:
            stamps["done"] = time.perf_counter()
            future.set_result(None)

        t0 = time.perf_counter()
        eng.run([x], done)
        t1 = time.perf_counter()
        future.wait()
        t2 = time.perf_counter()
        if i < 20:
            continue
        spans["run() call"].append(t1 - t0)
        spans["-> rs start"].append(stamps["rs>"] - t0)
        spans["rs"].append(stamps["rs<"] - stamps["rs>"])
        spans["rs end -> ag start"].append(stamps["ag>"] - stamps["rs<"])
        spans["ag"].append(stamps["ag<"] - stamps["ag>"])
        spans["ag end -> done"].append(stamps["done"] - stamps["ag<"])
        spans["done -> wait returns"].append(t2 - stamps["done"])
        spans["total"].append(t2 - t0)
    if dist.get_rank() == 0:
        for name, values in spans.items():
            print(f"{name:24s} median {sorted(values)[len(values) // 2] * 1e6:7.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
