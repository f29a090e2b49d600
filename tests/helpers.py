"""Shared test helpers: real summation-server processes, raw protocol peers (a pyzmq DEALER, a stream), and a
job of spawned ranks with a torch.distributed default group (`run_ranks`)."""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import zmq
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from torch_bps.address import parse_listening, split_host_port
from torch_bps.futures import completer
from torch_bps.security import ClientCredentials
from torch_bps.wire import HEADER_SIZE, Command, Header, Mode, Partition, Status

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ServerProcess:
    """A `python -m torch_bps.server` subprocess on loopback. `.address` is "127.0.0.1:PORT"."""

    def __init__(
        self,
        port: int = 0,
        log_level: str = "WARNING",
        start_timeout: float = 30.0,
        extra_args: tuple[str, ...] = (),
        auth: bool = True,
        wait: bool = True,
    ):
        """auth: require BPS_POOL_CREDENTIAL (conftest sets one for the session) with BPS_AUTH's mechanism;
        False: --auth off. wait: False returns once the process started; `wait_listening()` then waits for it
        to listen (`start_servers` starts several side by side)."""
        self.extra_args = tuple(extra_args)
        self.credential = os.environ.get("BPS_POOL_CREDENTIAL", "") if auth else ""
        self.port = port
        self.log_level = log_level
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0
        self.launch()
        if wait:
            self.wait_listening()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.launch()
        self.wait_listening()

    def launch(self) -> None:
        cmd = [sys.executable, "-m", "torch_bps.server", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", self.log_level]  # fmt: skip
        cmd += self.extra_args if self.credential else ("--auth", "off", *self.extra_args)
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env["BPS_POOL_CREDENTIAL"] = self.credential or ""
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)

    def wait_listening(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if (listening := parse_listening(line)) or self.proc.poll() is not None:
                break
        if not line or not (listening := parse_listening(line)):
            self.kill()
            raise RuntimeError(f"bps-server did not start within {self.start_timeout}s (last line {line!r})")
        self.port, self.incarnation = listening

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the server dies without closing anything, as a crashed machine would."""
        if self.alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM, and wait for the server to shut down (`stop_servers` stops several side by side)."""
        self.terminate()
        self.wait_stopped()

    def terminate(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        """Kill and start again on the same port: a new incarnation."""
        self.kill()
        self.start()


def start_servers(count: int, **kwargs) -> list[ServerProcess]:
    """Start `count` ServerProcess(**kwargs) side by side (each imports torch: seconds of CPU); return them once
    every one listens. Example: `servers = start_servers(2)`, then `stop_servers(servers)`."""
    servers = []
    try:
        servers += [ServerProcess(wait=False, **kwargs) for _ in range(count)]
        for s in servers:
            s.wait_listening()
    except BaseException:
        for s in servers:
            s.kill()
        raise
    return servers


def stop_servers(servers: list[ServerProcess]) -> None:
    """Stop every server in `servers`, side by side."""
    for s in servers:
        s.terminate()
    for s in servers:
        s.wait_stopped()


class RawPeer:
    """A worker speaking the wire protocol by hand through a pyzmq DEALER: for server-side tests."""

    def __init__(self, address: str, job_id: int = 1, worker: int = 0, num_workers: int = 1, timeout: float = 10.0,
                 auth: ClientCredentials | bool | None = None):  # fmt: skip
        """auth: credentials to connect with (their server 0's); None: those of BPS_POOL_CREDENTIAL for
        job_id, as `Client` uses, if it is set; False: none."""
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))  # a refused handshake leaves no pipe: send blocks
        if auth is None:
            from torch_bps.client import default_credentials  # here: importing the client loads the C++ extension

            auth = default_credentials(job_id, 1)
        if auth and auth.mechanism == "curve":
            self.sock.curve_publickey, self.sock.curve_secretkey = auth.client.public, auth.client.secret
            self.sock.curve_serverkey = auth.server_keys[0]
        elif auth:
            self.sock.plain_username, self.sock.plain_password = auth.client.public, auth.tokens[0]
        self.sock.connect(f"tcp://{address}")
        self.address = address
        self.timeout_ms = int(timeout * 1000)
        self.job_id, self.worker, self.num_workers = job_id, worker, num_workers
        self.incarnation = 0
        self._next_id = 1

    def request(self, command: int, *payload: bytes, **fields) -> tuple[Header, list[bytes]]:
        """Send one request and wait for its reply; return (reply header, payload frames)."""
        rid = self.send(command, *payload, **fields)
        return self.recv(rid)

    def send(self, command: int, *payload: bytes, **fields) -> int:
        rid = self._next_id
        self._next_id += 1
        base = dict(
            command=command, job_id=self.job_id, worker=self.worker, incarnation=self.incarnation, request_id=rid
        )
        # Unless told otherwise: a PUSH's length is its payload's, a PULL asks for the whole key.
        if command == Command.PUSH and payload:
            base["length"] = len(payload[0])
        elif command == Command.PULL:
            base["length"] = fields.get("nbytes", 0) - fields.get("offset", 0)
        self.send_frames([Header(**{**base, **fields}).pack(), *payload])
        return rid

    def send_frames(self, frames: list[bytes]) -> None:
        try:
            self.sock.send_multipart(frames)
        except zmq.Again:
            raise TimeoutError(f"could not send to {self.address} within {self.timeout_ms} ms") from None

    def recv_any(self) -> tuple[Header, list[bytes]]:
        if not self.sock.poll(self.timeout_ms):
            raise TimeoutError(f"no reply within {self.timeout_ms} ms")
        frames = self.sock.recv_multipart()
        assert len(frames[0]) == HEADER_SIZE
        return Header.unpack(frames[0]), frames[1:]

    def recv(self, request_id: int) -> tuple[Header, list[bytes]]:
        header, rest = self.recv_any()
        assert header.request_id == request_id, f"reply to {header.request_id}, expected {request_id}"
        return header, rest

    def hello(self) -> Header:
        h, _ = self.request(Command.HELLO, num_workers=self.num_workers)
        self.incarnation = h.incarnation
        return h

    def close(self) -> None:
        self.sock.close()


