"""The CUDA path: how a CUDA tensor's collective reaches the summation service and comes back.

- `paths`: the paths of a float sum (`PATHS`: the device local stages, or a partition at a time through pinned
  memory), `choose`, the one place that picks the first whose `enabled()` holds (None: the host path), and
  `DeviceLocalStage`, a machine's local stages on the device.
- `comm`: `DeviceLocalComm`, reduce-scatter and all-gather among a machine's local ranks in device memory shared
  through CUDA IPC (the Triton sum), and `open_local_stage`, which decides alike on every local rank whether it can.
- `pinned`: CUDA tensors through pinned host memory on a side stream: whole (`DeviceStaging`, what every other CUDA
  collective takes) or a partition at a time through a bounded pool (`PartitionPipeline`, `PinnedPool`).
- `cuda_ops`: every stream, event, copy and device Future the path makes, behind `CudaOps` (tests record them).

The front doors (torch_bps.pg, torch_bps.hook) import this room; the engine and the runtime take its objects as
arguments and never import it (the runtime opens `comm`'s channels on first use).
May import: torch, torch.distributed, torch_bps.errors, torch_bps.futures, torch_bps.wire, torch_bps.local,
triton_kernels.
"""
