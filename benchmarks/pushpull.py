"""Push/pull throughput against a real summation server on loopback, next to baselines from the same run.

Per tensor size S, all measured in this one run:
  - push_pull goodput: S / t for one worker's push_pull (the push sends S bytes, the pull returns S),
    as one client message of S bytes (like for like with the echo: `goodput_vs_tcp`), and through the
    library's engine (what the backend and the hook run: partitions, pipelined: `engine_goodput_vs_tcp`).
  - raw TCP: S / t for a plain-socket echo doing the same work (send S, a subprocess receives all of it,
    sends S back); store-and-forward like the summation server.
  - torch add_: S / t for one thread's in-place `a.add_(b)` on fp32 tensors of S bytes.
  - server summation: a second run with 2 workers so the server really adds; its STATS counters give
    bytes_summed / sum_ns, compared with the torch add_ figure.

Usage: python benchmarks/pushpull.py [--quick] [--json out.json]
May import: the standard library, torch and torch_bps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from torch_bps.client import Client, job_id_from_name  # noqa: E402
from torch_bps.security import new_secret  # noqa: E402

KB, MB = 1 << 10, 1 << 20
FULL_SIZES = [4 * KB, 16 * KB, 64 * KB, 256 * KB, 1 * MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB]
QUICK_SIZES = [4 * KB, 256 * KB, 4 * MB, 64 * MB, 256 * MB]

# A store-and-forward echo: read an 8-byte length, then that many bytes, then send them all back.
ECHO_SERVER = r"""
import socket, struct, sys
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(1)
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(int(sys.argv[1]))
view = memoryview(buf)
while True:
    head = conn.recv(8, socket.MSG_WAITALL)
    if len(head) < 8:
        break
    n = struct.unpack("<Q", head)[0]
    got = 0
    while got < n:
        got += conn.recv_into(view[got:n])
    conn.sendall(view[:n])
"""


def start_process(cmd: list[str], pattern: str, timeout: float = 60.0) -> tuple[subprocess.Popen, int]:
    """Start a subprocess and return it with the port it prints (first group of `pattern`)."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + timeout
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


