"""The worker-side engine: partitioning, placement, scheduling and the per-partition pipeline.

Front doors (the "byteps" ProcessGroup, bps_hook) call `PushPullEngine.push_pull`; the engine cuts the
tensor into partitions, reduces them among the machine's local workers, pushes/pulls them through the
C++ client to the summation servers, and copies the sums home; gathers move bytes the same way
without summing (engine/exchange.py).

May import: torch, torch_bps.config, torch_bps.errors, torch_bps.wire, torch_bps.client,
torch_bps.local, triton_kernels.
"""
