"""The sum of a sparse COO tensor over a group (`launch_sum`): gloo's coalesced result, at the bytes of the rows.

A sparse tensor of `sparse_dim` sparse dimensions is a set of rows: each index column, linearized row-major
over the sparse sizes, is a row id, and each row holds prod(dense sizes) values. One sum is two collectives:
every rank's `Meta` and row ids gathered (the ids in a second gather when they outgrow the caller's `Room`), then
the values placed at their rows' positions in the sorted union of all ranks' rows (`compact`) and that (union x
row) buffer summed like a dense tensor; `expand` makes the coalesced result, the one gloo returns. The "byteps"
backend's all_reduce and bps_hook use it.

Buffers are padded to `padded` sizes (2^k or 3 x 2^(k-1)): a key is planned per buffer size, so this bounds the
keys (and the servers' memory) a training run makes, for at most a third more bytes.

May import: torch, torch_bps.wire, torch_bps.engine.exchange, torch_bps.pg.staging, torch_bps.pg.work.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torch_bps.engine.exchange import Exchange
from torch_bps.pg.staging import BACKEND, as_bytes, check_tensor, real
from torch_bps.wire import Mode

MAX_DIMS = 64  # torch's limit on a tensor's dimensions
META_LEN = 4 + MAX_DIMS  # nnz, sparse_dim, dtype, ndim, then the sizes


# launch(transfers, result, device) -> the collective's Work; reduce(dtype, flat, op, finish) -> the Exchange of a sum.
Launch = Callable[[list[Exchange], object, "torch.device | None"], dist.Work]
Reduce = Callable[[torch.dtype, torch.Tensor, str, Callable[[], None]], Exchange]


@dataclass
class Room:
    """How many row ids the first gather of a sparse sum carries beside the shapes: room for the largest count of
    the caller's last sum and a quarter more, so that a run of similar sums gathers once, not twice. It comes from
    gathered counts, so it is the same on every rank that made the same calls."""

    rows: int = 0


def launch_sum(name: str, t: torch.Tensor, op: str, rank: int, world: int, launch: Launch, reduce: Reduce,
               result: object, room: Room) -> dist.Work:  # fmt: skip
    """Sum sparse `t` over the group into `t` (its coalesced sum, as gloo's): its rows' ids and every rank's shape
    gathered (waited for here), then the values of the rows any rank touched summed (the Work returned, its future
    holding `result`). The caller keeps other collectives from coming between these (a lock, or one thread) and
    keeps `room` for its next sum."""
    meta = check_sparse(name, t, op)
    src = t.detach().cpu()
    bad = out_of_range(src._indices(), meta.sizes[: meta.sparse_dim])
    src = src if bad else src.coalesce()
    mine = row_ids(src._indices(), meta.sizes[: meta.sparse_dim])
    meta = Meta(-1 if bad else mine.numel(), meta.sparse_dim, meta.dtype, meta.sizes)
    # Every rank learns what is wrong with any rank's tensor, and all refuse it alike: nobody waits.
    first = torch.full((META_LEN + room.rows,), -1, dtype=torch.int64)
    first[:META_LEN] = meta.encode()
    first[META_LEN : META_LEN + min(mine.numel(), room.rows)] = mine[: room.rows]
    gathered = _gather_now(first, rank, world, launch).view(world, first.numel())
    metas = gathered[:, :META_LEN]
    differ = [r for r in range(world) if not meta.same_shape(metas[r])]
    if differ:
        raise ValueError(f"{name}: a sparse tensor of size {list(meta.sizes)}, sparse_dim {meta.sparse_dim}, "
                         f"{meta.dtype} on rank {rank} and another size, sparse_dim or dtype on ranks {differ} "
                         f"('{BACKEND}' backend): every rank must pass the same")  # fmt: skip
    counts = metas[:, 0].tolist()
    if -1 in counts:
        raise ValueError(f"{name}: the sparse tensor of rank(s) {[r for r, n in enumerate(counts) if n < 0]} has "
                         f"indices outside its size {list(meta.sizes)} ('{BACKEND}' backend)")  # fmt: skip
    most = max(counts)
    every = gathered[:, META_LEN:]
    if most > room.rows:  # someone's ids did not all fit: gather them all
        ids = torch.full((padded(most),), -1, dtype=torch.int64)
        ids[: mine.numel()] = mine
        every = _gather_now(ids, rank, world, launch).view(world, ids.numel())
    room.rows = padded(most + most // 4)
    union = torch.cat([every[r, :n] for r, n in enumerate(counts)]).unique(sorted=True)
    summed = compact(src._values(), mine, union, padded(union.numel()))

    def finish() -> None:
        with torch.no_grad():
            t.copy_(expand(summed, union, meta).to(t.device))

    return launch([reduce(meta.dtype, summed, op, finish)], result, t.device)


def _gather_now(mine: torch.Tensor, rank: int, world: int, launch: Launch) -> torch.Tensor:
    """Every rank's `mine` (1-D, one shape on every rank) end to end, waited for: an all-gather of its bytes."""
    n = mine.numel()
    out = torch.empty(world * n, dtype=mine.dtype)
    out[rank * n : (rank + 1) * n] = mine
    size = n * mine.element_size()
    slots = [(r * size, (r + 1) * size) for r in range(world)]
    launch([Exchange(as_bytes(out), Mode.COPY, push=slots)], [out], None).wait()
    return out


@dataclass(frozen=True)
class Meta:
    """What every rank must agree on before its rows can be summed with the others', and its row count."""

    nnz: int  # -1: this rank's indices are out of range
    sparse_dim: int
    dtype: torch.dtype
    sizes: tuple[int, ...]

    def encode(self) -> torch.Tensor:
        """This rank's meta as META_LEN int64s (a fixed size, so every rank's gather has one shape)."""
        out = torch.full((META_LEN,), -1, dtype=torch.int64)
        dtype_id = zlib.crc32(str(self.dtype).encode())
        out[:4] = torch.tensor([self.nnz, self.sparse_dim, dtype_id, len(self.sizes)])
        out[4 : 4 + len(self.sizes)] = torch.tensor(self.sizes, dtype=torch.int64)
        return out

    def same_shape(self, encoded: torch.Tensor) -> bool:
        """Whether another rank's encoded meta has this one's sparse_dim, dtype and sizes."""
        return bool(torch.equal(encoded[1:], self.encode()[1:]))


def check_sparse(name: str, t: torch.Tensor, op: str) -> Meta:
    """Refuse what a sparse sum cannot carry, naming it; return the tensor's Meta (its nnz: 0 here). Out-of-range
    indices are not refused here but by every rank together (`out_of_range`), after the ranks' metas are gathered."""
    if t.layout != torch.sparse_coo:
        raise ValueError(f"{name}: {t.layout} tensors are not supported by the '{BACKEND}' backend "
                         f"(dense and sparse_coo only)")  # fmt: skip
    if op not in ("SUM", "AVG"):
        raise ValueError(f"{name}: ReduceOp.{op} of a sparse tensor is not supported by the '{BACKEND}' backend "
                         f"(SUM and AVG only: rows a rank does not hold are zeros)")  # fmt: skip
    if t.dtype == torch.bool:
        raise TypeError(f"{name}: sparse tensors of torch.bool are not supported by the '{BACKEND}' backend")
    check_tensor(name, t._values())
    return Meta(0, t.sparse_dim(), t.dtype, tuple(t.shape))


def out_of_range(indices: torch.Tensor, sizes: tuple[int, ...]) -> bool:
    """Whether an index (sparse_dim x nnz) lies outside `sizes` (torch does not check a sparse tensor's indices)."""
    if indices.numel() == 0:
        return False
    return bool((indices.min(dim=1).values < 0).any() or (indices.max(dim=1).values >= torch.tensor(sizes)).any())


def row_ids(indices: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """Each index column (sparse_dim x nnz) as one int64, row-major over `sizes`: coalesced order is id order."""
    ids = torch.zeros(indices.shape[1], dtype=torch.int64)
    for d, size in enumerate(sizes):
        ids.mul_(size).add_(indices[d])
    return ids


def row_indices(ids: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """The inverse of `row_ids`: a (len(sizes) x len(ids)) index tensor."""
    out = torch.empty(len(sizes), ids.numel(), dtype=torch.int64)
    rest = ids.clone()
    for d in reversed(range(len(sizes))):
        out[d] = rest % sizes[d]
        rest.div_(sizes[d], rounding_mode="floor")
    return out


def padded(n: int) -> int:
    """The smallest of 0, 1, 2, 3, 4, 6, 8, 12, 16, 24... (2^k or 3 x 2^(k-1)) that is at least `n`."""
    if n <= 2:
        return n
    p = 1 << (n - 1).bit_length()
    return 3 * p // 4 if 3 * p // 4 >= n else p


def compact(values: torch.Tensor, mine: torch.Tensor, union: torch.Tensor, rows: int) -> torch.Tensor:
    """A flat (rows x row width) buffer of `values`' real view, each row at its id's position in `union`, zeros
    elsewhere. `mine` are this rank's (sorted, distinct) row ids, `union` every rank's; rows >= len(union)."""
    vals = real(values)
    vals = vals.reshape(mine.numel(), math.prod(vals.shape[1:]))
    buf = torch.zeros(rows, vals.shape[1], dtype=vals.dtype)
    buf[torch.searchsorted(union, mine)] = vals
    return buf.view(-1)


def expand(summed: torch.Tensor, union: torch.Tensor, meta: Meta) -> torch.Tensor:
    """The coalesced sparse tensor whose rows are `union` with the first len(union) rows of `summed`."""
    dense = meta.sizes[meta.sparse_dim :]
    values = torch.zeros((union.numel(), *dense), dtype=meta.dtype)
    if values.numel():
        view = real(values).reshape(union.numel(), -1)
        view.copy_(summed.view(-1, view.shape[1])[: union.numel()])
    indices = row_indices(union, meta.sizes[: meta.sparse_dim])
    return torch.sparse_coo_tensor(indices, values, meta.sizes, is_coalesced=True, check_invariants=False)
