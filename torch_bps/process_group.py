"""The "byteps" torch.distributed backend: collectives are sums on the summation servers.

`import torch_bps` registers it for cpu and cuda; then `dist.init_process_group("byteps")`, and
`dist.new_group(ranks)` for subgroups. The group is a C++ ProcessGroupBPS (cpp_ext/python/py_process_group.h,
so that torch names it "byteps" and reads its sequence numbers) holding, for both devices, the C++ Backend
`torch_bps._C.make_backend` builds around a `BackendBPS` (cpp_ext/python/py_backend.h): so `group._device_types`,
DCP and FSDP2's default-device lookups and the dispatcher's c10d ops all find it. Under
TORCH_DISTRIBUTED_DEBUG=DETAIL that Backend sits inside torch's ProcessGroupWrapper, as gloo's and NCCL's do.
Each collective becomes one or more `Runtime.push_pull`s of flat CPU buffers:

| collective | as a sum |
| --- | --- |
| all_reduce SUM / AVG | the tensor itself (AVG: divided by the world size first; integers: after, toward zero) |
| all_reduce MIN, MAX, PRODUCT, BAND, BOR, BXOR | an all-gather, then a local reduce (world x the traffic) |
| all_reduce of bools | int32 counts of True, summed (gloo's or / and / xor) |
| all_reduce of a sparse COO tensor | row ids all-gathered, then the rows any rank touched summed (pg/sparse.py) |
| broadcast | bytes copied, not summed: the root pushes them, every other rank pulls them |
| all_gather, all_gather_single | bytes copied: each rank pushes only its slot, pulls the whole buffer |
| gather | each rank fills its slot of a (world * n) buffer, -0.0 elsewhere |
| reduce_scatter, reduce_scatter_single | the whole input summed; each rank pulls only its own slice of the sum |
| scatter | a broadcast of the root's concatenated list; each rank keeps its slice |
| reduce | an all-reduce; only the root's tensor is written |
| barrier | a 1-element sum |

Point-to-point (send, recv, recv_anysource, and so batch_isend_irecv), all-to-all and monitored_barrier go worker
to worker through an internal gloo group on the same store (torch_bps/pg/p2p.py). Collectives are staged and
launched under the group's Runtime's launch lock (bps_hook takes the same one), so one collective's push_pulls stay
contiguous even when several threads use the group (DDP's autograd thread and a comm hook's callbacks); ranks must
still call collectives in the same order, as with any backend.

May import: torch, torch_bps.config, torch_bps.device, torch_bps.engine.exchange, torch_bps.errors, torch_bps.wire,
torch_bps.pg;
torch_bps.runtime and torch_bps._C only when a group is created (they load the C++ client, which
`import torch_bps` must not).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from torch_bps.config import Config
from torch_bps.device import paths
from torch_bps.engine.exchange import Exchange
from torch_bps.errors import ConfigError
from torch_bps.pg import sparse, staging
from torch_bps.pg.p2p import GlooSide
from torch_bps.pg.staging import (
    BACKEND,
    HostCopy,
    as_bytes,
    check_movable,
    check_tensor,
    copy_into,
    cpu_flat,
    fill_except,
    neutral,
    real,
)
from torch_bps.pg.work import launch, launch_on_device, locked
from torch_bps.wire import Mode

_DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default for non-NCCL backends


class BackendBPS:
    """One "byteps" group's collectives, on a torch_bps Runtime (and point-to-point on `p2p`, a GlooSide).

    Created by torch through `register_backend`'s creator, not by hand; `implementation(group)` finds it. Its
    methods carry the names and arguments of torch's ProcessGroup methods."""

    def __init__(self, runtime, rank: int, size: int, timeout: timedelta = _DEFAULT_TIMEOUT, p2p=None):
        self.runtime = runtime
        self.p2p = p2p
        self._rank, self._size = rank, size
        self._timeout = timeout.total_seconds()
        self._launch_lock = runtime.launch_lock  # shared with bps_hook on this group's Runtime
        self._sparse_room = sparse.Room()
        self._group_name = ""

    # -- identity -------------------------------------------------------------------------------------------
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def set_timeout(self, seconds: float) -> None:
        """The group's default timeout (torch's `ProcessGroup.set_timeout`); a collective's opts.timeout wins."""
        self._timeout = seconds
        if self.p2p is not None:
            self.p2p.set_timeout(timedelta(seconds=seconds))

    def __repr__(self) -> str:
        return f"BackendBPS(name={self._group_name!r}, rank={self.rank()}, size={self.size()})"

    def shutdown(self) -> None:
        """Leave the summation job (torch calls this from destroy_process_group)."""
        self.runtime.close()

    def abort(self) -> None:
        self.runtime.close()

    # -- reductions -----------------------------------------------------------------------------------------
    @locked
    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        t = self._single("allreduce", tensors)
        if isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo:
            return self._sparse_allreduce(t, staging.op_name(opts.reduceOp) if opts is not None else "SUM")
        op = self._op("allreduce", opts, t)
        if (path := paths.choose(self.runtime, t, op)) is not None:
            return launch_on_device(self.runtime, "allreduce", t.detach().view(-1), path, tensors, average=op == "AVG",
                                    where=self._where(), timeout=self._timeout)  # fmt: skip
        s = HostCopy("allreduce", t)
        return self._launch("allreduce", [self._reduce(t.dtype, s.flat, op, s.write_back)], tensors, device=t.device)

    @locked
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        """One push_pull per dtype: the tensors of that dtype flattened end to end."""
        name = "allreduce_coalesced"
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            self._op(name, opts, t)
            by_dtype.setdefault(t.dtype, []).append(t)
        op = staging.op_name(opts.reduceOp) if opts is not None else "SUM"
        transfers = []
        for dtype, group in by_dtype.items():
            flat = torch.cat([cpu_flat(t) for t in group])
            transfers.append(self._reduce(dtype, flat, op, lambda g=group, f=flat: _scatter_back(g, f)))
        return self._launch(name, transfers, tensors, device=_device(tensors))

    def _sparse_allreduce(self, t: torch.Tensor, op: str) -> dist.Work:
        """pg/sparse.py's `launch_sum`, under the launch lock: no other collective comes between its steps."""
        with self._launch_lock:
            return sparse.launch_sum("allreduce", t, op, self.rank(), self.size(),
                                     lambda ts, result, device: self._launch("allreduce", ts, result, device),
                                     self._reduce, [t], self._sparse_room)  # fmt: skip

    @locked
    def reduce(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        t = self._single("reduce", tensors)
        op = self._op("reduce", opts, t)
        if self.rank() == opts.rootRank:
            s = HostCopy("reduce", t)
            transfer = self._reduce(t.dtype, s.flat, op, s.write_back)
        else:  # the sum is computed everywhere; only the root's tensor is written
            transfer = self._reduce(t.dtype, cpu_flat(t), op, None)
        return self._launch("reduce", [transfer], tensors, device=t.device)

    @locked
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> dist.Work:
        return self._launch("reduce_scatter_single", self._reduce_scatter_plan(output, input, opts), [output],
                            device=output.device)  # fmt: skip

    @locked
    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts=None) -> dist.Work:  # fmt: skip
        plans = [t for o, i in zip(outputs, inputs, strict=True) for t in self._reduce_scatter_plan(o, i, opts)]
        return self._launch("reduce_scatter_single_coalesced", plans, outputs, device=_device(outputs))

    @locked
    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None
    ) -> dist.Work:
        name = "reduce_scatter"
        out = self._single(name, outputs)
        inputs = self._single(name, input_lists, what="input list")
        self._check_world_list(name, inputs)
        for t in inputs:
            op = self._op(name, opts, t)
        slots = _slots([real(t).numel() for t in inputs])
        flat = torch.cat([cpu_flat(t) for t in inputs])
        mine = flat[slice(*slots[self.rank()])]
        transfer = self._reduction(flat, op, lambda: copy_into(out, mine))
        return self._launch(name, [_pull_only(transfer, op, slots)], outputs, device=out.device)

    # -- data movement: bytes copied, never summed (bit-exact for every pattern, any dtype) -------------------
    @locked
    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        t = self._single("broadcast", tensors)
        root = opts.rootRank if opts is not None else 0
        s = HostCopy("broadcast", t, load=self.rank() == root, movable=True)
        buf = as_bytes(s.flat)
        everything, nothing = (0, buf.numel()), (0, 0)
        push = [everything if r == root else nothing for r in range(self.size())]
        pull = [nothing if r == root else everything for r in range(self.size())]  # the root has it already
        transfer = Exchange(buf, Mode.COPY, push, pull, finish=s.write_back)
        return self._launch("broadcast", [transfer], tensors, device=t.device)

    @locked
    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None) -> dist.Work:
        return self._launch("all_gather", self._allgather_plan(output_lists, inputs), output_lists,
                            device=_device(inputs))  # fmt: skip

    @locked
    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts=None) -> dist.Work:  # fmt: skip
        """output_lists[r][j] receives rank r's inputs[j] (torch's layout): one all_gather per input."""
        if len(output_lists) != self.size() or any(len(outs) != len(inputs) for outs in output_lists):
            raise ValueError(f"all_gather_coalesced: expected world_size ({self.size()}) output lists of "
                             f"{len(inputs)} tensors, one per input ('{BACKEND}' backend)")  # fmt: skip
        per_input = [[outs[j] for outs in output_lists] for j in range(len(inputs))]
        plans = [t for outs, i in zip(per_input, inputs, strict=True) for t in self._allgather_plan([outs], [i])]
        return self._launch("all_gather_coalesced", plans, output_lists, device=_device(inputs))

    @locked
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts=None) -> dist.Work:
        return self._launch("all_gather_single", self._gather_single_plan(output, input), [output],
                            device=output.device)  # fmt: skip

    @locked
    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts=None) -> dist.Work:  # fmt: skip
        plans = [t for o, i in zip(outputs, inputs, strict=True) for t in self._gather_single_plan(o, i)]
        return self._launch("all_gather_single_coalesced", plans, outputs, device=_device(outputs))

    @locked
    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None) -> dist.Work:
        name = "gather"
        inp = self._single(name, inputs)
        check_tensor(name, inp)
        is_root = self.rank() == opts.rootRank
        outs = self._single(name, output_lists, what="output list") if is_root else []
        if is_root:
            self._check_world_list(name, outs, like=inp)
        n = real(inp).numel()  # every rank's input has this size: the other ranks cannot know otherwise
        buf = torch.empty(self.size() * n, dtype=real(inp).dtype)
        fill_except(buf, self.rank() * n, (self.rank() + 1) * n)
        buf[self.rank() * n : (self.rank() + 1) * n].copy_(real(inp).reshape(-1))
        finish = (lambda: [copy_into(o, buf[i * n : (i + 1) * n]) for i, o in enumerate(outs)]) if is_root else None
        return self._launch(name, [Exchange(buf, finish=finish)], output_lists, device=inp.device)

    @locked
    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None) -> dist.Work:
        name = "scatter"
        out = self._single(name, outputs)
        check_tensor(name, out)
        n = real(out).numel()
        if self.rank() == opts.rootRank:
            inputs = self._single(name, input_lists, what="input list")
            self._check_world_list(name, inputs, like=out)
            buf = torch.cat([cpu_flat(t) for t in inputs])
        else:
            buf = torch.full((self.size() * n,), neutral(real(out).dtype), dtype=real(out).dtype)
        mine = buf[self.rank() * n : (self.rank() + 1) * n]
        return self._launch(name, [Exchange(buf, finish=lambda: copy_into(out, mine))], outputs, device=out.device)

    @locked
    def barrier(self, opts=None) -> dist.Work:
        return self._launch("barrier", [Exchange(torch.zeros(1, dtype=torch.int32))], [])

    # -- worker to worker, through the internal gloo group (pg/p2p.py) --------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        return self.p2p.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        return self.p2p.recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        return self.p2p.recv_anysource(tensors, tag)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None) -> dist.Work:
        return self.p2p.alltoall(outputs, inputs, opts if opts is not None else dist.AllToAllOptions())

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts=None) -> dist.Work:  # fmt: skip
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self.p2p.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def monitored_barrier(self, opts, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier: names the ranks that did not arrive within opts.timeout."""
        self.p2p.monitored_barrier(opts, wait_all_ranks)

    # -- plans: the transfers of one collective ------------------------------------------------------------------
    def _reduce(self, dtype: torch.dtype, flat: torch.Tensor, op: str, finish) -> Exchange:
        """`_reduction`, but bools (their bytes in `flat`) go as one sum of int32 counts of True."""
        if dtype != torch.bool:
            return self._reduction(flat, op, finish)
        counts, back = staging.logical_counts(flat, op, self.size())
        return Exchange(counts, finish=lambda: (back(), finish() if finish is not None else None))

    def _reduction(self, flat: torch.Tensor, op: str, finish) -> Exchange:
        """Reduce `flat` (1-D contiguous CPU) over the group with `op`, then run `finish` (may be None)."""
        if op in ("SUM", "AVG"):
            if op == "AVG" and (flat.dtype.is_floating_point or flat.dtype.is_complex):
                # Divide first: the servers sum in the tensor's own dtype, and a float16 sum of undivided
                # values can overflow where the sum of divided ones does not.
                flat.div_(self.size())
            elif op == "AVG":  # integers, as NCCL: the sum, then divided by the group's size, rounded toward zero

                def average() -> None:
                    flat.div_(self.size(), rounding_mode="trunc")
                    if finish is not None:
                        finish()

                return Exchange(flat, finish=average)
            return Exchange(flat, finish=finish)
        n, r = flat.numel(), self.rank()
        rows = torch.empty(self.size() * n, dtype=flat.dtype)
        fill_except(rows, r * n, (r + 1) * n)
        rows[r * n : (r + 1) * n].copy_(flat)

        def reduce_rows() -> None:
            flat.copy_(staging.reduce_gathered(rows.view(self.size(), n), op))
            if finish is not None:
                finish()

        return Exchange(rows, finish=reduce_rows)

    def _reduce_scatter_plan(self, output: torch.Tensor, input: torch.Tensor, opts) -> list[Exchange]:
        name = "reduce_scatter_single"
        op = self._op(name, opts, input)
        check_tensor(name, output)
        n = real(output).numel()
        self._check_world_multiple(name, "input", input, "output", output)
        flat = cpu_flat(input)  # a copy: the caller's input must stay untouched
        mine = flat[self.rank() * n : (self.rank() + 1) * n]
        transfer = self._reduction(flat, op, lambda: copy_into(output, mine))
        return [_pull_only(transfer, op, _slots([n] * self.size()))]

    def _allgather_plan(self, output_lists, inputs) -> list[Exchange]:
        name = "all_gather"
        inp = self._single(name, inputs)
        check_movable(name, inp)
        outs = self._single(name, output_lists, what="output list")
        self._check_world_list(name, outs, like=inp, same_size=False, movable=True)
        sizes = [real(o).numel() for o in outs]
        if sizes[self.rank()] != real(inp).numel():
            raise ValueError(f"{name}: output tensor {self.rank()} has {outs[self.rank()].numel()} elements, the "
                             f"input {inp.numel()} ('{BACKEND}' backend)")  # fmt: skip
        size = real(inp).element_size()
        slots = _slots([n * size for n in sizes])  # in bytes
        buf = torch.empty(slots[-1][1], dtype=torch.uint8)
        buf[slice(*slots[self.rank()])].copy_(as_bytes(real(inp).reshape(-1).contiguous()))

        def unpack() -> None:
            for o, (lo, hi) in zip(outs, slots, strict=True):
                copy_into(o, buf[lo:hi].view(real(o).dtype))

        return [Exchange(buf, Mode.COPY, push=slots, finish=unpack)]

    def _gather_single_plan(self, output: torch.Tensor, input: torch.Tensor) -> list[Exchange]:
        name = "all_gather_single"
        check_movable(name, input)
        n = real(input).numel()
        self._check_world_multiple(name, "output", output, "input", input)
        s = HostCopy(name, output, load=False, movable=True)
        lo, hi = self.rank() * n, (self.rank() + 1) * n
        s.flat[lo:hi].copy_(real(input).reshape(-1))  # `input` may be this very slice of `output`
        size = s.flat.element_size()
        slots = _slots([n * size] * self.size())  # in bytes
        return [Exchange(as_bytes(s.flat), Mode.COPY, push=slots, finish=s.write_back)]

    # -- helpers --------------------------------------------------------------------------------------------------
    def _launch(self, op: str, transfers: Sequence[Exchange], result, device: torch.device | None = None) -> dist.Work:
        with self._launch_lock:
            # One priority for all: the client sends in submission order, the one order every worker shares
            # (docs/design.md, "Scheduling").
            return launch(self.runtime, op, transfers, result, where=self._where(), timeout=self._timeout,
                          device=device)  # fmt: skip

    def _where(self) -> str:
        return f"on '{BACKEND}' group {self._group_name!r} (rank {self.rank()} of {self.size()})"

    def _check_world_multiple(self, name: str, big_name: str, big: torch.Tensor, small_name: str,
                              small: torch.Tensor) -> None:  # fmt: skip
        """Refuse unless `big` holds world_size x `small`'s elements of the same dtype."""
        if real(big).numel() != self.size() * real(small).numel() or big.dtype != small.dtype:
            raise ValueError(f"{name}: {big_name} must hold world_size ({self.size()}) x {small_name} elements of "
                             f"the same dtype, got {big_name} {tuple(big.shape)} {big.dtype}, {small_name} "
                             f"{tuple(small.shape)} {small.dtype} ('{BACKEND}' backend)")  # fmt: skip

    def _single(self, name: str, items: list, what: str = "tensor"):
        if len(items) != 1:
            raise ValueError(f"{name}: the '{BACKEND}' backend takes exactly one {what} per process, got {len(items)}")
        return items[0]

    def _op(self, name: str, opts, t: torch.Tensor) -> str:
        check_tensor(name, t)
        op = staging.op_name(opts.reduceOp) if opts is not None else "SUM"
        staging.check_reduce_op(name, t.dtype, op)
        return op

    def _check_world_list(self, name: str, tensors: list[torch.Tensor], like: torch.Tensor | None = None,
                          same_size: bool = True, movable: bool = False) -> None:  # fmt: skip
        if len(tensors) != self.size():
            raise ValueError(f"{name}: expected a list of world_size ({self.size()}) tensors, got {len(tensors)} "
                             f"('{BACKEND}' backend)")  # fmt: skip
        for t in tensors:
            (check_movable if movable else check_tensor)(name, t)
            if like is not None and t.dtype != like.dtype:
                raise TypeError(f"{name}: tensors of dtype {t.dtype} and {like.dtype} mixed ('{BACKEND}' backend)")
            if like is not None and same_size and t.numel() != like.numel():
                raise ValueError(f"{name}: every tensor must have {like.numel()} elements, one has {t.numel()} "
                                 f"('{BACKEND}' backend)")  # fmt: skip


def _slots(sizes: list[int]) -> list[tuple[int, int]]:
    """[start, stop) of each piece when pieces of these sizes are laid end to end."""
    ends = list(itertools.accumulate(sizes))
    return [(end - n, end) for n, end in zip(sizes, ends, strict=True)]


def _pull_only(exchange: Exchange, op: str, slots: list[tuple[int, int]]) -> Exchange:
    """A reduce-scatter's sum: each rank pulls only its own slot of it (MIN, MAX... gather every row instead)."""
    return dataclasses.replace(exchange, pull=slots) if op in ("SUM", "AVG") else exchange


def _scatter_back(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for t in tensors:
        n = real(t).numel()
        copy_into(t, flat[offset : offset + n])
        offset += n


def _device(tensors) -> torch.device | None:
    return tensors[0].device if tensors and isinstance(tensors[0], torch.Tensor) else None


def _config(pg_options) -> Config:
    if pg_options is None:
        return Config.resolve()
    if isinstance(pg_options, Config):
        return pg_options
    raise ConfigError(f"pg_options for the '{BACKEND}' backend must be a torch_bps.Config, got {type(pg_options)}")


def _create(opts, pg_options):
    """torch's creator (extended API): one Runtime and one internal gloo group per group (the default group's
    Runtime is named "default"); returns the group itself, a C++ ProcessGroupBPS holding the C++ Backend for cpu
    and cuda (cpp_ext/python/py_process_group.h says why not the bare Backend)."""
    from torch_bps import _C  # loads the C++ client: only when a group is really created
    from torch_bps.runtime import Runtime

    is_default = len(opts.global_ranks_in_group) == 0  # torch passes no ranks for the default group
    name = "default" if is_default else f"group-{opts.group_id}"
    runtime = Runtime.create(opts.store, opts.group_rank, opts.group_size, name=name, config=_config(pg_options))
    p2p = GlooSide(opts.store, opts.group_rank, opts.group_size, opts.timeout, runtime.launch.attempt)
    impl = BackendBPS(runtime, opts.group_rank, opts.group_size, timeout=opts.timeout, p2p=p2p)
    impl.setGroupName(opts.group_id)  # the debug wrapper below does not pass torch's group name on
    backend = _C.make_backend(impl, opts.group_rank, opts.group_size)
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:
        # torch wraps a backend it registers itself in ProcessGroupWrapper, which checks every collective's
        # fingerprint (op, shapes, dtypes, sequence number) across ranks through a gloo helper group first; a
        # group returned whole is not wrapped, so the same wrapping happens here, on the same store prefix.
        backend = dist.distributed_c10d._create_process_group_wrapper(
            wrapped_pg=backend, store_prefix=opts.group_id, store=opts.store, rank=opts.group_rank,
            world_size=opts.group_size, timeout=opts.timeout,
        )  # fmt: skip
    return _C.make_process_group(opts.store, opts.group_rank, opts.group_size, backend)


def implementation(group: dist.ProcessGroup | None = None) -> BackendBPS | None:
    """The BackendBPS behind a "byteps" group (None: the default group), or None for any other group."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    if group in (None, dist.GroupMember.NON_GROUP_MEMBER) or dist.get_backend(group) != BACKEND:
        return None
    from torch_bps import _C

    backend = group._get_backend(torch.device("cpu"))
    while isinstance(backend, dist.distributed_c10d._ProcessGroupWrapper):  # TORCH_DISTRIBUTED_DEBUG=DETAIL
        backend = backend.wrapped_pg
    return _C.backend_impl(backend)


def rebalance(group: dist.ProcessGroup | None = None) -> dict | None:
    """Take servers that came back, or standbys registered since, into the placement, and re-place every key by
    the paper's rule over the dedicated servers that answer now (torch_bps/failover.py, `Router.rebalance`).

    Collective: every rank of the "byteps" group (None: the default group) calls it at a step boundary. Returns
    what it did, or None when the group has no failover (no dedicated servers, or BPS_FAILOVER=0).
    """
    impl = implementation(group)
    if impl is None:
        raise ValueError("torch_bps.rebalance needs a group of the 'byteps' backend (AsyncTraining: its rebalance())")
    return impl.runtime.rebalance()


def register_backend() -> None:
    """Make "byteps" a torch.distributed backend for CPU and CUDA tensors. Idempotent."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
