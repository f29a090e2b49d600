"""Every Triton kernel compiles ahead of time for real GPUs (sm_80, sm_90), with no GPU present.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` runs the whole pipeline (TTIR -> TTGIR
-> LLVM IR -> PTX -> cubin, the last with the ptxas triton ships in triton/backends/nvidia/bin), so a kernel
that would not compile on a GPU fails here. Compiled: every (dtypes, tensor count) the entry points can
launch, with the specialization a launch on freshly allocated tensors gets (16-byte aligned pointers and
a numel divisible by 16), plus the other specializations triton may pick at launch (unaligned, a numel
of 1 or past 2**31) on one combination. Each run compiles into a fresh cache directory.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from triton_kernels import BLOCK_SIZE, MAX_TENSORS, SUPPORTED_DTYPES
from triton_kernels.broadcast import _scale_cast_kernel
from triton_kernels.reduce import _sum_scale_cast_kernel

CAPABILITIES = (80, 90)
TRITON_TYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
ALIGNED = [["tt.divisibility", 16]]
DTYPE_PAIRS = list(itertools.product(SUPPORTED_DTYPES, SUPPORTED_DTYPES))
COUNTS = range(1, MAX_TENSORS + 1)


@pytest.fixture(scope="module", autouse=True)
def fresh_triton_cache(tmp_path_factory):
    """Compile for real every run, and leave ~/.triton alone."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton_cache")))
        yield


def _sum_source(in_dtype, out_dtype, n_inputs, variant="aligned"):
    """The kernel sum_scale_cast launches: (in_ptrs, out_ptr, n_elements, scale, BLOCK_SIZE)."""
    signature = {
        "in_ptrs": (f"*{TRITON_TYPE[in_dtype]}",) * n_inputs,
        "out_ptr": f"*{TRITON_TYPE[out_dtype]}",
        "n_elements": "i64" if variant == "i64" else "i32",
        "scale": "fp32",
        "BLOCK_SIZE": "constexpr",
    }
    pointer_paths = [(0, i) for i in range(n_inputs)] + [(1,)]
    return _source(_sum_scale_cast_kernel, signature, pointer_paths, variant)


def _broadcast_source(src_dtype, dst_dtype, n_dsts, variant="aligned"):
    """The kernel scale_cast_into launches: (src_ptr, dst_ptrs, n_elements, scale, BLOCK_SIZE)."""
    signature = {
        "src_ptr": f"*{TRITON_TYPE[src_dtype]}",
        "dst_ptrs": (f"*{TRITON_TYPE[dst_dtype]}",) * n_dsts,
        "n_elements": "i64" if variant == "i64" else "i32",
        "scale": "fp32",
        "BLOCK_SIZE": "constexpr",
    }
    pointer_paths = [(0,)] + [(1, i) for i in range(n_dsts)]
    return _source(_scale_cast_kernel, signature, pointer_paths, variant)


def _source(kernel, signature, pointer_paths, variant):
    constexprs = {"BLOCK_SIZE": BLOCK_SIZE}
    attrs = {}
    if variant in ("aligned", "i64"):
        attrs = {path: ALIGNED for path in pointer_paths} | {(2,): ALIGNED}
    elif variant == "numel_1":  # triton turns an int argument equal to 1 into a constant
        signature = signature | {"n_elements": "constexpr"}
        constexprs["n_elements"] = 1
    return ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)


def _compile(source, capability):
    kernel = compile(source, target=GPUTarget("cuda", capability, 32), options={"enable_fp_fusion": False})
    ptx, cubin = kernel.asm["ptx"], kernel.asm["cubin"]
    assert f".target sm_{capability}" in ptx
    assert f".entry {source.name}" in ptx
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000
    return ptx


def _name(dtype):
    return TRITON_TYPE[dtype]


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c}")
@pytest.mark.parametrize("n_inputs", COUNTS, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("in_dtype,out_dtype", DTYPE_PAIRS, ids=[f"{_name(a)}_to_{_name(b)}" for a, b in DTYPE_PAIRS])
def test_sum_scale_cast_compiles(in_dtype, out_dtype, n_inputs, capability):
    ptx = _compile(_sum_source(in_dtype, out_dtype, n_inputs), capability)
    # Aligned launches must move 128 bits per access: the kernel is bound by memory bandwidth.
    assert "ld.global.v4" in ptx


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c}")
@pytest.mark.parametrize("n_dsts", COUNTS, ids=lambda n: f"N{n}")
@pytest.mark.parametrize("src_dtype,dst_dtype", DTYPE_PAIRS, ids=[f"{_name(a)}_to_{_name(b)}" for a, b in DTYPE_PAIRS])
def test_scale_cast_compiles(src_dtype, dst_dtype, n_dsts, capability):
    ptx = _compile(_broadcast_source(src_dtype, dst_dtype, n_dsts), capability)
    assert "ld.global.v4" in ptx


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: f"sm{c}")
@pytest.mark.parametrize("variant", ["unaligned", "i64", "numel_1"])
def test_launch_specializations_compile(variant, capability):
    _compile(_sum_source(torch.bfloat16, torch.float16, 3, variant), capability)
    _compile(_broadcast_source(torch.float16, torch.bfloat16, 3, variant), capability)
