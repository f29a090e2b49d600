"""The summation service: a CPU server that only adds. `bps-server --help` for the command line.

May import: the standard library, torch, pyzmq, torch_bps.wire and torch_bps.errors.
"""

from torch_bps.server.server import SummationServer

__all__ = ["SummationServer"]
