"""Draining a summation server (SIGTERM): take no new job, let the rounds in flight finish, then stop.

A draining server refuses the HELLO of a job it does not know, says "not ready" on /readyz, and keeps serving
the jobs it has until none of them has a round in flight; then it stops, and their workers, who see its
connections close, fail over to the servers that remain or to a standby (torch_bps/failover.py) with no round
to recover. A drain that outlasts its deadline stops anyway: the failover then finishes the open rounds.

The server cannot see a round's state from Python (the native core runs the rounds), but it can see the
counters: a worker sends each round's PUSH and then its PULL, pipelined on one connection, and the core counts
a PULL when it reads it. So a job whose pushes and pulls are equal has a pull for every push it sent, and
with no pull waiting (the core's `keys_waiting`) every one of those pulls was answered: no round is open.
A job none of whose requests came for `idle_after` seconds, or one that lost a worker, will not close its open
rounds here soon (nobody is pushing them, or they can never close): the drain does not wait for it.

May import: the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass

IDLE_AFTER_S = 2.0  # a job silent this long is not waited for


@dataclass(frozen=True)
class JobActivity:
    """What the drain reads of one job: its PUSH and PULL counts, seconds since its last request, a lost worker."""

    pushes: int
    pulls: int
    idle: float
    lost: bool


def quiet(jobs: dict[int, JobActivity], keys_waiting: int, idle_after: float = IDLE_AFTER_S) -> bool:
    """Return whether no job the drain waits for has a round in flight.

    keys_waiting: the keys with pulls waiting for their round to close, server-wide (the core cannot say whose).

    Example: `quiet({7: JobActivity(pushes=4, pulls=4, idle=0.1, lost=False)}, keys_waiting=0)` -> True.
    """
    live = [a for a in jobs.values() if a.idle < idle_after and not a.lost]
    return not live or (keys_waiting == 0 and all(a.pushes == a.pulls for a in live))
