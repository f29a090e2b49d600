"""The "byteps" ProcessGroup: every collective against gloo's result, in real processes; its logic (staging,
completion threads, the PowerSGD trap) against an in-process fake Runtime whose ranks are threads.

The spawned-job harness `run_ranks` lives in tests/helpers.py.
"""

from __future__ import annotations

import functools
import queue
import re
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

import torch_bps
from tests.helpers import exact_floats, run_ranks
from torch_bps.engine.exchange import Exchange
from torch_bps.errors import BpsError, BpsTimeoutError, ServerError
from torch_bps.pg.work import launch
from torch_bps.process_group import BackendBPS
from torch_bps.wire import Mode

# ---------------------------------------------------------------------------------------------------------------
# End to end: every collective, byteps against gloo, in the same processes.
# ---------------------------------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8,
          torch.int8]  # fmt: skip
# Sums, maxima and minima are compared exactly: the data's sums are exact in every dtype (see _rand). Products,
# averages and complex sums round, in different orders on the servers and in gloo, hence tolerances there.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12),
       torch.float16: dict(rtol=1e-2, atol=1e-2), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}  # fmt: skip
EXACT_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.BAND, dist.ReduceOp.BOR,
             dist.ReduceOp.BXOR)  # fmt: skip


def _close(a, b, what, exact=True):
    if exact:
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: {a} != {b}"
        return
    tol = TOL.get(a.real.dtype if a.is_complex() else a.dtype, dict(rtol=0, atol=0))  # integers: exact
    torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{what}: {m}")


def _rand(shape, dtype, gen):
    if dtype.is_floating_point:
        return exact_floats(shape, dtype, gen)  # sums of up to 8 ranks exact, low bits in use
    lo, hi = (0, 50) if dtype == torch.uint8 else (-20, 20)
    return torch.randint(lo, hi, shape, generator=gen).to(dtype)


def _reference_allreduce(x, op, gloo, world):
    """op over the ranks by way of a gloo all_gather (gloo has no AVG; bf16 products are gloo's own business)."""
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=gloo)
    rows = torch.stack(parts)
    if op == dist.ReduceOp.AVG:
        return (rows / world).sum(0).to(x.dtype)
    return {dist.ReduceOp.MAX: lambda: rows.amax(0), dist.ReduceOp.MIN: lambda: rows.amin(0)}[op]()


def _check_reductions(rank, world, gloo, gen):
    for dtype in DTYPES:
        x = _rand((4, 5), dtype, gen)
        ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT]
        ops += [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR] if not dtype.is_floating_point else []
        for op in ops:
            if dtype == torch.bfloat16 and op == dist.ReduceOp.PRODUCT:
                continue  # gloo's bf16 product rounds at every step, ours once: not comparable
            a, b = x.clone(), x.clone()
            dist.all_reduce(a, op=op)
            dist.all_reduce(b, op=op, group=gloo)
            _close(a, b, f"all_reduce {op} {dtype}", exact=op in EXACT_OPS)
        if dtype.is_floating_point:
            a = x.clone()
            dist.all_reduce(a, op=dist.ReduceOp.AVG)
            want = _reference_allreduce(x, dist.ReduceOp.AVG, gloo, world)
            _close(a, want, f"all_reduce AVG {dtype}", exact=False)
        # async: the work and its future both see the sum
        a, b = x.clone(), x.clone()
        work = dist.all_reduce(a, async_op=True)
        dist.all_reduce(b, group=gloo)
        fut = work.get_future()
        assert work.wait() is True and work.is_completed() and work.is_success() and work.exception() is None
        assert fut.value()[0] is a
        _close(a, b, f"async all_reduce {dtype}")
        # reduce: only the root's tensor changes
        a, b = x.clone(), x.clone()
        dist.reduce(a, dst=world - 1)
        dist.reduce(b, dst=world - 1, group=gloo)
        _close(a, b if rank == world - 1 else x, f"reduce {dtype}")


