"""What ZeroMQ costs per message, against plain TCP sockets: the floor a native transport could reach.

The data plane's pattern, stripped of everything else: a sender keeps 8 messages of S bytes in flight to a
receiver, which answers each with a 96-byte acknowledgement (a header), over loopback TCP. Once through pyzmq
(DEALER -> ROUTER, as the client and server talk) and once through blocking Python sockets, the same Python loop
around both. Reports each process's CPU (user + system) per message; the difference is ZeroMQ's: its I/O
thread, and the wake-ups between it and the thread that sends or receives.

    python benchmarks/zmq_overhead.py --sizes-kib 64,256 --repeats 3

May import: the standard library and pyzmq only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

import zmq

ACK = b"a" * 96
IN_FLIGHT = 8


def _zmq_receiver(port: int, count: int, ready, result) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    ready.put(None)
    start = time.process_time()
    for _ in range(count):
        ident, _msg = sock.recv_multipart(copy=False)
        sock.send_multipart([ident, ACK])
    result.put(time.process_time() - start)
    sock.close(linger=0)
    ctx.term()


def _zmq_sender(port: int, count: int, size: int) -> float:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    payload, sent, acked = bytes(size), 0, 0
    start = time.process_time()
    while acked < count:
        while sent < count and sent - acked < IN_FLIGHT:
            sock.send(payload, copy=False)
            sent += 1
        sock.recv()
        acked += 1
    cpu = time.process_time() - start
    sock.close(linger=0)
    ctx.term()
    return cpu


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def _tcp_receiver(port: int, count: int, ready, result, size: int) -> None:
    with socket.create_server(("127.0.0.1", port)) as listener:
        ready.put(None)
        conn, _ = listener.accept()
    view = memoryview(bytearray(size))
    start = time.process_time()
    for _ in range(count):
        _recv_exactly(conn, view)
        conn.sendall(ACK)
    result.put(time.process_time() - start)
    conn.close()


def _tcp_sender(port: int, count: int, size: int) -> float:
    conn = socket.create_connection(("127.0.0.1", port))
    payload, ack, sent, acked = bytes(size), memoryview(bytearray(len(ACK))), 0, 0
    start = time.process_time()
    while acked < count:
        while sent < count and sent - acked < IN_FLIGHT:
            conn.sendall(payload)
            sent += 1
        _recv_exactly(conn, ack)
        acked += 1
    cpu = time.process_time() - start
    conn.close()
    return cpu


def measure(transport: str, size: int, count: int) -> tuple[float, float]:
    """Return (sender, receiver) CPU seconds per message."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    ready, result = ctx.Queue(), ctx.Queue()
    if transport == "zmq":
        receiver = ctx.Process(target=_zmq_receiver, args=(port, count, ready, result))
    else:
        receiver = ctx.Process(target=_tcp_receiver, args=(port, count, ready, result, size))
    receiver.start()
    try:
        ready.get(timeout=30)
        sender = (_zmq_sender if transport == "zmq" else _tcp_sender)(port, count, size)
        return sender / count, result.get(timeout=60) / count
    finally:
        receiver.join(10)
        if receiver.is_alive():
            receiver.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-kib", default="64,256", help="message sizes in KiB, comma separated")
    p.add_argument("--messages", type=int, default=3000, help="messages per measurement")
    p.add_argument("--repeats", type=int, default=3, help="alternated repeats; medians are printed")
    args = p.parse_args()
    print("| size | sender us/msg: zmq / tcp | receiver us/msg: zmq / tcp | zmq - tcp, both sides (us) |")
    print("| --- | --- | --- | --- |")
    for kib in (int(s) for s in args.sizes_kib.split(",")):
        runs = {"zmq": [], "tcp": []}
        for _ in range(args.repeats):
            for transport in runs:
                runs[transport].append(measure(transport, kib << 10, args.messages))
        med = {t: [statistics.median(r[i] for r in rs) * 1e6 for i in (0, 1)] for t, rs in runs.items()}
        extra = med["zmq"][0] + med["zmq"][1] - med["tcp"][0] - med["tcp"][1]
        print(
            f"| {kib} KiB | {med['zmq'][0]:.0f} / {med['tcp'][0]:.0f} | {med['zmq'][1]:.0f} / {med['tcp'][1]:.0f} "
            f"| {extra:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
