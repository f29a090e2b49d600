"""torch_bps.device.comm: the device local stage's exchange between real processes (CPU stand-in, Triton interpreted).

On CPU the shared buffers are /dev/shm files instead of CUDA IPC and there is no stream: what runs here is the
exchange itself (regions, halves, rounds, barriers), and the fused kernel under TRITON_INTERPRET=1, against a
plain torch reference. The CUDA sharing and streams run only in tests/gpu/test_local_stage.py.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import traceback
import uuid

import pytest
import torch
import torch.distributed as dist

from torch_bps.device.comm import choose_path

pytestmark = pytest.mark.timeout(240)

CAPACITY = 4096  # bytes: a half holds 256 fp32 per destination with 2 ranks, so a few thousand take many rounds


def contribution(rank: int, numel: int, dtype: torch.dtype, step: int) -> torch.Tensor:
    """Small integers: every sum, half-sum and cast to bf16 below is exact."""
    g = torch.Generator().manual_seed(1000 * rank + 7 * step + numel)
    return torch.randint(-60, 60, (numel,), generator=g).to(dtype)


def _scenarios(comm, rank: int, size: int) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    from triton_kernels import sum_scale_cast_reference
    from triton_kernels.reduce import _sum_scale_cast_kernel

    assert isinstance(_sum_scale_cast_kernel, InterpretedFunction), "the fused kernel must run (interpreted) here"
    for step, numel in enumerate((1, 5, 1001, 3000)):
        x = contribution(rank, numel, torch.float32, step)
        lo, hi = comm.slice_range(numel)
        got = comm.reduce_scatter(x, scale=0.5, out_dtype=torch.bfloat16)
        parts = [contribution(r, numel, torch.float32, step)[lo:hi] for r in range(size)]
        want = sum_scale_cast_reference(parts, scale=0.5, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), f"reduce_scatter numel={numel}"
        # in place, then the all-gather back into the same tensor
        comm.reduce_scatter(x, out=x[lo:hi])
        comm.all_gather(x[lo:hi], x)
        want_all = sum(contribution(r, numel, torch.float32, step) for r in range(size))
        assert torch.equal(x, want_all), f"reduce_scatter + all_gather in place numel={numel}"
    _expect_input_error(lambda: comm.reduce_scatter(torch.ones(10 + (rank == 0))), "local ranks disagree")
    out = torch.ones(8)  # rank 1 alone passes it as 2-D: every rank raises, rank 1 saying why
    lo, hi = comm.slice_range(8)
    bad, why = (out.view(4, 2), "must be a 1-D") if rank == 1 else (out, r"local rank\(s\) \[1\] passed invalid input")
    _expect_input_error(lambda: comm.all_gather(out[lo:hi], bad), why)
    y = contribution(rank, 777, torch.int64, 9)  # and the comm is usable after both
    got = comm.reduce_scatter(y)
    lo, hi = comm.slice_range(777)
    assert torch.equal(got, sum(contribution(r, 777, torch.int64, 9) for r in range(size))[lo:hi]), "int64 (torch sum)"


def _expect_input_error(call, pattern: str) -> None:
    import re

    from torch_bps.local import LocalInputError

    try:
        call()
    except LocalInputError as e:
        assert re.search(pattern, str(e)), f"LocalInputError without {pattern!r}: {e}"
        return
    raise AssertionError(f"no LocalInputError ({pattern!r})")


def _child(rank, size, port, node, results):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton_kernels is imported: the kernel runs interpreted on CPU
    try:
        from torch_bps.device.comm import DeviceLocalComm

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        comm = DeviceLocalComm(store, rank, size, node, "cpu", capacity_bytes=CAPACITY, timeout=60,
                               kernel_backend="triton")  # fmt: skip
        _scenarios(comm, rank, size)
        comm.close()
        results.put((rank, None))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, traceback.format_exc()))


@pytest.mark.parametrize("size", [2, 3])
def test_device_local_stage_sums_scales_casts_and_gathers_between_processes(size):
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    node = f"dev-{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=_child, args=(r, size, store.port, node, results), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    try:
        reports = {}
        for _ in range(size):
            try:
                rank, error = results.get(timeout=180)
            except queue.Empty:
                pytest.fail(f"waited 180 s for the local ranks' reports; got {sorted(reports)} of {size}")
            reports[rank] = error
        failed = {r: e for r, e in reports.items() if e}
        assert not failed, "\n".join(f"local rank {r}:\n{e}" for r, e in sorted(failed.items()))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def test_path_is_the_device_when_ranks_share_a_gpu_or_have_peer_access():
    assert choose_path(["a", "a"], lambda x, y: False)[0] == "device"
    assert choose_path(["a", "b", "a"], lambda x, y: True) == ("device", "3 local ranks on 2 device(s)")


def test_path_falls_back_to_the_host_without_peer_access_or_a_device_and_says_why():
    path, why = choose_path(["a", "b"], lambda x, y: (x, y) != ("b", "a"))
    assert path == "host" and why == "no peer access from device b to device a"
    path, why = choose_path(["a", "!tensors on cpu"], lambda x, y: True)
    assert path == "host" and why == "local rank 1: tensors on cpu"


def _child_cannot_map(rank, size, port, node, results):
    """Local rank 1 cannot map its peers' buffers (as in a sandbox without CUDA IPC): every rank's set-up must raise
    the same LocalInputError, rank 1's saying why, and leave nothing behind."""
    try:
        from torch_bps.device.comm import DeviceLocalComm
        from torch_bps.local import LocalInputError

        if rank == 1:

            def refuse(self, store, key, peer):
                raise OSError("no IPC here")

            DeviceLocalComm._open = refuse
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        try:
            DeviceLocalComm(store, rank, size, node, "cpu", capacity_bytes=CAPACITY, timeout=60)
        except LocalInputError as e:
            results.put((rank, str(e)))
            return
        results.put((rank, "no error"))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, traceback.format_exc()))


