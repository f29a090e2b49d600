"""What a summation server knows of one job: its workers, where each was last heard from, and which were lost.

The control plane (server.py) keeps one Job per job id: who said HELLO, from where, when each worker was
last heard from, and how a lost one was lost, which is how its errors name a worker.

May import: the standard library only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Job:
    """What a server knows of one job's workers."""

    num_workers: int
    workers: set[int] = field(default_factory=set)
    peers: dict[int, str] = field(default_factory=dict)  # worker -> the address its last HELLO came from
    last_seen: dict[int, float] = field(default_factory=dict)  # worker -> time.monotonic() of its last request
    lost: dict[int, str] = field(default_factory=dict)  # worker -> how it was lost

    def describe(self, worker: int) -> str:
        """Name a worker the way an operator finds it: index, address, when it was last heard from."""
        if worker in self.lost:
            return self.lost[worker]
        if worker not in self.peers:
            return f"worker {worker} (never said HELLO to this server)"
        heard = f"last request {time.monotonic() - self.last_seen[worker]:.1f} s ago"
        return f"worker {worker} (at {self.peers[worker]}, {heard})"
