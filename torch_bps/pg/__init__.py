"""Building blocks of the "byteps" front doors (the ProcessGroup in torch_bps.process_group, and bps_hook).

- `staging`: the caller's tensors seen as the flat CPU buffers a Runtime sums (`HostCopy`), and the sums copied back;
  dtype and layout checks with errors that name the op and the backend.
- `work`: `launch` (sum a collective's buffers, finish, complete), `launch_on_device` (a CUDA sum through the path
  torch_bps.device chose), `LaunchOrder` and the C++ Work handed to torch.
- `sparse`: sparse COO sums at the bytes of their rows. `p2p`: point-to-point, all-to-all and monitored barriers on
  an internal gloo group.

May import: torch, torch_bps.wire (the dtype table), torch_bps.errors, torch_bps.futures, torch_bps.engine.exchange
(what a collective exchanges), torch_bps.device (the CUDA path); torch_bps._C only inside functions. Never
torch_bps.runtime: a Runtime is passed in, so this package loads without the C++ client.
"""