class StreamPeer(RawPeer):
    """A worker speaking the wire protocol by hand over the stream transport (docs/protocol.md): a plain
    socket, the 8-byte length words written here. `auth` as RawPeer's; `open=False` leaves AUTH to the test."""

    MORE = 1 << 63

    def __init__(self, address: str, port: int, job_id: int = 1, worker: int = 0, num_workers: int = 1,
                 timeout: float = 10.0, auth: ClientCredentials | bool | None = None, open: bool = True):  # fmt: skip
        self.sock = socket.create_connection((address.rsplit(":", 1)[0], port), timeout=timeout)
        self.address, self.timeout = f"{address.rsplit(':', 1)[0]}:{port}", timeout
        self.job_id, self.worker, self.num_workers = job_id, worker, num_workers
        self.incarnation = 0
        self._next_id = 1
        if auth is None:
            from torch_bps.client import default_credentials  # here: importing the client loads the C++ extension

            auth = default_credentials(job_id, 1)
        self.credentials = [b"PLAIN", auth.client.public, auth.tokens[0]] if auth else [b"NULL"]
        if open:
            self.send_frames([b"BPS-STREAM-1", *self.credentials])
            assert self.recv_frames() == [b"BPS-STREAM-1", b"200"]

    def send_frames(self, frames: list[bytes]) -> None:
        out = b"".join(
            (len(f) | (self.MORE if i + 1 < len(frames) else 0)).to_bytes(8, "little") + f for i, f in enumerate(frames)
        )
        self.sock.sendall(out)

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError(f"stream {self.address} closed by the server")
            data += chunk
        return data

    def recv_frames(self) -> list[bytes]:
        """The next message's frames; ConnectionError if the server closed the stream, TimeoutError if silent."""
        frames, more = [], True
        while more:
            word = int.from_bytes(self._read(8), "little")
            more = bool(word & self.MORE)
            frames.append(self._read(word & ~self.MORE))
        return frames

    def recv_any(self) -> tuple[Header, list[bytes]]:
        try:
            frames = self.recv_frames()
        except TimeoutError:
            raise TimeoutError(f"no reply within {self.timeout} s") from None
        assert len(frames[0]) == HEADER_SIZE
        return Header.unpack(frames[0]), frames[1:]

    def closed_by_server(self, within: float = 5.0) -> bool:
        """True once the server closed this stream (EOF or reset), False if it stayed open `within` seconds."""
        self.sock.settimeout(within)
        try:
            while self.sock.recv(65536):
                pass
            return True
        except TimeoutError:
            return False
        except OSError:
            return True


