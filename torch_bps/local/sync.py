"""Cross-process synchronisation of a node's local ranks through control slots in the shared segment.

Each local rank owns one 256-byte slot: a 32-bit sequence counter (alone on its cache line), its state,
its pid and start time, and two operation descriptors. Only the owner writes its slot; every rank reads
every slot. A step is made of rounds numbered 1, 2, 3, ... and every round has the same shape:

    write my data into half (k % 2) of the data area  ->  arrive(k): seq = k, wake waiters
    wait_all(k): every peer's seq >= k                ->  read everyone's data from half (k % 2)

Why two halves suffice: a rank writing half h in round k has passed round k-1's wait, so every peer
arrived at k-1, i.e. finished reading round k-2, the last round that used half h. A fast rank is thus at
most one round ahead of the slowest reader and never overwrites data still being read. Descriptors are
double-buffered the same way.

Waiting: a rank first spins on the peer's counter for a few tens of microseconds, when every local rank
can have a core of its own (a peer on another core usually arrives within that, and sleeping then being
woken costs more than the spin); then, between polls, it sleeps on a futex (the peer's counter word,
woken by the peer's arrive) or, where futexes are unavailable or `wait_mode="poll"`, with an
exponential backoff of 20 us .. 1 ms. Every wait checks, at least every 50 ms, that the peer has not
closed, aborted or died (pid and start time from /proc, so a zombie or recycled pid counts as dead;
peers whose pid is not visible from here, in another pid namespace, are left to the timeout), and
gives up at its deadline. A wait may be given a shorter bound too, at which it returns without failing
(`wait_all(within=...)`: the caller then hands the rest of its call to another thread). Errors name the
node, this rank, the operation and round, and the peer.

Memory ordering: counters are aligned 32-bit stores from Python after the data copies returned, which
x86-64's total store order makes sufficient; a weakly ordered CPU would need a release fence here.

May import: the standard library, torch_bps.errors and torch_bps.local.shm only.
"""

from __future__ import annotations

import ctypes
import enum
import os
import platform
import struct
import sys
import time

from torch_bps.errors import BpsTimeoutError, TransportError
from torch_bps.local.shm import process_alive, process_start_time

CONTROL_OFFSET = 256  # the segment header lives below
SLOT_BYTES = 256
_SEQ, _STATE, _PID = 0, 64, 72  # byte offsets in a slot; at _PID: u64 pid, start time, pid namespace
_DESC = (128, 160)  # descriptor by round parity
DESC = struct.Struct("<QIIQI")  # call number, op, dtype code, numel, error code
_MASK, _HALF = 0xFFFFFFFF, 0x80000000
_CHECK_PERIOD = 0.05  # seconds between liveness checks, and the longest futex sleep
_SPIN = 50e-6  # seconds a wait polls before it sleeps, when the local ranks fit the cores


class State(enum.IntEnum):
    ATTACHING = 0
    READY = 1
    CLOSED = 2
    ABORTED = 3


def control_bytes(local_size: int) -> int:
    """Bytes taken by the header and the control slots of `local_size` ranks."""
    return CONTROL_OFFSET + local_size * SLOT_BYTES


def _pid_ns() -> int:
    """Return the inode of this process's pid namespace (0 if unknown): equal inodes, comparable pids."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _reached(seq: int, target: int) -> bool:
    # Counters wrap at 2**32; a peer is never more than a few rounds away, so compare modulo 2**32.
    return ((seq - target) & _MASK) < _HALF


class _Futex:
    """FUTEX_WAIT / FUTEX_WAKE on shared (non-private) words, through libc's syscall()."""

    _NR = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}

    @classmethod
    def available(cls) -> bool:
        return sys.platform.startswith("linux") and platform.machine().lower() in cls._NR

    def __init__(self):
        # FUTEX_WAIT sleeps, so it lets go of the GIL (CDLL); FUTEX_WAKE never blocks, so it keeps it (PyDLL): a
        # thread that lets go of the GIL for a syscall of a microsecond may wait a whole switch interval to get it
        # back while another thread of this process runs Python.
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._syscall_holding_gil = ctypes.PyDLL(None, use_errno=True).syscall
        for call in (self._syscall, self._syscall_holding_gil):
            call.restype = ctypes.c_long
        self._nr = ctypes.c_long(self._NR[platform.machine().lower()])
        self._wait_op, self._wake_op = ctypes.c_int(0), ctypes.c_int(1)  # FUTEX_WAIT, FUTEX_WAKE
        self._all = ctypes.c_int(0x7FFFFFFF)

    class _Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    def wait(self, addr: int, expected: int, timeout: float) -> None:
        """Sleep while *addr == expected, at most `timeout` s; spurious returns are fine (callers re-check)."""
        ts = self._Timespec(int(timeout), int((timeout % 1.0) * 1e9))
        self._syscall(
            self._nr, ctypes.c_void_p(addr), self._wait_op, ctypes.c_uint32(expected), ctypes.byref(ts), None, 0
        )

    def wake(self, addr: int) -> None:
        self._syscall_holding_gil(self._nr, ctypes.c_void_p(addr), self._wake_op, self._all, None, None, 0)


