"""torch_bps.local: shared-memory reduce-scatter / all-gather among a node's local ranks.

End-to-end and fault tests run real processes (multiprocessing forkserver: spawn-like, but torch is
imported once) sharing a TCPStore hosted by the test process; each group of ranks runs a list of
scenarios. Set-up and
pure-logic tests run in-process (threads where two ranks are needed).
"""

from __future__ import annotations

import datetime
import errno
import mmap
import multiprocessing as mp
import os
import queue
import signal
import struct
import threading
import time
import traceback
import uuid
import zlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import exact_floats
from torch_bps.errors import BpsError, BpsTimeoutError, ConfigError, TransportError
from torch_bps.local import LocalComm, LocalInputError, local_sum, shm, split_range, sync
from torch_bps.local import comm as local_comm
from torch_bps.local import reduce as local_reduce

pytestmark = pytest.mark.timeout(120)

ALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
SMALL_CAPACITY = 64 << 10  # so a few hundred KB take many rounds


# -- data and references ---------------------------------------------------------------------------
def contribution(node: str, rank: int, numel: int, dtype: torch.dtype, step: int) -> torch.Tensor:
    """A deterministic tensor for (node, rank, step) whose sums over up to 8 ranks are exact in its dtype."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{node}/{rank}/{numel}/{dtype}/{step}".encode()))
    if dtype in (torch.float16, torch.bfloat16):
        return exact_floats((numel,), dtype, g)
    return torch.randint(-1000, 1000, (numel,), generator=g).to(dtype)  # exact in fp32/fp64/int


def reference(node: str, local_size: int, numel: int, dtype: torch.dtype, step: int) -> torch.Tensor:
    parts = [contribution(node, q, numel, dtype, step).double() for q in range(local_size)]
    return torch.stack(parts).sum(0) if parts else torch.zeros(0, dtype=torch.float64)


def assert_matches(got: torch.Tensor, want64: torch.Tensor, local_size: int, what: str) -> None:
    assert got.dtype in ALL_DTYPES and got.numel() == want64.numel() and local_size <= 8, what
    assert torch.equal(got, want64.to(got.dtype)), what  # contribution()'s sums are exact in every dtype


def bps_entries(token: str) -> list[str]:
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(shm.PREFIX) and token in n]


# -- spawned ranks ---------------------------------------------------------------------------------
def _child(index, spec, port, scenarios, results):
    """Entry point of a spawned rank: run scenarios in order, report each result or the error."""
    node, local_rank, local_size, options = spec
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    lc = None
    try:
        lc = LocalComm(store, local_rank, local_size, node, timeout=options.get("timeout", 30.0),
                       capacity_bytes=options.get("capacity", SMALL_CAPACITY))  # fmt: skip
        for name in scenarios:
            try:
                results.put((index, name, "ok", SCENARIOS[name](lc, store, options)))
            except BaseException as e:  # reported to the test process, which decides
                results.put((index, name, type(e).__name__, f"{e}\n{traceback.format_exc()}"))
    except BaseException as e:
        results.put((index, "setup", type(e).__name__, f"{e}\n{traceback.format_exc()}"))
    finally:
        if lc is not None:
            lc.close()
        store.set(f"done/{index}", "1")


def _context():
    """A forkserver context whose server has imported torch and this module once: each rank then starts in
    milliseconds instead of re-importing torch (~2 s of CPU on these machines). Ranks are still fresh
    processes that inherit nothing from the test process."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def run_group(specs, scenarios, wait: float = 90.0, during=None):
    """Spawn one process per (node, local_rank, local_size, options) spec; return results per scenario.

    Returns {scenario: {index: (status, payload)}} and the processes' exit codes. `during(store, procs)`
    runs in the test process while the ranks work (e.g. to kill one).
    """
    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(i, s, store.port, scenarios, results), daemon=True)
        for i, s in enumerate(specs)
    ]
    for p in procs:
        p.start()
    out: dict[str, dict[int, tuple[str, object]]] = {}
    try:
        if during is not None:
            during(store, procs)
        deadline = time.monotonic() + wait
        while any(p.is_alive() for p in procs) or not results.empty():
            try:
                index, name, status, payload = results.get(timeout=0.2)
                out.setdefault(name, {})[index] = (status, payload)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise AssertionError(f"ranks still running after {wait} s; results so far: {out}") from None
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    return out, [p.exitcode for p in procs]


