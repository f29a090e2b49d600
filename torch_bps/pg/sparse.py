"""Sparse COO tensors for all_reduce: rows as ids, the union of every rank's rows, and the coalesced sum.

A sparse tensor of `sparse_dim` sparse dimensions is a set of rows: each index column, linearized row-major
over the sparse sizes, is a row id, and each row holds prod(dense sizes) values. The backend sums one in three
collectives (`BackendBPS._sparse_allreduce`): every rank's `Meta` gathered, every rank's row ids gathered, then
the values placed at their rows' positions in the sorted union of all ranks' rows (`compact`) and that
(union x row) buffer summed like a dense tensor; `expand` makes the coalesced result, the one gloo returns.

Buffers are padded to `padded` sizes (2^k or 3 x 2^(k-1)): a key is planned per buffer size, so this bounds the
keys (and the servers' memory) a training run makes, for at most a third more bytes.

May import: torch, torch_bps.pg.staging.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from torch_bps.pg.staging import BACKEND, check_tensor, real

MAX_DIMS = 64  # torch's limit on a tensor's dimensions
META_LEN = 4 + MAX_DIMS  # nnz, sparse_dim, dtype, ndim, then the sizes


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
