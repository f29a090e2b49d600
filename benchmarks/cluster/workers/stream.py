"""A plain TCP stream between two hosts, to calibrate the shaped links: `recv` on one host, `send` on another.

    python -m benchmarks.cluster.workers.stream recv --port 5201
    python -m benchmarks.cluster.workers.stream send --to 10.77.0.2:5201 --seconds 3

The receiver reports goodput (payload bytes over the time from first to last byte) in its RESULT line.
May import: the standard library and benchmarks.cluster.workers.common.
"""

from __future__ import annotations

import argparse
import socket
import time

from benchmarks.cluster.workers.common import emit

CHUNK = 4 << 20


def receive(port: int, timeout_s: float) -> dict:
    with socket.create_server(("0.0.0.0", port)) as srv:
        srv.settimeout(timeout_s)
        conn, peer = srv.accept()
    with conn:
        conn.settimeout(timeout_s)
        buf = bytearray(CHUNK)
        total, first, last = 0, None, None
        while True:
            n = conn.recv_into(buf)
            if n == 0:
                break
            last = time.monotonic()
            first = first if first is not None else last
            total += n
    seconds = (last - first) if total else 0.0
    return {
        "bytes": total,
        "seconds": seconds,
        "mbit_s": total * 8 / seconds / 1e6 if seconds else 0.0,
        "peer": peer[0],
    }


def send(to: str, seconds: float, timeout_s: float) -> dict:
    host, _, port = to.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:  # the receiver may still be starting: retry until the deadline
        try:
            sock = socket.create_connection((host, int(port)), timeout=2.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = memoryview(bytes(CHUNK))
    sent = 0
    with sock:
        sock.settimeout(timeout_s)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sock.sendall(payload)
            sent += CHUNK
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # wait for the receiver to close: all bytes have arrived
    return {"bytes_sent": sent}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("mode", choices=["recv", "send"])
    p.add_argument("--port", type=int, default=5201)
    p.add_argument("--to", help="ip:port of the receiver (send mode)")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args(argv)
    if args.mode == "recv":
        emit(receive(args.port, args.timeout))
    else:
        emit(send(args.to, args.seconds, args.timeout))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
