"""CUDA tensors through host memory: pinned staging, a side copy stream, events, a fused write-back.

The summation service works on host memory, so a GPU tensor makes a round trip: device -> pinned host
buffer (on a copy stream that first waits for the producer's stream) -> push_pull -> back to the device,
where the Triton kernel `triton_kernels.scale_cast_into` casts and copies the sum into the caller's
tensor on the copy stream. The caller's stream is then made to wait for the copy stream, so the Future
(created with `devices=[...]`) records its completion event after the data is in place.

NOT RUN ON A GPU: this project has none. The code follows torch's documented stream semantics; the
Triton kernel it calls is compiled for sm_80/sm_90 in CI (tests/test_triton_aot.py) and checked under
TRITON_INTERPRET=1, and `staging_kind` (the dispatch) is unit-tested.
May import: torch, triton_kernels.
"""

from __future__ import annotations

import threading

import torch

_streams: dict[torch.device, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def staging_kind(device: torch.device, contiguous: bool) -> str:
    """How a tensor is staged: "in_place" (CPU, contiguous: summed in its own storage), "host_copy"
    (CPU, strided: a contiguous copy), or "device" (CUDA: pinned host buffer and copy stream)."""
    if device.type == "cuda":
        return "device"
    if device.type != "cpu":
        raise TypeError(f"tensors on {device} are not supported by the 'byteps' backend (cpu and cuda only)")
    return "in_place" if contiguous else "host_copy"


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    with _streams_lock:
        if device not in _streams:
            _streams[device] = torch.cuda.Stream(device=device)
        return _streams[device]


class DeviceStaging:
    """One CUDA tensor's flat pinned host copy (`flat`) and the way back (`write_back`)."""

    def __init__(self, real: torch.Tensor, load: bool):
        self._real = real
        self._device = real.device
        self._stream = _copy_stream(real.device)
        self.flat = torch.empty(real.numel(), dtype=real.dtype, pin_memory=True)
        if load:
            # The copy must see everything the caller's stream wrote (e.g. the backward pass's gradients).
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._stream):
                self.flat.copy_(real.reshape(-1), non_blocking=True)
            real.record_stream(self._stream)  # the caller may free it before the copy ran
            self._stream.synchronize()  # push_pull reads the host buffer next: wait for this copy only

    def write_back(self) -> None:
        from triton_kernels import scale_cast_into  # imports triton: only on the CUDA path

        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            summed = self.flat.to(self._device, non_blocking=True)  # pinned: truly asynchronous
            if self._real.is_contiguous():
                scale_cast_into(summed, self._real.view(-1))
            else:
                self._real.copy_(summed.view(self._real.shape))
        # The thread completing the Future records its event on its current stream: order it after the copy.
        torch.cuda.current_stream(self._device).wait_stream(self._stream)
