"""The summation server's CPU cost per byte and per message, against the floor of what it must do.

A real `bps-server` process (authentication `token`, as by default) and W worker processes (a
torch_bps.client.Client each, default 4) on loopback. Each worker push_pulls P keys (partitions) of S
bytes, all in flight at once, for R rounds; the figure is the server process's CPU seconds (its CPU-time
clock, in nanoseconds: every thread, kernel time of its sockets included) over those rounds, per GiB pushed
into it and per message (a PUSH or a PULL; each gets one reply).

Beside it, measured in this process in the same run (one thread, CPU time, buffers cycled through 64 MiB
so they are not cache-resident, as received frames are not), the floor a server cannot go below:
  - add: torch `add_` of the bytes summed (W - 1 adds of S per key and round: the first push is kept),
  - memcpy: `copy_` of the bytes moved twice (received into memory, sent back out: W pushes in, W pulls out).
The ratios: server CPU / (add + memcpy) per GiB, and per message the server's CPU beyond that floor.

`--server NAME=DIR` (repeatable) runs the server from another checkout DIR (`python -m torch_bps.server`
with DIR first on the path), e.g. `--server old=/tmp/bps-base --server new=.` for an A/B: servers alternate
within every repeat, so machine load drifting hits all alike, and each ratio is taken within a repeat.

`--dtype float16|bfloat16` pushes 16-bit keys, which the server sums in an fp32 accumulator and rounds once
(docs/protocol.md, "Summation"); the floor's add is then torch's `add_` in that dtype.

`--codec SPEC` (repeatable: onebit, topk:R, randomk:R) adds a variant per codec beside plain fp32 keys, alternated
within every repeat: each key of S dense fp32 bytes is pushed encoded (torch_bps.engine.compress), a fresh random
gradient every round, and the server decodes, sums, and encodes the sum with its own error feedback
(docs/protocol.md, "Compressed keys"). Its row gives the server's CPU per GiB on the wire and per dense GiB, each
over plain fp32's per GiB in the same repeat.
With `--server`, each codec runs on each checkout (variant NAME:SPEC), over that checkout's plain fp32 keys.

Usage: python benchmarks/server_cpu.py [--quick] [--dtype D] [--codec SPEC ...] [--server NAME=DIR ...] [--json F]
May import: the standard library, torch, torch_bps, benchmarks._harness and benchmarks.cluster.cpu.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks._harness import Child, Server  # noqa: E402
from benchmarks.cluster.cpu import process_cpu_seconds  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB]
FLOOR_POOL_BYTES = 64 * MiB  # the floor's buffers: bigger than any cache, as a stream of received frames is
STEP_TIMEOUT = 300.0  # seconds any worker step may take before the run is abandoned


def start_server(checkout: str, max_frame: int) -> Server:
    """`python -m torch_bps.server` from `checkout` on loopback, authentication `token` with the pool credential of
    BPS_POOL_CREDENTIAL (set by Server when unset), which the workers' Clients also read."""
    return Server("--auth", "token", "--max-frame-bytes", str(max(max_frame, 16 * MiB)), repo=checkout,
                  start_timeout=120)  # fmt: skip


def run_workers(server: Server, workers: int, size: int, keys: int, rounds: int, tag: str, dtype: str = "float32",
                codec: str = "") -> dict:  # fmt: skip
    """W worker processes push_pull `keys` keys of `size` (dense) bytes for `rounds` rounds; return the server's
    CPU, and the bytes pushed into it (encoded, with a codec)."""
    job = f"server-cpu-{os.getpid()}-{tag}"
    argv = [sys.executable, os.path.abspath(__file__), "_worker", server.address, job, dtype, codec or "-",
            str(workers), str(size), str(keys), str(rounds)]  # fmt: skip
    procs = [Child([*argv, str(w)], name=f"worker {w}") for w in range(workers)]
    try:
        for p in procs:  # each has said HELLO, declared its keys and run one round (first sums allocated)
            wire = int(p.expect(r"^ready (\d+)", STEP_TIMEOUT).group(1))
        cpu0, start = process_cpu_seconds(server.pid), time.perf_counter()
        for p in procs:
            p.say("go")
        for p in procs:
            if wrong := p.expect(r"^done(.*)", STEP_TIMEOUT).group(1).strip():
                raise RuntimeError(f"server at {server.address}: {wrong}")
        wall, cpu = time.perf_counter() - start, process_cpu_seconds(server.pid) - cpu0
        for p in procs:
            p.say("exit")
    finally:
        for p in procs:
            p.stop()
    received = workers * keys * rounds * wire
    return dict(cpu=cpu, wall=wall, received=received, dense=workers * keys * rounds * size,
                messages=2 * workers * keys * rounds)  # fmt: skip