def expect_ok(out, scenario, count):
    got = out.get(scenario, {})
    failures = {i: v for i, v in got.items() if v[0] != "ok"}
    assert not failures and len(got) == count, f"{scenario}: {failures or got} (setup: {out.get('setup')})"
    return {i: v[1] for i, v in got.items()}


# -- scenarios (run inside the spawned ranks) -----------------------------------------------------
def _sc_no_name_left(lc, store, options):
    """Once set up, the segment has no name any more: a crash from here on cannot leak it."""
    return bps_entries(lc.node_id), lc.unwatched_peers


def _sc_correctness(lc, store, options):
    """reduce_scatter + all_gather vs a float64 reference, every dtype, uneven and multi-round sizes."""
    L, step, checked = lc.local_size, 0, 0
    sizes = options.get("sizes", [0, 1, L - 1, L + 1, 1000, 4099, 40_000])
    for dtype in options.get("dtypes", ALL_DTYPES):
        for n in sizes:
            step += 1
            x = contribution(lc.node_id, lc.local_rank, n, dtype, step)
            want = reference(lc.node_id, L, n, dtype, step)
            lo, hi = lc.slice_range(n)
            part = lc.reduce_scatter(x)
            what = f"{lc.node_id} rank {lc.local_rank} {dtype} n={n}"
            assert_matches(part, want[lo:hi], L, "reduce_scatter " + what)
            assert part.untyped_storage().nbytes() == part.numel() * part.element_size(), "not a fresh tensor"
            assert torch.equal(x, contribution(lc.node_id, lc.local_rank, n, dtype, step)), "input modified"
            out = torch.full((n,), 7, dtype=dtype)
            lc.all_gather(part, out)
            assert_matches(out, want, L, "all_gather " + what)
            # The pattern the engine uses: in place, the slice being a view of the full tensor.
            y = x.clone()
            lc.reduce_scatter(y, out=y[lo:hi])
            lc.all_gather(y[lo:hi], y)
            assert torch.equal(y, out), "in place " + what
            checked += 1
    return checked


def _sc_steps(lc, store, options):
    """Many consecutive calls, ranks at different speeds; a slow reader must never see newer data."""
    import random

    rng = random.Random(lc.local_rank * 7919 + 1)
    slow = lc.local_rank == lc.local_size - 1
    real_sum = local_reduce.local_sum

    def sluggish_sum(parts, out):  # the slow rank reads the staging area late
        time.sleep(rng.random() * 2e-3)
        real_sum(parts, out)

    if slow:
        local_reduce.local_sum = sluggish_sum
    try:
        for step in range(options.get("steps", 150)):
            n = (5, 1000, 30_000)[step % 3]  # 1, several and many rounds
            x = contribution(lc.node_id, lc.local_rank, n, torch.int64, step)
            if not slow and rng.random() < 0.3:
                time.sleep(rng.random() * 1e-3)
            part = lc.reduce_scatter(x)
            lo, hi = lc.slice_range(n)
            want = reference(lc.node_id, lc.local_size, n, torch.int64, step).long()
            assert torch.equal(part, want[lo:hi]), f"step {step} rank {lc.local_rank}: stale or torn slice"
            out = torch.empty(n, dtype=torch.int64)
            if slow:
                time.sleep(rng.random() * 1e-3)
            lc.all_gather(part, out)
            assert torch.equal(out, want), f"step {step} rank {lc.local_rank}: stale all_gather"
    finally:
        local_reduce.local_sum = real_sum
    return step + 1


def _sc_bad_input(lc, store, options):
    """Each bad call raises LocalInputError on every rank, after which the LocalComm still works."""
    me, L, seen = lc.local_rank, lc.local_size, []

    def attempt(fn):
        try:
            fn()
            seen.append(("ok", ""))
        except Exception as e:
            seen.append((type(e).__name__, str(e)))

    attempt(lambda: lc.reduce_scatter(torch.ones(10 if me == 0 else 11)))  # numel mismatch
    attempt(lambda: lc.reduce_scatter(torch.ones(10, dtype=torch.float64 if me == 1 else torch.float32)))
    attempt(lambda: lc.reduce_scatter(torch.ones(20)[::2] if me == L - 1 else torch.ones(10)))  # non-contiguous
    attempt(lambda: lc.reduce_scatter(torch.ones(10, dtype=torch.complex64 if me == 0 else torch.float32)))
    mine = len(range(*lc.slice_range(12)))
    attempt(lambda: lc.all_gather(torch.ones(mine + (me == 1)), torch.empty(12)))  # wrong slice size on rank 1
    attempt(lambda: lc.all_gather(torch.ones(mine), torch.empty(12)) if me == 0 else lc.reduce_scatter(torch.ones(12)))
    part = lc.reduce_scatter(torch.full((9,), float(me + 1)))
    out = torch.empty(9)
    lc.all_gather(part, out)
    assert torch.equal(out, torch.full((9,), L * (L + 1) / 2)), out
    return seen


