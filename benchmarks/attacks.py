"""The memory-exhaustion attacks of issue 12 against a real server, with the server's RSS before and after.

Each attack gets a fresh `bps-server` with the given bounds; the attacker holds the pool credential (an
authenticated peer: a stranger cannot even complete the handshake). Attacks:
  frame:   one 1 GiB frame under a bogus header
  jobs:    50,000 HELLO + INIT of distinct jobs
  rounds:  200 keys x 2 rounds x 1 MiB pushed by one worker of two (rounds that never close)
  pulls:   100,000 PULLs of one round that never closes

Usage: python benchmarks/attacks.py [--max-memory-bytes N] [--json out.json]
May import: the standard library, pyzmq and torch_bps (and benchmarks._harness).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import zmq

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks._harness import Server  # noqa: E402
from torch_bps.client import default_credentials  # noqa: E402
from torch_bps.security import new_secret  # noqa: E402
from torch_bps.wire import Command, Header  # noqa: E402

MB = 1 << 20


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class Peer:
    """An authenticated DEALER that sends requests and drains replies without waiting on each."""

    def __init__(self, address: str, job_id: int, num_workers: int):
        credentials = default_credentials(job_id, 1)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if credentials.mechanism == "curve":
            self.sock.curve_publickey, self.sock.curve_secretkey = credentials.client.public, credentials.client.secret
            self.sock.curve_serverkey = credentials.server_keys[0]
        else:
            self.sock.plain_username, self.sock.plain_password = credentials.client.public, credentials.tokens[0]
        self.sock.connect(f"tcp://{address}")
        self.job_id, self.num_workers, self.incarnation = job_id, num_workers, 0

    def request(self, command: int, *payload: bytes, **fields) -> Header:
        fields = {"job_id": self.job_id, "incarnation": self.incarnation, **fields}
        self.sock.send_multipart([Header(command=command, **fields).pack(), *payload])
        if not self.sock.poll(30_000):
            raise TimeoutError("no reply within 30 s")
        return Header.unpack(self.sock.recv_multipart()[0])

    def hello(self, **fields) -> Header:
        h = self.request(Command.HELLO, num_workers=self.num_workers, **fields)
        self.incarnation = h.incarnation or self.incarnation
        return h


def attack_frame(address: str) -> str:
    p = Peer(address, 1, 1)
    p.sock.send_multipart([b"\0" * 72, b"\0" * (1 << 30)])
    time.sleep(3)
    p.sock.close()
    return "sent 1 GiB"


def attack_jobs(address: str) -> str:
    p = Peer(address, 1, 1)
    refused = 0
    for job in range(50_000):
        h = p.hello(job_id=10_000 + job)
        if h.status:
            refused += 1
            continue
        p.request(Command.INIT, job_id=10_000 + job, key=0, nbytes=64, dtype=7)
    return f"{refused} of 50000 HELLOs refused"


def attack_rounds(address: str) -> str:
    p = Peer(address, 2, 2)
    p.hello()
    refused = 0
    for key in range(200):
        if p.request(Command.INIT, key=key, nbytes=MB, dtype=7).status:
            refused += 1
            continue
        for rnd in range(2):
            p.request(Command.PUSH, b"\1" * MB, key=key, round=rnd, nbytes=MB, dtype=7)
    return f"{refused} of 200 INITs refused"


def attack_pulls(address: str) -> str:
    p = Peer(address, 3, 2)
    p.hello()
    p.request(Command.INIT, key=0, nbytes=16, dtype=1)
    pull = dict(job_id=3, incarnation=p.incarnation, key=0, round=0, nbytes=16, dtype=1)
    p.sock.send_multipart([Header(command=Command.PULL, **pull).pack()])  # waits for worker 1, forever
    refused = 0
    for _ in range(100_000):
        refused += p.request(Command.PULL, **pull).status != 0
    return f"{refused} of 100000 PULLs refused (one waits)"


ATTACKS = {"frame": attack_frame, "jobs": attack_jobs, "rounds": attack_rounds, "pulls": attack_pulls}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-memory-bytes", type=int, default=64 * MB, help="the server's bound (default 64 MiB)")
    p.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated subset of " + ",".join(ATTACKS))
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    os.environ.setdefault("BPS_POOL_CREDENTIAL", new_secret())
    results = []
    print(f"server bound --max-memory-bytes {args.max_memory_bytes >> 20} MiB, --max-frame-bytes 16 MiB (default)")
    for name in args.attacks.split(","):
        server = Server("--max-memory-bytes", str(args.max_memory_bytes))
        try:
            before = rss(server.pid)
            start = time.perf_counter()
            outcome = ATTACKS[name](server.address)
            seconds = time.perf_counter() - start
            time.sleep(0.5)
            after, alive = rss(server.pid), server.proc.poll() is None
        finally:
            server.stop()
        results.append(dict(attack=name, rss_before=before, rss_after=after, alive=alive, outcome=outcome))
        print(f"{name:>7}: RSS {before / MB:7.1f} -> {after / MB:7.1f} MiB (+{(after - before) / MB:6.1f}), "
              f"alive {alive}, {outcome}, {seconds:.1f} s", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
