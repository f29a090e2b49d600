"""LocalComm: reduce-scatter and all-gather among the local ranks of one node, through shared memory.

The local ranks of a node map one shared segment (shm.py) holding a control slot per rank (sync.py) and
a data area split in two halves used by alternate rounds. A reduce-scatter round: every rank copies, for
every destination rank d, the next chunk of d's slice of its input into its own block of the current
half; after the round's barrier, rank d sums column d of all blocks into its result (`local_sum`). An
all-gather round: every rank copies the next chunk of its slice into its block; after the barrier,
every rank copies the others' chunks into `out`. Tensors larger than the segment take several rounds.

Chunking, not growing the segment: growing would need every rank to agree on and remap a new segment in
the middle of a step (a set-up in the hot path) and would let /dev/shm use grow with the largest tensor
(containers often cap /dev/shm at 64 MB). Chunks of a fixed segment keep memory bounded; a round costs
one barrier (a ~12 us futex ping-pong between two idle cores) against chunk copies of a millisecond
or more at the default capacity.

The first round of every call also carries a descriptor (call number, op, dtype, numel, input error)
per rank. Every rank checks them after that round's barrier, so bad input on one rank (mismatched numel
or dtype, a non-contiguous tensor) raises LocalInputError on every rank, and the LocalComm stays
usable; so does an all-gather a rank joins with nothing to give (`failed`: LocalPeerFailedError). Any
other failure (a dead or departed peer, a timeout, an interrupt) marks it broken: this rank raises, its
peers see it ABORTED within ~50 ms and raise too, and later calls raise at once.

May import: torch, torch.distributed (the Store), torch_bps.errors, torch_bps.wire (dtype codes) and torch_bps.local.*.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import warnings
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist

from torch_bps.errors import BpsError, BpsTimeoutError, ConfigError
from torch_bps.local import reduce as _reduce  # looked up per call, so `local_sum` can be swapped
from torch_bps.local.shm import Segment, SegmentHeader, process_start_time, segment_name, sweep_stale
from torch_bps.local.sync import Board, State, control_bytes
from torch_bps.wire import DTYPE_CODES  # every dtype the wire carries (uint8/int8 too: object collectives)

_DTYPE_OF = {code: dt for dt, code in DTYPE_CODES.items()}
_REDUCE_SCATTER, _ALL_GATHER = 1, 2
_OP_NAMES = {_REDUCE_SCATTER: "reduce_scatter", _ALL_GATHER: "all_gather"}
_ALIGN = 64  # bytes: every chunk region starts on a cache line


class LocalInputError(BpsError, ValueError):
    """A local rank passed an invalid tensor, or the local ranks passed tensors that do not match."""


class LocalPeerFailedError(BpsError):
    """A local rank came to an all-gather with nothing to give: its collective had failed before it (its own error
    says why). Raised on every local rank alike, at once; the LocalComm stays usable."""


def raise_if_peer_failed(where: str, failed: bool, gone: list[int]) -> None:
    """An all-gather this rank came to `failed`, or local ranks `gone` did: raise LocalPeerFailedError, on every rank
    alike (a failed rank's own error says why; this one names it to its peers)."""
    if failed:
        raise LocalPeerFailedError(f"{where}: this rank's collective failed before it")
    if gone:
        raise LocalPeerFailedError(f"{where}: local rank(s) {gone} came with nothing to give: their collective "
                                   "failed before it (their errors say why)")  # fmt: skip


def _tensor_problem(t, name: str) -> str | None:
    if not isinstance(t, torch.Tensor):
        return f"{name} is a {type(t).__name__}, not a torch.Tensor"
    if t.device.type != "cpu":
        return f"{name} is on {t.device}; LocalComm stages CPU tensors only"
    if t.dtype not in DTYPE_CODES:
        return f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in DTYPE_CODES)}"
    if not t.is_contiguous():
        return f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}); pass .contiguous()"
    return None


def split_range(numel: int, parts: int, index: int) -> tuple[int, int]:
    """Return [start, end) of part `index` when `numel` elements are cut into `parts` contiguous parts.

    Parts differ in length by at most one; the first numel % parts get the longer ones, so with
    numel < parts the last ones are empty. Example: split_range(10, 4, 3) == (8, 10).
    """
    if not 0 <= index < parts or numel < 0:
        raise ValueError(f"split_range(numel={numel}, parts={parts}, index={index})")
    base, rem = divmod(numel, parts)
    start = index * base + min(index, rem)
    return start, start + base + (1 if index < rem else 0)


