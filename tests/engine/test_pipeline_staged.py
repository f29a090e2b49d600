"""PushPullEngine.run_copied over real summation servers: partitions staged one at a time through a PartitionPipeline
(CPU tensors and a recording stand-in for torch.cuda), interleaved with plain collectives on the same keys."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.helpers import DEVICE, RecordingOps
from torch_bps.client import Client
from torch_bps.device.pinned import PartitionPipeline
from torch_bps.engine.partition import KeyBook
from torch_bps.engine.pipeline import PushPullEngine
from torch_bps.engine.placement import Placement, server_weights

pytestmark = pytest.mark.timeout(120)

PARTITION = 16 << 10
N = 5 * PARTITION // 4 + 7  # fp32: six partitions, the last a few elements


def _data(worker: int, step: int, n: int = N) -> torch.Tensor:
    return (torch.arange(n) % 13 * (worker + 1) + step).float()  # sums exact in fp32


class _Waiter:
    def __init__(self):
        self.errors, self._event, self._left, self._lock = [], threading.Event(), 0, threading.Lock()

    def add(self):
        with self._lock:
            self._left += 1

        def done(error):
            with self._lock:
                self.errors.append(error)
                self._left -= 1
                if self._left == 0:
                    self._event.set()

        return done

    def wait(self, what: str):
        assert self._event.wait(60), f"waited 60 s for {what}"
        assert all(e is None for e in self.errors), self.errors


def test_staged_and_plain_collectives_on_the_same_keys_sum_right_on_every_worker(servers, job_id):
    addresses = [s.address for s in servers]
    weights = server_weights(addresses[:2], addresses[2:])
    clients, engines, pipes, ops = [], [], [], []
    try:
        for w in range(2):
            clients.append(Client(addresses, job_id, w, 2, timeout=60))
            # One slot: every collective of this shape uses the same keys, so only submission order keeps rounds apart.
            keys = KeyBook(Placement(weights), PARTITION, lambda n: [(0, n)], min_partition_bytes=PARTITION, slots=1)
            engines.append(PushPullEngine(clients[w], keys, timeout=60))
            ops.append(RecordingOps())
            pipes.append(PartitionPipeline(DEVICE, slot_bytes=PARTITION, slots=2, ops=ops[w], timeout=60))
        for step in range(3):
            waiter = _Waiter()
            tensors = [[_data(w, step), _data(w, step + 10), _data(w, step + 20)] for w in range(2)]
            # A staged tensor, then plain ones of the same numel and dtype (the same keys). Worker 1 launches them
            # at once: its plain ones must wait behind its staged partitions. Worker 0 launches its plain ones only
            # once its staged partitions were all handed to the client: that order is the one every worker must see.
            for w in (1, 0):
                engines[w].run_copied(tensors[w][0], pipes[w], waiter.add(), priority=step)
                deadline = time.monotonic() + 30
                while w == 0 and pipes[w].pending() and time.monotonic() < deadline:
                    time.sleep(0.001)
                for t in tensors[w][1:]:
                    engines[w].run([t], waiter.add())
            waiter.wait(f"step {step}")
            for i, salt in enumerate((0, 10, 20)):
                want = _data(0, step + salt) + _data(1, step + salt)
                for w in range(2):
                    assert torch.equal(tensors[w][i], want), f"step {step}, worker {w}, collective {i}"
        for w in range(2):
            assert pipes[w].pool.made == 2, "pinned memory is bounded by the pool's slots"
            d2h = sum(e[:3] == ("copy", "side", "d2h") for e in ops[w].log)
            assert d2h == 3 * 6, f"one copy to the host per partition: {d2h}"
    finally:
        for p in pipes:
            p.close()
        for e in engines:
            e.close()
        for c in clients:
            c.close()


def test_run_staged_refuses_a_tensor_the_wire_would_cast(server, job_id):
    client = Client([server.address], job_id, 0, 1, timeout=10)
    try:
        keys = KeyBook(Placement(server_weights([server.address], [])), PARTITION, lambda n: [(0, n)])
        engine = PushPullEngine(client, keys, timeout=10, wire_dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="travels as torch.bfloat16 \\(the wire dtype\\)"):
            engine.run_copied(torch.zeros(8), None, lambda e: None)
        engine.close()
    finally:
        client.close()