def _check_movement(rank, world, gloo, gen):
    for dtype in DTYPES:
        x = _rand((3, 4), dtype, gen)
        for root in range(world):
            a, b = x.clone(), x.clone()
            dist.broadcast(a, root)
            dist.broadcast(b, root, group=gloo)
            assert torch.equal(a, b), f"broadcast {dtype} from {root}"
        outs = [torch.empty_like(x) for _ in range(world)]
        ref = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(outs, x)
        dist.all_gather(ref, x, group=gloo)
        assert all(torch.equal(o, r) for o, r in zip(outs, ref, strict=True)), f"all_gather {dtype}"
        out, ref1 = torch.empty((world * 3, 4), dtype=dtype), torch.empty((world * 3, 4), dtype=dtype)
        dist.all_gather_single(out, x)
        dist.all_gather_single(ref1, x, group=gloo)
        assert torch.equal(out, ref1), f"all_gather_single {dtype}"
        big = _rand((world * 2, 3), dtype, gen)
        a, b = torch.empty((2, 3), dtype=dtype), torch.empty((2, 3), dtype=dtype)
        dist.reduce_scatter_single(a, big)
        ref_full = big.clone()
        dist.all_reduce(ref_full, group=gloo)  # gloo has no reduce_scatter: its all_reduce, sliced
        _close(a, ref_full[rank * 2 : rank * 2 + 2], f"reduce_scatter_single {dtype}")
        chunks = list(big.chunk(world))
        dist.reduce_scatter(b, chunks)
        _close(b, ref_full[rank * 2 : rank * 2 + 2], f"reduce_scatter {dtype}")
        assert torch.equal(torch.cat(chunks), big), "reduce_scatter must not touch its input"
    # broadcast keeps every bit of the root's data: inf, nan, denormals. Our side keeps -0.0 too (the other
    # ranks add -0.0, see test_logic_on_threaded_ranks), but the engine's local reduce may not: -0.0 == 0.0 here.
    special = torch.tensor([-0.0, 0.0, float("inf"), float("-inf"), float("nan"), 1e-45])
    a = special.clone() if rank == 0 else torch.randn(6)
    dist.broadcast(a, 0)
    assert torch.equal(a[1:].view(torch.int32), special[1:].view(torch.int32)) and a[0] == 0, a
    # in-place all_gather_single: the input is this rank's slice of the output
    out = torch.zeros(world * 5)
    out[rank * 5 : rank * 5 + 5] = rank + 1.0
    dist.all_gather_single(out, out[rank * 5 : rank * 5 + 5])
    assert torch.equal(out, torch.arange(1, world + 1).float().repeat_interleave(5))
    # uneven all_gather
    outs = [torch.empty(r + 1) for r in range(world)]
    dist.all_gather(outs, torch.full((rank + 1,), float(rank)))
    assert all(torch.equal(o, torch.full((r + 1,), float(r))) for r, o in enumerate(outs))
    # gather / scatter
    g_out = [torch.empty(4) for _ in range(world)] if rank == 1 else None
    dist.gather(torch.full((4,), rank * 2.0), g_out, dst=1)
    if rank == 1:
        assert all(torch.equal(o, torch.full((4,), r * 2.0)) for r, o in enumerate(g_out))
    s_out = torch.empty(3, dtype=torch.int64)
    dist.scatter(s_out, [torch.full((3,), 10 + r) for r in range(world)] if rank == 0 else None, src=0)
    assert torch.equal(s_out, torch.full((3,), 10 + rank))


def _check_layouts(rank, world, gloo, gen):
    # non-contiguous tensors: summed into the caller's strides
    x = _rand((6, 4), torch.float32, gen)
    a, b = x.t(), x.clone().t()
    assert not a.is_contiguous()
    dist.all_reduce(a)
    dist.all_reduce(b, group=gloo)
    _close(a, b, "non-contiguous all_reduce")
    c = torch.zeros(4, 6)[:, ::2]
    if rank == 0:
        c.copy_(x[:4, :3])
    dist.broadcast(c, 0)
    expect = x[:4, :3].clone()
    dist.broadcast(expect, 0, group=gloo)
    assert torch.equal(c, expect)
    outs = [torch.zeros(4, 2)[:, 0] for _ in range(world)]
    dist.all_gather(outs, torch.full((4,), float(rank)))
    assert all(torch.equal(o, torch.full((4,), float(r))) for r, o in enumerate(outs))
    # complex travels as pairs of reals
    z = torch.randn(5, dtype=torch.complex64, generator=gen)
    a, b = z.clone(), z.clone()
    dist.all_reduce(a)
    dist.all_reduce(b, group=gloo)
    _close(a, b, "complex all_reduce", exact=False)
    # a parameter that requires grad can be overwritten, as DDP's constructor does
    p = torch.nn.Parameter(torch.full((3,), float(rank)))
    dist.broadcast(p, 0)
    assert torch.equal(p.detach(), torch.zeros(3))
    # zero elements: nothing to send, nothing to wait for
    e = torch.empty(0)
    dist.all_reduce(e)
    dist.broadcast(e, 0)


