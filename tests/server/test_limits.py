"""A server's memory stays bounded whatever a peer sends: the exhaustion attacks of issue 12, measured as RSS.

Each test starts its own server with small limits, attacks it over real sockets, and checks the server's
resident memory grew by less than its configured bound (plus a fixed allowance for the interpreter's own
growth), that the attack was refused with the right status, and that a legitimate job still sums.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.helpers import RawPeer, ServerProcess, declare, error_of, pull, push, rss_bytes
from torch_bps.wire import Command, Status

pytestmark = pytest.mark.timeout(120)

MB = 1 << 20
SLACK = 24 * MB  # what the interpreter, torch and ZeroMQ may grow by on their own under this traffic


def limited_server(*args: str) -> ServerProcess:
    return ServerProcess(extra_args=args)


def still_sums(server: ServerProcess, job_id: int) -> None:
    a, b = RawPeer(server.address, job_id, 0, 2), RawPeer(server.address, job_id, 1, 2)
    for p in (a, b):
        assert p.hello().status == Status.OK
    t = torch.arange(1000, dtype=torch.float32)
    declare([a, b], 5, t)
    for p in (a, b):
        assert push(p, 5, 0, t)[0].status == Status.OK
    for p in (a, b):
        assert torch.equal(pull(p, 5, 0, t), 2 * t)
        p.close()


def test_an_oversized_frame_drops_its_connection_unread():
    server = limited_server("--max-frame-bytes", str(4 * MB))
    try:
        before = rss_bytes(server.proc.pid)
        attacker = RawPeer(server.address, 666)  # holds the pool credential: authenticated
        attacker.sock.send_multipart([b"\0" * 72, b"\0" * (256 * MB)])  # a bogus header in front of 256 MiB
        time.sleep(1.0)
        attacker.close()
        assert rss_bytes(server.proc.pid) - before < SLACK
        assert server.alive()
        still_sums(server, 1)
    finally:
        server.stop()


def test_a_job_past_its_quota_is_refused_and_held_rounds_stay_bounded():
    # 200 keys x 1 MiB pushed by one worker of two: each round waits forever for the other worker.
    server = limited_server("--job-quota-bytes", str(32 * MB), "--max-memory-bytes", str(64 * MB))
    try:
        before = rss_bytes(server.proc.pid)
        p = RawPeer(server.address, 7, 0, 2)
        p.hello()
        data = b"\1" * MB
        refused = 0
        for key in range(200):
            for rnd in range(2):
                h, rest = p.request(Command.INIT, key=key, nbytes=MB, dtype=7) if rnd == 0 else (None, None)
                if h is not None and h.status != Status.OK:
                    assert h.status == Status.OVER_QUOTA, rest
                    assert b"quota" in rest[0]
                    refused += 1
                    break
                h, _ = p.request(Command.PUSH, data, key=key, round=rnd, nbytes=MB, dtype=7)
                assert h.status == Status.OK
        assert refused > 180  # 32 MiB holds 15 keys of two 1 MiB rounds
        assert rss_bytes(server.proc.pid) - before < 32 * MB + SLACK
        p.close()
        still_sums(server, 8)  # another job still has room under the server's bound
    finally:
        server.stop()


def test_many_jobs_stop_at_the_server_bound():
    server = limited_server("--max-memory-bytes", str(8 * MB))
    try:
        before = rss_bytes(server.proc.pid)
        p = RawPeer(server.address)
        statuses = []
        for job in range(3000):
            h, _ = p.request(Command.HELLO, job_id=1000 + job, num_workers=1)
            statuses.append(h.status)
            if h.status == Status.OK:
                p.incarnation = h.incarnation
                p.request(Command.INIT, job_id=1000 + job, key=0, nbytes=64, dtype=7)
        assert statuses.count(Status.OK) < 2000 and set(statuses) == {Status.OK, Status.OVER_QUOTA}
        assert rss_bytes(server.proc.pid) - before < 8 * MB + SLACK
    finally:
        server.stop()


def test_an_idle_job_is_forgotten_after_its_lease_and_its_waiting_pull_answered():
    server = limited_server("--job-lease", "1", "--max-memory-bytes", str(64 * MB))
    try:
        idle = RawPeer(server.address, 11, 0, 2)
        idle.hello()
        t = torch.ones(4)
        declare([idle], 0, t)
        push(idle, 0, 0, t)
        rid = idle.send(Command.PULL, key=0, round=0, nbytes=16, dtype=1)  # waits for worker 1, who never comes
        time.sleep(1.5)
        still_sums(server, 12)  # any request after the lease sweeps
        h, rest = idle.recv(rid)
        assert h.status == Status.UNKNOWN_JOB and b"forgotten" in rest[0]
        assert error_of(idle.request(Command.INIT, key=1, nbytes=16, dtype=1))[0] == Status.UNKNOWN_JOB
        assert idle.hello().status == Status.OK  # the job id is free again
    finally:
        server.stop()


def test_a_second_pull_of_a_waiting_round_is_refused():
    server = limited_server()
    try:
        p = RawPeer(server.address, 3, 0, 2)
        p.hello()
        t = torch.ones(4)
        declare([p], 0, t)
        first = p.send(Command.PULL, key=0, round=0, nbytes=16, dtype=1)
        for _ in range(3):
            status, message = error_of(p.request(Command.PULL, key=0, round=0, nbytes=16, dtype=1))
            assert status == Status.BAD_ROUND and "already waits" in message
        q = RawPeer(server.address, 3, 1, 2)
        q.hello()
        push(p, 0, 0, t)
        push(q, 0, 0, t)
        h, rest = p.recv(first)
        assert h.status == Status.OK and torch.equal(torch.frombuffer(bytearray(rest[0]), dtype=torch.float32), 2 * t)
    finally:
        server.stop()


def test_a_job_whose_workers_are_all_gone_is_forgotten_long_before_its_lease():
    server = limited_server("--lost-job-lease", "1", "--job-lease", "3600")
    try:
        workers = [RawPeer(server.address, 21, w, 2) for w in range(2)]
        for p in workers:
            p.hello()
        declare(workers, 0, torch.ones(4))
        for p in workers:
            p.close()  # the server sees both connections drop: the job's workers are all lost
        time.sleep(2.0)
        still_sums(server, 22)  # any request sweeps
        again = RawPeer(server.address, 21, 0, 3)  # the id is free: a new job of 3 workers may take it
        assert again.hello().status == Status.OK
        again.close()
    finally:
        server.stop()
