"""Push/pull throughput against a real summation server on loopback, next to like-for-like baselines.

Per tensor size S, every figure is measured `--repeats` times (alternating, so drifting machine load hits
all alike) and reported as min / median / max over the repeats; each ratio is taken within a repeat.
  - 1 message: S / t of one worker's `Client.push_pull` of the whole tensor (push S, pull the sum back), against
    raw TCP, 1 message: a plain-socket echo that receives all S bytes and then sends them back, store-and-forward
    as the server is with one message.
  - engine: S / t of the library's push_pull (PushPullEngine: partitions of P bytes, pipelined under the
    credit), against raw TCP, pipelined: the same echo fed S bytes in chunks of P, each chunk sent back as soon
    as it arrived while the client keeps sending.
  - server: the summation server's rate from receive to reply: 2 workers (threads, a Client each) keep several
    keys of S bytes in flight for rounds on end; bytes pushed into the server per second of wall time, with
    the server's CPU time over that wall time (near 1 or more: the server is the bottleneck). Against one
    thread's in-place `torch add_` of S bytes, what summing alone would cost. `server_add_kernel` is the
    server's own counter (bytes added / time inside add_): kernel time only, in the JSON.

With `--like-for-like`, only the figures that compare with ps-lite's `test_benchmark` (mode 1: per iteration a
push and a pull of each of 40 keys of S bytes, all in flight, then a wait for all; benchmarks/pslite.py):
  - engine, 40 keys: 40 x S / t of one iteration that issues 40 collectives of one S-byte tensor each through the
    engine back to back, then waits for all 40. That is what DDP does with the "byteps" backend or the hook: one
    all_reduce per gradient bucket, launched as the bucket is ready, all waited at the end of backward.
  - ps-lite (with `--pslite DIR`, a built ps-lite checkout): its own goodput at S, run in the same repeat right
    after ours (a scheduler, a server and a worker process), and the ratio of the two.

Usage: python benchmarks/pushpull.py [--quick] [--json out.json] [--like-for-like [--pslite DIR]]
May import: the standard library, torch and torch_bps (and benchmarks.pslite, benchmarks.cluster.cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks._harness import Server  # noqa: E402
from benchmarks.cluster.cpu import process_cpu_seconds  # noqa: E402
from benchmarks.pslite import KEYS as PSLITE_KEYS  # noqa: E402
from benchmarks.pslite import PsLite  # noqa: E402
from torch_bps.client import Client, job_id_from_name  # noqa: E402

KB, MB = 1 << 10, 1 << 20
FULL_SIZES = [4 * KB, 16 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB]
QUICK_SIZES = [4 * KB, 256 * KB, 4 * MB, 64 * MB]
LIKE_FOR_LIKE_SIZES = [64 * KB, 256 * KB, 1 * MB, 4 * MB]  # issue 15's targets are at 64 KB and 4 MB
SERVER_BYTES_IN_FLIGHT = 32 * MB  # per worker in the server run: enough keys that the server never waits

# An echo: per request a 16-byte (length, chunk) header, then the bytes. chunk 0: receive all, then send all
# (store-and-forward); otherwise send each chunk back as soon as it arrived (pipelined).
ECHO_SERVER = r"""
import socket, struct, sys
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(1)
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
view = memoryview(bytearray(int(sys.argv[1])))
while len(head := conn.recv(16, socket.MSG_WAITALL)) == 16:
    n, chunk = struct.unpack("<QQ", head)
    step = chunk or n
    for lo in range(0, n, step):
        hi, got = min(n, lo + step), lo
        while got < hi:
            got += conn.recv_into(view[got:hi])
        conn.sendall(view[lo:hi])