class Board:
    """The control slots of one segment, seen by local rank `rank`.

    Args:
        buf: the segment's mmap (slots start at CONTROL_OFFSET).
        local_size, rank, node_id: who we are; node_id only appears in error messages.
        timeout: the longest any single wait may take, in seconds.
        wait_mode: "futex", "poll", or "auto" (futex where available).
    """

    def __init__(self, buf, local_size: int, rank: int, node_id: str, timeout: float, *,
                 wait_mode: str = "auto"):  # fmt: skip
        if wait_mode not in ("auto", "futex", "poll"):
            raise ValueError(f"wait_mode must be 'auto', 'futex' or 'poll', not {wait_mode!r}")
        if wait_mode == "futex" and not _Futex.available():
            raise ValueError(f"futex waits are not available on {sys.platform}/{platform.machine()}")
        self._buf = buf
        self.local_size, self.rank, self.node_id, self.timeout = local_size, rank, node_id, timeout
        self._words = memoryview(buf)[: control_bytes(local_size)].cast("I")
        self._seq_index = [(CONTROL_OFFSET + p * SLOT_BYTES + _SEQ) // 4 for p in range(local_size)]
        self._futex = _Futex() if wait_mode != "poll" and _Futex.available() else None
        if self._futex is not None:
            self._anchor = ctypes.c_char.from_buffer(buf)  # pins the mapping's address while we use it
            base = ctypes.addressof(self._anchor)
            self._seq_addr = [base + CONTROL_OFFSET + p * SLOT_BYTES + _SEQ for p in range(local_size)]
        self.wait_mode = "futex" if self._futex is not None else "poll"
        # With more local ranks than cores a spinning waiter holds the core its peer needs to arrive.
        self._spin = _SPIN if local_size <= len(os.sched_getaffinity(0)) else 0.0
        self._watch = [False] * local_size  # whose liveness we check: see find_visible_peers

    # -- own slot --------------------------------------------------------------------------------
    def _slot(self, p: int) -> int:
        return CONTROL_OFFSET + p * SLOT_BYTES

    def announce(self) -> None:
        """Record this process (pid, start time, pid namespace) in its slot, mark it READY; seq starts at 0."""
        me = os.getpid()
        struct.pack_into("<QQQ", self._buf, self._slot(self.rank) + _PID, me, process_start_time(me) or 0, _pid_ns())
        self._words[self._seq_index[self.rank]] = 0
        self.set_state(State.READY)

    def find_visible_peers(self) -> list[int]:
        """Decide, once every rank announced, which peers' liveness we can watch; return the others.

        A peer in another pid namespace (e.g. another container sharing /dev/shm) has a pid we cannot
        see, or one that names an unrelated process here: waits on it rely on the timeout alone.
        """
        mine = _pid_ns()
        self._watch = [p != self.rank and mine != 0 and self._pid_ns_of(p) == mine for p in range(self.local_size)]
        return [p for p in range(self.local_size) if p != self.rank and not self._watch[p]]

    def set_state(self, state: State) -> None:
        self._words[(self._slot(self.rank) + _STATE) // 4] = int(state)
        if self._futex is not None:  # wake peers sleeping on us so they notice promptly
            self._futex.wake(self._seq_addr[self.rank])

    def state(self, p: int) -> State:
        return State(self._words[(self._slot(p) + _STATE) // 4])

    def pid(self, p: int) -> tuple[int, int]:
        """Return (pid, start time) of local rank p's process, as it recorded them."""
        return struct.unpack_from("<QQ", self._buf, self._slot(p) + _PID)

    def _pid_ns_of(self, p: int) -> int:
        return struct.unpack_from("<Q", self._buf, self._slot(p) + _PID + 16)[0]

    def write_desc(self, k: int, call: int, op: int, dtype: int, numel: int, error: int) -> None:
        """Describe the operation starting at round k (read by peers after round k's wait)."""
        DESC.pack_into(self._buf, self._slot(self.rank) + _DESC[k % 2], call, op, dtype, numel, error)

    def read_desc(self, p: int, k: int) -> tuple[int, int, int, int, int]:
        return DESC.unpack_from(self._buf, self._slot(p) + _DESC[k % 2])

    def arrive(self, k: int) -> None:
        """Publish that this rank's round-k data is written (and its round k-1 reads are done)."""
        self._words[self._seq_index[self.rank]] = k & _MASK
        if self._futex is not None:
            self._futex.wake(self._seq_addr[self.rank])

    # -- waiting ---------------------------------------------------------------------------------
    def wait_all(self, k: int, what: str, *, within: float | None = None) -> bool:
        """Return True once every local rank arrived at round k; raise if one died, closed or the wait timed out.

        `what` names the operation for error messages, e.g. "reduce_scatter call #7 round 2/5". With `within`,
        return False instead once that many seconds passed without them all (a dead or departed peer still raises).
        """
        now = time.monotonic()
        deadline = now + self.timeout
        until = deadline if within is None else min(deadline, now + within)
        target = k & _MASK
        for p in range(self.local_size):
            if p != self.rank and not _reached(self._words[self._seq_index[p]], target):
                if not self._wait_for(p, target, deadline, until, what):
                    return False
        return True

    def _wait_for(self, p: int, target: int, deadline: float, until: float, what: str) -> bool:
        words, idx = self._words, self._seq_index[p]
        if self._spin:
            spin_end = time.perf_counter() + self._spin
            while time.perf_counter() < spin_end:
                if _reached(words[idx], target):
                    return True
        next_check = min(time.monotonic() + _CHECK_PERIOD, until)
        backoff = 20e-6
        while True:
            v = words[idx]
            if _reached(v, target):
                return True
            if self.state(p) in (State.CLOSED, State.ABORTED):  # cheap: a word in the segment
                self._fail(p, target, v, what)
            now = time.monotonic()
            if now >= next_check:  # reading /proc costs ~20 us: not on every poll
                if now >= deadline or (self._watch[p] and not process_alive(*self.pid(p))):
                    self._fail(p, target, v, what)
                if now >= until:
                    return False
                next_check = min(now + _CHECK_PERIOD, until)
            if self._futex is not None:
                self._futex.wait(self._seq_addr[p], v, min(_CHECK_PERIOD, max(until - now, 1e-4)))
            else:
                time.sleep(backoff)
                backoff = min(backoff * 2, 1e-3)

    def _fail(self, p: int, target: int, seq: int, what: str) -> None:
        """Raise the error explaining why peer p will not reach `target`."""
        pid, start = self.pid(p)
        who = f"node {self.node_id!r} local rank {self.rank}: {what}"
        peer = f"local rank {p} (pid {pid})"
        state = self.state(p)
        if state in (State.CLOSED, State.ABORTED):
            verb = "closed its LocalComm" if state == State.CLOSED else "gave up after an error of its own"
            raise TransportError(f"{who}: {peer} {verb} before reaching sequence {target} (it is at {seq})")
        if self._watch[p] and not process_alive(pid, start):
            raise TransportError(f"{who}: {peer} died (crashed or killed) before reaching sequence {target} "
                                 f"(it is at {seq})")  # fmt: skip
        raise BpsTimeoutError(f"{who}: timed out after {self.timeout:.1f} s waiting for {peer} to reach "
                              f"sequence {target} (it is at {seq}; is it running a different operation?)")  # fmt: skip

    def close(self) -> None:
        """Release our views of the mapping so the segment can be unmapped."""
        self._anchor = None
        self._words.release()
