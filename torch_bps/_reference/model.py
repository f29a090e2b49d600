"""Reference model, not run by the server: a MODEL key, asynchronous training's running total on the servers.

The rules are docs/protocol.md's ("Asynchronous training"): every worker's pushes of the key are added, in the
worker's round order and exactly once each, into one total (zeros before the first); a push of a round the worker
already pushed is acknowledged and ignored, a push that skips a round is refused (BAD_ROUND). A pull of round r by
worker w is answered with a copy of the total once w's own push of r and every other worker's push of r - s are in
it (s: the job's staleness bound, Job.staleness; a lost worker holds nobody back). A refused push refuses that
worker's pull of that round only. A pull waiting past its deadline fails with ROUND_TIMEOUT, naming the workers
that hold it back.

The server runs the native rules (cpp_ext/server/model.cpp); tests/server/test_server_rounds.py drives both with
the same random sequences and compares every answer. Nothing here locks: one thread uses a ModelRounds.

May import: the standard library, torch, torch_bps.wire, torch_bps.errors, torch_bps.server.job and
torch_bps._reference.rounds.
"""

from __future__ import annotations

import math
import time

import torch

from torch_bps._reference.rounds import Result, Round, SumCounters
from torch_bps.errors import ProtocolError
from torch_bps.server.job import Job
from torch_bps.wire import Status


class ModelRounds:
    """The running total of one (job, key) of mode MODEL, with KeyRounds' interface."""

    floor = 0  # no rounds to free: the total is all there is

    def __init__(self, name: str, job: Job, counters: SumCounters, nbytes: int, dtype: torch.dtype):
        self.name, self.job, self.nbytes, self.dtype = name, job, nbytes, dtype
        self.total: torch.Tensor | None = None
        self.applied = [0] * job.num_workers  # each worker's rounds in the total
        self.waiting: list[tuple[object, int, int, float]] = []  # (token, worker, round, deadline)
        self.refused: dict[int, tuple[int, str]] = {}  # worker -> (round, why) of its refused push
        self.released: list[tuple[object, Result]] = []
        self._counters = counters

    def push(self, worker: int, rnd: int, data: torch.Tensor, offset: int = 0, source: object = None):
        """Add worker's push of rnd once; return the (pull token, result) pairs it lets go."""
        if rnd < self.applied[worker]:
            return []  # a resent push: acknowledged, never added twice
        if rnd > self.applied[worker]:
            raise ProtocolError(Status.BAD_ROUND, f"push of {self.name} round {rnd} by worker {worker}: its round "
                                f"{self.applied[worker]} was never pushed (a worker's pushes are added in order, each "
                                "once)")  # fmt: skip
        if self.total is None:
            self.total = data  # the first push as it arrived: the total starts at zero
        else:
            start = time.perf_counter_ns()
            self.total.add_(data)
            self._counters.sum_ns += time.perf_counter_ns() - start
            self._counters.bytes_summed += data.numel() * data.element_size()
        self.applied[worker] += 1
        self.refused.pop(worker, None)
        self._release()
        return self.take_released()

    def pull(self, worker: int, rnd: int, token: object, deadline: float = math.inf) -> Round | None:
        """Return a copy of the total if worker's pull of rnd may have it now, else queue token and return None."""
        what = f"pull of {self.name} round {rnd} by worker {worker}"
        if self.refused.get(worker, (None,))[0] == rnd:
            raise ProtocolError(Status.KEY_MISMATCH, f"{what}: {self.refused[worker][1]}")
        if rnd > self.applied[worker]:
            raise ProtocolError(Status.BAD_ROUND, f"{what}: this worker pushed only rounds below "
                                f"{self.applied[worker]} (a pull follows its own push)")  # fmt: skip
        if self._ready(rnd, worker):
            return self._snapshot()
        if any(w == worker for _, w, _, _ in self.waiting):  # keeps waiting pulls <= workers
            raise ProtocolError(Status.BAD_ROUND, f"{what}: this worker's pull of it already waits")
        self.waiting.append((token, worker, rnd, deadline))
        return None

    def refuse(self, worker: int, rnd: int, reason: str) -> list[object]:
        """Worker's push of rnd was refused: only its pull of rnd fails (the tokens returned), the others go on."""
        self.refused[worker] = (rnd, reason)
        failed = [t for t, w, r, _ in self.waiting if (w, r) == (worker, rnd)]
        self.waiting = [item for item in self.waiting if (item[1], item[2]) != (worker, rnd)]
        return failed

    def fail_lost(self) -> list[tuple[object, str]]:
        """A lost worker holds nobody back: its waiters' pulls are released (take_released); none fails."""
        self._release()
        return []

    def expire(self, now: float) -> list[tuple[object, str]]:
        expired, keep = [], []
        for token, worker, rnd, deadline in self.waiting:
            if deadline > now:
                keep.append((token, worker, rnd, deadline))
                continue
            message = f"pull of {self.name} round {rnd} by worker {worker}"
            if self.applied[worker] <= rnd:
                message += ": this worker's own push of it never arrived"
            else:
                need, s = rnd - self.job.staleness, self.job.staleness
                missing = [w for w in range(self.job.num_workers)
                           if w not in self.job.lost and self.applied[w] <= need]  # fmt: skip
                message += (f": it waits until every worker pushed round {need} (staleness {s}): {len(missing)} have "
                            f"not (stalled or hung?): " + "; ".join(self.job.describe(w) for w in missing))  # fmt: skip
            expired.append((token, message))
        self.waiting = keep
        return expired

    def take_released(self) -> list[tuple[object, Result]]:
        released, self.released = self.released, []
        return released

    @property
    def has_waiting(self) -> bool:
        return bool(self.waiting)

    def _slowest(self) -> float:
        alive = [n for w, n in enumerate(self.applied) if w not in self.job.lost]
        return min(alive) if alive else math.inf

    def _ready(self, rnd: int, worker: int) -> bool:
        s = self.job.staleness
        return self.applied[worker] > rnd and (s > rnd or self._slowest() >= rnd + 1 - s)

    def _snapshot(self) -> Round:
        # A copy: the total changes with the next push.
        total = torch.zeros(self.nbytes // self.dtype.itemsize, dtype=self.dtype) if self.total is None else self.total
        return Round(total=total.clone())

    def _release(self) -> None:
        keep = []
        for token, worker, rnd, deadline in self.waiting:
            if self._ready(rnd, worker):
                self.released.append((token, self._snapshot()))
            else:
                keep.append((token, worker, rnd, deadline))
        self.waiting = keep
