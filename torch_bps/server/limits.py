"""Memory limits of a summation server: what one frame, one job and the whole server may make it hold.

A server holds, per key, at most two live rounds (the job's window W with backup workers), each one tensor of
the key's size (cpp_ext/server/rounds.h; an fp16 or bf16 SUM key also an fp32 accumulator per round, twice its
size), at most one waiting PULL per worker and round, and a little metadata.
That is known the moment a key is declared, so the book charges it then: INIT of a key that would take its job
past the job's quota, or the server past its bound, is refused with OVER_QUOTA before anything is allocated.
HELLO of a new job is charged a fixed cost the same way, and a job nobody has sent anything for `job_lease` seconds is
forgotten, which gives its charge back. What the book does not see is bounded at the socket: a frame over
`max_frame_bytes` drops its connection before it is read (ZMQ_MAXMSGSIZE), at most `queue_messages`
messages wait per connection (ZMQ_RCVHWM). Nothing queues between the socket and the summation: the
server's loop thread sums each push as it reads it.

May import: the standard library, torch_bps.wire and torch_bps.errors.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from torch_bps.errors import ProtocolError
from torch_bps.wire import DTYPES, Mode, Status

# What the server holds besides round data, per thing, rounded up so the book never undercounts: a key's
# declaration, its rounds' bookkeeping and their table slots; a waiting pull's identity frame and header.
JOB_OVERHEAD = 4096
KEY_OVERHEAD = 1024
PULL_OVERHEAD = 512
FRAME_SLACK = 4096  # a frame's header and CURVE's box around the payload, on top of the payload


def _physical_memory() -> int:
    """This machine's memory, or the container's limit (cgroup v2 memory.max) if lower."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 8 << 30
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            memory = min(memory, int(limit))
    except OSError:
        pass
    return memory


@dataclass(frozen=True)
class Limits:
    """The bounds of one server. Every field has a bps-server flag (`--max-frame-bytes`...)."""

    # Largest frame read from a peer. The runtime sends partitions of at most BPS_PARTITION_BYTES
    # (4,096,000 by default; the engine may choose smaller ones): 16 MiB leaves room for raising it 4x.
    max_frame_bytes: int = 16 << 20
    # Everything the server may hold for all jobs together (round data and metadata, as charged).
    max_memory_bytes: int = 0  # 0: half of this machine's memory
    # What one job may hold; 0: max_memory_bytes.
    job_quota_bytes: int = 0
    # A job with no request for this long is forgotten (its keys, rounds and charge).
    job_lease_seconds: float = 3600.0
    # HELLO may declare at most this many workers (a round holds one waiting pull per worker).
    max_workers: int = 4096
    # Messages that may wait, per connection, before the server stops reading that connection.
    queue_messages: int = 32
    # A job every worker of which is lost (its connection dropped) is forgotten after this many seconds
    # without a request, long before the lease: nobody is left to finish its rounds.
    lost_job_seconds: float = 60.0

    def resolved(self) -> Limits:
        """Return a copy with the 0 ("default") fields filled in."""
        memory = self.max_memory_bytes or _physical_memory() // 2
        return Limits(
            self.max_frame_bytes, memory, self.job_quota_bytes or memory, self.job_lease_seconds,
            self.max_workers, self.queue_messages, self.lost_job_seconds,
        )  # fmt: skip

    def check(self) -> None:
        """Raise ValueError naming the first field out of range."""
        for name in ("max_frame_bytes", "max_memory_bytes", "job_quota_bytes", "max_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must not be negative")
        if self.job_lease_seconds <= 0 or self.lost_job_seconds <= 0 or self.queue_messages < 1:
            raise ValueError(f"job_lease_seconds={self.job_lease_seconds}, queue_messages={self.queue_messages}")


# SUM keys of these dtype codes are summed in an fp32 accumulator per live round (cpp_ext/server/sums.h).
WIDENED_DTYPES = tuple(code for code, dtype in DTYPES.items() if dtype.itemsize == 2 and dtype.is_floating_point)


def key_charge(nbytes: int, num_workers: int, window: int = 2, dtype: int = 0, mode: int = Mode.SUM,
               dense_bytes: int = 0) -> int:  # fmt: skip
    """Return the most a key of nbytes can make the server hold: `window` live rounds (the job's; 2 without backup
    workers), a waiting pull per worker each, and for an fp16/bf16 SUM key an fp32 accumulator (twice nbytes) each;
    a compressed key (dense_bytes > 0) an fp32 accumulator of dense_bytes per round and its residual."""
    accumulators = window * 2 * nbytes if mode == Mode.SUM and dtype in WIDENED_DTYPES else 0
    accumulators += (window + 1) * dense_bytes
    return window * nbytes + accumulators + KEY_OVERHEAD + window * num_workers * PULL_OVERHEAD


class MemoryBook:
    """Charges of every job against its quota and the server's bound, and when each job was last heard.

    Used by the server's loop thread only. Example:
        book = MemoryBook(Limits(max_memory_bytes=1 << 30).resolved()); book.add_job(7); book.add_key(7, 4096, 2)
    """

    def __init__(self, limits: Limits):
        self.limits = limits
        self.total = 0
        self._charged: dict[int, int] = {}
        self._seen: dict[int, float] = {}

    def add_job(self, job_id: int) -> None:
        """Charge a new job; raise ProtocolError(OVER_QUOTA) if the server is full."""
        self._take(job_id, JOB_OVERHEAD, f"HELLO of job {job_id:#x}")
        self._seen[job_id] = time.monotonic()

    def add_key(self, job_id: int, nbytes: int, num_workers: int, window: int = 2, dtype: int = 0,
                mode: int = Mode.SUM, dense_bytes: int = 0) -> None:  # fmt: skip
        """Charge a new key of job_id; raise ProtocolError(OVER_QUOTA) past the job's quota or the server's bound."""
        charge = key_charge(nbytes, num_workers, window, dtype, mode, dense_bytes)
        self._take(job_id, charge, f"INIT of {nbytes} bytes for job {job_id:#x}")

    def touch(self, job_id: int, now: float) -> None:
        """Record a request of job_id at time.monotonic() `now`."""
        self._seen[job_id] = now

    def idle(self, job_id: int) -> float:
        """Seconds since job_id's last request."""
        return time.monotonic() - self._seen.get(job_id, time.monotonic())

    def charged(self, job_id: int) -> int:
        return self._charged.get(job_id, 0)

    def expired(self) -> list[int]:
        """Return the jobs not heard from for longer than the lease."""
        oldest = time.monotonic() - self.limits.job_lease_seconds
        return [job for job, seen in self._seen.items() if seen < oldest]

    def release(self, job_id: int) -> None:
        """Give back everything charged to job_id."""
        self.total -= self._charged.pop(job_id, 0)
        self._seen.pop(job_id, None)

    def _take(self, job_id: int, amount: int, what: str) -> None:
        job = self._charged.get(job_id, 0)
        if job + amount > self.limits.job_quota_bytes:
            raise ProtocolError(
                Status.OVER_QUOTA,
                f"{what}: the job would hold {job + amount} bytes, over its quota of {self.limits.job_quota_bytes}",
            )
        if self.total + amount > self.limits.max_memory_bytes:
            # Says nothing about other jobs: only that this server is full.
            raise ProtocolError(Status.OVER_QUOTA, f"{what}: this server is at its memory bound; retry elsewhere")
        self._charged[job_id] = job + amount
        self.total += amount
