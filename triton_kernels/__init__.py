"""Kernels for the local work of the intra-machine hierarchy (BytePS paper, section 4.2).

On the way up, the local ranks' gradients of one partition are summed, averaged and cast for the wire
(`sum_scale_cast`); on the way down, the partition pulled from the servers is scaled, cast back to the
bucket dtype and written into every local rank's tensor (`scale_cast_into`). Each entry point runs a
Triton kernel on CUDA tensors and vectorized torch ops on CPU tensors; beside each kernel sits its plain
torch reference, which the tests hold both paths to.

May import: torch, triton and the standard library only — never torch_bps (the engine imports us).
"""

from triton_kernels._common import BLOCK_SIZE, MAX_TENSORS, SUPPORTED_DTYPES
from triton_kernels.broadcast import scale_cast_into, scale_cast_reference
from triton_kernels.reduce import sum_scale_cast, sum_scale_cast_reference

__all__ = [
    "BLOCK_SIZE",
    "MAX_TENSORS",
    "SUPPORTED_DTYPES",
    "scale_cast_into",
    "scale_cast_reference",
    "sum_scale_cast",
    "sum_scale_cast_reference",
]
