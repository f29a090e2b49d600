"""Shared by the CUDA tests: which device they run on, and why they skip.

The tests in tests/gpu/ carry the `cuda` marker and run on `cuda:0` when torch sees a GPU. Elsewhere they skip
with a one-line reason, so `make test` on a CPU machine collects and skips them in well under a second.
Two CPU dry runs check the tests' own logic where no GPU exists (they are not GPU results):
- TRITON_INTERPRET=1 runs the kernel tests on CPU tensors under Triton's interpreter;
- TORCH_BPS_TEST_DEVICE=cpu runs the backend, hook and DDP tests on CPU tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

DRY_RUN_ENV = "TORCH_BPS_TEST_DEVICE"


def _no_gpu_reason() -> str:
    build = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return f"no CUDA device (torch {torch.__version__}, {build}): run `make gpu-test` on a GPU machine"


def kernel_device() -> str | None:
    """cuda:0; else cpu when the Triton interpreter is on (a dry run); else None."""
    if torch.cuda.is_available():
        return "cuda:0"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


def collective_device() -> str | None:
    """cuda:0; else cpu when TORCH_BPS_TEST_DEVICE=cpu (a dry run); else None."""
    if torch.cuda.is_available():
        return "cuda:0"
    return "cpu" if os.environ.get(DRY_RUN_ENV) == "cpu" else None


def requires(device: str | None) -> list:
    """The marks of a CUDA test module: `cuda`, and a skip with its reason when there is no device to run on."""
    return [pytest.mark.cuda, pytest.mark.skipif(device is None, reason=_no_gpu_reason())]


def on_device(t: torch.Tensor, device: str) -> bool:
    return t.device.type == torch.device(device).type
