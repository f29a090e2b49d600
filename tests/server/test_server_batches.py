"""The server's front loop under bursts: many requests queued before it reads (handled in batches per
wake-up), replies of whole results sent as the received message itself, partial ones as a slice of it.

Real server process, raw DEALER peers (tests.helpers.RawPeer), every wait bounded by the peers' timeouts.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import RawPeer
from torch_bps.wire import Command, Status

pytestmark = pytest.mark.timeout(120)

FLOAT32 = 1  # the dtype code of docs/protocol.md
SMALL, BIG = 96 * 1024, 3 * 1024 * 1024  # a small key and one over 1 MiB (the size the old server split at)


def _peers(server, job_id: int, n: int) -> list[RawPeer]:
    ps = [RawPeer(server.address, job_id, w, n, timeout=60) for w in range(n)]
    for p in ps:
        assert p.hello().status == Status.OK
    return ps


def _data(worker: int, key: int, rnd: int, nbytes: int) -> torch.Tensor:
    # Small integers in float32: every sum is exact, and differs by worker, key and round.
    return (torch.arange(nbytes // 4) % 97 + worker * 1000 + key * 10 + rnd).float()


def test_a_burst_of_pipelined_requests_is_answered_in_full_with_the_right_sums(server, job_id):
    """Every worker sends all its INITs, PUSHes and PULLs of several rounds of many keys without waiting for a
    reply (hundreds of messages, several times the front loop's batch); every reply arrives, and every pull
    gets its round's sum: whole (the first push's message sent back) or a byte range of it."""
    workers, rounds = 3, 2
    sizes = {key: SMALL for key in range(40)} | {40: BIG, 41: BIG}
    ps = _peers(server, job_id, workers)
    expected = {}  # request id per peer -> what its reply must carry
    for rnd in range(rounds):
        for p in ps:
            for key, nbytes in sizes.items():
                if rnd == 0:
                    rid = p.send(Command.INIT, key=key, nbytes=nbytes, dtype=FLOAT32)
                    expected[p.worker, rid] = None
                data = _data(p.worker, key, rnd, nbytes).numpy().tobytes()
                rid = p.send(Command.PUSH, data, key=key, round=rnd, nbytes=nbytes, dtype=FLOAT32)
                expected[p.worker, rid] = None
        total = {key: sum(_data(w, key, rnd, n) for w in range(workers)) for key, n in sizes.items()}
        for p in ps:
            for key, nbytes in sizes.items():
                # Worker 0 pulls every key whole; the others only a range of it (as a reduce-scatter does).
                offset, length = (0, nbytes) if p.worker == 0 else (p.worker * 4096, nbytes // 3)
                rid = p.send(Command.PULL, key=key, round=rnd, nbytes=nbytes, dtype=FLOAT32, offset=offset,
                             length=length)  # fmt: skip
                expected[p.worker, rid] = total[key].view(torch.uint8)[offset : offset + length]
        for p in ps:  # a round's replies before the next round's pushes: at most two rounds may be alive
            for _ in range(sum(1 for w, _ in expected if w == p.worker)):
                h, rest = p.recv_any()
                want = expected.pop((p.worker, h.request_id))
                assert h.status == Status.OK, (h, rest)
                if want is not None:
                    got = torch.frombuffer(bytearray(rest[0]), dtype=torch.uint8)
                    assert torch.equal(got, want), f"worker {p.worker} key {h.key} round {h.round}"
    assert not expected
    for p in ps:
        p.close()


def test_a_whole_result_sent_back_is_not_changed_by_the_next_rounds_pushes(server, job_id):
    """A closed round's reply is the first push's message itself: the next round of the key, pushed before a
    slow worker pulls, must not write into it (each round sums into its own first push)."""
    ps = _peers(server, job_id, 2)
    for p in ps:
        assert p.request(Command.INIT, key=3, nbytes=SMALL, dtype=FLOAT32)[0].status == Status.OK
    for p in ps:
        data = _data(p.worker, 3, 0, SMALL).numpy().tobytes()
        assert p.request(Command.PUSH, data, key=3, round=0, nbytes=SMALL, dtype=FLOAT32)[0].status == Status.OK
    fast, slow = ps
    h, first = fast.request(Command.PULL, key=3, round=0, nbytes=SMALL, dtype=FLOAT32)
    assert h.status == Status.OK
    for p in ps:  # round 1 is pushed by both before the slow worker pulls round 0
        data = _data(p.worker, 3, 1, SMALL).numpy().tobytes()
        assert p.request(Command.PUSH, data, key=3, round=1, nbytes=SMALL, dtype=FLOAT32)[0].status == Status.OK
    h, late = slow.request(Command.PULL, key=3, round=0, nbytes=SMALL, dtype=FLOAT32)
    assert h.status == Status.OK
    assert late[0] == first[0] == (_data(0, 3, 0, SMALL) + _data(1, 3, 0, SMALL)).numpy().tobytes()
    for p in ps:
        p.close()
