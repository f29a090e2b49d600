"""The summation service: a CPU server that only adds. `bps-server --help` for the command line.

May import: the standard library, torch, pyzmq, torch_bps._C, torch_bps.address, torch_bps.wire, torch_bps.errors,
torch_bps.registry, torch_bps.security and torch_bps.server.
"""

from torch_bps.server.server import SummationServer

__all__ = ["SummationServer"]
