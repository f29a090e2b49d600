"""The summation server: a ZeroMQ ROUTER front thread and engine threads that own disjoint keys.

The front thread receives every message, checks what can be checked from metadata alone (header,
incarnation, job, key declaration, sizes and byte ranges: keys.py) and answers HELLO, INIT and STATS itself.
A key sums its rounds (SUM) or gathers them, copying each push's bytes into place (COPY: rounds.py). PUSH and PULL of a
big key go to the engine that owns it (the least loaded by bytes when the key was declared), so one
key's requests stay in order and big partitions of different keys are summed in parallel: torch's add
releases the GIL. Engines hand replies back over an inproc socket, since only the front thread may
touch the ROUTER. A monitor on the ROUTER reports dropped connections (a killed worker at once, a stopped
one after the heartbeat timeout): the workers that said HELLO on it are lost, and pulls of rounds they
never pushed fail naming them. Pulls waiting past their wait_ms fail naming the workers not yet pushed.
Keys up to INLINE_BYTES are summed on the front thread: there the hand-off (two
thread wake-ups, an inproc message) costs more CPU than the addition, and thread switches are what a
busy machine is short of.
The front thread handles what waits on a socket in batches (up to _BATCH messages per poll wake-up), and
sends a round's whole result back as the message it was summed into (shared by reference count in libzmq).

What may reach that code is decided before it runs: with authentication (auth.py) libzmq lets in only
peers that pass the mechanism (token or CURVE) and the ZAP handler, and auth.JobGuard refuses a job's
requests to any identity but the one that said its first HELLO; limits.py bounds frame sizes and charges
every new job and key against the job's quota and the server's bound.

May import: the standard library, torch, pyzmq, torch_bps.wire, torch_bps.errors, torch_bps.server.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import queue
import struct
import threading
import time

import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from torch_bps.errors import ProtocolError
from torch_bps.server.auth import JobGuard, ServerSecurity
from torch_bps.server.keys import KeyInfo, check_init, check_request
from torch_bps.server.limits import FRAME_SLACK, EngineBacklog, Limits, MemoryBook
from torch_bps.server.rounds import Job, KeyRounds, Round, SumCounters
from torch_bps.wire import DTYPES, REPLY, STATS_FIELDS, Command, Header, Mode, Status

log = logging.getLogger("torch_bps.server")

_REPLIES = "inproc://bps-replies-{}"
_POLL_MS = 200  # how often the front thread looks at the stop flag
# Messages handled per poll wake-up and socket: a poll costs as much Python as handling a small message, and
# under load messages queue up; bounded so the other sockets (engines' replies, the monitor) are not starved.
_BATCH = 64
INLINE_BYTES = 1 << 20  # keys up to this size are summed on the front thread itself
_FRONT = -1  # KeyInfo.engine of an inline key
_EXPIRE_S = 0.25  # how often waiting pulls are checked against their deadlines
_LOST = "lost"  # an engine inbox item: (_LOST, job_id), a worker of that job was lost
_FORGET = "forget"  # an engine inbox item: (_FORGET, job_id), drop every key of that job (past its lease)
_SWEEP_SECONDS = 10.0  # how often the front thread looks for jobs past their lease


class KeyOwner:
    """The rounds of a set of keys: folds pushes into sums and answers pulls. Used by one thread only."""

    def __init__(self, name: str):
        self.name = name
        self.counters = SumCounters()
        self._keys: dict[tuple[int, int], KeyRounds] = {}
        self._waiting: set[KeyRounds] = set()  # keys with queued pulls, for expire()
        self._next_expire = 0.0

    def handle(self, item: tuple, send) -> None:
        """Process one (ident, header, payload, job, key info) item; `send(frames)` each reply.

        ident None means the front thread refused a push of this key: its round fails for everyone.
        """
        ident, header, payload, job, info = item
        if ident is None:
            return self._refuse(send, header, payload, job, info)
        try:
            for frames in self._handle(ident, header, payload, job, info):
                send(frames)
        except ProtocolError as e:
            send(_error(ident, header, e.status, str(e)))
        except Exception as e:  # a bug: answer it, keep serving everyone else
            log.exception("%s failed on %s", self.name, header)
            send(_error(ident, header, Status.INTERNAL, f"{type(e).__name__}: {e}"))

    def worker_lost(self, job_id: int, send) -> None:
        """Fail the waiting pulls of every round of job_id that one of its lost workers has not pushed."""
        for (job, _), rounds in self._keys.items():
            if job == job_id:
                for (ident, pull), message in rounds.fail_lost():
                    send(_error(ident, pull, Status.WORKER_LOST, message))

    def expire(self, send) -> None:
        """Answer every pull waiting past its deadline with ROUND_TIMEOUT (looks at most every _EXPIRE_S)."""
        now = time.monotonic()
        if now < self._next_expire:
            return
        self._next_expire = now + _EXPIRE_S
        for rounds in list(self._waiting):
            for (ident, pull), message in rounds.expire(now):
                send(_error(ident, pull, Status.ROUND_TIMEOUT, message))
            if not rounds.has_waiting:
                self._waiting.discard(rounds)

    def _rounds(self, header: Header, job: Job, info: KeyInfo) -> KeyRounds:
        rounds = self._keys.get((header.job_id, header.key))
        if rounds is None:
            name = f"job {header.job_id:#x} key {header.key}"
            rounds = KeyRounds(name, job, self.counters, info.mode, info.nbytes)
            self._keys[(header.job_id, header.key)] = rounds
        return rounds

    def forget(self, job_id: int, send) -> None:
        """Drop every key of job_id; answer its waiting pulls with UNKNOWN_JOB."""
        for job_key in [k for k in self._keys if k[0] == job_id]:
            rounds = self._keys.pop(job_key)
            self._waiting.discard(rounds)
            for r in rounds.rounds.values():
                for (ident, pull), _, _ in r.waiting:
                    message = f"job {job_id:#x} was forgotten by this server: no request for longer than its lease"
                    send(_error(ident, pull, Status.UNKNOWN_JOB, message))

    def _refuse(self, send, header: Header, reason: str, job: Job, info: KeyInfo) -> None:
        reason = f"the round failed because another worker's push was refused ({reason})"
        try:
            waiting = self._rounds(header, job, info).refuse(header.worker, header.round, reason)
        except ProtocolError as e:  # the refused push named a round that is not alive: nothing to fail
            log.info("%s", e)
            return
        for ident, pull in waiting:
            message = (
                f"pull of job {pull.job_id:#x} key {pull.key} round {pull.round} by worker {pull.worker}: {reason}"
            )
            send(_error(ident, pull, Status.KEY_MISMATCH, message))

    def _handle(self, ident, header: Header, payload, job: Job, info: KeyInfo):
        rounds = self._rounds(header, job, info)
        if header.command == Command.PUSH:
            ready = rounds.push(header.worker, header.round, _as_tensor(payload, header), header.offset, payload)
            yield [ident, header.reply().pack()]
            for (pull_ident, pull), result in ready:
                if isinstance(result, str):  # the round failed as it closed
                    message = f"pull of job {pull.job_id:#x} key {pull.key} round {pull.round} by worker {pull.worker}"
                    yield _error(pull_ident, pull, Status.KEY_MISMATCH, f"{message}: {result}")
                else:
                    yield _result_reply(pull_ident, pull, result)
        else:
            deadline = time.monotonic() + header.wait_ms / 1000 if header.wait_ms else math.inf
            closed = rounds.pull(header.worker, header.round, (ident, header), deadline)
            if closed is not None:
                yield _result_reply(ident, header, closed)
            else:
                self._waiting.add(rounds)


class Engine(threading.Thread):
    """A thread owning the keys placed on it; replies go back to the front thread over inproc."""

    def __init__(self, index: int, ctx: zmq.Context, reply_address: str, backlog: EngineBacklog):
        super().__init__(name=f"bps-engine-{index}", daemon=True)
        self.index = index
        self.inbox: queue.Queue = queue.Queue()
        self.backlog = backlog  # bytes of pushes queued here; released once processed
        self.bytes_owned = 0  # load measure used to place new keys
        self.owner = KeyOwner(self.name)
        self._ctx = ctx
        self._reply_address = reply_address

    def run(self) -> None:
        out = self._ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.SNDHWM, 0)  # never block: the front thread may be waiting for this engine's backlog
        out.connect(self._reply_address)
        send = functools.partial(out.send_multipart, copy=False)
        try:
            while True:
                try:
                    item = self.inbox.get(timeout=_EXPIRE_S)
                except queue.Empty:
                    item = ()
                if item is None:
                    break
                if item and item[0] == _LOST:
                    self.owner.worker_lost(item[1], send)
                elif item and item[0] == _FORGET:
                    self.owner.forget(item[1], send)
                elif item:
                    self.owner.handle(item, send)
                    self.backlog.release(_queued_bytes(item))
                self.owner.expire(send)
        finally:
            out.close()


def _drain(sock: zmq.Socket, handle) -> None:
    """Pass `handle` each message waiting on sock, up to _BATCH: one poll wake-up for all of them."""
    for _ in range(_BATCH):
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:  # once per batch: checking zmq.EVENTS before each message costs a syscall each
            return
        handle(frames)


def _queued_bytes(item: tuple) -> int:
    payload = item[2]
    return len(payload) if isinstance(payload, zmq.Frame) else 0


def _as_tensor(payload: zmq.Frame, header: Header) -> torch.Tensor:
    dtype = torch.uint8 if header.mode == Mode.COPY else DTYPES[header.dtype]  # COPY moves bytes, of any dtype
    if header.length == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(payload.buffer, dtype=dtype)


def _result_reply(ident, header: Header, closed: Round) -> list:
    """Answer a PULL with bytes [offset, offset + length) of its round's result (the range was checked)."""
    # A round's result is never written again once closed, so it can go out zero-copy. When it is a received
    # message and the whole of it is wanted (every all-reduce pull), that message itself goes back: libzmq
    # shares it by reference count. A tensor sent zero-copy instead costs pyzmq a wake-up of its garbage
    # collector thread per reply, to drop the reference once libzmq is done.
    if closed.source is not None and header.offset == 0 and header.length == len(closed.source):
        return [ident, header.reply().pack(), closed.source]
    data = closed.total.view(torch.uint8)[header.offset : header.offset + header.length]
    return [ident, header.reply().pack(), data.numpy() if data.numel() else b""]