def _sc_kill_self_mid_step(lc, store, options):
    """Local rank 1 dies by SIGKILL inside its 3rd reduce_scatter, after its first round; others must fail fast."""
    if lc.local_rank == 1:
        real_sum = local_reduce.local_sum
        calls = [0]

        def die_on_third(parts, out):
            calls[0] += 1
            if calls[0] == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            real_sum(parts, out)

        local_reduce.local_sum = die_on_third
    started = time.monotonic()
    try:
        for step in range(20):
            started = time.monotonic()
            x = contribution(lc.node_id, lc.local_rank, 200_000, torch.float32, step)
            lc.all_gather(lc.reduce_scatter(x), x)
    except (BpsError, TimeoutError) as e:
        elapsed = time.monotonic() - started
        try:
            lc.reduce_scatter(torch.ones(4))
            after = "no error"
        except BpsError as e2:
            after = str(e2)
        return (type(e).__name__, str(e), elapsed, after, bps_entries(lc.node_id))
    return ("no error", "", 0.0, "", [])


def _sc_loop_until_killed(lc, store, options):
    """Loop steps until a peer is SIGKILLed by the test process; report the error and how fast it came."""
    store.set(f"looping/{lc.local_rank}", "1")
    last = time.monotonic()
    try:
        for step in range(100_000):
            x = contribution(lc.node_id, lc.local_rank, 50_000, torch.float32, step % 3)
            lc.all_gather(lc.reduce_scatter(x), x)
            last = time.monotonic()
    except BpsError as e:
        return (type(e).__name__, str(e), time.monotonic() - last)
    return ("no error", "", 0.0)


def _sc_late_peer(lc, store, options):
    """Rank 0 times out waiting for rank 1 (alive, 2.5 s late); rank 1 then meets rank 0 ABORTED."""
    errors = []
    if lc.local_rank == 1:
        time.sleep(2.5)
    for _ in range(3):
        started = time.monotonic()
        try:
            lc.all_gather(lc.reduce_scatter(torch.ones(100)), torch.empty(100))
            errors.append(("ok", "", 0.0))
        except BpsError as e:
            errors.append((type(e).__name__, str(e), time.monotonic() - started))
    return errors


SCENARIOS = {f.__name__[4:]: f for f in [_sc_no_name_left, _sc_correctness, _sc_steps, _sc_bad_input,
                                         _sc_kill_self_mid_step, _sc_loop_until_killed, _sc_late_peer]}  # fmt: skip


# -- end-to-end tests (real processes) ------------------------------------------------------------
def test_two_nodes_of_two_local_ranks():
    token = uuid.uuid4().hex[:8]
    specs = [(f"a{token}", r, 2, {}) for r in range(2)] + [(f"b{token}", r, 2, {}) for r in range(2)]
    out, codes = run_group(specs, ["no_name_left", "correctness", "steps"])
    assert expect_ok(out, "no_name_left", 4) == {i: ([], []) for i in range(4)}
    assert all(n == len(ALL_DTYPES) * 7 for n in expect_ok(out, "correctness", 4).values())
    expect_ok(out, "steps", 4)
    assert codes == [0] * 4 and bps_entries(token) == []


@pytest.mark.parametrize("local_size", [3, 4])
def test_local_sizes(local_size):
    token = uuid.uuid4().hex[:8]
    specs = [(f"n{token}", r, local_size, {}) for r in range(local_size)]
    scenarios = ["correctness", "bad_input"] + (["steps"] if local_size == 3 else [])
    out, codes = run_group(specs, scenarios)
    expect_ok(out, "correctness", local_size)
    seen = expect_ok(out, "bad_input", local_size)
    L = local_size
    for r, results in seen.items():
        kinds = [k for k, _ in results]
        assert kinds == ["LocalInputError"] * 6, results
        mismatch, dtype, noncontig, complex_, slice_size, op = (m for _, m in results)
        assert "disagree" in mismatch and "numel=10" in mismatch and "numel=11" in mismatch
        assert "torch.float64" in dtype and "torch.float32" in dtype
        assert ("not contiguous" in noncontig) if r == L - 1 else (f"[{L - 1}] passed invalid input" in noncontig)
        assert ("complex64" in complex_) if r == 0 else ("[0] passed invalid input" in complex_)
        assert ("slice_ has" in slice_size) if r == 1 else ("[1] passed invalid input" in slice_size)
        assert "all_gather" in op and "reduce_scatter" in op and "disagree" in op
        assert f"local rank {r}" in mismatch and "call #1" in mismatch
    if local_size == 3:
        expect_ok(out, "steps", 3)
    assert codes == [0] * L and bps_entries(token) == []


