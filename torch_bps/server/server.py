"""The summation server: a native core that serves PUSH and PULL, and the control plane around it.

The core (`torch_bps._C.ServerCore`, cpp_ext/server/core.h) owns the ROUTER and the stream listeners (TCP and the
local stream) with their streams (docs/protocol.md, "The stream transport"; their requests take the ROUTER's path)
and runs its loop on the thread that calls `serve_forever`. PUSH and PULL of a declared key never enter Python: the
core checks the header, the job's identity and the key's declaration, runs the key's rounds (cpp_ext/server/rounds.h,
held to torch_bps/_reference/rounds.py by the tests), sums in place into the first push's received
message and answers pulls with that message itself (shared by reference count). Everything else comes here,
synchronously on the same thread, so every peer's messages keep their order (an INIT pipelined in front of
its key's first PUSH is declared before that PUSH is read): HELLO, INIT, STATS, garbage and every request
the core refuses (`_on_request`, which answers with keys.py's and auth.py's words), dropped connections
(`_on_disconnect`: the workers that said HELLO on them are lost), ZAP requests (auth.ZapHandler) and a tick
every _TICK_S (stop flag, parent process, drain, lease sweep). Whatever changes here is told to the core at once:
a job registered and bound to its identity, a key declared, a worker lost, a push refused, a job forgotten.

What may reach that code is decided before it runs: with authentication (auth.py) libzmq lets in only
peers that pass the mechanism (token or CURVE) and the ZAP handler, and a job's requests are served only
from the identity that said its first HELLO (auth.JobGuard here, the same check natively); limits.py
bounds frame sizes and charges every new job and key against the job's quota and the server's bound.

May import: the standard library, pyzmq (option constants), torch_bps._C, torch_bps.wire, torch_bps.errors,
torch_bps.server.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable

import zmq

import torch_bps._C as _C
from torch_bps.errors import ProtocolError
from torch_bps.server.auth import JobGuard, ServerSecurity
from torch_bps.server.drain import JobActivity, quiet
from torch_bps.server.job import Job, job_settings
from torch_bps.server.keys import KeyInfo, check_init, check_request
from torch_bps.server.limits import FRAME_SLACK, Limits, MemoryBook
from torch_bps.server.metrics import resident_bytes
from torch_bps.server.timeline import ServerTimeline
from torch_bps.wire import LOCAL_PEER, REPLY, STATS_FIELDS, STREAM_LOCAL, Command, Header, Mode, Status, foreign_reply

log = logging.getLogger("torch_bps.server")

_TICK_S = 0.2  # how often the loop calls _tick: the stop flag, the parent process, the lease sweep
_SWEEP_SECONDS = 10.0  # how often jobs past their lease are looked for


def _error(ident: bytes, header: Header | None, status: int, message: str, frame: bytes = b"") -> list[bytes]:
    if header is not None:
        packed = header.reply(status, nbytes=0).pack()
    elif status == Status.BAD_VERSION:  # answered in the asker's framing, which its own version can read
        packed = foreign_reply(frame, status)
    else:
        packed = Header(command=REPLY, status=status).pack()
    return [ident, packed, message.encode()]


def _no_zap(frames: list[bytes]) -> list[bytes]:
    raise AssertionError("a ZAP request reached a server without authentication")


class SummationServer:
    """A summation server bound to host:port (port 0 picks a free port; see `.port`).

    Example:
        server = SummationServer("127.0.0.1", 0); threading.Thread(target=server.serve_forever).start(); ...
        server.stop()
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 9000, *, heartbeat_interval: float = 1.0,
                 heartbeat_timeout: float = 10.0, limits: Limits | None = None,
                 security: ServerSecurity | None = None, stream: bool = True,
                 receive_buffer_bytes: int = 0):  # fmt: skip
        if not 0 <= receive_buffer_bytes < 1 << 31:
            raise ValueError(f"receive_buffer_bytes={receive_buffer_bytes} must be in [0, 2^31) (0: the kernel's)")
        self.incarnation = int.from_bytes(os.urandom(8), "little") | 1  # never 0: 0 means "no incarnation yet"
        self.limits = (limits or Limits()).resolved()
        self.limits.check()
        self._core = core = _C.ServerCore(self.incarnation)
        core.set_option(zmq.ROUTER_MANDATORY, 0)  # replies to a vanished worker are dropped, not raised
        # A bigger frame drops its connection as soon as its length is read: it is never allocated.
        core.set_option(zmq.MAXMSGSIZE, self.limits.max_frame_bytes + FRAME_SLACK)
        core.set_option(zmq.RCVHWM, self.limits.queue_messages)
        self.security = security
        self.zap = security.configure(core) if security is not None else None
        # A worker silent for heartbeat_timeout after a PING (stopped, cut off) is disconnected; a killed one
        # closes TCP at once. Either way the core's monitor reports the connection's fd, and the workers that
        # said HELLO on it are lost (see _on_disconnect).
        core.set_option(zmq.HEARTBEAT_IVL, int(heartbeat_interval * 1000))
        core.set_option(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
        bound = core.bind(f"tcp://{host}:{port or '*'}")
        self.host, self.port = host, int(bound.rsplit(":", 1)[1])
        # The stream transport (docs/protocol.md): offered in the HELLO reply, never under CURVE (not encrypted).
        offer = stream and (security is None or security.mechanism == "token")
        listen_host = host if host not in ("0.0.0.0", "*") else ""
        self.stream_port = core.listen_stream(listen_host, receive_buffer_bytes) if offer else 0
        # What HELLO replies offer: the port, and the local stream if it listens on one.
        self._stream_offer = self.stream_port | (STREAM_LOCAL if self.stream_port and core.local_stream else 0)
        self._connections: dict[int, list[tuple[int, int]]] = {}  # fd -> (job, worker) that said HELLO on it
        self._book = MemoryBook(self.limits)
        self._next_sweep = self._last_sweep = 0.0
        self._jobs: dict[int, Job] = {}
        self._guard = JobGuard(self._jobs)
        self._keys: dict[tuple[int, int], KeyInfo] = {}
        self._parent_pid: int | None = None
        self._stop = threading.Event()
        self._drain_deadline: float | None = None  # set by drain(): time.monotonic() by which to stop regardless
        self._drain_logged = False
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # on_loop's, run by _tick
        self._timeline: ServerTimeline | None = None

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def stop(self) -> None:
        """Ask serve_forever to return (thread-safe, also from a signal handler)."""
        self._stop.set()

    def drain(self, timeout: float) -> None:
        """Take no new job, and stop once no job has a round in flight, or after `timeout` seconds (thread-safe,
        also from a signal handler; a second call keeps the first deadline). See drain.py."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + timeout

    @property
    def accepting(self) -> bool:
        """Whether this server takes new jobs: False once it drains."""
        return self._drain_deadline is None

    def serve_forever(self, parent_pid: int | None = None) -> None:
        """Run the core's loop on this thread until stop() (or until process parent_pid is gone); then close.

        parent_pid: for an embedded server, the worker that started it: the server must not outlive the job
        even when that worker is killed without a chance to stop it.
        """
        self._parent_pid = parent_pid
        zap = self.zap.answer if self.zap is not None else _no_zap
        try:
            self._core.run(self._on_request, self._on_disconnect, zap, self._tick, _TICK_S)
        finally:
            if self._timeline is not None:
                self._timeline.close()

    def record_timeline(self, directory: str, max_events: int = 500_000) -> str:
        """Record a timeline of sums and queue depth into DIRECTORY/server-HOST-PORT.json (see timeline.py);
        before serve_forever. Return the file's path."""
        host = self.host if self.host not in ("0.0.0.0", "*", "") else socket.gethostname()
        path = os.path.join(directory, f"server-{host}-{self.port}.json")
        self._timeline = ServerTimeline(self._core, path, f"server {self.host}:{self.port}", max_events)
        return path

    def on_loop(self, fn: Callable[[], object], timeout: float = 5.0) -> object:
        """Run fn() on the loop thread at its next tick (at most _TICK_S away) and return its result; from any
        other thread. Raise TimeoutError if the loop did not run it within `timeout` seconds."""
        done, box = threading.Event(), {}

        def call() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e
            done.set()

        self._calls.put(call)
        if not done.wait(timeout):
            raise TimeoutError(f"the loop of server {self.address} did not take a request within {timeout:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def counters(self) -> dict[str, int]:
        """The server's totals: STATS_FIELDS and memory_bound. On the loop thread only."""
        return {**self._core.counters(), "jobs": len(self._jobs), "memory_charged": self._book.total,
                "memory_bound": self.limits.max_memory_bytes, "resident_bytes": resident_bytes()}  # fmt: skip

    def job_counters(self) -> dict[int, dict[str, int]]:
        """Each job's share of the counters, its memory charge, workers and keys. On the loop thread only."""
        keys = Counter(job_id for job_id, _ in self._keys)
        jobs = self._core.job_counters()
        for job_id, counters in jobs.items():
            job = self._jobs.get(job_id)
            counters.update(memory_charged=self._book.charged(job_id), workers=job.num_workers if job else 0,
                            keys=keys[job_id])  # fmt: skip
        return jobs

    def _tick(self) -> bool:
        while True:  # what other threads asked of the loop (a metrics scrape)
            try:
                self._calls.get_nowait()()
            except queue.Empty:
                break
        if self._timeline is not None:
            self._timeline.flush()
        if self._stop.is_set():
            return False
        if self._parent_pid is not None and os.getppid() != self._parent_pid:
            log.warning("parent process %d is gone: shutting down", self._parent_pid)
            return False
        if self._drain_deadline is not None and self._drained():
            return False
        self._sweep()
        return True

    def _drained(self) -> bool:
        """Whether a drain may stop now: no round in flight (drain.quiet), or its deadline passed."""
        for job_id, seen in self._core.take_touched():
            self._book.touch(job_id, seen)
        counters = self._core.job_counters()
        jobs = {}
        for job_id, job in self._jobs.items():
            mine = counters.get(job_id, {"pushes": 0, "pulls": 0})
            jobs[job_id] = JobActivity(mine["pushes"], mine["pulls"], self._book.idle(job_id), bool(job.lost))
        if not self._drain_logged:
            self._drain_logged = True
            log.info("draining: %d job(s) registered; no new job is taken", len(jobs))
        if quiet(jobs, self._core.counters()["keys_waiting"]):
            log.info("drained: no round in flight; stopping")
            return True
        if time.monotonic() >= self._drain_deadline:
            log.warning("drain deadline passed with rounds in flight; stopping (the jobs' failover finishes them)")
            return True
        return False

    def _on_disconnect(self, fd: int) -> None:
        """The connection on fd is gone: every worker that said HELLO on it is lost to its job."""
        for job_id, worker in self._connections.pop(fd, ()):
            job = self._jobs.get(job_id)
            if job is None or worker in job.lost:
                continue
            job.lost[worker] = (
                f"worker {worker} of job {job_id:#x} (at {job.peers.get(worker, 'an unknown address')}) disconnected"
            )
            log.info("%s", job.lost[worker])  # also how every job ends: the errors tell the failures
            self._core.worker_lost(job_id, worker, job.lost[worker])

    def _on_request(self, frames: list[bytes], fd: int, peer: str, user_id: str) -> list[bytes] | None:
        """Answer a message the core did not serve; return the reply's frames."""
        ident, rest = frames[0], frames[1:]
        header = None
        try:
            if not rest:
                raise ProtocolError(Status.BAD_FRAME, "message has no header frame")
            header = Header.unpack(rest[0])
            identity = user_id if self.security is not None else ""
            self._guard.check(header, identity)
            reply = self._dispatch(ident, header, rest[1:], fd, peer, identity)
            if header.command == Command.HELLO:
                self._guard.bind(header, identity)
            return reply
        except ProtocolError as e:
            log.info("refused request from %r: %s", ident, e)
            if e.status == Status.KEY_MISMATCH and header.command == Command.PUSH:
                # A refused push fails its round for every worker: the others would wait for a sum that can
                # never be right.
                self._core.refuse(header.job_id, header.key, header.worker, header.round, str(e))
            return _error(ident, header, e.status, str(e), rest[0] if rest else b"")
        except Exception as e:  # a bug: answer it and keep serving everyone else
            log.exception("control plane failed on %s", header)
            return _error(ident, header, Status.INTERNAL, f"{type(e).__name__}: {e}")

    def _dispatch(self, ident: bytes, h: Header, payload: list[bytes], fd: int, peer: str, identity: str) -> list:
        expect = 1 if h.command == Command.PUSH else 0
        if len(payload) != expect:
            raise ProtocolError(
                Status.BAD_FRAME, f"command {h.command} takes {expect + 1} frame(s), got {len(payload) + 1}"
            )
        if h.command == Command.HELLO:
            return self._hello(ident, h, fd, peer, identity)
        if h.command == Command.STATS:
            return [ident, h.reply().pack(), self._stats()]
        if h.command not in (Command.INIT, Command.PUSH, Command.PULL):
            raise ProtocolError(Status.BAD_COMMAND, f"unknown command {h.command}")
        if h.incarnation != self.incarnation:
            raise ProtocolError(
                Status.WRONG_INCARNATION,
                f"request for server incarnation {h.incarnation:#x}, but this server ({self.address}) is incarnation "
                f"{self.incarnation:#x}: it restarted and has lost the state of job {h.job_id:#x}",
            )
        job = self._jobs.get(h.job_id)
        if job is None:
            raise ProtocolError(Status.UNKNOWN_JOB, f"job {h.job_id:#x} has not said HELLO to this server")
        if h.worker >= job.num_workers:
            raise ProtocolError(
                Status.JOB_MISMATCH, f"worker {h.worker} out of range for job {h.job_id:#x} of {job.num_workers}"
            )
        self._book.touch(h.job_id, time.monotonic())
        self._core.touch(h.job_id, h.worker)
        if h.command == Command.INIT:
            return self._init(ident, h)
        check_request(self._keys.get((h.job_id, h.key)), h, len(payload[0]) if payload else 0)
        # Every check passed here, so the core should have served it: the two tables disagree.
        raise RuntimeError(f"{Command(h.command).name} of job {h.job_id:#x} key {h.key} passed the control plane's "
                           "checks but not the native core's")  # fmt: skip

    def _hello(self, ident: bytes, h: Header, fd: int, peer: str, identity: str) -> list:
        # The core read every disconnect before handing this over: this HELLO's connection may reuse the fd
        # number of one that dropped, whose record must be gone before this one is made.
        job = self._jobs.get(h.job_id)
        if h.num_workers == 0 or h.worker >= h.num_workers or h.num_workers > self.limits.max_workers:
            raise ProtocolError(
                Status.JOB_MISMATCH,
                f"HELLO of job {h.job_id:#x}: worker {h.worker} of {h.num_workers} (at most "
                f"{self.limits.max_workers} workers)",
            )
        if job is None and not self.accepting:
            raise ProtocolError(Status.UNKNOWN_JOB, f"HELLO of job {h.job_id:#x}: server {self.address} is draining "
                                "(it was sent SIGTERM) and takes no new job; give the job another server")  # fmt: skip
        backups, window, staleness = job_settings(h)
        if job is None:
            self._charge(self._book.add_job, h.job_id)
            job = self._jobs[h.job_id] = Job(h.num_workers, backups, window, staleness)
            log.info("job %#x: %d workers%s", h.job_id, h.num_workers,
                     f", {backups} backup workers, {window} live rounds per key" if backups else "")  # fmt: skip
        elif (job.num_workers, job.backups, job.window, job.staleness) != (h.num_workers, backups, window, staleness):
            raise ProtocolError(
                Status.JOB_MISMATCH,
                f"HELLO of job {h.job_id:#x} from worker {h.worker} says {h.num_workers} workers, {backups} backup "
                f"workers, {window} live rounds and staleness {staleness}, but the job was declared with "
                f"{job.num_workers}, {job.backups}, {job.window} and {job.staleness}",
            )
        job.workers.add(h.worker)
        # Which connection this worker is on, to know it lost when that connection drops. A worker that
        # says HELLO again (after a reconnection) is back.
        self._connections.setdefault(fd, []).append((h.job_id, h.worker))
        if peer == LOCAL_PEER:  # its HELLO on the local stream: the address its HELLO on ZeroMQ came from says more
            peer = job.peers.get(h.worker) or "this server's machine"
        job.peers[h.worker] = peer or "an unknown address"
        job.lost.pop(h.worker, None)
        self._book.touch(h.job_id, time.monotonic())
        self._core.hello(h.job_id, h.worker, h.num_workers, backups, window, staleness, job.peers[h.worker],
                         identity)  # fmt: skip
        return [ident, h.reply(incarnation=self.incarnation, stream=self._stream_offer).pack()]

    def _init(self, ident: bytes, h: Header) -> list:
        check_init(h)
        info = self._keys.get((h.job_id, h.key))
        if info is None:
            job = self._jobs[h.job_id]
            dense = h.dense_bytes if h.codec else 0  # a compressed key's fp32 partition
            self._charge(self._book.add_key, h.job_id, h.nbytes, job.num_workers, job.window, h.dtype, h.mode, dense)
            self._keys[(h.job_id, h.key)] = KeyInfo(h.nbytes, h.dtype, Mode(h.mode), h.codec, dense)
            self._core.declare(h.job_id, h.key, h.nbytes, h.dtype, h.mode, h.codec, dense)
        else:
            check_request(info, h)
        return [ident, h.reply().pack()]

    def _charge(self, add, *args) -> None:
        """Charge the memory book; when full, forget jobs past their lease first and try once more."""
        try:
            add(*args)
        except ProtocolError:
            self._sweep(force=True)
            add(*args)

    def _sweep(self, force: bool = False) -> None:
        """Forget every job past its lease, and every job whose workers are all lost and silent for
        lost_job_seconds: every _SWEEP_SECONDS (or a quarter of either), or when forced because the book is
        full, but then at most once a second (a sweep walks every job)."""
        now = time.monotonic()
        if now < self._next_sweep and not (force and now >= self._last_sweep + 1.0):
            return
        self._last_sweep = now
        limits = self.limits
        self._next_sweep = now + min(_SWEEP_SECONDS, limits.job_lease_seconds / 4, limits.lost_job_seconds / 4)
        for job_id, seen in self._core.take_touched():  # the requests the core served since the last sweep
            self._book.touch(job_id, seen)
        for job_id in self._book.expired():
            self.forget_job(job_id, f"no request for {limits.job_lease_seconds:.0f} s")
        gone = [j for j, job in self._jobs.items() if job.workers and job.workers <= job.lost.keys()]
        for job_id in gone:
            if self._book.idle(job_id) > limits.lost_job_seconds:
                self.forget_job(job_id, f"every worker lost, no request for {limits.lost_job_seconds:.0f} s")

    def forget_job(self, job_id: int, why: str = "") -> None:
        """Drop job_id: its registration, identity binding, keys and rounds (pulls still waiting are answered
        UNKNOWN_JOB), and its memory charge. On the loop thread only."""
        log.info("job %#x: forgotten (%s)", job_id, why)
        self._jobs.pop(job_id, None)
        self._guard.forget(job_id)
        for job_key in [k for k in self._keys if k[0] == job_id]:
            del self._keys[job_key]
        message = f"job {job_id:#x} was forgotten by this server: no request for longer than its lease"
        self._core.forget_job(job_id, message)
        self._book.release(job_id)

    def _stats(self) -> bytes:
        counters = self.counters()
        return struct.pack(f"<{len(STATS_FIELDS)}Q", *(counters[f] for f in STATS_FIELDS))
