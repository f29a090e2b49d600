"""Where this rank sits (its machine and its index among the machine's local ranks), and what the launcher says
of the whole job: the one place torchrun's variables are read.

torchrun exports LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the node) and GROUP_WORLD_SIZE (nodes); tests
and other launchers may set the same variables to emulate several machines on one. Without them every
rank is taken to share one machine. RANK, WORLD_SIZE, MASTER_ADDR, TORCHELASTIC_RESTART_COUNT and
TORCHELASTIC_RUN_ID describe the job (Launch).
May import: the standard library and torch_bps.errors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torch_bps.errors import ConfigError


@dataclass(frozen=True)
class Launch:
    """What the launcher says of the whole job, read once per group (Runtime.create).

    rank, world_size: the process's place in the whole job (RANK, WORLD_SIZE), None where the launcher set none.
    master_addr: the store's host as the launcher named it (MASTER_ADDR), "" if unset.
    attempt: which of torchrun's restarts this is (TORCHELASTIC_RESTART_COUNT, "0" without torchrun): restarts reuse
        the store, so each attempt's keys are kept apart under it.
    run_id: names the job's shared-memory segments on a machine (TORCHELASTIC_RUN_ID, "job" without torchrun).
    Example: Launch.from_env({"RANK": "3", "WORLD_SIZE": "8"}).attempt == "0".
    """

    rank: int | None = None
    world_size: int | None = None
    master_addr: str = ""
    attempt: str = "0"
    run_id: str = "job"

    @classmethod
    def from_env(cls, env=os.environ) -> Launch:
        """Resolve the launcher's variables; a RANK or WORLD_SIZE that is not a number is a ConfigError."""

        def number(name: str) -> int | None:
            raw = env.get(name)
            try:
                return None if raw is None else int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not a number (set by the launcher)") from None

        return cls(number("RANK"), number("WORLD_SIZE"), env.get("MASTER_ADDR", ""),
                   env.get("TORCHELASTIC_RESTART_COUNT", "0"), env.get("TORCHELASTIC_RUN_ID", "job"))  # fmt: skip


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

    @classmethod
    def one_per_machine(cls, rank: int, world_size: int) -> Topology:
        """Every rank its own machine: a subgroup's topology, as torchrun's variables describe the whole job."""
        return cls(rank, world_size, 0, 1, rank, world_size)