def _two_local_ranks(target) -> tuple[dict, str, list]:
    """Run `target(rank, 2, port, node, results)` in 2 spawned processes; return what each put, by rank, the node's
    name and the processes."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    node = f"dev-{uuid.uuid4().hex[:8]}"
    procs = [ctx.Process(target=target, args=(r, 2, store.port, node, results), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        reports = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return reports, node, procs


def test_a_rank_that_cannot_map_its_peers_buffers_fails_every_ranks_set_up_alike():
    reports, node, procs = _two_local_ranks(_child_cannot_map)
    assert "set-up: cannot map local rank 0's buffer (OSError: no IPC here)" in reports[1], reports[1]
    assert r"local rank(s) [1] passed invalid input" in reports[0], reports[0]
    # Only these ranks' files (the name carries the creator's pid): other tests may run beside this one.
    mine = tuple(f"torch_bps_devstage_{p.pid}_" for p in procs)
    assert not [f for f in os.listdir("/dev/shm") if node in f or f.startswith(mine)], "the set-up left files behind"


def _child_recorded(rank, size, port, node, results):
    """One reduce-scatter of two rounds and one all-gather of one, their stream operations recorded (tests.helpers'
    stand-in for torch.cuda): returns the log."""
    try:
        from tests.helpers import RecordingOps
        from torch_bps.device.comm import DeviceLocalComm

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
        ops = RecordingOps()
        comm = DeviceLocalComm(store, rank, size, node, "cpu", capacity_bytes=CAPACITY, timeout=60, ops=ops)
        x = contribution(rank, 1000, torch.float32, 0)  # 500 a rank: two rounds of 256
        lo, hi = comm.slice_range(1000)
        comm.reduce_scatter(x, out=x[lo:hi])
        comm.all_gather(x[lo:hi], x)
        comm.close()
        results.put((rank, ops.log))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, traceback.format_exc()))


def test_the_stage_stream_waits_for_the_callers_and_every_barrier_for_the_stage_stream():
    """What a GPU's streams would do, recorded: each call's stage stream first waits for an event of the caller's
    stream (the copies in read what the caller wrote), every barrier host-waits for an event of the stage stream (a
    peer may then overwrite what this rank read), and the caller's stream waits for the stage stream at the end."""
    logs, _, _ = _two_local_ranks(_child_recorded)
    for rank, log in logs.items():
        assert isinstance(log, list), f"local rank {rank}:\n{log}"
        recorded = {e[2]: e[1] for e in log if e[0] == "record"}  # event -> the stream it was recorded on
        (stage,) = {e[1] for e in log if e[0] == "enter"}
        assert stage != "caller"
        waits = [e for e in log if e[0] == "host_wait"]
        assert len(waits) == 1 + 2 + 1, f"local rank {rank}: the set-up's barrier, the two rounds', the gather's"
        assert all(recorded[n] == stage for _, n in waits), "a barrier host-waits for the stage stream's work"
        enters = [i for i, e in enumerate(log) if e[0] == "enter"]
        assert len(enters) == 2, log
        for i in enters:  # caller's event, the stage stream waits for it, then the stage stream is entered
            assert log[i - 1][:2] == ("wait", stage) and recorded[log[i - 1][2]] == "caller", log[i - 2 : i + 1]
        ends = [e for e in log if e[0] == "wait" and e[1] == "caller"]
        assert len(ends) == 2 and all(recorded[n] == stage for _, _, n in ends), "the caller waits for the stage"
        assert log[-1] == ends[-1], "nothing after the caller's last wait"