def timed(fn, budget: float, min_iters: int = 3, max_iters: int = 2000) -> list[float]:
    """Run fn once to warm up, then repeatedly until `budget` seconds passed; return per-call seconds."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_iters and (len(times) < min_iters or time.perf_counter() - start < budget):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


class Echo:
    """The raw TCP baseline: a connection to the echo subprocess."""

    def __init__(self, max_size: int):
        self.proc, port = start_process([sys.executable, "-c", ECHO_SERVER, str(max_size)], r"^(\d+)$")
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def roundtrip(self, src: memoryview, dst: memoryview) -> None:
        n = len(src)
        self.sock.sendall(n.to_bytes(8, "little"))
        self.sock.sendall(src)
        got = 0
        while got < n:
            got += self.sock.recv_into(dst[got:], n - got)

    def close(self) -> None:
        self.sock.close()
        stop(self.proc)


def torch_add_rate(size: int, budget: float) -> float:
    """S / t of one thread's in-place fp32 add of S-byte tensors."""
    a, b = torch.ones(size // 4), torch.ones(size // 4)
    return size / statistics.median(timed(lambda: a.add_(b), budget))


def start_server(engine_threads: int, max_frame: int, auth: str) -> tuple[subprocess.Popen, str]:
    """A summation server on loopback: `auth` curve (with the pool credential of BPS_POOL_CREDENTIAL, which
    Client also picks up) or off. Returns it and its address."""
    os.environ.setdefault("BPS_POOL_CREDENTIAL", new_secret())
    server, port = start_process(
        [sys.executable, "-m", "torch_bps.server", "--host", "127.0.0.1", "--port", "0", "--auth", auth,
         "--engine-threads", str(engine_threads), "--max-frame-bytes", str(max_frame)],
        r"port (\d+) incarnation",
    )  # fmt: skip
    return server, f"127.0.0.1:{port}"


def server_sum_rate(address: str, size: int, budget: float, tag: str, curve: bool | None) -> tuple[float, int]:
    """Run rounds with 2 workers (threads with a client each); return the server's bytes_summed/sum_ns."""
    job = job_id_from_name(f"bench-sum-{tag}-{size}")
    clients = [Client([address], job, w, 2, timeout=120, curve=curve) for w in range(2)]
    tensors = [torch.ones(size // 4) for _ in range(2)]
    try:
        clients[0].push_pull(tensors[0], 0)  # warm-up round: INIT, first allocation of the sum
        clients[1].push_pull(tensors[1], 0).wait()
        before = clients[0].server_stats(0)
        rounds, start = 0, time.perf_counter()
        while rounds < 3 or time.perf_counter() - start < budget:
            futs = [c.push_pull(t, 0) for c, t in zip(clients, tensors, strict=True)]
            for f in futs:
                f.wait()
            rounds += 1
        after = clients[0].server_stats(0)
    finally:
        for c in clients:
            c.close()
    summed, ns = after["bytes_summed"] - before["bytes_summed"], after["sum_ns"] - before["sum_ns"]
    return (summed / ns * 1e9 if ns else float("nan")), rounds


def measure(sizes: list[int], budget: float, engine_threads: int, auth: str = "curve") -> list[dict]:
    torch.set_num_threads(1)  # the add_ baseline is one thread, as the server's engines are
    server, address = start_server(engine_threads, max(sizes), auth)
    curve = False if auth == "off" else None  # None: the keys of BPS_POOL_CREDENTIAL
    echo = Echo(max(sizes))
    rows = []
    try:
        with (
            Client(
                [address], job_id_from_name(f"bench-goodput-{os.getpid()}"), 0, 1, timeout=120, curve=curve
            ) as client,
            Client(
                [address], job_id_from_name(f"bench-engine-{os.getpid()}"), 0, 1, timeout=120, curve=curve
            ) as engine_client,
        ):
            engine = library_engine(engine_client, address)
            for key, size in enumerate(sizes):
                t = torch.ones(size // 4)
                dst = torch.empty_like(t)
                src_view, dst_view = memoryview(t.numpy()).cast("B"), memoryview(dst.numpy()).cast("B")
                # Alternate the two in short bursts so drifting machine load hits both alike.
                bps_times, tcp_times, engine_times = [], [], []
                for _ in range(3):
                    bps_times += timed(lambda t=t, key=key: client.push_pull(t, key).wait(), budget / 3)
                    engine_times += timed(lambda t=t: engine.push_pull(t).wait(), budget / 3)
                    tcp_times += timed(lambda s=src_view, d=dst_view: echo.roundtrip(s, d), budget / 3)
                pushpull = size / statistics.median(bps_times)
                engined = size / statistics.median(engine_times)
                tcp = size / statistics.median(tcp_times)
                add = torch_add_rate(size, budget / 2)
                summed, sum_rounds = server_sum_rate(address, size, budget, str(os.getpid()), curve)
                rows.append(
                    dict(size=size, engine_Bps=engined, pushpull_Bps=pushpull, tcp_Bps=tcp,
                         goodput_vs_tcp=pushpull / tcp,
                         engine_goodput_vs_tcp=engined / tcp,
                         torch_add_Bps=add, server_sum_Bps=summed, sum_vs_torch_add=summed / add,
                         pushpull_iters=len(bps_times), tcp_iters=len(tcp_times), sum_rounds=sum_rounds)
                )  # fmt: skip
                print_row(rows[-1])
                del t, dst, src_view, dst_view
    finally:
        echo.close()
        stop(server)
    return rows


def human(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def rate(n: float) -> str:
    return human(n) + "/s"


def library_engine(client: Client, address: str):
    """torch_bps's worker pipeline (4 MB partitions, placement, credit scheduler) over `client`."""
    from torch_bps.engine.partition import KeyBook
    from torch_bps.engine.pipeline import PushPullEngine
    from torch_bps.engine.placement import Placement, server_weights
    from torch_bps.engine.scheduler import DEFAULT_CREDIT_BYTES, CreditScheduler

    keys = KeyBook(Placement(server_weights([address], [])), 4_096_000, lambda numel: [(0, numel)])
    return PushPullEngine(client, keys, CreditScheduler(DEFAULT_CREDIT_BYTES))


def print_header() -> None:
    left = f"{'1 message':>11} {'raw TCP':>11} {'ratio':>6} {'engine':>11} {'ratio':>6}"
    right = f"{'server sum':>11} {'torch add_':>11} {'ratio':>6}"
    print(f"{'size':>9} | {left} | {right}")


def print_row(r: dict) -> None:
    size = f"{r['size'] // MB} MB" if r["size"] >= MB else f"{r['size'] // KB} KB"
    left = f"{rate(r['pushpull_Bps']):>11} {rate(r['tcp_Bps']):>11} {r['goodput_vs_tcp']:>6.2f} "
    left += f"{rate(r['engine_Bps']):>11} {r['engine_goodput_vs_tcp']:>6.2f}"
    right = f"{rate(r['server_sum_Bps']):>11} {rate(r['torch_add_Bps']):>11} {r['sum_vs_torch_add']:>6.2f}"
    print(f"{size:>9} | {left} | {right}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a reduced sweep, under a minute")
    p.add_argument("--json", metavar="PATH", help="write the per-size rows and summary ratios here")
    p.add_argument("--sizes", help="comma-separated sizes in bytes (default: 4 KB to 256 MB by 4x)")
    p.add_argument("--budget", type=float, help="seconds per measurement (default 1.5, quick 0.5)")
    p.add_argument("--engine-threads", type=int, default=2, help="the server's engine threads (default 2)")
    p.add_argument(
        "--auth", choices=("curve", "off"), default="curve", help="curve (the default) or off; see auth_cost.py"
    )
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else QUICK_SIZES if args.quick else FULL_SIZES
    budget = args.budget or (0.5 if args.quick else 1.5)

    print(f"push_pull: 1 worker, 1 server subprocess on loopback (auth {args.auth}); server sum: 2 workers; "
          f"torch {torch.__version__}")  # fmt: skip
    print("goodput = bytes of the tensor per second of push_pull; ratios are measured in this run")
    print(
        "1 message = one client push_pull of the whole tensor; "
        "engine = the library's push_pull (partitioned, pipelined)"
    )
    print_header()
    rows = measure(sizes, budget, args.engine_threads, args.auth)
    largest = max(rows, key=lambda r: r["size"])
    summary = {
        "goodput_vs_tcp": largest["goodput_vs_tcp"],
        "engine_goodput_vs_tcp": largest["engine_goodput_vs_tcp"],
        "sum_vs_torch_add": largest["sum_vs_torch_add"],
        "largest_size": largest["size"],
        "rows": rows,
    }
    print(f"largest size {human(largest['size'])}: goodput_vs_tcp {largest['goodput_vs_tcp']:.2f} (target 0.7), "
          f"sum_vs_torch_add {largest['sum_vs_torch_add']:.2f} (target 0.7)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
