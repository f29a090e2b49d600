"""What a summation server knows of one job: its workers, where each was last heard from, and which were lost.

The control plane (server.py) keeps one Job per job id: who said HELLO, from where, when each worker was
last heard from, and how a lost one was lost, which is how its errors name a worker.

A job may run with backup workers (its HELLO's `mode` = b, `rounds` = the window W of live rounds per key) or with
MODEL keys trained asynchronously (its HELLO's `round` = the staleness bound s; docs/protocol.md): every HELLO of the
job must say the same.

May import: the standard library, torch_bps.errors and torch_bps.wire.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from torch_bps.errors import ProtocolError
from torch_bps.wire import Header, Status

MAX_WINDOW = 64  # live rounds per key a job may ask for: each holds a key-sized result
UNBOUNDED = (1 << 64) - 1  # a HELLO's staleness bound that bounds nothing: fully asynchronous


def job_settings(h: Header) -> tuple[int, int, int]:
    """Return (backup workers, live rounds per key, staleness bound) a HELLO asks for; ProtocolError(JOB_MISMATCH) if
    they cannot be."""
    backups, window, staleness = h.backups, h.window or 2, h.staleness
    if backups and staleness:
        raise ProtocolError(Status.JOB_MISMATCH, f"HELLO of job {h.job_id:#x} from worker {h.worker}: {backups} backup "
                            f"workers and staleness {_bound(staleness)}: a job has one or the other")  # fmt: skip
    if backups and backups >= h.num_workers:
        raise ProtocolError(Status.JOB_MISMATCH, f"HELLO of job {h.job_id:#x} from worker {h.worker}: {backups} backup "
                            f"workers of {h.num_workers}: at least one worker must push every round")  # fmt: skip
    if not 2 <= window <= MAX_WINDOW or (window != 2 and not backups):
        raise ProtocolError(Status.JOB_MISMATCH, f"HELLO of job {h.job_id:#x} from worker {h.worker}: {window} live "
                            f"rounds per key: 2 without backup workers, 2 to {MAX_WINDOW} with")  # fmt: skip
    return backups, window, staleness


def _bound(staleness: int) -> str:
    return "unbounded" if staleness == UNBOUNDED else str(staleness)


@dataclass
class Job:
    """What a server knows of one job's workers."""

    num_workers: int
    backups: int = 0  # b: a floating SUM round closes once num_workers - b workers pushed it
    window: int = 2  # rounds alive per key
    staleness: int = 0  # s: a MODEL key's pull of round r waits until every worker pushed round r - s
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
