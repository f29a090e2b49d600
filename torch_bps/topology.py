"""Where this rank sits: its machine (node) and its index among the machine's local ranks.

torchrun exports LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node) and GROUP_WORLD_SIZE (nodes); tests
and other launchers may set the same variables to emulate several machines on one. Without them every
rank is taken to share one machine.
May import: the standard library and torch_bps.errors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torch_bps.errors import ConfigError


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int

    @classmethod
    def from_env(cls, rank: int, world_size: int, env=os.environ) -> Topology:
        """Resolve the topology of `rank` in a job of `world_size` ranks from torchrun's variables."""
        if "LOCAL_WORLD_SIZE" not in env:
            return cls(rank, world_size, rank, world_size, 0, 1)
        try:
            local_size = int(env["LOCAL_WORLD_SIZE"])
            local_rank = int(env.get("LOCAL_RANK", rank % local_size))
            node_rank = int(env.get("GROUP_RANK", rank // local_size))
            num_nodes = int(env.get("GROUP_WORLD_SIZE", world_size // local_size))
        except ValueError as e:
            raise ConfigError(f"bad torchrun topology variable: {e}") from None
        topo = cls(rank, world_size, local_rank, local_size, node_rank, num_nodes)
        if local_size * num_nodes != world_size or rank != node_rank * local_size + local_rank:
            raise ConfigError(
                f"inconsistent topology for rank {rank}: LOCAL_RANK={local_rank} LOCAL_WORLD_SIZE={local_size} "
                f"GROUP_RANK={node_rank} GROUP_WORLD_SIZE={num_nodes} with world size {world_size} "
                "(torch_bps needs the same number of ranks on every machine, ranks numbered machine by machine)"
            )
        return topo
