"""The way back down the intra-machine hierarchy: dst = cast(scale * src, dst.dtype) for one or more dst.

One read of `src` (e.g. the summed fp16 partition pulled from a server), computed in fp32, written into
every destination (e.g. the fp32 gradient bucket of each local rank: the local all-gather). One fused pass
on CUDA tensors (Triton), cache-blocked torch passes on CPU tensors; `scale_cast_reference` is the plain
torch statement of the result.
May import: torch, triton and the standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from triton_kernels import _common


@triton.jit
def _scale_cast_kernel(src_ptr, dst_ptrs, n_elements, scale, BLOCK_SIZE: tl.constexpr):
    # dst_ptrs is a tuple of pointers to one dtype: its length is part of the specialization (unrolled).
    pid = tl.program_id(axis=0)
    # 64-bit offsets: a bucket may hold more than 2**31 elements.
    offsets = pid.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(src_ptr + offsets, mask=mask).to(tl.float32)
    out = (x * scale).to(dst_ptrs[0].dtype.element_ty)
    for i in tl.static_range(len(dst_ptrs)):
        tl.store(dst_ptrs[i] + offsets, out, mask=mask)


def scale_cast_into(
    src: torch.Tensor,
    dsts: torch.Tensor | Sequence[torch.Tensor],
    *,
    scale: float = 1.0,
    backend: str = "auto",
) -> torch.Tensor | Sequence[torch.Tensor]:
    """Write cast(src * scale) into every destination, computing in fp32: the local unpack/all-gather.

    Args:
        src: contiguous 1-D float32, float16 or bfloat16 tensor.
        dsts: one tensor, or 1 to 8 tensors sharing one dtype; each contiguous, 1-D, with src's numel and
            device. A destination may be `src` itself (same dtype: scale in place); destinations must not
            overlap each other.
        scale: multiplies src in fp32 before the cast (e.g. 1 / world_size to average).
        backend: "auto" (Triton on CUDA, torch ops elsewhere), "torch", or "triton" (on CPU tensors only
            when TRITON_INTERPRET=1 was set before triton_kernels was imported: for tests).

    Returns:
        `dsts`, as given.

    Example:
        >>> summed = torch.full((4,), 8.0, dtype=torch.float16)
        >>> buckets = [torch.empty(4) for _ in range(2)]
        >>> _ = scale_cast_into(summed, buckets, scale=1 / 8)
        >>> buckets[1]
        tensor([1., 1., 1., 1.])
    """
    targets = [dsts] if isinstance(dsts, torch.Tensor) else dsts
    _common.check_tensor("src", src)
    _common.check_tensors("dsts", targets)
    _common.check_same_device_and_numel("dsts[0]", targets[0], "src", src)
    named = [(f"dsts[{i}]", t) for i, t in enumerate(targets)]
    for i, (name, dst) in enumerate(named):
        _common.check_no_overlap((name, dst), [("src", src)], may_alias=("src",))
        _common.check_no_overlap((name, dst), named[i + 1 :])
    scale = _common.check_scale(scale)
    backend = _common.resolve_backend(backend, src.device, _scale_cast_kernel)
    if src.numel() == 0:
        return dsts
    if backend == "triton":
        _launch(src, targets, scale)
    else:
        _scale_cast_torch(src, targets, scale)
    return dsts


def _launch(src: torch.Tensor, dsts: Sequence[torch.Tensor], scale: float) -> None:
    n_elements = src.numel()
    grid = (triton.cdiv(n_elements, _common.BLOCK_SIZE),)
    with _common.device_guard(src):
        # No FMA to fuse here; pinning fusion off keeps the rounding the reference's, whatever triton's default.
        _scale_cast_kernel[grid](
            src, tuple(dsts), n_elements, scale, BLOCK_SIZE=_common.BLOCK_SIZE, enable_fp_fusion=False
        )


@torch.no_grad()
def _scale_cast_torch(src: torch.Tensor, dsts: Sequence[torch.Tensor], scale: float) -> None:
    # Compute into dsts[0] chunk by chunk, then copy the chunk (still in cache) to the other destinations.
    first = dsts[0]
    # torch.mul(src, scale, out=...) computes in src's dtype (with an fp32 scale): the fp32 result the
    # reference rounds once only when src is fp32 or already of the destination's dtype.
    one_pass = scale == 1.0 or src.dtype == torch.float32 or src.dtype == first.dtype
    scratch = None
    if not one_pass and first.dtype != torch.float32:  # fp16 <-> bf16: widen into fp32 scratch first
        scratch = torch.empty(_common.chunk_size(src.numel(), src.device), dtype=torch.float32, device=src.device)
    for part in _common.chunks(src.numel(), src.device):
        s, d = src[part], first[part]
        if scale == 1.0:
            d.copy_(s)  # copy_ converts through fp32: one rounding, like the reference
        elif one_pass:
            torch.mul(s, scale, out=d)
        elif scratch is None:  # widening into fp32 is exact; scale there
            d.copy_(s)
            d.mul_(scale)
        else:
            acc = scratch[: d.numel()]
            acc.copy_(s)
            torch.mul(acc, scale, out=d)
        for other in dsts[1:]:
            other[part].copy_(d)


def scale_cast_reference(src: torch.Tensor, scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Return cast(fp32(src) * scale, dtype) in plain torch (dtype defaults to src's).

    Example:
        >>> scale_cast_reference(torch.full((2,), 3.0, dtype=torch.float16), 0.5, torch.float32)
        tensor([1.5000, 1.5000])
    """
    return (src.to(torch.float32) * scale).to(src.dtype if dtype is None else dtype)
