"""CUDA staging's order of copies, events and waits, checked against a recording stand-in for torch.cuda (no GPU)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.helpers import DEVICE, RecordingOps
from torch_bps.device.pinned import DeviceStaging, PartitionPipeline, PinnedPool
from torch_bps.errors import BpsTimeoutError


class FakeService:
    """Pushes are 'summed' (+1) and answered on another thread once released (all at once by default)."""

    def __init__(self, ops: RecordingOps, hold: bool = False, fail_at: int | None = None):
        self.ops, self.hold, self.fail_at = ops, hold, fail_at
        self.pending: list[tuple[int, torch.Tensor, object]] = []
        self._lock = threading.Lock()

    def push(self, index, host, pulled):
        self.ops._add("push", index)
        with self._lock:
            self.pending.append((index, host, pulled))
        if not self.hold:
            self.answer()

    def answer(self, count: int | None = None) -> None:
        with self._lock:
            take, self.pending = self.pending[:count], self.pending[len(self.pending[:count]) :]
        for index, host, pulled in take:
            error = RuntimeError(f"partition {index} lost") if index == self.fail_at else None
            if error is None:
                host.add_(1)
            threading.Thread(target=pulled, args=(error,)).start()


def _bounds(n: int, parts: int) -> list[tuple[int, int]]:
    step = -(-n // parts)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def _run(pipe, tensor, bounds, service, timeout=10.0):
    result = {}
    finished = threading.Event()

    def done(error):
        result["error"] = error
        result["stream"] = pipe._ops.current_stream(DEVICE)
        result["calls"] = result.get("calls", 0) + 1
        finished.set()

    pipe.start(tensor, bounds, service.push, done)
    return result, finished


def test_every_partition_goes_out_and_its_sum_comes_back_into_the_tensor():
    ops = RecordingOps()
    pipe = PartitionPipeline(DEVICE, slot_bytes=16, slots=2, ops=ops)
    t = torch.arange(10, dtype=torch.float32)
    result, finished = _run(pipe, t, _bounds(10, 3), FakeService(ops))
    assert finished.wait(10), "the staging never called done"
    assert result["error"] is None
    assert torch.equal(t, torch.arange(10, dtype=torch.float32) + 1)
    assert ops.pushes() == [0, 1, 2]
    pipe.close()


def test_the_copy_of_partition_i_plus_1_is_queued_before_partition_i_is_pushed():
    ops = RecordingOps()
    pipe = PartitionPipeline(DEVICE, slot_bytes=64, slots=4, ops=ops)
    t = torch.zeros(64)
    bounds = _bounds(64, 4)
    result, finished = _run(pipe, t, bounds, FakeService(ops))
    assert finished.wait(10)
    d2h = [i for i, e in enumerate(ops.log) if e[:3] == ("copy", "side", "d2h")]
    assert len(d2h) == 4
    for i in range(3):
        assert d2h[i + 1] < ops.index(("push", i)), f"copy of partition {i + 1} not queued before push {i}: {ops.log}"
    # and each push waits for its own copy's event, recorded right after that copy
    for i in range(4):
        event = ops.log[d2h[i] + 1]
        assert event[:2] == ("record", "side")
        assert ops.index(("host_wait", event[2])) < ops.index(("push", i))
    pipe.close()


def test_the_side_stream_waits_for_the_callers_stream_before_any_copy():
    ops = RecordingOps()
    pipe = PartitionPipeline(DEVICE, slot_bytes=64, slots=2, ops=ops)
    result, finished = _run(pipe, torch.zeros(16), _bounds(16, 2), FakeService(ops))
    assert finished.wait(10)
    ready = next(e for e in ops.log if e[:2] == ("record", "caller"))
    first_copy = next(i for i, e in enumerate(ops.log) if e[0] == "copy")
    assert ops.index(("wait", "side", ready[2])) < first_copy
    pipe.close()


def test_the_staging_thread_allocates_copies_and_pushes_with_the_device_set():
    # A thread that never set its device makes a CUDA context on cuda:0 at its first allocation, event or copy.
    ops = RecordingOps()
    pipe = PartitionPipeline(DEVICE, slot_bytes=64, slots=2, ops=ops)
    service = FakeService(ops)
    streams = []
    push = service.push
    service.push = lambda *args: (streams.append(ops.current_stream(DEVICE)), push(*args))
    result, finished = _run(pipe, torch.zeros(16), _bounds(16, 4), service)
    assert finished.wait(10)
    assert [e for e in ops.log if e[0] == "pinned"] == [("pinned", "side")] * 2 and streams == ["side"] * 4
    pipe.close()


def test_pinned_memory_is_bounded_a_copy_waits_for_a_slot_given_back_by_a_pull():
    ops = RecordingOps()
    pipe = PartitionPipeline(DEVICE, slot_bytes=16, slots=2, ops=ops)
    service = FakeService(ops, hold=True)
    t = torch.zeros(24)
    result, finished = _run(pipe, t, _bounds(24, 6), service)
    deadline = time.monotonic() + 5
    while ops.pushes() != [0] and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    # Two slots: partitions 0 and 1 are on the host, 0 pushed; 2 cannot be copied until 0's sum came back.
    assert ops.pushes() == [0]
    assert sum(e[:3] == ("copy", "side", "d2h") for e in ops.log) == 2
    for _ in range(6):
        deadline = time.monotonic() + 5
        while not service.pending and not finished.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)
        service.answer(1)
    assert finished.wait(10), "the staging never called done"
    assert result["error"] is None and torch.equal(t, torch.ones(24))
    assert pipe.pool.made == 2
    d2h = [i for i, e in enumerate(ops.log) if e[:3] == ("copy", "side", "d2h")]
    h2d = [i for i, e in enumerate(ops.log) if e[:3] == ("copy", "side", "h2d")]
    for i in range(2, 6):  # partition i reuses the slot partition i - 2's copy back gave up, after that copy
        assert h2d[i - 2] < d2h[i]
        assert ops.index(("push", i - 2)) < d2h[i]
    pipe.close()


def test_done_runs_with_the_side_stream_current_after_the_last_copy_back():
    ops = RecordingOps()
    pipe = PartitionPipeline(DEVICE, slot_bytes=64, slots=2, ops=ops)
    result, finished = _run(pipe, torch.zeros(16), _bounds(16, 4), FakeService(ops))
    assert finished.wait(10)
    assert result["stream"] == "side", "done must run with the side stream current (the Future records there)"
    last_h2d = max(i for i, e in enumerate(ops.log) if e[:3] == ("copy", "side", "h2d"))
    assert last_h2d < max(i for i, e in enumerate(ops.log) if e == ("enter", "side"))
    assert result["calls"] == 1
    pipe.close()


def test_a_failed_partition_fails_the_tensor_once_drops_its_slots_and_the_next_tensor_still_runs():
    ops = RecordingOps()
    pipe = PartitionPipeline(DEVICE, slot_bytes=16, slots=2, ops=ops)
    result, finished = _run(pipe, torch.zeros(16), _bounds(16, 4), FakeService(ops, fail_at=1))
    assert finished.wait(10)
    time.sleep(0.1)  # late answers must not call done again
    assert isinstance(result["error"], RuntimeError) and "partition 1" in str(result["error"])
    assert result["calls"] == 1
    t = torch.zeros(8)
    result2, finished2 = _run(pipe, t, _bounds(8, 2), FakeService(ops))
    assert finished2.wait(10) and result2["error"] is None and torch.equal(t, torch.ones(8))
    pipe.close()


def test_a_partition_larger_than_a_slot_is_refused_up_front():
    pipe = PartitionPipeline(DEVICE, slot_bytes=16, slots=2, ops=RecordingOps())
    with pytest.raises(ValueError, match="exceeds the staging slot of 16 bytes"):
        pipe.start(torch.zeros(8), [(0, 8)], lambda *a: None, lambda e: None)
    pipe.close()


def test_a_pool_with_every_slot_in_flight_times_out_naming_what_waited():
    pool = PinnedPool(RecordingOps(), slot_bytes=8, slots=2)
    pool.acquire(1, "a")
    pool.acquire(1, "b")
    with pytest.raises(BpsTimeoutError, match="free pinned staging slot .* for partition 7"):
        pool.acquire(0.05, "partition 7")


@pytest.mark.parametrize("load", [True, False])
def test_whole_tensor_staging_always_orders_its_side_stream_after_the_callers_stream(load):
    # A collective that only writes (broadcast on a non-root rank) must not copy back before a queued write.
    ops = RecordingOps()
    t = torch.arange(6, dtype=torch.float32)
    staging = DeviceStaging(t, load=load, ops=ops)
    ready = next(e for e in ops.log if e[:2] == ("record", "caller"))
    assert ("wait", "side", ready[2]) in ops.log
    if load:
        assert torch.equal(staging.flat, t)
        copied = ops.log[ops.index(("copy", "side", "d2h", 6)) + 2]  # after record_stream
        assert copied[:2] == ("record", "side") and ("host_wait", copied[2]) in ops.log
    staging.flat.fill_(7)
    staging.write_back()
    assert ops.log[-2][:3] == ("copy", "side", "h2d") and torch.equal(t, torch.full((6,), 7.0))
    assert not any(e[0] == "wait" and e[1] == "caller" for e in ops.log), "never wait inside the caller's stream"


def test_a_runtime_gets_one_pipeline_per_device_closed_when_the_runtime_goes(monkeypatch):
    import gc
    import types

    from torch_bps.device import pinned as device

    monkeypatch.setattr(device, "_ops", RecordingOps())

    class Runtime:  # what pipeline_for reads of a Runtime
        config = types.SimpleNamespace(partition_bytes=4096)

    runtime = Runtime()
    first = device.pipeline_for(runtime, DEVICE)
    assert device.pipeline_for(runtime, DEVICE) is first
    assert device.pipeline_for(runtime, torch.device("cuda", 1)) is not first
    assert first.pool.slot_bytes == 4096 and first.pool.slots == device.PIPELINE_SLOTS
    del runtime
    gc.collect()
    first._thread.join(5)
    assert not first._thread.is_alive(), "the pipeline's thread outlived its runtime"


def _finished_on_a_thread(exchanges, done, priority: int = 0) -> None:
    """What launch needs of a Runtime: `run`, whose `done` comes on another thread (a completion thread)."""
    threading.Thread(target=done, args=(None,)).start()


def test_a_collective_writing_into_device_outputs_orders_the_side_stream_after_the_callers_and_carries_the_device(
    monkeypatch,
):
    # A scatter's receivers (and every finish through copy_into) write outputs the collective only writes: the write
    # must land after what the caller's stream queued before the launch, and the Future must carry the device.
    import types

    from torch_bps.device import pinned as device
    from torch_bps.engine.exchange import Exchange
    from torch_bps.pg.work import launch

    ops = RecordingOps()
    monkeypatch.setattr(device, "_ops", ops)
    out, mine = torch.zeros(4), torch.arange(4.0)
    finish = lambda: device.copy_on_side(out, mine, DEVICE)  # noqa: E731
    runtime = types.SimpleNamespace(run=_finished_on_a_thread)
    work = launch(runtime, "scatter", [Exchange(torch.zeros(8), finish=finish)], [out], where="in a test", timeout=10,
                  device=DEVICE)  # fmt: skip
    assert work.wait() and torch.equal(out, mine)
    assert ops.log[0] == ("future", (str(DEVICE),)), "the Future carries the outputs' device"
    ready = ops.log[1]
    assert ready[:2] == ("record", "caller") and ops.log[2] == ("wait", "side", ready[2]), "at launch, in order"
    copied = ops.index(("copy", "side", "d2d", 4))
    assert ops.log[copied + 1] == ("record_stream", "side"), "the caller may drop the output before the copy ran"
    assert ops.index(("enter", "side")) < copied, "the finish runs with the device set and the side stream current"


def test_a_recv_into_a_device_tensor_copies_back_on_the_side_stream_after_the_callers_with_the_device_set(
    monkeypatch,
):
    import types

    from torch_bps.device import pinned as device
    from torch_bps.pg import p2p

    ops = RecordingOps()
    monkeypatch.setattr(device, "_ops", ops)
    received = threading.Event()
    gloo_work = types.SimpleNamespace(wait=lambda: received.wait(10))  # gloo's recv Work, into the host copy
    t, host = torch.zeros(3), torch.zeros(3)
    work = p2p.copied_back(gloo_work, [host], [t], DEVICE, "recv in a test", 10)
    ready = ops.log[1]
    assert ops.log[0] == ("future", ("cpu",)) and ready[:2] == ("record", "caller")
    assert ops.log[2] == ("wait", "side", ready[2]), "ordered on the caller's thread, before gloo's data arrive"
    host.fill_(5)
    received.set()
    assert work.wait() and torch.equal(t, torch.full((3,), 5.0))
    enter, copied = ops.index(("enter", "side")), ops.index(("copy", "side", "d2d", 3))
    assert enter < copied and ops.log[copied + 1] == ("record_stream", "side")


def test_the_list_form_of_all_to_all_returns_a_future_with_its_outputs_devices(monkeypatch):
    from datetime import timedelta

    import torch.distributed as dist

    from torch_bps.device import pinned as device
    from torch_bps.pg import p2p

    ops = RecordingOps()
    monkeypatch.setattr(device, "_ops", ops)
    side = p2p.GlooSide(dist.HashStore(), 0, 1, timedelta(seconds=10), "test")
    outputs = [torch.zeros(3)]  # one per rank
    work = side.alltoall(outputs, [torch.full((3,), 2.0)], dist.AllToAllOptions())
    assert work.wait() and torch.equal(outputs[0], torch.full((3,), 2.0))
    assert ("future", ("cpu",)) in ops.log, "a Future made without the outputs' devices"


def test_a_copy_on_a_side_stream_sets_the_streams_device_first(monkeypatch):
    # A bare torch.cuda.stream() returns the thread to the device it found (cuda:0 on a fresh thread): a context on
    # GPU 0 for a rank on another GPU.
    import contextlib
    import types

    from torch_bps.device.cuda_ops import TorchCudaOps

    entered = []

    def recorded(kind):
        @contextlib.contextmanager
        def enter(arg):
            entered.append((kind, arg))
            yield

        return enter

    monkeypatch.setattr(torch.cuda, "device", recorded("device"))
    monkeypatch.setattr(torch.cuda, "stream", recorded("stream"))
    stream = types.SimpleNamespace(device=torch.device("cuda", 1))
    dst = torch.zeros(3)
    TorchCudaOps().copy(dst, torch.ones(3), stream)
    assert entered == [("device", torch.device("cuda", 1)), ("stream", stream)] and torch.equal(dst, torch.ones(3))