class TcpRelay:
    """A TCP relay on loopback to a server: real sockets and the real protocol, with the faults a test needs of the
    network between: `rate` (bytes/s each way per connection: a slow link), `frozen` (set: the server's bytes toward
    the clients are held, never delivered) and `cut()` (every connection dropped, as a dying link would).

    Example: `relay = TcpRelay(server.address, rate=256 << 10); Client([relay.address], ...)`.

    It relays the server's ZeroMQ port only: a client with streams (BPS_TRANSPORT=stream) would reach the stream
    port the server offers directly, around the relay's faults. Relayed servers run with `--stream off`, or their
    clients with `stream=False`.
    """

    def __init__(self, target: str, rate: float | None = None):
        self.target, self.rate = split_host_port(target), rate
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.frozen = threading.Event()
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, name="tcp-relay", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # cut
            try:
                server = socket.create_connection(self.target)
            except OSError:  # the server is gone: so is this connection
                client.close()
                continue
            self.socks += [client, server]
            for src, dst, to_client in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, to_client), name="tcp-relay", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_client: bool) -> None:
        try:
            while data := src.recv(16 << 10 if self.rate else 1 << 16):
                if to_client and self.frozen.is_set():
                    continue  # held: never delivered
                if self.rate:
                    time.sleep(len(data) / self.rate)
                dst.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        self.listener.close()
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


# A job of spawned ranks with a "byteps" (or gloo) default group and a gloo group beside it.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_context():
    """A multiprocessing context for ranks: a forkserver that imported torch and torch_bps once, so that each
    rank starts in milliseconds instead of re-importing them (2-3 s of CPU each, DDP's torch._dynamo as much
    again). Ranks are still fresh processes that inherit nothing from the test process but what they are given:
    pass them its environment (a forkserver's children have the forkserver's, from when it started)."""
    ctx = multiprocessing.get_context("forkserver")
    # Only the first call, which starts the forkserver, preloads; later ones change nothing.
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "torch_bps", "tests.helpers"])
    return ctx