def _check_coalesced_and_objects(rank, world, gloo, gen):
    ts = [_rand((3,), torch.float32, gen), _rand((2, 2), torch.int64, gen), _rand((5,), torch.float32, gen)]
    ref = [t.clone() for t in ts]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    for t in ref:
        dist.all_reduce(t, group=gloo)
    for t, r in zip(ts, ref, strict=True):
        _close(t, r, "coalesced all_reduce")
    x = _rand((4,), torch.float32, gen)
    outs = [torch.empty(world * 4), torch.empty(world * 4)]
    with dist._coalescing_manager():
        dist.all_gather_single(outs[0], x)
        dist.all_gather_single(outs[1], x * 2)
    ref1 = torch.empty(world * 4)
    dist.all_gather_single(ref1, x, group=gloo)
    assert torch.equal(outs[0], ref1) and torch.equal(outs[1], ref1 * 2)
    big = _rand((world * 2,), torch.float64, gen)
    rs = [torch.empty(2), torch.empty(2, dtype=torch.float64)]
    with dist._coalescing_manager():
        dist.reduce_scatter_single(rs[0], big.float())
        dist.reduce_scatter_single(rs[1], big)
    full = big.clone()
    dist.all_reduce(full, group=gloo)
    _close(rs[0], full[rank * 2 : rank * 2 + 2].float(), "coalesced reduce_scatter_single fp32")
    _close(rs[1], full[rank * 2 : rank * 2 + 2], "coalesced reduce_scatter_single fp64")
    # object collectives ride on all_gather / broadcast / gather / scatter
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "tag": "x" * rank})
    assert objs == [{"rank": r, "tag": "x" * r} for r in range(world)]
    lst = [{"from": "root"}, [1, 2, 3]] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == [{"from": "root"}, [1, 2, 3]]
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(("r", rank), gathered, dst=0)
    if rank == 0:
        assert gathered == [("r", r) for r in range(world)]
    got = [None]
    dist.scatter_object_list(got, [f"to {r}" for r in range(world)] if rank == 0 else None, src=0)
    assert got == [f"to {rank}"]


def _check_groups(rank, world, gloo, gen):
    pg = dist.group.WORLD
    assert isinstance(torch_bps.implementation(pg), BackendBPS) and dist.get_backend() == "byteps"
    assert pg._get_backend(torch.device("cpu")).name() == "byteps"  # pg.name() is torch's "custom"
    assert pg.group_name == "0" and pg.group_desc == "default_pg"
    assert dist.get_backend(gloo) == "gloo" and torch_bps.implementation(gloo) is None
    dist.barrier()
    dist.barrier(async_op=True).wait()
    members = [0, world - 1]
    sub = dist.new_group(members)
    if rank not in members:
        assert sub == dist.GroupMember.NON_GROUP_MEMBER
    else:
        assert isinstance(torch_bps.implementation(sub), BackendBPS) and dist.get_backend(sub) == "byteps"
        assert sub.size() == 2 and {d.type for d in sub._device_types} == {"cpu", "cuda"}
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=sub)
        assert torch.equal(t, torch.full((3,), float(1 + world)))
        out = [torch.empty(1), torch.empty(1)]
        dist.all_gather(out, torch.tensor([float(rank)]), group=sub)
        assert [o.item() for o in out] == [0.0, float(world - 1)]
    # the default group still works after a subgroup was made
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(world)))


def _all_collectives(rank, world, gloo):
    gen = torch.Generator().manual_seed(1234 + rank)
    for check in (_check_reductions, _check_movement, _check_layouts, _check_coalesced_and_objects, _check_groups):
        check(rank, world, gloo, gen)
    return "done"


