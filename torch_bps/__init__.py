"""torch_bps: BytePS rebuilt PyTorch-native. Gradient summation on CPU summation servers.

Front doors: `dist.init_process_group("byteps")`, `ddp.register_comm_hook(state, torch_bps.bps_hook)`,
`bps-server`, and the data-plane `Client` used by both.
"""

from torch_bps.config import Config
from torch_bps.errors import BpsError, BpsTimeoutError, ConfigError, ProtocolError, ServerError, TransportError

__all__ = ["BpsError", "BpsTimeoutError", "Config", "ConfigError", "ProtocolError", "ServerError", "TransportError"]