def test_rank_sigkilled_mid_step_is_reported_and_leaks_nothing():
    token = uuid.uuid4().hex[:8]
    specs = [(f"k{token}", r, 3, {"timeout": 60.0, "capacity": 1 << 20}) for r in range(3)]
    out, codes = run_group(specs, ["kill_self_mid_step"])
    assert codes[1] == -signal.SIGKILL and codes[0] == 0 and codes[2] == 0
    for r in (0, 2):
        status, (kind, message, elapsed, after, entries) = out["kill_self_mid_step"][r]
        assert status == "ok" and kind == "TransportError", message
        assert f"node 'k{token}' local rank {r}" in message and "local rank 1 (pid" in message and "died" in message
        assert "reduce_scatter call #" in message or "all_gather call #" in message
        assert elapsed < 5.0, f"detected after {elapsed:.1f} s, timeout is 60 s"
        assert "unusable after an earlier error" in after and entries == []
    assert bps_entries(token) == []


def test_segment_creator_sigkilled_from_outside():
    token = uuid.uuid4().hex[:8]
    specs = [(f"s{token}", r, 2, {"timeout": 60.0}) for r in range(2)]

    def kill_rank0(store, procs):
        store.wait(["looping/0", "looping/1"], datetime.timedelta(seconds=60))
        time.sleep(0.5)
        os.kill(procs[0].pid, signal.SIGKILL)

    out, codes = run_group(specs, ["loop_until_killed"], during=kill_rank0)
    assert codes[0] == -signal.SIGKILL
    status, (kind, message, elapsed) = out["loop_until_killed"][1]
    assert status == "ok" and kind == "TransportError" and "local rank 0 (pid" in message and "died" in message
    assert elapsed < 5.0 and bps_entries(token) == []


def test_late_peer_times_out_and_the_abort_propagates():
    token = uuid.uuid4().hex[:8]
    out, codes = run_group([(f"t{token}", r, 2, {"timeout": 1.0}) for r in range(2)], ["late_peer"])
    first, *rest = out["late_peer"][0][1]
    assert first[0] == "BpsTimeoutError" and "local rank 1 (pid" in first[1] and "reduce_scatter call #1" in first[1]
    assert 0.9 < first[2] < 3.0
    assert all(kind == "BpsError" and "unusable" in msg for kind, msg, _ in rest)
    # Rank 1 completes the round rank 0 had arrived at, then finds rank 0 ABORTED.
    late = out["late_peer"][1][1]
    assert any(kind == "TransportError" and "local rank 0" in msg and "gave up" in msg for kind, msg, _ in late), late
    assert all(kind != "BpsTimeoutError" for kind, _, _ in late) and bps_entries(token) == []
    assert codes == [0, 0]


# -- in-process tests ------------------------------------------------------------------------------
def test_local_size_one_is_a_pass_through():
    with LocalComm(dist.HashStore(), 0, 1, "solo") as lc:
        x = torch.arange(10.0)
        assert lc.reduce_scatter(x) is not None and lc.reduce_scatter(x).data_ptr() == x.data_ptr()
        assert lc.slice_range(10) == (0, 10)
        out = torch.empty(10)
        lc.all_gather(x, out)
        assert torch.equal(out, x)
        dest = torch.empty(10)
        assert torch.equal(lc.reduce_scatter(x, out=dest), x) and dest.data_ptr() != x.data_ptr()
        with pytest.raises(LocalInputError, match="not contiguous"):
            lc.reduce_scatter(torch.ones(10)[::2])
        with pytest.raises(LocalInputError, match="slice_ has 3 elements"):
            lc.all_gather(torch.ones(3), torch.empty(4))
    with pytest.raises(BpsError, match="closed"):
        lc.reduce_scatter(x)