@pytest.mark.timeout(240)
def test_every_collective_matches_gloo():
    """Three ranks (an odd world: no power-of-two luck in the sums), every collective and dtype, sync and async."""
    assert run_ranks(_all_collectives, 3, timeout=220) == ["done"] * 3


def _bad_input(rank, world, gloo):
    # unsupported dtype and op: refused on the caller's side, naming what and who
    with pytest.raises(TypeError, match=r"dtype torch.uint16 .*'byteps' backend"):
        dist.all_reduce(torch.ones(3, dtype=torch.uint16))
    # AVG of integers is accepted, as NCCL computes it: the sum divided by the world size, rounded toward zero
    # (a framework's metric sync averages int64 counters this way); 1 + 4 = 5 over 2 ranks: 2, and -5: -2, not -3.
    avg = torch.tensor([3 * rank + 1, -(3 * rank + 1), 7], dtype=torch.int64)
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    assert avg.tolist() == [2, -2, 7], avg
    with pytest.raises(TypeError, match=r"AVG is not defined on torch.bool"):
        dist.all_reduce(torch.ones(3, dtype=torch.bool), op=dist.ReduceOp.AVG)
    with pytest.raises(ValueError, match=r"PREMUL_SUM is not supported by the 'byteps' backend"):
        dist.all_reduce(torch.ones(3), op=dist._make_nccl_premul_sum(2.0))
    with pytest.raises(ValueError, match=r"world_size \(2\) x input elements"):
        dist.all_gather_single(torch.empty(3), torch.ones(2))
    # Work.wait honours its timeout, and the collective still completes once the peer joins
    t = torch.ones(2)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        start = time.monotonic()
        with pytest.raises(BpsTimeoutError, match="all_reduce|allreduce"):
            work.wait(timeout=timedelta(seconds=1))
        assert time.monotonic() - start < 5 and not work.is_completed()
        dist.barrier(group=gloo)
        assert work.wait()
    else:
        dist.barrier(group=gloo)
        dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), 2.0))
    # different shapes on different ranks: a size check (here the local stage's) fails the collective, loudly
    start = time.monotonic()
    work = dist.all_reduce(torch.ones(4 + rank), async_op=True)
    with pytest.raises(BpsError) as err:
        work.wait()
    elapsed = time.monotonic() - start
    assert work.is_completed() and not work.is_success() and work.exception() is err.value
    with pytest.raises(BpsError):
        work.get_future().wait()  # the future fails too: nothing is swallowed
    return type(err.value).__name__, str(err.value), elapsed


@pytest.mark.timeout(150)
@pytest.mark.parametrize("machines", [1, 2])
def test_bad_input_fails_clearly(machines):
    env = {"BPS_TIMEOUT": "20", "BPS_CONNECT_TIMEOUT": "20"}
    results = run_ranks(_bad_input, 2, env=env | ({"LOCAL_WORLD_SIZE": "2"} if machines == 1 else {}), timeout=130)
    for name, message, elapsed in results:
        assert elapsed < 20 + 10, f"the size mismatch took {elapsed:.1f}s to surface: {message}"
        if machines == 1:  # the local reduce-scatter compares the ranks before anything reaches a server
            assert name == "LocalInputError" and re.search(r"disagree.*numel=4.*numel=5", message), (name, message)
        else:  # the server refuses the push whose size differs from the key's, and fails the round for both
            assert name == "ServerError" and re.search(r"KEY_MISMATCH.*key \d+, round 0", message), (name, message)


# ---------------------------------------------------------------------------------------------------------------
# Logic, in one process: ranks as threads over a fake Runtime (same interface, one completion thread).
# ---------------------------------------------------------------------------------------------------------------