"""


def start_process(cmd: list[str], pattern: str, timeout: float = 60.0) -> tuple[subprocess.Popen, int]:
    """Start a subprocess and return it with the port it prints (first group of `pattern`)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if m := re.search(pattern, line):
            return proc, int(m.group(1))
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{cmd[:3]} did not start (last line {line!r})")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def timed(fn, budget: float, min_iters: int = 3, max_iters: int = 2000) -> float:
    """Run fn once to warm up, then repeatedly until `budget` seconds passed; return the median seconds."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_iters and (len(times) < min_iters or time.perf_counter() - start < budget):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Echo:
    """The raw TCP baselines: a connection to the echo subprocess, and a thread that sends for `pipelined`."""

    def __init__(self, max_size: int):
        self.proc, port = start_process([sys.executable, "-c", ECHO_SERVER, str(max_size)], r"^(\d+)$")
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._outbox: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, daemon=True)
        self._sender.start()

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            self.sock.sendall(item)

    def one_message(self, src: memoryview, dst: memoryview) -> None:
        self.sock.sendall(struct.pack("<QQ", len(src), 0))
        self.sock.sendall(src)
        self._receive(dst, len(src))

    def pipelined(self, src: memoryview, dst: memoryview, chunk: int) -> None:
        self.sock.sendall(struct.pack("<QQ", len(src), chunk))
        self._outbox.put(src)  # sent from the other thread while this one receives the echoes
        self._receive(dst, len(src))

    def _receive(self, dst: memoryview, n: int) -> None:
        got = 0
        while got < n:
            got += self.sock.recv_into(dst[got:], n - got)

    def close(self) -> None:
        self._outbox.put(None)
        self._sender.join(timeout=10)
        self.sock.close()
        stop(self.proc)


def library_engine(client: Client, address: str):
    """torch_bps's worker pipeline (4 MB partitions, placement) over `client` (which schedules within its credit)."""
    from torch_bps.engine.partition import KeyBook
    from torch_bps.engine.pipeline import PushPullEngine
    from torch_bps.engine.placement import Placement, server_weights

    keys = KeyBook(Placement(server_weights([address], [])), 4_096_000, lambda numel: [(0, numel)])
    return PushPullEngine(client, keys)