def _threads(*targets):
    """Run callables on threads; return their results or exceptions, in order."""
    results = [None] * len(targets)

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_threads_as_ranks_and_poll_mode():
    """Two ranks as threads of one process, with the sleep-polling waiter."""
    store, node = dist.HashStore(), f"p{uuid.uuid4().hex[:8]}"

    def rank(r):
        with LocalComm(store, r, 2, node, timeout=10, capacity_bytes=4096, wait_mode="poll") as lc:
            assert lc.wait_mode == "poll"
            for step in range(20):
                x = contribution(node, r, 777, torch.int32, step)
                out = torch.empty(777, dtype=torch.int32)
                lc.all_gather(lc.reduce_scatter(x), out)
                assert torch.equal(out, reference(node, 2, 777, torch.int32, step).int())
            return step

    assert _threads(lambda: rank(0), lambda: rank(1)) == [19, 19]
    assert bps_entries(node) == []


def test_a_call_paused_for_a_late_peer_finishes_on_another_thread():
    """A call's steps with patience: rank 1 is late, so rank 0's reduce-scatter pauses after its patience instead of
    waiting, and another thread finishes it, over several rounds, with the exact sum; peers in time never pause it."""
    store, node, late = dist.HashStore(), f"s{uuid.uuid4().hex[:8]}", threading.Event()

    def rank(r):
        with LocalComm(store, r, 2, node, timeout=10, capacity_bytes=4096) as lc:
            x, out = contribution(node, r, 777, torch.int32, 0), torch.empty(777, dtype=torch.int32)
            if r == 1:
                assert late.wait(10)
                mine = lc.reduce_scatter(x)
            else:
                steps = lc.reduce_scatter_steps(x, patience=0.05)
                started = time.monotonic()
                next(steps)  # a pause, not the end (StopIteration)
                waited = time.monotonic() - started
                assert 0.04 < waited < 1, waited
                late.set()
                [mine] = _threads(lambda: local_comm.finish(steps))
            steps = lc.all_gather_steps(mine, out, patience=5.0)
            with pytest.raises(StopIteration):
                next(steps)  # both in time: the call ends in one step
            assert torch.equal(out, reference(node, 2, 777, torch.int32, 0).int())
            return r

    assert _threads(lambda: rank(0), lambda: rank(1)) == [0, 1]
    assert bps_entries(node) == []


def test_set_up_waits_time_out_and_leave_nothing():
    node = f"u{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    with pytest.raises(BpsTimeoutError, match=r"local rank 1: set-up: .*local rank 0 to create"):
        LocalComm(dist.HashStore(), 1, 2, node, timeout=0.5)
    with pytest.raises(BpsTimeoutError, match=r"local rank 0: set-up: .*every local rank to map"):
        LocalComm(dist.HashStore(), 0, 2, node, timeout=0.5)
    assert time.monotonic() - started < 5 and bps_entries(node) == []