def _rank_main(fn, rank, world, port, backend, environ, env, args, results):
    os.environ.clear()  # the test process's environment when it started the job, as a spawned rank would have
    os.environ.update(environ)
    if "LOCAL_WORLD_SIZE" not in env:  # every rank its own emulated machine, as torchrun would say on N nodes
        os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank), GROUP_WORLD_SIZE=str(world))
    os.environ.update(env)
    # torch reads TORCH_DISTRIBUTED_DEBUG once, when torch.distributed is imported: here that was in the forkserver,
    # before this rank's environment was set.
    dist.set_debug_level_from_env()
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))  # fmt: skip
        gloo = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")
        out = fn(rank, world, gloo, *args)
        dist.barrier(group=gloo)  # rank 0 hosts the store: nobody leaves before everyone is done with it
        dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world: int, *args, backend: str = "byteps", env: dict | None = None, timeout: float = 150.0):
    """Run `fn(rank, world, gloo_group, *args)` in `world` fresh processes; return its results by rank.

    Each process joined a `backend` default group first (and a gloo group, passed as `gloo_group`). Each rank is
    a machine of its own (its own worker to the servers, its own embedded server) unless `env` sets
    LOCAL_WORLD_SIZE (then torchrun's other variables follow from it). A rank's exception fails the test with its
    traceback; a job still running after `timeout` seconds is killed.
    """
    ctx = rank_context()
    results = ctx.Queue()
    port = _free_port()
    job = (port, backend, dict(os.environ), env or {}, args, results)
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, *job), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world:
            left = deadline - time.monotonic()
            if any(s == "error" for s, _ in outcome.values()):
                left = min(left, 5.0)  # the others may be stuck in a collective with the failed rank
            try:
                rank, status, out = results.get(timeout=max(left, 0.01))
            except queue.Empty:
                break
            outcome[rank] = (status, out)
    finally:
        for p in procs:
            p.join(timeout=10 if len(outcome) == world else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r}:\n{out}" for r, (s, out) in sorted(outcome.items()) if s == "error"]
    missing = sorted(set(range(world)) - set(outcome))
    if errors or missing:
        pytest.fail("\n".join(errors) + (f"\nranks {missing} did not finish within {timeout}s" if missing else ""))
    return [outcome[r][1] for r in range(world)]


# Float test data whose sums are exact, so results can be compared bit for bit: multiples of 2**-8 below 1 in
# magnitude (2**-4 below 2 for bf16), so any 8 of them add without rounding (fp16 keeps 11 significant bits,
# bf16 8) while the low bits are in use: a sum done in a narrower type, or a round mixed up, changes the bits.
_EXACT_UNITS = {torch.bfloat16: (32, 2.0**-4)}


def _losing_rank_main(fn, rank, world, port, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      GROUP_RANK=str(rank), GROUP_WORLD_SIZE=str(world))  # fmt: skip
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put((rank, "error", repr(e)))
    time.sleep(3)  # rank 0 hosts the store: leave it up while the others finish
    os._exit(0)