class _Hub:
    """Sums the k-th push_pull of every rank; completes every future from ONE thread, like a Runtime may."""

    def __init__(self, world: int):
        self.world = world
        self._lock = threading.Lock()
        self._rounds: dict[int, list] = {}
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._complete, daemon=True).start()

    def push_pull(self, rank: int, index: int, x: Exchange, fut: torch.futures.Future) -> None:
        with self._lock:
            entries = self._rounds.setdefault(index, [])
            entries.append((rank, x, fut))
            if len(entries) < self.world:
                return
            del self._rounds[index]
        if len({x.tensor.numel() for _, x, _ in entries}) > 1:
            sizes = [x.tensor.numel() for _, x, _ in entries]
            for _, _, f in entries:
                self._done.put((f, ServerError(8, f"key {index}: size mismatch {sizes}")))
            return
        if x.mode == Mode.COPY:  # every rank's own range, copied (pulled ranges: a subset of everything)
            total = torch.empty_like(x.tensor)
            for r, y, _ in entries:
                lo, hi = y.push[r]
                total[lo:hi] = y.tensor[lo:hi]
        else:  # keeps -0.0, like the server
            total = functools.reduce(torch.add, [x.tensor.to(torch.float64) for _, x, _ in entries])
        for _, x, f in entries:
            x.tensor.copy_(total)
            self._done.put((f, x.tensor))

    def _complete(self) -> None:
        while True:
            f, value = self._done.get()
            f.set_exception(value) if isinstance(value, BaseException) else f.set_result(value)


def _error_of(f: torch.futures.Future) -> BaseException | None:
    try:
        f.value()
    except BaseException as e:  # noqa: BLE001
        return e
    return None


class _FakeRuntime:
    def __init__(self, hub: _Hub, rank: int):
        self.hub, self.rank, self.world_size, self.name = hub, rank, hub.world, f"fake{rank}"
        self.config = torch_bps.Config.resolve()
        self.calls = 0
        self.priorities: list[int] = []
        self.launch_lock = threading.RLock()

    def run(self, tensors, done, *, priority: int = 0) -> None:
        """Like Runtime.run; `done` runs on a thread of its own, as the client's completion pool would give a
        callback that blocks (here every one does)."""
        self.priorities.append(priority)
        futures = []
        for item in tensors:
            x = item if isinstance(item, Exchange) else Exchange(item)
            assert x.tensor.device.type == "cpu" and x.tensor.dim() == 1 and x.tensor.is_contiguous()
            futures.append(torch.futures.Future())
            self.calls += 1
            self.hub.push_pull(self.rank, self.calls, x, futures[-1])
        if not futures:
            return done(None)

        def finish(_):
            error = next((e for e in (_error_of(f) for f in futures) if e is not None), None)
            threading.Thread(target=done, args=(error,), daemon=True).start()

        torch.futures.collect_all(futures).add_done_callback(finish)

    def close(self) -> None:
        pass


def _threaded_groups(world: int) -> list[BackendBPS]:
    hub = _Hub(world)
    return [BackendBPS(_FakeRuntime(hub, r), r, world, timeout=timedelta(seconds=30)) for r in range(world)]


def _on_threads(groups, fn):
    """Run fn(pg) for every rank's group on its own thread; return the results by rank."""
    out, errors = [None] * len(groups), []

    def body(r):
        try:
            out[r] = fn(groups[r])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return out


def _opts(cls, **fields):
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


@pytest.mark.timeout(60)
def test_nested_blocking_callbacks_do_not_deadlock():
    """The PowerSGD trap: a callback launches a collective and blocks on it. The group must hold no lock
    across a completion (the real client's pool starts another thread for the blocked one: see test_client
    and test_ddp's PowerSGD)."""
    groups = _threaded_groups(2)

    def chain(pg):
        t = torch.ones(4)
        fut = pg.allreduce([t], _opts(dist.AllreduceOptions)).get_future()

        def nested(f):
            inner = torch.full((2,), 3.0)
            pg.allreduce([inner], _opts(dist.AllreduceOptions)).get_future().wait()
            deeper = torch.ones(1)
            pg.allreduce([deeper], _opts(dist.AllreduceOptions)).wait()
            return f.value()[0] + inner.sum() + deeper

        return fut.then(nested).wait()

    for value in _on_threads(groups, chain):
        assert torch.equal(value, torch.full((4,), 2.0 + 12.0 + 2.0))