def _error(ident, header: Header | None, status: int, message: str) -> list:
    reply = header.reply(status, nbytes=0) if header is not None else Header(command=REPLY, status=status)
    return [ident, reply.pack(), message.encode()]


class SummationServer:
    """A summation server bound to host:port (port 0 picks a free port; see `.port` after start).

    Example:
        server = SummationServer("127.0.0.1", 0, engine_threads=2); server.start(); ...; server.stop()
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 9000, engine_threads: int = 2, *,
                 heartbeat_interval: float = 1.0, heartbeat_timeout: float = 10.0, limits: Limits | None = None,
                 security: ServerSecurity | None = None):  # fmt: skip
        self.incarnation = int.from_bytes(os.urandom(8), "little") | 1  # never 0: 0 means "no incarnation yet"
        self.limits = (limits or Limits()).resolved()
        self.limits.check()
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to a vanished worker are dropped, not raised
        # A bigger frame drops its connection as soon as its length is read: it is never allocated.
        self._router.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes + FRAME_SLACK)
        self._router.setsockopt(zmq.RCVHWM, self.limits.queue_messages)
        self.security = security
        self.zap = security.apply(self._ctx, self._router) if security is not None else None
        # A worker silent for heartbeat_timeout after a PING (stopped, cut off) is disconnected; a killed one
        # closes TCP at once. Either way the monitor reports the connection's fd, and the workers that said
        # HELLO on it are lost (see _on_disconnect).
        self._router.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_interval * 1000))
        self._router.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout * 1000))
        self._monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._connections: dict[int, list[tuple[int, int]]] = {}  # fd -> (job, worker) that said HELLO on it
        if port:
            self._router.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._router.bind_to_random_port(f"tcp://{host}")
        self.host = host
        reply_address = _REPLIES.format(id(self))
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.RCVHWM, 0)
        self._replies.bind(reply_address)
        self._backlog = EngineBacklog(self.limits.backlog_bytes)
        self._engines = [Engine(i, self._ctx, reply_address, self._backlog) for i in range(max(1, engine_threads))]
        self._book = MemoryBook(self.limits)
        self._next_sweep = self._last_sweep = 0.0
        self._inline = KeyOwner("front thread")  # small keys: a hand-off to an engine costs more than the sum
        self._jobs: dict[int, Job] = {}
        self._guard = JobGuard(self._jobs)
        self._keys: dict[tuple[int, int], KeyInfo] = {}
        self._counts = dict.fromkeys(("pushes", "pulls", "bytes_in", "bytes_out", "errors"), 0)
        self._stop = threading.Event()

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def start(self) -> None:
        for e in self._engines:
            e.start()

    def stop(self) -> None:
        """Ask serve_forever to return (thread-safe, also from a signal handler)."""
        self._stop.set()

    def serve_forever(self, parent_pid: int | None = None) -> None:
        """Run the front loop until stop() (or until process parent_pid is gone); then shut down.

        parent_pid: for an embedded server, the worker that started it: the server must not outlive the job
        even when that worker is killed without a chance to stop it.
        """
        poller = zmq.Poller()
        # The monitor first: a disconnect must be seen before a message from a new connection that reuses
        # its fd number (its HELLO would otherwise be recorded, then dropped with the old connection).
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if parent_pid is not None and os.getppid() != parent_pid:
                    log.warning("parent process %d is gone: shutting down", parent_pid)
                    break
                for sock, _ in poller.poll(_POLL_MS):
                    if sock is self._monitor:
                        self._drain_monitor()
                    elif sock is self._router:
                        _drain(self._router, self._on_request)
                    else:
                        _drain(self._replies, self._send)
                self._inline.expire(self._send)
                self._sweep()
        finally:
            for e in self._engines:
                e.inbox.put(None)
            for e in self._engines:
                e.join(timeout=5)
            self._replies.close()
            self._router.disable_monitor()
            self._monitor.close()
            self._router.close()
            self._ctx.term()

    def _send(self, frames: list) -> None:
        if len(frames) > 2:
            status = struct.unpack_from("<H", frames[1], 8)[0]
            if status == Status.OK:
                self._counts["bytes_out"] += len(frames[2])
            else:
                self._counts["errors"] += 1
        self._router.send_multipart(frames, copy=False)

    def _drain_monitor(self) -> None:
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._on_disconnect(event["value"])

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
            self._inline.worker_lost(job_id, self._send)
            for e in self._engines:
                e.inbox.put((_LOST, job_id))

    def _on_request(self, frames: list) -> None:
        ident, rest = frames[0], frames[1:]
        header = None
        try:
            if not rest:
                raise ProtocolError(Status.BAD_FRAME, "message has no header frame")
            header = Header.unpack(rest[0].bytes)
            identity = JobGuard.identity(rest[0]) if self.security is not None else ""
            self._guard.check(header, identity)
            self._dispatch(ident, header, rest[0], rest[1:])
            if header.command == Command.HELLO:
                self._guard.bind(header, identity)
        except ProtocolError as e:
            log.info("refused request from %r: %s", bytes(ident.bytes), e)
            self._send(_error(ident, header, e.status, str(e)))
            if e.status == Status.KEY_MISMATCH and header.command == Command.PUSH:
                info = self._keys.get((header.job_id, header.key))
                job = self._jobs.get(header.job_id)
                if info is not None and job is not None and header.worker < job.num_workers:
                    self._to_owner(info, (None, header, str(e), job, info))
        except Exception as e:  # a bug: answer it and keep serving everyone else
            log.exception("front thread failed on %s", header)
            self._send(_error(ident, header, Status.INTERNAL, f"{type(e).__name__}: {e}"))

    def _dispatch(self, ident, h: Header, head: zmq.Frame, payload: list) -> None:
        expect = 1 if h.command == Command.PUSH else 0
        if len(payload) != expect:
            raise ProtocolError(
                Status.BAD_FRAME, f"command {h.command} takes {expect + 1} frame(s), got {len(payload) + 1}"
            )
        if h.command == Command.HELLO:
            return self._hello(ident, h, head)
        if h.command == Command.STATS:  # not through _send: bytes_out counts the data pulled, nothing else
            return self._router.send_multipart([ident, h.reply().pack(), self._stats()], copy=False)
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
        now = time.monotonic()
        self._book.touch(h.job_id, now)
        job.last_seen[h.worker] = now
        if h.command == Command.INIT:
            return self._init(ident, h)
        key = (h.job_id, h.key)
        if h.command == Command.PUSH:
            got = len(payload[0])
            info = check_request(self._keys.get(key), h, got)
            self._counts["pushes"] += 1
            self._counts["bytes_in"] += got
            self._to_owner(info, (ident, h, payload[0], job, info))
        else:
            info = check_request(self._keys.get(key), h)
            self._counts["pulls"] += 1
            self._to_owner(info, (ident, h, None, job, info))

    def _to_owner(self, info: KeyInfo, item: tuple) -> None:
        if info.engine == _FRONT:
            self._inline.handle(item, self._send)
        else:
            self._backlog.acquire(_queued_bytes(item))
            self._engines[info.engine].inbox.put(item)

    def _hello(self, ident, h: Header, head: zmq.Frame) -> None:
        # Disconnects first: this HELLO's connection may reuse the fd number of one that dropped while the
        # messages of a batch were handled, and its record must not be dropped with the old connection's.
        self._drain_monitor()
        job = self._jobs.get(h.job_id)
        if h.num_workers == 0 or h.worker >= h.num_workers or h.num_workers > self.limits.max_workers:
            raise ProtocolError(
                Status.JOB_MISMATCH,
                f"HELLO of job {h.job_id:#x}: worker {h.worker} of {h.num_workers} (at most "
                f"{self.limits.max_workers} workers)",
            )
        if job is None:
            self._charge(self._book.add_job, h.job_id)
            job = self._jobs[h.job_id] = Job(h.num_workers)
            log.info("job %#x: %d workers", h.job_id, h.num_workers)
        elif job.num_workers != h.num_workers:
            raise ProtocolError(
                Status.JOB_MISMATCH,
                f"HELLO of job {h.job_id:#x} from worker {h.worker} says {h.num_workers} workers, "
                f"but the job was declared with {job.num_workers}",
            )
        job.workers.add(h.worker)
        # Which connection this worker is on, to know it lost when that connection drops. A worker that
        # says HELLO again (after a reconnection) is back.
        self._connections.setdefault(head.get(zmq.SRCFD), []).append((h.job_id, h.worker))
        job.peers[h.worker] = head.get("Peer-Address") or "an unknown address"
        job.last_seen[h.worker] = now = time.monotonic()
        job.lost.pop(h.worker, None)
        self._book.touch(h.job_id, now)
        self._send([ident, h.reply(incarnation=self.incarnation).pack()])

    def _init(self, ident, h: Header) -> None:
        check_init(h)
        info = self._keys.get((h.job_id, h.key))
        if info is None:
            self._charge(self._book.add_key, h.job_id, h.nbytes, self._jobs[h.job_id].num_workers)
            owner = _FRONT
            if h.nbytes > INLINE_BYTES:
                engine = min(self._engines, key=lambda e: e.bytes_owned)
                engine.bytes_owned += h.nbytes
                owner = engine.index
            self._keys[(h.job_id, h.key)] = KeyInfo(h.nbytes, h.dtype, Mode(h.mode), owner)
        else:
            check_request(info, h)
        self._send([ident, h.reply().pack()])

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
        for job_id in self._book.expired():
            self.forget_job(job_id, f"no request for {limits.job_lease_seconds:.0f} s")
        gone = [j for j, job in self._jobs.items() if job.workers and job.workers <= job.lost.keys()]
        for job_id in gone:
            if self._book.idle(job_id) > limits.lost_job_seconds:
                self.forget_job(job_id, f"every worker lost, no request for {limits.lost_job_seconds:.0f} s")

    def forget_job(self, job_id: int, why: str = "") -> None:
        """Drop job_id: its registration, identity binding, keys and rounds (pulls still waiting are answered
        UNKNOWN_JOB by their owners), and its memory charge."""
        log.info("job %#x: forgotten (%s)", job_id, why)
        self._jobs.pop(job_id, None)
        self._guard.forget(job_id)
        for job_key in [k for k in self._keys if k[0] == job_id]:
            info = self._keys.pop(job_key)
            if info.engine != _FRONT:
                self._engines[info.engine].bytes_owned -= info.nbytes
        self._inline.forget(job_id, self._send)
        for e in self._engines:
            e.inbox.put((_FORGET, job_id))
        self._book.release(job_id)

    def _stats(self) -> bytes:
        values = {**self._counts, "bytes_summed": 0, "sum_ns": 0}
        for owner in [self._inline, *(e.owner for e in self._engines)]:
            values["bytes_summed"] += owner.counters.bytes_summed
            values["sum_ns"] += owner.counters.sum_ns
        return struct.pack(f"<{len(STATS_FIELDS)}Q", *(values[f] for f in STATS_FIELDS))
