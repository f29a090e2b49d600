"""The local sum: the one place where a node's L staged contributions are added.

`local_sum` is the swap point for a fused kernel (triton_kernels): it receives the L contributions as
one strided (L, n) view of the shared segment and writes their sum into `out` in a single call.
May import: torch only.
"""

from __future__ import annotations

import torch

# torch.sum(dim=0) over fp16/bf16 upcasts per element and ran ~4x slower than chained in-dtype adds
# here (2.6 vs 10 GB/s, one core); chained adds round after each add, as the summation server does.
_CHAINED = (torch.float16, torch.bfloat16)


def local_sum(parts: torch.Tensor, out: torch.Tensor) -> None:
    """Write parts.sum(0) into out, in parts' dtype (integers wrap).

    Args:
        parts: (L, n) view, rows possibly strided (one row per local rank, in rank order).
        out: (n,) contiguous tensor of parts' dtype; must not overlap parts.
    Example: `local_sum(torch.ones(3, 5), out := torch.empty(5))` -> out is all 3.
    """
    n_parts = parts.shape[0]
    if n_parts == 1:
        out.copy_(parts[0])
    elif n_parts == 2 or parts.dtype in _CHAINED:
        torch.add(parts[0], parts[1], out=out)
        for i in range(2, n_parts):
            out.add_(parts[i])
    else:  # one pass: reads each row once, writes out once
        torch.sum(parts, dim=0, dtype=parts.dtype, out=out)
