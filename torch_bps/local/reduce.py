"""The local sum: the one place where a node's L staged contributions are added.

`local_sum` receives the L contributions as one strided (L, n) view of the shared segment (each row
contiguous) and writes their sum into `out` in a single call. fp32 sums of more than two CPU rows (of two or
more CUDA ones) go through the fused kernel's entry point `triton_kernels.sum_scale_cast` (Triton on CUDA
tensors, torch on CPU ones); LocalComm looks `local_sum` up on this module at every call, so replacing the
attribute swaps it.
May import: torch and triton_kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# torch.sum(dim=0) over fp16/bf16 upcasts per element and ran ~4x slower than chained in-dtype adds
# here (2.6 vs 10 GB/s, one core); chained adds round after each add, as the summation server does.
_CHAINED = (torch.float16, torch.bfloat16)


def local_sum(parts: torch.Tensor | Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Write the sum of the rows of `parts` into out, in their dtype (integers wrap).

    Args:
        parts: an (L, n) view whose rows are contiguous and may lie far apart, or a sequence of L (n,)
            contiguous tensors; one row per local rank, in rank order.
        out: (n,) contiguous tensor of the same dtype. With two parts it may be either of them (an
            elementwise add in place); otherwise it must not overlap them.
    Example: `local_sum(torch.ones(3, 5), out := torch.empty(5))` -> out is all 3.
    """
    n_parts = len(parts)
    # Two rows need one add, rounded as the fused kernel rounds it: on CPU tensors its entry point's checks would
    # cost more than the add itself.
    if parts[0].dtype == torch.float32 and (3 <= n_parts <= 8 or (n_parts == 2 and out.is_cuda)):
        _fused_sum(parts, out)
    elif n_parts == 1:
        out.copy_(parts[0])
    elif n_parts == 2 or parts[0].dtype in _CHAINED or not isinstance(parts, torch.Tensor):
        torch.add(parts[0], parts[1], out=out)
        for i in range(2, n_parts):
            out.add_(parts[i])
    else:  # one pass: reads each row once, writes out once
        torch.sum(parts, dim=0, dtype=parts.dtype, out=out)


def _fused_sum(parts: torch.Tensor | Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """fp32 through the fused kernel's entry point (Triton on CUDA, cache-blocked torch on CPU: as fast as
    torch.add/sum here); fp16/bf16 stay on chained in-dtype adds, 3-4x faster on CPU than its fp32
    accumulation and rounded the way the summation server rounds."""
    from triton_kernels import sum_scale_cast  # imports triton: only when a machine has several ranks

    rows = list(parts.unbind(0)) if isinstance(parts, torch.Tensor) else list(parts)
    # The kernel may write over its first input only: put the row that `out` is (if any) first.
    mine = next((i for i, r in enumerate(rows) if r.data_ptr() == out.data_ptr()), 0)
    rows.insert(0, rows.pop(mine))
    sum_scale_cast(rows, out)