def server_rate(server: Server, address: str, size: int, budget: float, tag: str) -> dict:
    """2 workers keep SERVER_BYTES_IN_FLIGHT of keys in flight each; return the server's receive-to-reply rate."""
    keys = max(1, min(16, SERVER_BYTES_IN_FLIGHT // size))
    job = job_id_from_name(f"bench-server-{tag}")
    clients = [Client([address], job, w, 2, timeout=120) for w in range(2)]
    tensors = [[torch.ones(size // 4) for _ in range(keys)] for _ in range(2)]

    def round_() -> None:
        futures = [c.push_pull(t, key) for c, ts in zip(clients, tensors, strict=True) for key, t in enumerate(ts)]
        for f in futures:
            f.wait()

    try:
        round_()  # warm-up: INIT, first allocation of every sum
        before, cpu0 = clients[0].server_stats(0), process_cpu_seconds(server.pid)
        rounds, start = 0, time.perf_counter()
        while rounds < 3 or time.perf_counter() - start < budget:
            round_()
            rounds += 1
        wall = time.perf_counter() - start
        cpu, after = process_cpu_seconds(server.pid) - cpu0, clients[0].server_stats(0)
    finally:
        for c in clients:
            c.close()
    bytes_in = after["bytes_in"] - before["bytes_in"]
    summed, ns = after["bytes_summed"] - before["bytes_summed"], after["sum_ns"] - before["sum_ns"]
    assert bytes_in == 2 * keys * size * rounds, (bytes_in, keys, rounds)  # every push reached the server once
    return dict(server=bytes_in / wall, server_cpu=cpu / wall, server_add_kernel=summed / ns * 1e9 if ns else 0.0)


def measure_once(size, budget, client, engine, echo, server, address, tag) -> dict:
    """One repeat of every figure for one size."""
    t = torch.ones(size // 4)
    dst = torch.empty_like(t)
    src_view, dst_view = memoryview(t.numpy()).cast("B"), memoryview(dst.numpy()).cast("B")
    chunk = engine.keys.partition_size(size)
    r = dict(
        one_message=size / timed(lambda: client.push_pull(t, size).wait(), budget),
        tcp_one_message=size / timed(lambda: echo.one_message(src_view, dst_view), budget),
        engine=size / timed(lambda: engine.push_pull(t).wait(), budget),
        tcp_pipelined=size / timed(lambda: echo.pipelined(src_view, dst_view, chunk), budget),
        torch_add=size / timed(lambda: dst.add_(t), budget),
        partition=chunk,
    )
    r.update(server_rate(server, address, size, budget, tag))
    r["one_message_vs_tcp"] = r["one_message"] / r["tcp_one_message"]
    r["engine_vs_pipelined_tcp"] = r["engine"] / r["tcp_pipelined"]
    r["server_vs_torch_add"] = r["server"] / r["torch_add"]
    return r


FIGURES = ("one_message", "tcp_one_message", "one_message_vs_tcp", "engine", "tcp_pipelined",
           "engine_vs_pipelined_tcp", "server", "server_cpu", "torch_add", "server_vs_torch_add",
           "server_add_kernel")  # fmt: skip


def start_server(max_frame: int, auth: str = "") -> tuple[Server, str]:
    """A summation server on loopback: `auth` token, curve (with the pool credential of BPS_POOL_CREDENTIAL,
    which Client also picks up) or off; default BPS_AUTH's, as Client's. Returns it and its address."""
    auth = auth or os.environ.get("BPS_AUTH", "token")
    server = Server("--auth", auth, "--max-frame-bytes", str(max(max_frame, 16 * MB)))
    return server, server.address


def measure(sizes: list[int], budget: float, repeats: int) -> list[dict]:
    server, address = start_server(max(sizes))  # authentication on, as by default
    echo = Echo(max(sizes))
    rows = []
    try:
        with (
            Client([address], job_id_from_name(f"bench-one-{os.getpid()}"), 0, 1, timeout=120) as client,
            Client([address], job_id_from_name(f"bench-engine-{os.getpid()}"), 0, 1, timeout=120) as engine_client,
        ):
            engine = library_engine(engine_client, address)
            for size in sizes:
                runs = [measure_once(size, budget, client, engine, echo, server, address, f"{os.getpid()}-{size}-{i}")
                        for i in range(repeats)]  # fmt: skip
                row = {"size": size, "partition": runs[0]["partition"], "repeats": repeats}
                row.update(spreads(runs, FIGURES))
                rows.append(row)
                print_row(row)
            engine.close()
    finally:
        echo.close()
        server.stop()
    return rows


def spreads(runs: list[dict], names: Sequence[str]) -> dict:
    """Per figure present in the runs: min, median, max and every repeat's value (sorted)."""
    out = {}
    for name in names:
        values = sorted(r[name] for r in runs if name in r)
        if values:
            out[name] = dict(min=values[0], median=statistics.median(values), max=values[-1], all=values)
    return out


def engine_keys(engine, tensors: list[torch.Tensor]) -> None:
    """One iteration as ps-lite's test_benchmark makes it: one collective per tensor, issued back to back as DDP
    issues its buckets' all_reduces, then a wait for all of them."""
    futures = [engine.push_pull(t) for t in tensors]
    for f in futures:
        f.wait()


LIKE_FIGURES = ("engine_40_keys", "pslite", "engine_40_keys_vs_pslite", "load")


def measure_like_for_like(sizes: list[int], budget: float, repeats: int, pslite: PsLite | None) -> list[dict]:
    """Per size and repeat: the engine's goodput with 40 keys in flight, then (with `pslite`) ps-lite's."""
    server, address = start_server(max(sizes))  # authentication on, as by default
    rows = []
    try:
        with Client([address], job_id_from_name(f"bench-keys-{os.getpid()}"), 0, 1, timeout=120) as client:
            engine = library_engine(client, address)
            for size in sizes:
                tensors = [torch.ones(size // 4) for _ in range(PSLITE_KEYS)]
                runs = []
                for _ in range(repeats):
                    r = {"load": os.getloadavg()[0]}  # 1-minute load average as the repeat starts
                    calls, before = [], client.server_stats(0)["bytes_in"]
                    r["engine_40_keys"] = (
                        PSLITE_KEYS
                        * size
                        / timed(lambda t=tensors, calls=calls: calls.append(engine_keys(engine, t)), budget)
                    )
                    bytes_in = client.server_stats(0)["bytes_in"] - before
                    assert bytes_in == len(calls) * PSLITE_KEYS * size, (bytes_in, len(calls))  # all via the server
                    if pslite is not None:
                        r["pslite"] = pslite.goodput(size, budget)
                        r["engine_40_keys_vs_pslite"] = r["engine_40_keys"] / r["pslite"]
                    runs.append(r)
                row = {"size": size, "partition": engine.keys.partition_size(size), "keys": PSLITE_KEYS}
                row.update(repeats=repeats, **spreads(runs, LIKE_FIGURES))
                rows.append(row)
                cells = [spread(row[name], name.endswith("_pslite") or name == "load") for name in LIKE_FIGURES
                         if name in row]  # fmt: skip
                print(f"{size_name(size)} | " + " | ".join(cells), flush=True)
            engine.close()
    finally:
        server.stop()
    return rows


def human(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def size_name(size: int) -> str:
    return f"{size // MB} MB" if size >= MB else f"{size // KB} KB"


def spread(stat: dict, bare: bool) -> str:
    """median (min-max), rates in B/s and ratios bare."""
    if not bare:
        return f"{human(stat['median'])}/s ({human(stat['min'])}-{human(stat['max'])})"
    return f"{stat['median']:.2f} ({stat['min']:.2f}-{stat['max']:.2f})"


def print_row(row: dict) -> None:
    cells = [spread(row[name], name.endswith(("_vs_tcp", "_vs_pipelined_tcp", "_vs_torch_add", "_cpu")))
             for name in FIGURES[:-1]]  # fmt: skip
    print(f"{size_name(row['size'])} | " + " | ".join(cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a reduced sweep (4 sizes, 3 repeats)")
    p.add_argument("--json", metavar="PATH", help="write the per-size rows (every repeat) and the summary here")
    p.add_argument("--sizes", help="comma-separated sizes in bytes (default: 4 KB to 256 MB by 4x; "
                                   "--like-for-like: 64 KB to 4 MB by 4x)")  # fmt: skip
    p.add_argument(
        "--budget", type=float, help="seconds per figure per repeat (default 0.4, quick 0.2, like-for-like 2)"
    )
    p.add_argument("--repeats", type=int, help="repeats of every figure (default 5, quick 3)")
    p.add_argument("--like-for-like", action="store_true", help="only the figures to compare with ps-lite's benchmark")
    p.add_argument("--pslite", metavar="DIR", help="with --like-for-like: a built ps-lite checkout; its "
                                                   "test_benchmark runs in every repeat, right after ours")  # fmt: skip
    args = p.parse_args(argv)
    if args.pslite and not args.like_for_like:
        p.error("--pslite goes with --like-for-like")
    default_sizes = LIKE_FOR_LIKE_SIZES if args.like_for_like else QUICK_SIZES if args.quick else FULL_SIZES
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else default_sizes
    budget = args.budget or (2.0 if args.like_for_like else 0.2 if args.quick else 0.4)
    repeats = args.repeats or (3 if args.quick else 5)
    torch.set_num_threads(1)  # the add_ baseline is one thread, as the server sums on one thread
    command = " ".join(["python", "benchmarks/pushpull.py", *(argv or [])])

    if args.like_for_like:
        pslite = PsLite(args.pslite) if args.pslite else None
        print(f"1 worker and 1 server subprocess on loopback, {PSLITE_KEYS} keys per iteration; torch "
              f"{torch.__version__}; median (min-max) of {repeats} repeats")  # fmt: skip
        print("size | " + " | ".join(n for n in LIKE_FIGURES if pslite or "pslite" not in n))
        rows = measure_like_for_like(sizes, budget, repeats, pslite)
        summary = {f"engine_40_keys_vs_pslite_{r['size']}": r["engine_40_keys_vs_pslite"]["median"]
                   for r in rows if "engine_40_keys_vs_pslite" in r}  # fmt: skip
    else:
        print(f"1 worker and 1 server subprocess on loopback (server: 2 workers); torch {torch.__version__}; "
              f"median (min-max) of {repeats} repeats")  # fmt: skip
        print("size | " + " | ".join(FIGURES[:-1]))
        rows = measure(sizes, budget, repeats)
        largest = max(rows, key=lambda r: r["size"])
        summary = {name: largest[name]["median"] for name in FIGURES if "_vs_" in name}
        summary["largest_size"] = largest["size"]
    print("medians: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items() if "_vs_" in k))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "command": command, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