# A call as a generator: each next() runs it on until it ends (StopIteration carries its result) or pauses because
# its peers are late at its first meeting; whoever runs it on next waits for them. One thread at a time.
Steps = Generator[None, None, Any]


def finish(steps: Steps) -> Any:
    """Run a call's steps (`LocalComm.reduce_scatter_steps`, `all_gather_steps`) to their end; return their result."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


class LocalComm:
    """Reduce-scatter / all-gather among the `local_size` ranks of node `node_id`, through shared memory.

    Args:
        store: a c10d Store shared by the job; used during set-up only (segment name, a barrier).
        local_rank, local_size: this rank and the number of ranks on the node.
        node_id: names the node; distinct per emulated node when several share a machine.
        timeout: the longest any wait (set-up, or one round's barrier) may take, in seconds.
        capacity_bytes: size of the data area; larger tensors are processed in several rounds. Local
            rank 0's value is used by everyone.
        wait_mode: "auto" (futex where available), "futex" or "poll" (sleep with backoff).
        job: names the job in its shared segment's file name (torchrun's run id: Launch.run_id), for whoever lists
            /dev/shm.

    Every local rank must make the same calls in the same order; one call at a time per LocalComm. A call's steps
    (`reduce_scatter_steps`, `all_gather_steps`) may pause where its peers are late and go on on another thread.
    Example:
        with LocalComm(store, local_rank, 2, "node0") as lc:
            part = lc.reduce_scatter(grad)      # this rank's slice, summed over the node
            ...                                  # push/pull `part` through the summation service
            lc.all_gather(part, out=grad)        # every rank gets the full tensor
    """

    def __init__(self, store: dist.Store, local_rank: int, local_size: int, node_id: str, *,
                 timeout: float = 300.0, capacity_bytes: int = 64 << 20, wait_mode: str = "auto",
                 job: str = "job"):  # fmt: skip
        if local_size < 1 or not 0 <= local_rank < local_size:
            raise ConfigError(f"local_rank={local_rank} must lie in [0, local_size={local_size})")
        if timeout <= 0:
            raise ConfigError(f"timeout={timeout} must be positive")
        if wait_mode not in ("auto", "futex", "poll"):
            raise ConfigError(f"wait_mode={wait_mode!r}; choose 'auto', 'futex' or 'poll'")
        self.local_rank, self.local_size, self.node_id, self.timeout = local_rank, local_size, str(node_id), timeout
        self._calls = 0  # operations started, for messages and the descriptor check
        self._round = 0  # rounds completed; round k uses half k % 2
        self._closed = False
        self._broken: str | None = None
        self._segment: Segment | None = None
        self._board: Board | None = None
        self._views: dict[torch.dtype, _Layout] = {}
        self.capacity_bytes = 0
        self.wait_mode = "none"
        self.unwatched_peers: list[int] = []  # peers whose death we cannot detect (other pid namespace)
        if local_size == 1:
            return  # a pass-through: no segment, no store traffic
        minimum = 2 * local_size * local_size * _ALIGN
        if capacity_bytes < minimum:
            raise ConfigError(
                f"capacity_bytes={capacity_bytes} is below {minimum}, the least for local_size={local_size}"
            )
        self._set_up(store, capacity_bytes, wait_mode, job)

    # -- set-up ----------------------------------------------------------------------------------
    def _set_up(self, store: dist.Store, capacity_bytes: int, wait_mode: str, job: str) -> None:
        L, me = self.local_size, self.local_rank
        prefix = f"torch_bps/local/{self.node_id}"
        # The n-th LocalComm of this node on every rank shares keys with the n-th on the others.
        key = f"{prefix}/{store.add(f'{prefix}/instances/{me}', 1)}"
        segment = None
        try:
            if me == 0:
                sweep_stale()
                data_offset = -(-control_bytes(L) // 4096) * 4096
                data_bytes = capacity_bytes // (2 * L * _ALIGN) * (2 * L * _ALIGN)
                header = SegmentHeader(L, data_offset, data_bytes, os.getpid(), process_start_time(os.getpid()) or 0,
                                       time.time() + self.timeout)  # fmt: skip
                try:
                    segment = Segment.create(segment_name(job, self.node_id),
                                             header, reserve=True)  # fmt: skip
                except OSError as e:
                    store.set(f"{key}/segment", f"!{e}")  # peers fail now rather than at their timeout
                    raise BpsError(f"{self._who()}: cannot create a {data_offset + data_bytes}-byte shared segment "
                                   f"in /dev/shm ({e}); lower capacity_bytes or enlarge /dev/shm "
                                   f"(docker: --shm-size)") from e  # fmt: skip
                store.set(f"{key}/segment", os.path.basename(segment.path))
            else:
                name = self._store_get(store, f"{key}/segment", "local rank 0 to create the shared segment")
                if name.startswith("!"):
                    raise BpsError(f"{self._who()}: local rank 0 could not create the shared segment: {name[1:]}")
                segment, header = Segment.attach(name)
                if header.local_size != L:
                    raise ConfigError(f"{self._who()}: local_size={L}, but local rank 0 created the segment "
                                      f"for local_size={header.local_size}")  # fmt: skip
            self._segment = segment
            self._board = Board(segment.buf, L, me, self.node_id, self.timeout, wait_mode=wait_mode)
            self._board.announce()
            # The last rank to map the segment removes its name: from here on no crash can leak it.
            if store.add(f"{key}/attached", 1) == L:
                segment.unlink()
                store.set(f"{key}/ready", "1")
            ready = self._store_get(store, f"{key}/ready", "every local rank to map the shared segment")
            if ready.startswith("!"):
                raise BpsError(f"{self._who()}: set-up failed on another local rank: {ready[1:]}")
            self.unwatched_peers = self._board.find_visible_peers()
            if self.unwatched_peers:
                warnings.warn(
                    f"{self._who()}: the processes of local ranks {self.unwatched_peers} are not visible from "
                    f"here (another pid namespace?): a crash of one is only noticed after timeout={self.timeout} s",
                    stacklevel=3,
                )
        except BaseException as e:
            if not isinstance(e, BpsError) or "set-up failed on another" not in str(e):
                try:  # let the other local ranks fail now rather than at their timeout
                    store.set(f"{key}/ready", f"!local rank {me}: {type(e).__name__}: {e}")
                except Exception:
                    pass  # the store itself is gone; the others will time out
            if segment is not None:
                self._release()
                segment.unlink()
                segment.close()
            raise
        self._data = torch.frombuffer(
            segment.buf, dtype=torch.uint8, count=header.data_bytes, offset=header.data_offset
        )
        self.capacity_bytes = header.data_bytes
        self._half = header.data_bytes // 2
        self._block = self._half // L // _ALIGN * _ALIGN  # one block per source rank in each half
        self.wait_mode = self._board.wait_mode

    def _store_get(self, store: dist.Store, key: str, what: str) -> str:
        try:
            store.wait([key], datetime.timedelta(seconds=self.timeout))
            return store.get(key).decode()
        except Exception as e:  # DistStoreError (timeout) or a lost store connection
            raise BpsTimeoutError(f"{self._who()}: set-up: waited up to {self.timeout:.1f} s for {what} "
                                  f"(store key {key!r}): {e}") from e  # fmt: skip

    # -- public operations -----------------------------------------------------------------------
    def slice_range(self, numel: int, local_rank: int | None = None) -> tuple[int, int]:
        """Return [start, end) of `local_rank`'s slice (default: this rank's) of a `numel`-element tensor.

        Slices are contiguous, in rank order, and differ in length by at most one element; the first
        numel % local_size ranks get the longer ones, so with numel < local_size the last ones are empty.
        Example: with local_size 4, slice_range(10, 3) == (8, 10).
        """
        return split_range(numel, self.local_size, self.local_rank if local_rank is None else local_rank)

    def reduce_scatter(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum `tensor` over the local ranks and return this rank's slice of the sum.

        Args:
            tensor: contiguous CPU tensor (read as 1-D); same numel and dtype on every local rank.
            out: optional contiguous destination of the slice's length; default a fresh tensor. It may be
                this rank's slice of `tensor` itself (in place, saves an allocation), no other part of it.
        Returns:
            A tensor owned by the caller (`out` or a fresh one), never a view of shared memory. With
            local_size == 1 and no `out` it is `tensor` itself, flattened, without a copy. fp16/bf16 are
            added in their own dtype (one rounding per add), integers wrap.
        Raises:
            LocalInputError on every local rank if any passed a bad or mismatching tensor (usable after);
            TransportError / BpsTimeoutError if a peer died, left or is late (the LocalComm is then broken).
        Example: `lo, hi = lc.slice_range(x.numel()); lc.reduce_scatter(x, out=x[lo:hi])`.
        """
        return finish(self.reduce_scatter_steps(tensor, out=out))

    def reduce_scatter_steps(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None,
                             patience: float | None = None) -> Steps:  # fmt: skip
        """`reduce_scatter` as steps (`Steps`): with `patience`, it pauses if its peers have not all arrived at
        its first meeting within that many seconds, so that the caller may hand the rest to another thread."""
        call = self._begin()
        problem = _tensor_problem(tensor, "tensor")
        if problem is None and out is not None:
            problem = _tensor_problem(out, "out")
            if problem is None and out.dtype != tensor.dtype:
                problem = f"out has dtype {out.dtype}, tensor {tensor.dtype}"
            if problem is None and out.numel() != self._len(tensor.numel(), self.local_rank):
                problem = f"out has {out.numel()} elements; this rank's slice has {self._len(tensor.numel())}"
        if self.local_size == 1:
            self._raise_if(problem, "reduce_scatter", call)
            return tensor.view(-1) if out is None else out.view(-1).copy_(tensor.view(-1))
        ok = problem is None
        numel, dtype = (tensor.numel(), tensor.dtype) if ok else (0, torch.float32)
        with self._failure_guard():
            L, me = self.local_size, self.local_rank
            bounds = self._bounds(numel)
            lo_me, hi_me = bounds[me]
            result = torch.empty(hi_me - lo_me, dtype=dtype) if out is None or not ok else out.view(-1)
            layout = self._layout(dtype)
            chunk, x = layout.rs_chunk, tensor.view(-1) if ok else None
            rounds = max(1, -(-(bounds[0][1] - bounds[0][0]) // chunk))  # slice 0 is the longest
            for j in range(rounds):
                k = self._round + 1
                h = k % 2  # this round's half of the data area
                if j == 0:
                    self._board.write_desc(k, call, _REDUCE_SCATTER, DTYPE_CODES[dtype], numel, 0 if ok else 1)
                if ok:  # my chunk of every destination's slice -> my block, one region per destination
                    for d, (region, (lo, hi)) in enumerate(zip(layout.rs_out[h], bounds, strict=True)):
                        lo += j * chunk
                        if lo < hi and (d != me or L > 2):  # with 2 ranks my own part is read from x
                            n = min(hi - lo, chunk)
                            region[:n].copy_(x[lo : lo + n])
                yield from self._meet(k, "reduce_scatter", call, j, rounds, patience)
                if j == 0:
                    self._agree(k, call, _REDUCE_SCATTER, problem)
                lo = lo_me + j * chunk
                if lo < hi_me:  # everyone's contribution to my slice's chunk, in rank order
                    n = min(hi_me - lo, chunk)
                    if L > 2:  # one strided (L, n) view: a single pass for torch.sum
                        parts = layout.rs_in[h][:, :n]
                    else:  # a plain add either way; skipping my own staging copy saves a pass
                        mine, theirs = x[lo : lo + n], layout.rs_in[h][1 - me, :n]
                        parts = (mine, theirs) if me == 0 else (theirs, mine)
                    _reduce.local_sum(parts, result[j * chunk : j * chunk + n])
        return result

    def all_gather(self, slice_: torch.Tensor, out: torch.Tensor) -> None:
        """Write every local rank's slice into `out`, so that every rank holds the full tensor.

        Args:
            slice_: this rank's slice, of length `slice_range(out.numel())`; may be that slice of `out`
                itself (in place: saves a copy).
            out: contiguous CPU tensor, same numel and dtype on every local rank; unspecified on error.
        Raises: as reduce_scatter.
        Example: `lc.all_gather(x[lo:hi], x)` after the in-place reduce_scatter above.
        """
        finish(self.all_gather_steps(slice_, out))

    def all_gather_steps(self, slice_: torch.Tensor, out: torch.Tensor, *, patience: float | None = None,
                         failed: bool = False) -> Steps:  # fmt: skip
        """`all_gather` as steps, pausing as `reduce_scatter_steps` does. `failed`: this rank's collective failed before
        its all-gather, so it has no slice to give: it meets its peers, and every rank raises LocalPeerFailedError
        (peers would otherwise wait for it until their timeout)."""
        call = self._begin()
        problem = _tensor_problem(out, "out") or _tensor_problem(slice_, "slice_")
        if problem is None and slice_.dtype != out.dtype:
            problem = f"slice_ has dtype {slice_.dtype}, out {out.dtype}"
        if problem is None and slice_.numel() != self._len(out.numel()):
            problem = (f"slice_ has {slice_.numel()} elements; this rank's slice of {out.numel()} elements "
                       f"is {self.slice_range(out.numel())}")  # fmt: skip
        if self.local_size == 1:
            self._raise_if(problem, "all_gather", call)
            raise_if_peer_failed(f"{self._who()}: all_gather call #{call}", failed, [])
            if slice_.data_ptr() != out.data_ptr():
                out.view(-1).copy_(slice_.view(-1))
            return
        ok = problem is None and not failed
        numel, dtype = (out.numel(), out.dtype) if ok else (0, torch.float32)
        flag = 2 if failed else 0 if problem is None else 1  # the descriptor's input error: failed, invalid input
        with self._failure_guard():
            me = self.local_rank
            bounds = self._bounds(numel)
            y = out.view(-1) if ok else None
            mine = slice_.view(-1) if ok else None
            layout = self._layout(dtype)
            chunk = layout.ag_chunk
            rounds = max(1, -(-(bounds[0][1] - bounds[0][0]) // chunk))
            for j in range(rounds):
                k = self._round + 1
                blocks = layout.ag_blocks[k % 2]  # one block per source rank in this round's half
                if j == 0:
                    self._board.write_desc(k, call, _ALL_GATHER, DTYPE_CODES[dtype], numel, flag)
                lo = j * chunk
                if ok and lo < mine.numel():
                    n = min(mine.numel() - lo, chunk)
                    blocks[me][:n].copy_(mine[lo : lo + n])
                yield from self._meet(k, "all_gather", call, j, rounds, patience)
                if j == 0:
                    self._agree(k, call, _ALL_GATHER, problem, failed)
                    lo_me, hi_me = bounds[me]
                    if mine.data_ptr() != y[lo_me:hi_me].data_ptr():  # not already in place
                        y[lo_me:hi_me].copy_(mine)
                for p, (lo, hi) in enumerate(bounds):
                    lo += j * chunk
                    if p != me and lo < hi:
                        n = min(hi - lo, chunk)
                        y[lo : lo + n].copy_(blocks[p][:n])

    def close(self) -> None:
        """Leave: mark this rank CLOSED, unmap the segment. Idempotent; peers still mid-call get an error."""
        if self._closed:
            return
        self._closed = True
        if self._board is not None and self._broken is None:
            self._board.set_state(State.CLOSED)
        self._release()
        if self._segment is not None:
            self._segment.unlink()  # normally gone already; covers a set-up that never completed
            self._segment.close()
            self._segment = None

    def __enter__(self) -> LocalComm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"LocalComm(node={self.node_id!r}, local_rank={self.local_rank}/{self.local_size}, "
                f"capacity={self.capacity_bytes}, wait={self.wait_mode}, calls={self._calls})")  # fmt: skip

    # -- internals -------------------------------------------------------------------------------
    def _who(self) -> str:
        return f"node {self.node_id!r} local rank {self.local_rank}"

    def _len(self, numel: int, local_rank: int | None = None) -> int:
        lo, hi = self.slice_range(numel, local_rank)
        return hi - lo

    def _begin(self) -> int:
        if self._closed:
            raise BpsError(f"{self._who()}: LocalComm is closed")
        if self._broken is not None:
            raise BpsError(f"{self._who()}: LocalComm is unusable after an earlier error: {self._broken}")
        self._calls += 1
        return self._calls

    def _raise_if(self, problem: str | None, op: str, call: int) -> None:
        if problem is not None:
            raise LocalInputError(f"{self._who()}: {op} call #{call}: {problem}")

    def _bounds(self, numel: int) -> list[tuple[int, int]]:
        return [split_range(numel, self.local_size, r) for r in range(self.local_size)]

    def _layout(self, dtype: torch.dtype) -> _Layout:
        if dtype not in self._views:
            self._views[dtype] = _Layout(self._data, self._half, self._block, self.local_size, self.local_rank, dtype)
        return self._views[dtype]

    def _meet(self, k: int, op: str, call: int, j: int, rounds: int, patience: float | None) -> Steps:
        """Arrive at round k and wait for every peer; in a call's first round with `patience`, pause (yield) first
        if they have not all come within that many seconds."""
        self._board.arrive(k)
        what = f"{op} call #{call} round {j + 1}/{rounds}"
        if j == 0 and patience is not None and not self._board.wait_all(k, what, within=patience):
            yield  # whoever resumes the call waits for them
        self._board.wait_all(k, what)
        self._round = k

    def _agree(self, k: int, call: int, op: int, problem: str | None, failed: bool = False) -> None:
        """Check every rank's descriptor of this call; raise the same LocalInputError (or LocalPeerFailedError) on
        every rank."""
        where = f"{self._who()}: {_OP_NAMES[op]} call #{call}"
        descs = [self._board.read_desc(p, k) for p in range(self.local_size)]
        if problem is not None:
            raise LocalInputError(f"{where}: {problem}")
        bad = [p for p, d in enumerate(descs) if d[4] == 1]
        if bad:
            raise LocalInputError(f"{where}: local rank(s) {bad} passed invalid input (their errors say why)")
        raise_if_peer_failed(where, failed, [p for p, d in enumerate(descs) if d[4] == 2])
        if any(d != descs[0] for d in descs):
            seen = "; ".join(f"rank {p}: {_OP_NAMES.get(d[1], d[1])} call #{d[0]} {_DTYPE_OF.get(d[2])} numel={d[3]}"
                             for p, d in enumerate(descs))  # fmt: skip
            raise LocalInputError(f"{where}: local ranks disagree ({seen})")

    @contextlib.contextmanager
    def _failure_guard(self):
        """Mark this LocalComm broken on any failure but an agreed LocalInputError or LocalPeerFailedError, and
        re-raise."""
        try:
            yield
        except (LocalInputError, LocalPeerFailedError):
            raise
        except BaseException as e:
            self._abort(e)
            raise

    def _abort(self, error: BaseException) -> None:
        self._broken = f"{type(error).__name__}: {error}"
        if self._board is not None:
            self._board.set_state(State.ABORTED)

    def _release(self) -> None:
        self._views.clear()
        self._data = None
        if self._board is not None:
            self._board.close()
            self._board = None


class _Layout:
    """Typed views of the data area for one dtype, built once: both halves, as rows ready to slice.

    A half holds one block per source rank. Reduce-scatter splits each block into one region per
    destination rank (`rs_chunk` elements each); all-gather uses whole blocks (`ag_chunk` elements).
    """

    def __init__(self, data: torch.Tensor, half: int, block: int, local_size: int, me: int, dtype: torch.dtype):
        L, es = local_size, torch.empty(0, dtype=dtype).element_size()
        self.ag_chunk = block // es
        self.rs_chunk = block // L // _ALIGN * _ALIGN // es
        halves = [data[h * half : (h + 1) * half].view(dtype) for h in (0, 1)]
        rs = [torch.as_strided(t, (L, L, self.rs_chunk), (self.ag_chunk, self.rs_chunk, 1)) for t in halves]
        self.rs_out = [[rs[h][me, dst] for dst in range(L)] for h in (0, 1)]  # my region for each destination
        self.rs_in = [rs[h][:, me, :] for h in (0, 1)]  # (L, rs_chunk): every source's region for me
        self.ag_blocks = [[t[src * self.ag_chunk : (src + 1) * self.ag_chunk] for src in range(L)] for t in halves]
