"""Plain TCP carrying exactly a push/pull step's bytes: what the transport allows, with no protocol of ours.

    python -m benchmarks.cluster.workers.tcp_matrix serve --port 9100 --workers 7 --bytes 4194304 --steps 7
    python -m benchmarks.cluster.workers.tcp_matrix push --servers 10.77.0.101:9100:4194304,... --steps 7

A `serve` process stands where a summation server stands and a `push` process where a worker does, with one
connection per worker and server (ours too). Every step, each worker writes a server's share of the bytes
(`--bytes`, the paper's split) and reads as many back. No headers, no credit, no acknowledgements: only TCP and the
socket buffers (`--socket-buffer-bytes`) bound what is in flight.
- `rounds`: a server sends back a partition (`--partition-bytes`) of a step only once every worker has pushed
  it (the worker on its own host counts as pushed: its bytes never cross a link), and a worker pushes a step
  once it has every reply of the one before. A round's dependency, with nothing else of ours.
- `free`: the servers send back from the start and the workers push every step at once: the traffic matrix alone,
  no dependency and no fill or drain. Every step is timed, from the first reply byte.
The worker's RESULT gives seconds per timed step (`rounds`: after `--warmup` steps); every RESULT the process's CPU
over its run.
May import: the standard library and benchmarks.cluster.{cpu,workers.common}.
"""

from __future__ import annotations

import argparse
import selectors
import socket
import time

from benchmarks.cluster.cpu import CpuWindow
from benchmarks.cluster.workers.common import emit, fail

CHUNK = 1 << 18  # the most one send or receive moves
ZEROS = memoryview(bytes(CHUNK))


class Flow:
    """One connection's two directions, counted in bytes since the first step."""

    def __init__(self, sock: socket.socket, name: str, expect: int):
        self.sock, self.name, self.expect = sock, name, expect  # expect: bytes to receive in all
        self.sent = self.received = 0
        self.may_send = 0  # bytes the rule lets out so far

    def pump(self, events: int, sink: memoryview) -> None:
        """Move all the socket takes and gives now (fewer wake-ups: this loop, not the links, must not be what
        costs CPU); a peer that closed early is an error naming it."""
        try:
            while events & selectors.EVENT_READ and self.received < self.expect:
                got = self.sock.recv_into(sink)
                if got == 0:
                    raise ConnectionError(f"{self.name} closed after {self.received} bytes")
                self.received += got
        except BlockingIOError:
            pass
        try:
            while events & selectors.EVENT_WRITE and self.sent < self.may_send:
                self.sent += self.sock.send(ZEROS[: min(CHUNK, self.may_send - self.sent)])
        except BlockingIOError:
            pass


def released(pushed: int, step_bytes: int, partition: int) -> int:
    """Bytes of the replies a server may send once every worker has pushed `pushed`: whole partitions of a step."""
    steps, within = divmod(pushed, step_bytes)
    return steps * step_bytes + within // partition * partition


def run(flows: list[Flow], rule, done, deadline: float, what: str) -> None:
    """Move bytes until `done()`; before each wait, `rule()` sets every flow's may_send (and notes steps ended)."""
    sel = selectors.DefaultSelector()
    watched: dict[Flow, int] = {}
    sink = memoryview(bytearray(CHUNK))
    try:
        while True:
            rule()
            if done():
                return
            for f in flows:
                # Nothing more is read once all arrived: the peer's close is then no error.
                want = (selectors.EVENT_READ if f.received < f.expect else 0) | (
                    selectors.EVENT_WRITE if f.sent < f.may_send else 0
                )
                if want == watched.get(f, 0):
                    continue
                if not want:
                    sel.unregister(f.sock)
                elif watched.get(f):
                    sel.modify(f.sock, want, f)
                else:
                    sel.register(f.sock, want, f)
                watched[f] = want
            left = deadline - time.monotonic()
            if left <= 0:
                states = ", ".join(f"{f.name}: sent {f.sent}, received {f.received}" for f in flows)
                raise TimeoutError(f"{what}: not done by the deadline ({states})")
            for key, events in sel.select(min(left, 1.0)):
                key.data.pump(events, sink)
    finally:
        sel.close()