def run_losing_last_rank(fn, world: int, *args, timeout: float = 120.0) -> dict[int, tuple[str, object]]:
    """Run `fn(rank, world, *args)` in `world` fresh processes joined in a gloo group, where the last rank loses itself
    (SIGKILL, SIGSTOP) on its own; return the others' (status, result) by rank, and kill the last.

    Unlike run_ranks, no rank waits for the others at the end: one of them never comes back.
    """
    ctx = rank_context()
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_losing_rank_main, args=(fn, r, world, port, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return {r: (s, out) for r, s, out in (results.get(timeout=timeout) for _ in range(world - 1))}
    finally:
        procs[-1].kill()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def quick_heartbeat_server() -> ServerProcess:
    """A server that counts a worker silent for 2 s after a heartbeat as lost (a SIGSTOPped one)."""
    return ServerProcess(auth=False, extra_args=("--heartbeat-interval", "0.5", "--heartbeat-timeout", "2"))


def exact_floats(shape, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Return random floats of `dtype` such that sums of up to 8 of them are exact in that dtype."""
    units, step = _EXACT_UNITS.get(dtype, (256, 2.0**-8))
    return (torch.randint(-units, units, shape, generator=generator) * step).to(dtype)


def rss_bytes(pid: int) -> int:
    """Resident memory of process pid (VmRSS), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


# --- Raw peers' requests, spoken as another implementation of docs/protocol.md would (tests/server) ------------------
# The dtype codes of docs/protocol.md, written out here rather than taken from torch_bps.wire: the peers below
# speak the protocol as another implementation would, so a server whose table drifted (fp16 and bf16 swapped,
# say) sums the wrong type and the sum tests fail, not only test_dtype_table_matches_protocol_doc.
PROTOCOL_CODES = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4, torch.int32: 5,
                  torch.int64: 6, torch.uint8: 7, torch.int8: 8}  # fmt: skip


def peers(server, job_id, n):
    """Return n RawPeers, workers 0..n-1 of `job_id`, each having said HELLO to `server`."""
    ps = [RawPeer(server.address, job_id, w, n) for w in range(n)]
    for p in ps:
        assert p.hello().status == Status.OK
    return ps


def declare(ps, key, t):
    """INIT `key` as a SUM key of `t`'s size and dtype from every peer of `ps`."""
    for p in ps:
        h, _ = p.request(Command.INIT, key=key, nbytes=t.numel() * t.element_size(), dtype=PROTOCOL_CODES[t.dtype])
        assert h.status == Status.OK, h


def push(p, key, rnd, t):
    """PUSH `t` as round `rnd` of `key`; return (reply header, payload frames)."""
    data = t.contiguous().view(torch.uint8).numpy().tobytes()
    return p.request(Command.PUSH, data, key=key, round=rnd, nbytes=len(data), dtype=PROTOCOL_CODES[t.dtype])


def pull(p, key, rnd, like):
    """PULL round `rnd` of `key` whole; return it as a tensor of `like`'s dtype (the reply must be OK)."""
    h, rest = p.request(
        Command.PULL, key=key, round=rnd, nbytes=like.numel() * like.element_size(), dtype=PROTOCOL_CODES[like.dtype]
    )
    assert h.status == Status.OK, rest
    return torch.frombuffer(bytearray(rest[0]), dtype=like.dtype) if rest[0] else torch.empty(0, dtype=like.dtype)


def error_of(reply) -> tuple[int, str]:
    """(status, error message) of a (reply header, payload frames) pair."""
    h, rest = reply
    return h.status, rest[0].decode() if rest else ""


# --- The C++ client through the door production uses (tests/client and every test that drives a Client) -------------
def push_pull_part(
    client,
    tensor: torch.Tensor,
    key: int,
    *,
    server: int | None = None,
    out: torch.Tensor | None = None,
    mode: Mode = Mode.SUM,
    key_numel: int | None = None,
    offset: int = 0,
    out_offset: int = 0,
    priority: int = 0,
    codec: int = 0,
    dense_numel: int = 0,
) -> torch.futures.Future:
    """Run one partition through `client.push_pull_batch` (a batch of one, as the engine sends); return a Future of
    where the result went (`out`, default `tensor`), failed with the batch's error.

    Example: `assert torch.equal(push_pull_part(c, torch.ones(4), key=0).wait(), 2 * torch.ones(4))`
    """
    future = torch.futures.Future()
    part = Partition(tensor, key, server, out, mode, key_numel, offset, out_offset, codec, dense_numel)
    client.push_pull_batch([part], priority=priority, on_done=completer(future, tensor if out is None else out))
    return future


# -- stand-ins for the CUDA paths on machines without a GPU: a recording `CudaOps` (device/cuda_ops.py) that copies
# CPU tensors at once and logs every stream, event and copy, in order.
DEVICE = torch.device("cuda", 0)  # a label only: the recorder never touches a GPU


class _Event:
    def __init__(self, n: int):
        self.n, self.stream = n, None


class RecordingOps:
    """CudaOps that performs copies at once on CPU tensors and logs every operation, in order, as tuples."""

    def __init__(self):
        self.log: list[tuple] = []
        self._lock = threading.Lock()
        self._events = 0
        self._pinned: list[torch.Tensor] = []
        self._current = threading.local()

    def _add(self, *entry) -> None:
        with self._lock:
            self.log.append(entry)

    def current_stream(self, device):
        return getattr(self._current, "stream", "caller")

    def side_stream(self, device):
        return "side"

    def new_stream(self, device):
        with self._lock:
            self._events += 1
            return f"stream-{self._events}"

    def new_event(self):
        with self._lock:
            self._events += 1
            return _Event(self._events)

    def record(self, event, stream):
        event.stream = stream
        self._add("record", stream, event.n)

    def wait_event(self, stream, event):
        assert event.stream is not None, "waited for an event never recorded"
        self._add("wait", stream, event.n)

    def wait_host(self, event, timeout, what):
        assert event.stream is not None, "host-waited for an event never recorded"
        self._add("host_wait", event.n)

    def _is_host(self, t: torch.Tensor) -> bool:
        p = t.data_ptr()
        return any(b.data_ptr() <= p < b.data_ptr() + b.numel() for b in self._pinned)

    def copy(self, dst, src, stream):
        dst.copy_(src)
        kind = "d2h" if self._is_host(dst) else "h2d" if self._is_host(src) else "d2d"
        self._add("copy", stream, kind, src.numel())

    def record_stream(self, tensor, stream):
        self._add("record_stream", stream)

    def pinned(self, nbytes):
        self._add("pinned", self.current_stream(DEVICE))  # "side": allocated with the device set (on_stream)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            self._pinned.append(buf)
        return buf

    @contextlib.contextmanager
    def on_stream(self, device, stream):
        before = self.current_stream(device)
        self._current.stream = stream
        self._add("enter", stream)
        try:
            yield
        finally:
            self._current.stream = before

    def future(self, devices):
        self._add("future", tuple(str(d) for d in devices))
        return torch.futures.Future()

    def index(self, entry: tuple) -> int:
        return self.log.index(entry)

    def pushes(self) -> list[int]:
        return [e[1] for e in self.log if e[0] == "push"]


# -- the same model trained with DDP on two process groups side by side, for the tests that compare a torch_bps
# path with gloo: both copies start from the same weights and see the same data; their gradients must agree within
# a tolerance every step, and every rank must end with bit-identical parameters.
PAIR_TOL = dict(rtol=1e-5, atol=1e-6)
PAIR_STEPS = 4


class BNNet(nn.Module):
    """Buffers (BatchNorm running stats, broadcast by DDP every forward) and an unused branch."""

    def __init__(self, with_unused: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)
        self.unused = nn.Linear(32, 4) if with_unused else None

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.bn(self.fc1(x))))))


