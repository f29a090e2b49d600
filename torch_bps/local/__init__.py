"""Intra-machine communication: the local ranks of a node reduce-scatter and all-gather through shared memory.

`LocalComm` (comm.py) is the public surface; shm.py keeps segment lifetime, sync.py the cross-process
rounds, reduce.py the one local-sum function a fused kernel can replace.
May import: torch, torch.distributed, torch_bps.errors, torch_bps.wire (the dtype codes), triton_kernels.
"""

from torch_bps.local.comm import LocalComm, LocalInputError, LocalPeerFailedError, split_range
from torch_bps.local.reduce import local_sum

__all__ = ["LocalComm", "LocalInputError", "LocalPeerFailedError", "local_sum", "split_range"]