def serve(args) -> dict:
    total = args.bytes * args.steps
    deadline = time.monotonic() + args.timeout
    with socket.socket() as lsock:
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        _buffers(lsock, args.socket_buffer_bytes)  # accepted sockets inherit them
        lsock.bind(("0.0.0.0", args.port))
        lsock.listen(args.workers)
        print("tcp_matrix serving", flush=True)
        lsock.settimeout(args.timeout)
        flows = []
        for _ in range(args.workers):
            conn, peer = lsock.accept()
            conn.setblocking(False)
            flows.append(Flow(conn, f"worker {peer[0]}", total))

    def rule() -> None:
        allowed = total if args.mode == "free" else released(min(f.received for f in flows), args.bytes,
                                                             args.partition_bytes)  # fmt: skip
        for f in flows:
            f.may_send = allowed

    def done() -> bool:
        return all(f.sent == total and f.received == total for f in flows)

    cpu = CpuWindow().start()
    try:
        run(flows, rule, done, deadline, f"server on port {args.port}")
    finally:
        for f in flows:
            f.sock.close()
    return {"served": len(flows), "bytes_each_way": total, "cpu": cpu.stop()}


def push(args) -> dict:
    deadline = time.monotonic() + args.timeout
    flows, shares = [], []
    for entry in args.servers.split(","):
        host, port, nbytes = entry.split(":")
        sock = _connect(host, int(port), args.socket_buffer_bytes, deadline)
        sock.setblocking(False)
        flows.append(Flow(sock, f"server {host}:{port}", args.steps * int(nbytes)))
        shares.append(int(nbytes))
    pairs = list(zip(flows, shares, strict=True))
    ends: list[float] = []
    free = args.mode == "free"
    timed_from: list[float] = []  # when the timed window began, once it has

    def rule() -> None:
        while len(ends) < args.steps and all(f.received >= (len(ends) + 1) * s for f, s in pairs):
            ends.append(time.perf_counter())
        if not timed_from and (any(f.received for f in flows) if free else len(ends) >= args.warmup):
            # free: every step, timed from the first reply byte (the servers start once every worker is
            # connected, so the workers start together); rounds: after the warm-up, as the other measurements.
            timed_from.append(ends[args.warmup - 1] if not free and args.warmup else time.perf_counter())
        if free:
            pushed = args.steps if timed_from else 0
        else:
            pushed = min(len(ends) + 1, args.steps)  # a step is pushed once the one before it came back
        for f, share in pairs:
            f.may_send = pushed * share

    def done() -> bool:
        return len(ends) == args.steps and all(f.sent == f.may_send for f in flows)

    cpu = CpuWindow().start()
    try:
        run(flows, rule, done, deadline, "worker")
    finally:
        for f in flows:
            f.sock.close()
    timed = args.steps if free else args.steps - args.warmup
    return {"seconds_per_step": (ends[-1] - timed_from[0]) / timed, "cpu": cpu.stop()}


def _buffers(sock: socket.socket, nbytes: int) -> None:
    """Set the socket's buffers (if `nbytes`) and TCP_NODELAY, as torch_bps's connections have them."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if nbytes > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)


def _connect(host: str, port: int, buffer_bytes: int, deadline: float) -> socket.socket:
    """Connect (the server may still be starting: retry until the deadline), buffers set before the handshake."""
    while True:
        sock = socket.socket()
        _buffers(sock, buffer_bytes)
        sock.settimeout(2.0)
        try:
            sock.connect((host, port))
            return sock
        except OSError as e:
            sock.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no connection to server {host}:{port} by the deadline: {e}") from e
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=["serve", "push"])
    p.add_argument("--mode", choices=["rounds", "free"], default="rounds")
    p.add_argument("--port", type=int, help="serve: the port to listen on")
    p.add_argument("--workers", type=int, help="serve: how many workers connect (those on other hosts)")
    p.add_argument("--bytes", type=int, help="serve: bytes per step each worker pushes here and pulls back")
    p.add_argument("--servers", help="push: ip:port:bytes per step, comma-separated (servers on other hosts)")
    p.add_argument("--steps", type=int, default=7, help="all steps, warm-up included")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--partition-bytes", type=int, default=128 << 10, help="rounds: the unit a server releases")
    p.add_argument("--socket-buffer-bytes", type=int, default=0, help="SO_SNDBUF and SO_RCVBUF (0: the kernel's)")
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        fail(f"--warmup {args.warmup} must be below --steps {args.steps}")
    if args.role == "serve" and (args.port is None or not args.workers or not args.bytes):
        fail("serve needs --port, --workers and --bytes")
    if args.role == "push" and not args.servers:
        fail("push needs --servers")
    emit(serve(args) if args.role == "serve" else push(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