def test_full_dev_shm_fails_fast_on_every_rank_with_a_hint(monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    store, node, started = dist.HashStore(), f"f{uuid.uuid4().hex[:8]}", time.monotonic()
    r0, r1 = _threads(
        lambda: LocalComm(store, 0, 2, node, timeout=20), lambda: LocalComm(store, 1, 2, node, timeout=20)
    )
    assert isinstance(r0, BpsError) and "No space left" in str(r0) and "enlarge /dev/shm" in str(r0)
    assert isinstance(r1, BpsError) and "local rank 0 could not create the shared segment" in str(r1)
    assert time.monotonic() - started < 5 and bps_entries(node) == []


def test_local_size_disagreement_and_bad_settings():
    store, node = dist.HashStore(), f"m{uuid.uuid4().hex[:8]}"
    r0, r1 = _threads(lambda: LocalComm(store, 0, 2, node, timeout=1.0),
                      lambda: LocalComm(store, 1, 3, node, timeout=1.0))  # fmt: skip
    assert isinstance(r1, ConfigError) and "local_size=3" in str(r1) and "local_size=2" in str(r1)
    assert isinstance(r0, BpsError) and "set-up failed on another local rank: local rank 1: ConfigError" in str(r0)
    assert bps_entries(node) == []
    with pytest.raises(ConfigError, match="capacity_bytes"):
        LocalComm(store, 0, 4, node, capacity_bytes=1024)
    with pytest.raises(ConfigError, match="local_rank"):
        LocalComm(store, 2, 2, node)
    with pytest.raises(ConfigError, match="wait_mode"):
        LocalComm(store, 0, 1, node, wait_mode="spin")


def test_sweep_removes_only_dead_expired_segments(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid, now = int(dead.stdout), time.time()

    def make(name, pid, deadline, magic=True):
        header = shm.SegmentHeader(2, 4096, 128, pid, 0, deadline).pack()
        (tmp_path / name).write_bytes(header if magic else b"x" * len(header))

    make("torch_bps_dead_expired", dead_pid, now - 1)
    make("torch_bps_dead_in_setup", dead_pid, now + 60)
    make("torch_bps_alive", os.getpid(), now - 1)
    make("torch_bps_not_ours", dead_pid, now - 1, magic=False)
    make("other_file", dead_pid, now - 1)
    removed = shm.sweep_stale(str(tmp_path), now=now)
    assert [os.path.basename(p) for p in removed] == ["torch_bps_dead_expired"]
    assert sorted(os.listdir(tmp_path)) == [
        "other_file",
        "torch_bps_alive",
        "torch_bps_dead_in_setup",
        "torch_bps_not_ours",
    ]


@pytest.mark.parametrize("same_namespace", [True, False])
def test_dead_peer_is_named_unless_its_pid_namespace_differs(same_namespace):
    """Two Boards over one buffer; rank 1's recorded pid is a finished process's."""
    import subprocess
    import sys

    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)
    buf = mmap.mmap(-1, sync.control_bytes(2))
    boards = [sync.Board(buf, 2, r, "n0", timeout=0.5, wait_mode="futex") for r in range(2)]
    for b in boards:
        b.announce()
    ns = sync._pid_ns() if same_namespace else 12345
    struct.pack_into("<QQQ", buf, sync.CONTROL_OFFSET + sync.SLOT_BYTES + sync._PID, dead_pid, 0, ns)
    assert boards[0].find_visible_peers() == ([] if same_namespace else [1])
    boards[0].arrive(1)
    started = time.monotonic()
    died = r"local rank 1 \(pid \d+\) died"
    expected = (
        (TransportError, died)
        if same_namespace
        else (BpsTimeoutError, r"timed out after 0.5 s waiting for local rank 1")
    )
    with pytest.raises(expected[0], match=r"node 'n0' local rank 0: step 7: " + expected[1]):
        boards[0].wait_all(1, "step 7")
    assert time.monotonic() - started < (0.3 if same_namespace else 1.0)
    for b in boards:
        b.close()


def test_process_liveness_sees_zombies_and_recycled_pids():
    ctx = mp.get_context("fork")
    p = ctx.Process(target=time.sleep, args=(30,))
    p.start()
    start = shm.process_start_time(p.pid)
    assert shm.process_alive(p.pid, start) and not shm.process_alive(p.pid, start + 1)
    os.kill(p.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while shm.process_alive(p.pid, start) and time.monotonic() < deadline:  # a zombie until joined
        time.sleep(0.01)
    assert not shm.process_alive(p.pid, start)
    p.join()


@given(numel=st.integers(0, 10_000), parts=st.integers(1, 64))
def test_split_range_partitions_evenly(numel, parts):
    bounds = [split_range(numel, parts, i) for i in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    lengths = [hi - lo for lo, hi in bounds]
    assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_local_sum_matches_torch_on_a_strided_view(dtype, parts):
    base = torch.stack([contribution("sum", q, 3 * 257, dtype, 0) for q in range(parts)])
    view = base.view(parts, 3, 257)[:, 1, :]  # rows are 771 elements apart, like the staging area
    out = torch.empty(257, dtype=dtype)
    local_sum(view, out)
    assert_matches(out, view.double().sum(0), parts, f"{dtype} x{parts}")
    as_list = torch.empty(257, dtype=dtype)
    local_sum(list(view.unbind(0)), as_list)  # the sequence form gives the same bits
    assert torch.equal(as_list, out)  # integer-valued data for the exact dtypes: order does not matter


def test_segment_header_round_trip_and_layout_constants():
    h = shm.SegmentHeader(4, 4096, 1 << 20, 123, 456, 7.5)
    assert shm.SegmentHeader.unpack(h.pack(), "x") == h
    with pytest.raises(BpsError, match="not a torch_bps local segment"):
        shm.SegmentHeader.unpack(b"\0" * shm.HEADER.size, "x")
    assert shm.HEADER.size <= local_comm.control_bytes(0) and struct.calcsize("<QIIQI") <= 32
