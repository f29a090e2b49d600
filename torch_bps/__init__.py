"""torch_bps: BytePS rebuilt PyTorch-native. Gradient summation on CPU summation servers.

Front doors: `dist.init_process_group("byteps")`, `ddp.register_comm_hook(state, torch_bps.bps_hook)`,
`bps-server`, and the data-plane `Client` used by both. Importing registers the "byteps" backend.
"""

from torch_bps.asynchronous import AsyncTraining
from torch_bps.backup import BackupWorkers
from torch_bps.config import Config
from torch_bps.errors import BpsError, BpsTimeoutError, ConfigError, ProtocolError, ServerError, TransportError
from torch_bps.hook import BpsHookState, bps_hook
from torch_bps.process_group import BackendBPS, implementation, rebalance, register_backend

# The version, in one place: setup.py reads this line without importing the package (which needs torch).
__version__ = "0.1.0"

register_backend()

__all__ = ["AsyncTraining", "BackendBPS", "BackupWorkers", "BpsError", "BpsHookState", "BpsTimeoutError", "Config",
           "ConfigError", "ProtocolError", "ServerError", "TransportError", "bps_hook", "implementation", "rebalance",
           "register_backend", "__version__"]  # fmt: skip
