"""Reference model, not run by the server: versioned rounds of one key, closed by distinct workers, bounded memory.

A SUM key's round adds whole-key pushes (fp16 and bf16 in an fp32 accumulator, rounded once to the key's dtype
when the round closes: docs/protocol.md, "Summation"); a COPY key's round writes each push's bytes at its offset (an
all-gather or broadcast: bytes are copied, never summed, so every bit pattern and any dtype survives), and
at close its pushes must tile the key exactly, or the round fails (bytes nobody wrote must never be sent).
The rules are docs/protocol.md's: round r closes when every worker of the job pushed it; a duplicate
push is acknowledged and ignored; pulls of r are answered once r closed (a worker's second pull of a round
still waiting is refused); r is freed once every worker pulled it; at most two rounds are alive (floor and
floor + 1). A round that a lost worker has not pushed can never close: its pulls fail with WORKER_LOST,
naming the worker. A pull that waited longer than it
allows fails with ROUND_TIMEOUT, naming the workers that have not pushed (a stalled rank).

With b backup workers (Job.backups), a floating SUM round closes once n - b workers pushed it, its sum scaled by
n / contributors (so that every reader's division by n gives the contributors' mean); later pushes of it are
dropped and counted; up to the job's window W of rounds are alive, and a pull of a closed round r is answered
once r <= floor + W - 2 (the worker's next push then lands inside the window); a round frees once every worker
that is not lost pulled it; and a round can never close once more than b workers were lost before pushing it.

The server runs the native rounds (cpp_ext/server/rounds.h); this module states the same rules in Python and
nothing in torch_bps imports it: tests/server/test_server_rounds.py drives both with the same random sequences
and compares every answer. Nothing here locks: one thread uses a KeyRounds.

May import: the standard library, torch, torch_bps.wire, torch_bps.errors and torch_bps.server.job.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from torch_bps.errors import ProtocolError
from torch_bps.server.job import Job
from torch_bps.wire import Mode, Status


@dataclass
class Round:
    pushed: set[int] = field(default_factory=set)
    pulled: set[int] = field(default_factory=set)
    waiting: list = field(default_factory=list)  # (token, worker, deadline) of pulls that came before it closed
    failure: str | None = None  # a worker's push was refused: the round can only end in an error
    # The sum so far: the first push as it arrived (a writable view of the received frame, no copy), into
    # which later pushes are added in place. No allocation: fresh big buffers cost page faults that ran
    # the add at a third of add_'s speed, and an out-of-place add moves a third more memory.
    total: torch.Tensor | None = None
    # What total's memory is, when it is a received message (the first push's): the server sends that message
    # itself as the reply, which shares the bytes by reference count instead of handing pyzmq a tensor to
    # track until libzmq releases it. Opaque here: never read, only kept beside total.
    source: object = None
    # fp16/bf16: the sum so far in fp32, from the round's second push until it closes and is rounded into total.
    wide: torch.Tensor | None = None
    pieces: list[tuple[int, int, int]] = field(default_factory=list)  # COPY: (offset, length, worker) pushed
    closed: bool = False
    contributors: int = 0  # how many pushes the result holds
    ahead: int = 0  # set when answered: how many later rounds of the key had closed (the reply's `behind`)


# SUM keys of these dtypes add in fp32 and round once, so the result does not depend on how many workers pushed
# or in which order, beyond fp32's own rounding.
WIDENED = (torch.float16, torch.bfloat16)

Result = Round | str  # a closed round (its total is the result), or why it failed


@dataclass
class SumCounters:
    bytes_summed: int = 0
    sum_ns: int = 0
    late_pushes: int = 0


class KeyRounds:
    """The live rounds of one (job, key)."""

    def __init__(self, name: str, job: Job, counters: SumCounters, mode: Mode = Mode.SUM, nbytes: int = 0,
                 dtype: torch.dtype | None = None):  # fmt: skip
        self.name = name  # "job J key K", for error messages
        self.job = job
        self.mode = mode
        self.dtype = dtype  # the key's (a backup round closes early only when it is floating)
        self.nbytes = nbytes  # the key's size (COPY rounds allocate it)
        self.num_workers = job.num_workers
        self.floor = 0  # every round below floor has been freed
        self.rounds: dict[int, Round] = {}
        self.released: list[tuple[object, Result]] = []
        self._counters = counters

    def refuse(self, worker: int, rnd: int, reason: str) -> list[object]:
        """Record that worker's push of rnd was refused (wrong size or dtype): the round fails for everyone.

        Return the waiting pulls, to be answered with the failure now: without this, the workers whose
        pushes were accepted would wait for a sum that can never be right. The failed round still closes and
        frees as usual (the refused push counts as pushed, each error-answered pull as pulled), so later
        rounds of the key work again once the workers agree.
        """
        r = self._live(rnd, worker, "push")
        r.failure = r.failure or reason
        self._mark_pushed(r, worker)
        waiting = [token for token, _, _ in r.waiting]
        r.pulled.update(puller for _, puller, _ in r.waiting)
        r.waiting.clear()
        self._free_done()
        return waiting

    def take_released(self) -> list[tuple[object, Result]]:
        """Return the (pull token, result) pairs that freeing a round released (the window moved) since last called."""
        released, self.released = self.released, []
        return released

    def push(
        self, worker: int, rnd: int, data: torch.Tensor, offset: int = 0, source: object = None
    ) -> list[tuple[object, Result]]:
        """Fold worker's data into round rnd (COPY: its bytes at `offset`). Return the (pull token, result) pairs
        that can now be answered: the closed Round, or a str saying why it failed (COPY pushes that do not tile
        the key). `source`: the received message `data` views, kept as Round.source if data becomes the total.

        Raises ProtocolError(BAD_ROUND) for a freed round or one too far ahead.
        """
        r = self._live(rnd, worker, "push")
        if r.failure is not None:
            self._mark_pushed(r, worker)
            self._free_done()
            raise ProtocolError(Status.KEY_MISMATCH, f"push of {self.name} round {rnd} by worker {worker}: {r.failure}")
        if worker in r.pushed:
            return []  # a resent push: acknowledged, never added twice
        if r.closed:  # a backup round closed without it: dropped, never half-added
            r.pushed.add(worker)
            self._counters.late_pushes += 1
            return []
        if self.mode == Mode.COPY:
            self._write(r, data, offset, worker, source)
        else:
            self._add(r, data, source)
        r.pushed.add(worker)
        if len(r.pushed) < self._needed():
            return []
        self._close(r, rnd)
        ready = []
        if r.failure is not None or self._released(rnd):  # else its pulls wait for the window (_free_done)
            ready = [(token, self._release(r, rnd, puller)) for token, puller, _ in r.waiting]
            r.waiting.clear()
        self._free_done()
        return ready

    def pull(self, worker: int, rnd: int, token: object, deadline: float = math.inf) -> Round | None:
        """Return round rnd if it closed (the caller answers now with its total), else queue token and return None.

        A queued pull still waiting at `deadline` (time.monotonic()) is returned by `expire`.
        """
        r = self._live(rnd, worker, "pull")
        if r.failure is not None:
            r.pulled.add(worker)
            self._free_done()
            raise ProtocolError(Status.KEY_MISMATCH, f"pull of {self.name} round {rnd} by worker {worker}: {r.failure}")
        if not r.closed or not self._released(rnd):
            if not r.closed and (lost := self._lost_before(r)):
                raise ProtocolError(Status.WORKER_LOST, f"pull of {self.name} round {rnd} by worker {worker}: {lost}")
            if any(waiting == worker for _, waiting, _ in r.waiting):  # keeps waiting pulls <= workers per round
                raise ProtocolError(
                    Status.BAD_ROUND,
                    f"pull of {self.name} round {rnd} by worker {worker}: this worker's pull of it already waits",
                )
            r.waiting.append((token, worker, deadline))
            return None
        result = self._release(r, rnd, worker)
        self._free_done()
        return result

    def fail_lost(self) -> list[tuple[object, str]]:
        """Return (pull token, message) for every waiting pull of a round that a lost worker has not pushed."""
        failed = []
        if self.job.backups:
            self._free_done()  # a lost worker's pulls are no longer awaited
        for rnd, r in self.rounds.items():
            if r.waiting and not r.closed and (lost := self._lost_before(r)):
                failed += [
                    (token, f"pull of {self.name} round {rnd} by worker {w}: {lost}") for token, w, _ in r.waiting
                ]
                r.waiting.clear()
        return failed

    def expire(self, now: float) -> list[tuple[object, str]]:
        """Return (pull token, message) for every waiting pull past its deadline, naming who has not pushed."""
        expired = []
        for rnd, r in self.rounds.items():
            if not any(deadline <= now for _, _, deadline in r.waiting):
                continue
            if r.closed:  # waiting for the window: name who holds the oldest round
                expired += [(token, f"pull of {self.name} round {rnd} by worker {w}: {self._behind(rnd)}")
                            for token, w, deadline in r.waiting if deadline <= now]  # fmt: skip
                r.waiting = [item for item in r.waiting if item[2] > now]
                continue
            missing = [w for w in range(self.num_workers) if w not in r.pushed]
            who = "; ".join(self.job.describe(w) for w in missing)
            keep = []
            for token, worker, deadline in r.waiting:
                if deadline > now:
                    keep.append((token, worker, deadline))
                    continue
                message = (
                    f"pull of {self.name} round {rnd} by worker {worker}: the round is still waiting for "
                    f"{len(missing)} of {self.num_workers} workers to push it (stalled or hung?): {who}"
                )
                expired.append((token, message))
            r.waiting = keep
        return expired

    @property
    def has_waiting(self) -> bool:
        return any(r.waiting for r in self.rounds.values())

    def _mark_pushed(self, r: Round, worker: int) -> None:
        r.pushed.add(worker)
        if r.failure is not None and len(r.pushed) >= self._needed():
            r.closed = True  # a failed round closes (and frees) as usual

    def _needed(self) -> int:
        """Pushes that close a round: n, or n - b for a floating SUM key (a mean can be rescaled)."""
        floating = self.dtype is not None and self.dtype.is_floating_point
        return self.num_workers - self.job.backups if self.mode == Mode.SUM and floating else self.num_workers

    @property
    def _window(self) -> int:
        return self.job.window if self.job.backups else 2

    def _released(self, rnd: int) -> bool:
        return not self.job.backups or rnd + 2 <= self.floor + self.job.window

    def _close(self, r: Round, rnd: int) -> None:
        r.closed, r.contributors = True, len(r.pushed)
        if self.mode == Mode.COPY:
            r.failure = self._untiled(r, rnd)
        else:
            if r.contributors < self.num_workers and r.total is not None:
                # A backup round: the sum of c pushes, scaled to stand for n (every reader divides by n for a mean);
                # a 16-bit one in fp32, before its one rounding.
                (r.wide if r.wide is not None else r.total).mul_(self.num_workers / r.contributors)
            self._round_once(r)

    def _release(self, r: Round, rnd: int, worker: int) -> Result:
        """Count worker's pull of closed round rnd and return what answers it."""
        r.pulled.add(worker)
        r.ahead = sum(1 for later, x in self.rounds.items() if later > rnd and x.closed)
        return r.failure or r

    def _lost_before(self, r: Round) -> str | None:
        """If more workers were lost before pushing round r than it may do without (so it can never close), say
        how the first was lost."""
        lost = [how for w, how in self.job.lost.items() if w not in r.pushed]
        if len(lost) > self.num_workers - self._needed():
            return f"the round can never close: {lost[0]} before pushing it"
        return None

    def _behind(self, rnd: int) -> str:
        """Why closed round rnd's pull waits: the workers that have not pulled the oldest live round."""
        oldest = self.rounds.get(self.floor)
        missing = [w for w in range(self.num_workers)
                   if w not in self.job.lost and (oldest is None or w not in oldest.pulled)]  # fmt: skip
        who = "; ".join(self.job.describe(w) for w in missing)
        return (
            f"the round closed, but its result waits until every worker pulled round {self.floor} (a worker may "
            f"fall at most {self.job.window - 1} rounds behind): {len(missing)} have not: {who} (round {rnd})"
        )

    def _live(self, rnd: int, worker: int, what: str) -> Round:
        if rnd < self.floor:
            raise ProtocolError(
                Status.BAD_ROUND,
                f"{what} of {self.name} round {rnd} by worker {worker}: round already completed and freed "
                f"(oldest live round is {self.floor})",
            )
        if rnd >= self.floor + self._window:
            most = "two" if self._window == 2 else str(self._window)
            raise ProtocolError(
                Status.BAD_ROUND,
                f"{what} of {self.name} round {rnd} by worker {worker}: at most {most} rounds may be alive and the "
                f"oldest live round is {self.floor} (every worker must pull round {self.floor} first)",
            )
        r = self.rounds.get(rnd)
        if r is None:  # not setdefault: that would build a Round on every push and pull
            r = self.rounds[rnd] = Round()
        return r

    def _add(self, r: Round, data: torch.Tensor, source: object) -> None:
        if r.total is None:
            r.total, r.source = data, source
            return
        start = time.perf_counter_ns()
        if data.dtype not in WIDENED:
            r.total.add_(data)
        elif r.wide is None:
            r.wide = r.total.float().add_(data)
        else:
            r.wide.add_(data)  # widened exactly, added in fp32
        self._counters.sum_ns += time.perf_counter_ns() - start
        self._counters.bytes_summed += data.numel() * data.element_size()

    def _round_once(self, r: Round) -> None:
        """A closed fp16/bf16 round: its fp32 sum, rounded to nearest (ties to even), becomes the result."""
        if r.wide is None:
            return  # one push is its own sum, exactly
        start = time.perf_counter_ns()
        r.total.copy_(r.wide)
        self._counters.sum_ns += time.perf_counter_ns() - start
        r.wide = None

    def _write(self, r: Round, data: torch.Tensor, offset: int, worker: int, source: object) -> None:
        data = data.view(torch.uint8)
        r.pieces.append((offset, data.numel(), worker))
        if r.total is None and offset == 0 and data.numel() == self.nbytes:
            # A broadcast's one push: kept as it arrived, no copy (as a SUM round's first push).
            r.total, r.source = data, source
            return
        if r.total is None:
            r.total = torch.empty(self.nbytes, dtype=torch.uint8)  # every byte is written, or the round fails
        if data.numel():
            r.total[offset : offset + data.numel()].copy_(data)

    def _untiled(self, r: Round, rnd: int) -> str | None:
        """Say why round rnd's COPY pushes do not cover every byte of the key exactly once, or None if they do."""
        end = 0
        for offset, length, _ in sorted(p for p in r.pieces if p[1]):
            if offset != end:
                break
            end += length
        else:
            if end == self.nbytes:
                return None
        pieces = ", ".join(f"worker {w}: [{o}, {o + n})" for o, n, w in sorted(r.pieces))
        return (f"the pushes of {self.name} round {rnd} do not tile its {self.nbytes} bytes (each byte written by "
                f"exactly one worker): {pieces}")  # fmt: skip

    def _free_done(self) -> None:
        # Rounds free in order: a later round fully pulled waits until the ones before it are freed.
        while (r := self.rounds.get(self.floor)) is not None and r.closed:
            # A lost worker will not pull: with backups the job goes on without it.
            gone = {w for w in self.job.lost if w not in r.pulled} if self.job.backups else set()
            if len(r.pulled) + len(gone) < self.num_workers:
                break
            del self.rounds[self.floor]
            self.floor += 1
            for rnd, later in self.rounds.items():  # the window moved: pulls of closed rounds inside it are answered
                if later.closed and later.waiting and self._released(rnd):
                    self.released += [(token, self._release(later, rnd, w)) for token, w, _ in later.waiting]
                    later.waiting.clear()