def _callback_launches_while_the_caller_does(rank, world, gloo, two_deep=False):
    """A `then` callback launches a collective (as PowerSGD's do) while the caller launches its next one: on rank 0
    the callback's comes first in time (the caller sleeps), on the others the caller's. `two_deep`: the callback does
    not wait for its collective but attaches a callback to it that launches a third. Returns (errors, which sums are
    exact)."""
    first, nested, then, third = (torch.full((n,), rank + 1.0) for n in (1000, 300, 700, 500))  # a key each

    def launches_nested(fut):
        if two_deep:
            dist.all_reduce(nested, async_op=True).get_future().then(lambda _: dist.all_reduce(third))
        else:
            dist.all_reduce(nested, async_op=True).get_future().wait()  # no timeout, as PowerSGD
        return fut.value()

    chained = dist.all_reduce(first, async_op=True).get_future().then(launches_nested)
    if rank == 0:
        time.sleep(0.3)  # its callback has launched by now; the other ranks launch `then` at once
    work = dist.all_reduce(then, async_op=True)
    errors, deadline = [], time.monotonic() + 20
    try:
        work.wait(timedelta(seconds=20))
        while not chained.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not chained.done():
            raise BpsTimeoutError("the callback's collective never completed")
        chained.wait()
    except Exception as e:  # noqa: BLE001 - reported to the test
        errors.append(f"{type(e).__name__}: {str(e)[:300]}")
    total = world * (world + 1) / 2
    if two_deep:
        deadline = time.monotonic() + 20
        while not third.eq(total).all() and time.monotonic() < deadline:
            time.sleep(0.01)
    return errors, [bool(t.eq(total).all()) for t in (first, nested, then, *([third] if two_deep else []))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local", ["1", "2"], ids=["2_machines_of_1", "1_machine_of_2"])
def test_a_callbacks_collective_starts_where_nccls_inline_callback_puts_it_on_every_rank(local):
    """Every rank starts the callback's collective before the caller's next one (NCCL's order: its futures complete
    at launch, so callbacks run inline): rank 0 issued them in that order in time, rank 1 in the other."""
    env = {"LOCAL_WORLD_SIZE": local, "BPS_TIMEOUT": "10"}
    for rank, (errors, exact) in enumerate(run_ranks(_callback_launches_while_the_caller_does, 2, env=env,
                                                     timeout=100)):  # fmt: skip
        assert errors == [] and exact == [True] * 3, f"rank {rank}: {errors}, exact sums {exact}"


@pytest.mark.timeout(120)
def test_the_callbacks_of_a_callbacks_collective_start_before_the_callers_next_one_on_every_rank():
    """A callback's collective whose own callback launches a third: NCCL runs both callbacks inline, so the third
    starts before the caller's next collective on every rank. Two machines of one rank: on one machine of two the
    first collective completes before its callback is attached, and every callback runs on the caller's thread."""
    env = {"LOCAL_WORLD_SIZE": "1", "BPS_TIMEOUT": "10"}
    for rank, (errors, exact) in enumerate(run_ranks(_callback_launches_while_the_caller_does, 2, True, env=env,
                                                     timeout=100)):  # fmt: skip
        assert errors == [] and exact == [True] * 4, f"rank {rank}: {errors}, exact sums {exact}"


def _buckets_held_back(rank, world, gloo):
    """How many of DDP's bucket all_reduces waited for an earlier collective's callbacks: with no hook (the reducer
    takes its futures in C++), then with torch's allreduce_hook (it takes them in Python)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from torch_bps.pg.work import LaunchOrder

    held = []
    start = LaunchOrder.start

    def counting(self, entry, run, hold):
        with self._lock:
            held.append(not entry.nested and bool(self._open or self._held or self._starting))
        return start(self, entry, run, hold)

    LaunchOrder.start = counting
    counts = []
    for hook in (None, allreduce_hook):
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(8))), bucket_cap_mb=1
        )  # 8 buckets of 1 MB
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        held.clear()
        for _ in range(3 if hook is None else 12):  # a hooked bucket is held only if the last is still summing
            ddp(torch.randn(8, 512)).sum().backward()
        counts.append(sum(held))
    return counts


@pytest.mark.timeout(90)
def test_ddps_own_buckets_are_never_held_back_for_callbacks():
    """Holding later collectives behind a future Python took (NCCL's callback order) must not reach DDP's own
    buckets, whose futures the reducer takes in C++: there it would cost the overlap of every bucket with the next.
    torch's Python hooks are held back (their buckets go one after another), which shows the count can see it."""
    counts = run_ranks(_buckets_held_back, 2, env={"BPS_TIMEOUT": "20"}, timeout=80)
    assert [plain for plain, _ in counts] == [0, 0], f"DDP's own bucket all_reduces held back, by rank: {counts}"
    assert sum(hooked for _, hooked in counts) > 0, f"allreduce_hook's buckets never held back: {counts}"


@pytest.mark.timeout(60)
def test_logic_on_threaded_ranks():
    groups = _threaded_groups(3)

    def body(pg):
        r = pg.rank()
        t = torch.arange(6.0).view(2, 3).t() * (r + 1)  # non-contiguous
        pg.allreduce([t], _opts(dist.AllreduceOptions)).wait()
        assert torch.equal(t, torch.arange(6.0).view(2, 3).t() * 6)
        m = torch.tensor([float(r), -float(r)])
        pg.allreduce([m], _opts(dist.AllreduceOptions, reduceOp=dist.ReduceOp.MAX)).wait()
        assert torch.equal(m, torch.tensor([2.0, 0.0]))
        avg = torch.full((2,), float(r))
        pg.allreduce([avg], _opts(dist.AllreduceOptions, reduceOp=dist.ReduceOp.AVG)).wait()
        assert torch.allclose(avg, torch.ones(2))
        b = torch.full((2,), -0.0 if r == 1 else 5.0)
        pg.broadcast([b], _opts(dist.BroadcastOptions, rootRank=1)).wait()
        assert torch.signbit(b).all() and (b == 0).all()  # -0.0 arrives as -0.0
        out = torch.empty(6)
        pg.all_gather_single(out, torch.full((2,), float(r)), _opts(c10d.AllgatherOptions)).wait()
        assert torch.equal(out, torch.tensor([0.0, 0, 1, 1, 2, 2]))
        rs = torch.empty(1)
        pg.reduce_scatter_single(rs, torch.arange(3.0), _opts(dist.ReduceScatterOptions)).wait()
        assert rs.item() == 3 * r
        work = pg.allreduce([torch.ones(1 + r)], _opts(dist.AllreduceOptions))  # sizes differ across ranks
        with pytest.raises(ServerError, match="size mismatch") as err:
            work.wait()
        assert "while running allreduce on 'byteps' group" in "".join(getattr(err.value, "__notes__", []))
        return True

    assert _on_threads(groups, body) == [True] * 3


def test_collectives_reach_the_client_at_one_priority():
    """The client sends equal priorities in submission order, the one order every worker shares (docs/design.md,
    "Scheduling"): a later collective that overtook an earlier one would do so at a different point on each worker,
    and the sums would wait for the slowest to come back to it."""
    (pg,) = _threaded_groups(1)
    for n in (1 << 20, 1 << 10, 7):  # DDP's buckets, largest first
        pg.allreduce([torch.ones(n)], _opts(dist.AllreduceOptions)).wait()
    pg.broadcast([torch.ones(3)], _opts(dist.BroadcastOptions)).wait()
    assert len(pg.runtime.priorities) == 4 and len(set(pg.runtime.priorities)) == 1


def test_work_wait_timeout_and_failure_without_processes():
    class Never:
        def run(self, tensors, done, *, priority=0):
            pass

    work = launch(Never(), "allreduce", [Exchange(torch.ones(2))], [], where="here", timeout=0.2)
    start = time.monotonic()
    # torch's words, with the space before them that torch's own suite matches (" (Timed out|closed|timeout) ")
    with pytest.raises(BpsTimeoutError, match=" Timed out after 0.2 s waiting for allreduce here to complete"):
        work.wait()
    with pytest.raises(BpsTimeoutError, match="Timed out after 0.05 s"):
        work.wait(timedelta(seconds=0.05))
    assert time.monotonic() - start < 2 and not work.is_completed()

    class Failing:
        def run(self, tensors, done, *, priority=0):
            done(ServerError(8, "key 7 round 0: nbytes 8 != 16"))

    work = launch(Failing(), "broadcast", [Exchange(torch.ones(2))], [], where="here", timeout=5)
    with pytest.raises(ServerError, match="key 7 round 0") as err:
        work.wait()
    assert "while running broadcast here" in "".join(err.value.__notes__)
    assert isinstance(work.exception(), ServerError) and not work.is_success() and work.is_completed()
    # The failure is set on the C++ future, which is what DDP's reducer and Join read: no exception object
    # posing as a value (torch's set_exception), so a C++ consumer's value() raises it.
    with pytest.raises(ServerError, match="key 7 round 0"):
        work.get_future().wait()


def test_errors_name_op_dtype_and_backend_without_processes():
    (pg,) = _threaded_groups(1)
    with pytest.raises(TypeError, match=r"allreduce: dtype torch.uint16 is not supported by the 'byteps' backend"):
        pg.allreduce([torch.ones(2, dtype=torch.uint16)], _opts(dist.AllreduceOptions))
    with pytest.raises(ValueError, match=r"sparse"):
        pg.broadcast([torch.ones(2).to_sparse()], _opts(dist.BroadcastOptions))
    with pytest.raises(TypeError, match=r"BXOR needs an integer dtype, got torch.float32"):
        pg.allreduce([torch.ones(2)], _opts(dist.AllreduceOptions, reduceOp=dist.ReduceOp.BXOR))
    assert "byteps" in dist.Backend.backend_list
    torch_bps.register_backend()  # idempotent
    assert dist.Backend.backend_list.count("byteps") == 1


def test_staging_dispatch_by_device():
    """Which staging a tensor gets. The CUDA branch is written but never ran here (no GPU): see device/pinned.py."""
    from torch_bps.device.pinned import staging_kind
    from torch_bps.pg.staging import HostCopy

    assert staging_kind(torch.device("cuda", 1), True) == "device"
    assert staging_kind(torch.device("cuda"), False) == "device"
    assert staging_kind(torch.device("cpu"), True) == "in_place"
    assert staging_kind(torch.device("cpu"), False) == "host_copy"
    with pytest.raises(TypeError, match="meta"):
        staging_kind(torch.device("meta"), True)
    t = torch.arange(12.0).view(3, 4)
    s = HostCopy("allreduce", t)
    assert s.kind == "in_place" and s.flat.data_ptr() == t.data_ptr()
    s = HostCopy("allreduce", t.t())
    assert s.kind == "host_copy" and s.flat.data_ptr() != t.data_ptr()
    s.flat.mul_(2)
    s.write_back()
    assert torch.equal(t, torch.arange(12.0).view(3, 4) * 2)


@pytest.mark.timeout(60)
def test_a_collective_is_checked_routed_staged_and_launched_under_the_runtimes_launch_lock(monkeypatch):
    """Two threads launching at once (DDP's autograd thread, a hook's callbacks) must stage and launch in one order:
    the path choice and the staging run under the lock, not only the launch (bps_hook takes the same lock)."""
    from torch_bps import process_group
    from torch_bps.device import paths

    (pg,) = _threaded_groups(1)
    held = []

    class Recorded(process_group.HostCopy):
        def __init__(self, *args, **kwargs):
            held.append(("staging", pg.runtime.launch_lock._is_owned()))
            super().__init__(*args, **kwargs)

    def choose(runtime, t, op="SUM", compressed=False):
        held.append(("path", runtime.launch_lock._is_owned()))

    monkeypatch.setattr(process_group, "HostCopy", Recorded)
    monkeypatch.setattr(paths, "choose", choose)
    assert pg.allreduce([torch.ones(4)], _opts(dist.AllreduceOptions)).wait()
    assert pg.broadcast([torch.ones(4)], _opts(dist.BroadcastOptions, rootRank=0)).wait()
    assert held == [("path", True), ("staging", True), ("staging", True)]


@pytest.mark.timeout(60)
def test_synchronize_returns_once_the_work_is_done():
    # c10d's synchronize() makes the caller's current stream wait for the work: completion is on the host here, so it
    # waits for it (and a device future's wait then makes the current streams wait for its events).
    from torch_bps import _C

    future = torch.futures.Future()
    work = _C.make_work(future, 10.0, "a test")
    threading.Timer(0.3, future.set_result, args=([torch.ones(1)],)).start()
    work.synchronize()
    assert future.done()