def worker_main(argv: list[str]) -> int:
    """One worker: `_worker ADDRESS JOB DTYPE CODEC WORKERS SIZE KEYS ROUNDS INDEX`, driven by "go"/"exit" on stdin."""
    from torch_bps.client import Client, job_id_from_name

    address, job, dtype, codec = argv[:4]
    workers, size, keys, rounds, index = map(int, argv[4:])
    torch.set_num_threads(1)
    if codec != "-":
        return _codec_worker(address, job, codec, workers, size, keys, rounds, index)
    dtype = getattr(torch, dtype)
    # Small integers: every sum is exact in every dtype, so a wrong one is the server's.
    tensors = [torch.full((size // dtype.itemsize,), float(index + 1), dtype=dtype) for _ in range(keys)]
    outs = [torch.empty_like(t) for t in tensors]  # the pushed tensors stay as they are: every sum is known
    with Client([address], job_id_from_name(job), index, workers, timeout=STEP_TIMEOUT) as client:

        def one_round() -> None:
            for f in [client.push_pull(t, key, out=o) for key, (t, o) in enumerate(zip(tensors, outs, strict=True))]:
                f.wait()

        one_round()
        print(f"ready {size}", flush=True)
        if sys.stdin.readline().strip() != "go":
            return 1
        for _ in range(rounds):
            one_round()
        expected = workers * (workers + 1) // 2
        wrong = [key for key, o in enumerate(outs) if not bool((o == expected).all())]
        print(f"done WRONG SUM of keys {wrong}" if wrong else "done", flush=True)
        sys.stdin.readline()
    return 0


def _codec_worker(address: str, job: str, codec: str, workers: int, size: int, keys: int, rounds: int,
                  index: int) -> int:  # fmt: skip
    """A worker of `--codec`: every round a fresh dense gradient per key, all encoded (with this worker's error
    feedback) before the timed rounds, so that the rows top-k sends change from round to round as a real gradient's
    do; pushed one round at a time."""
    from torch_bps.client import Client, job_id_from_name
    from torch_bps.engine.compress import Compressor
    from torch_bps.wire import Mode, Partition

    compressor = Compressor(codec)
    torch.manual_seed(index)
    outs: list[torch.Tensor] = []
    batches = []  # a warm-up round, then the timed ones
    for _ in range(rounds + 1):
        payloads = [compressor.encode(key, torch.randn(size // 4))[0] for key in range(keys)]
        outs = outs or [torch.empty_like(p) for p in payloads]
        batches.append([Partition(p, key, 0, outs[key], Mode.SUM, p.numel(), 0, 0, compressor.word, size // 4)
                        for key, p in enumerate(payloads)])  # fmt: skip
    with Client([address], job_id_from_name(job), index, workers, timeout=STEP_TIMEOUT) as client:
        client.push_pull_batch(batches[0]).wait()
        print(f"ready {outs[0].numel() * 4}", flush=True)
        if sys.stdin.readline().strip() != "go":
            return 1
        for parts in batches[1:]:
            client.push_pull_batch(parts).wait()
        decoded = torch.empty(size // 4)
        compressor.decode(0, rounds, outs[0], decoded)
        print("done" if bool(decoded.isfinite().all()) else "done WRONG SUM: not finite", flush=True)
        sys.stdin.readline()
    return 0


def floor_seconds_per_gib(size: int, workers: int, budget: float, dtype: str = "float32") -> dict:
    """CPU seconds per GiB pushed that the server cannot avoid: add_ of (W-1)/W of it, memcpy of twice it."""
    torch.set_num_threads(1)
    n = max(2, FLOOR_POOL_BYTES // size)
    dt = getattr(torch, dtype)
    pool = [torch.ones(size // dt.itemsize, dtype=dt) for _ in range(n)]
    other = [torch.ones(size // dt.itemsize, dtype=dt) for _ in range(n)]

    def per_byte(fn) -> float:
        for i in range(n):  # warm: touch every page once
            fn(pool[i], other[i])
        done, start = 0, time.thread_time()
        while done < 3 * n or time.thread_time() - start < budget:
            fn(pool[done % n], other[done % n])
            done += 1
        return (time.thread_time() - start) / (done * size)

    add = per_byte(lambda a, b: a.add_(b)) * GiB * (workers - 1) / workers
    memcpy = per_byte(lambda a, b: a.copy_(b)) * GiB * 2
    return dict(add=add, memcpy=memcpy)


def measure(servers: dict[str, tuple[str, str]], sizes: list[int], workers: int, mib: int, repeats: int,
            budget: float, dtype: str = "float32") -> list:  # fmt: skip
    """servers: name -> (checkout, codec or "")."""
    rows = []
    for size in sizes:
        keys = max(2, min(64, 8 * MiB // size))
        rounds = max(3, mib * MiB // (keys * size))
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        floors = []
        for rep in range(repeats):
            for name, (checkout, codec) in servers.items():
                with start_server(checkout, size) as server:
                    tag = f"{name}-{size}-{rep}"
                    runs[name].append(run_workers(server, workers, size, keys, rounds, tag, dtype, codec))
            floors.append(floor_seconds_per_gib(size, workers, budget, dtype))
        row = dict(size=size, keys=keys, rounds=rounds, workers=workers, repeats=repeats, dtype=dtype)
        for rep in range(repeats):
            floor = floors[rep]["add"] + floors[rep]["memcpy"]
            for name in servers:
                r = runs[name][rep]
                per_gib = r["cpu"] / (r["received"] / GiB)
                floor_cpu = floor * r["received"] / GiB
                r.update(cpu_per_gib=per_gib, vs_floor=per_gib / floor,
                         us_per_message=r["cpu"] / r["messages"] * 1e6,
                         us_per_message_over_floor=(r["cpu"] - floor_cpu) / r["messages"] * 1e6)  # fmt: skip
        plain = _plain_of(servers)
        for rep in range(repeats):  # a codec's CPU per byte over plain keys' (wire bytes; dense bytes)
            for name, (_, codec) in servers.items():
                if codec:
                    base = runs[plain[name]][rep]["cpu"] / runs[plain[name]][rep]["received"]
                    r = runs[name][rep]
                    r["wire_over_plain"] = r["cpu"] / r["received"] / base
                    r["dense_over_plain"] = r["cpu"] / r["dense"] / base
        row["floor"] = {k: statistics.median(f[k] for f in floors) for k in ("add", "memcpy")}
        for name in servers:
            figures = ("cpu_per_gib", "vs_floor", "us_per_message", "us_per_message_over_floor", "wall")
            row[name] = {k: statistics.median(r[k] for r in runs[name]) for k in figures}
            row[name]["all_vs_floor"] = [r["vs_floor"] for r in runs[name]]
            if servers[name][1]:
                for k in ("wire_over_plain", "dense_over_plain"):
                    row[name][k] = statistics.median(r[k] for r in runs[name])
        names = list(servers)
        if len(names) == 2 and not any(codec for _, codec in servers.values()):  # the A/B ratio, within each repeat
            a, b = names
            row[f"{b}_over_{a}"] = statistics.median(runs[b][i]["cpu"] / runs[a][i]["cpu"] for i in range(repeats))
        rows.append(row)
        print_row(row, names, plain)
    return rows


def _plain_of(servers: dict[str, tuple[str, str]]) -> dict[str, str]:
    """Each codec variant's plain fp32 server: the one of its checkout, else the first."""
    plain: dict[str, str] = {}
    for name, (checkout, codec) in servers.items():
        if not codec:
            plain.setdefault(checkout, name)
    first = next(iter(plain.values()))
    return {name: plain.get(checkout, first) for name, (checkout, codec) in servers.items() if codec}


def print_row(row: dict, names: list[str], plain: dict[str, str]) -> None:
    floor = row["floor"]
    cells = [f"{row['size'] // KiB} KiB x {row['keys']} keys x {row['rounds']} rounds",
             f"floor add {floor['add']:.3f} + memcpy {floor['memcpy']:.3f} s/GiB"]  # fmt: skip
    for name in names:
        r = row[name]
        if "wire_over_plain" in r:
            base = plain[name]
            cells.append(f"{name}: {r['cpu_per_gib']:.3f} s/GiB on the wire = {r['wire_over_plain']:.2f}x {base}'s, "
                         f"per dense GiB {r['dense_over_plain']:.2f}x, {r['us_per_message']:.0f} us/msg")  # fmt: skip
            continue
        cells.append(f"{name}: {r['cpu_per_gib']:.3f} s/GiB = {r['vs_floor']:.1f}x floor, "
                     f"{r['us_per_message']:.0f} us/msg ({r['us_per_message_over_floor']:.0f} over floor)")  # fmt: skip
    if f"{names[-1]}_over_{names[0]}" in row:
        cells.append(f"{names[1]}/{names[0]} CPU {row[f'{names[1]}_over_{names[0]}']:.2f}")
    print(" | ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        return worker_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", action="append", metavar="NAME=DIR",
                   help="a checkout whose server to measure (repeatable; default: this checkout)")  # fmt: skip
    p.add_argument("--sizes", help="comma-separated partition sizes in bytes (default 64 KiB, 256 KiB, 1 MiB, 4 MiB)")
    p.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    p.add_argument("--mib", type=int, default=128, help="MiB each worker pushes per run (default 128; quick 32)")
    p.add_argument("--repeats", type=int, default=3, help="runs per server and size (default 3; quick 1)")
    p.add_argument("--quick", action="store_true", help="--mib 32 --repeats 1")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="the keys' dtype (default float32)")  # fmt: skip
    p.add_argument("--codec", action="append", default=[], metavar="SPEC",
                   help="also push keys compressed with SPEC (onebit, topk:R, randomk:R; repeatable)")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="write every row (and each repeat's ratio) here")
    args = p.parse_args(argv)
    if args.codec and args.dtype != "float32":
        p.error("--codec compares with fp32 keys: no --dtype")
    checkouts = dict(s.split("=", 1) for s in args.server) if args.server else {"fp32" if args.codec else "this": REPO}
    servers = {name: (os.path.abspath(path), "") for name, path in checkouts.items()}
    for spec in args.codec:  # each codec on each checkout, named by the codec alone where there is one
        servers.update({f"{name}:{spec}" if args.server else spec: (os.path.abspath(path), spec)
                        for name, path in checkouts.items()})  # fmt: skip
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else SIZES
    mib, repeats = (32, 1) if args.quick else (args.mib, args.repeats)
    print(f"{args.workers} worker processes, 1 server process, loopback, auth token; {args.dtype} keys; torch "
          f"{torch.__version__}; {os.cpu_count()} CPUs; medians of {repeats} repeats")  # fmt: skip
    rows = measure(servers, sizes, args.workers, mib, repeats, budget=0.3, dtype=args.dtype)
    if args.json:
        command = " ".join(["python", "benchmarks/server_cpu.py", *argv])
        with open(args.json, "w") as f:
            json.dump({"command": command, "servers": servers, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