def train_pair(rank, world, gloo, bps_group, ddp_kwargs, with_unused, hooks=None, tol=PAIR_TOL):
    """Train one model on each group for PAIR_STEPS steps; compare gradients every step. Returns the max deviation."""
    torch.manual_seed(0)
    base = BNNet(with_unused)
    models = {"byteps": DDP(copy.deepcopy(base), process_group=bps_group, **ddp_kwargs),
              "gloo": DDP(copy.deepcopy(base), process_group=gloo, **ddp_kwargs)}  # fmt: skip
    if hooks is not None:
        for name, (state, hook) in hooks.items():
            models[name].register_comm_hook(state, hook)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    worst = 0.0
    for step in range(PAIR_STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        for name, m in models.items():
            opts[name].zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
        for (pn, pb), pg_ in zip(models["byteps"].named_parameters(), models["gloo"].parameters(), strict=True):
            if pb.grad is None or pg_.grad is None:
                assert pb.grad is None and pg_.grad is None, f"{pn}: grad on one side only"
                continue
            torch.testing.assert_close(pb.grad, pg_.grad, **tol, msg=lambda m, pn=pn, s=step: f"step {s} {pn}: {m}")
            worst = max(worst, (pb.grad - pg_.grad).abs().max().item())
        for o in opts.values():
            o.step()
    # every rank holds the same parameters (buffers differ until the next forward's broadcast: BN statistics)
    state = torch.cat([p.detach().reshape(-1) for p in models["byteps"].parameters()])
    everyone = [torch.empty_like(state) for _ in range(world)]
    dist.all_gather(everyone, state, group=gloo)
    assert all(torch.equal(everyone[0], s) for s in everyone), "parameters differ across ranks"
    return worst
