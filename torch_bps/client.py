"""The data-plane client: push a tensor to a summation server and pull back the sum over all workers.

`Client` wraps the C++ client of `torch_bps._C` (cpp_ext/): one IO thread owns a ZeroMQ DEALER per
server, sends payloads zero-copy from the caller's tensor and copies each sum straight into the
destination tensor. Each `push_pull` returns a `torch.futures.Future` completed on a completion thread,
never the IO thread, so `then` callbacks may block, even on other push_pulls of the same client: the
completion pool starts another thread whenever all of its threads are busy, up to 64 callbacks blocked
at once (beyond that, further completions wait for one to return).

Failures: a timeout names the server, job, key, round, worker and the reply waited for; a dropped
connection fails that server's outstanding requests at once (TransportError); a server's error reply
becomes ServerError(status, message). After a failure the key's rounds may be out of step with the
other workers (the job is broken, as after a collective error), and a timed-out push may still be
leaving: do not reuse that tensor's memory for anything the server must not see.

`push_pull_batch` hands a whole collective's partitions down at once: the IO thread sends them in priority
order within a credit of bytes in flight and completes one future when all are back (see cpp_ext/client/client.h).

May import: the standard library, torch, torch_bps.address, torch_bps.config, torch_bps.wire, torch_bps.errors,
torch_bps.futures, torch_bps.security and torch_bps._C.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence

import torch

from torch_bps import _C
from torch_bps.address import split_host_port
from torch_bps.config import DEFAULT_CREDIT_BYTES, from_environment, transport_options
from torch_bps.errors import TransportError
from torch_bps.futures import completer
from torch_bps.security import ClientCredentials
from torch_bps.wire import DTYPE_CODES, STATS_FIELDS, Mode, Partition, codec_name

_U64 = 1 << 64
# A batch part's outcome (push_pull_batch's `outcomes`; cpp_ext/client/options.h PartOutcome).
OUTCOME_OK, OUTCOME_SERVER_LOST, OUTCOME_FAILED, OUTCOME_NOT_RUN = 0, 1, 2, 3


def job_id_from_name(name: str) -> int:
    """Return a stable 64-bit job id for a job name (blake2b), so jobs can be named by string.

    Example: `Client(servers, job_id_from_name("resnet-run-7"), worker=0, num_workers=4)`.
    """
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


class _Pending:
    """Completion callbacks waiting for the C++ client, by token. Separate from Client so the C++ side's
    reference to `complete` does not keep the Client alive (its finalizer closes the C++ client)."""

    def __init__(self) -> None:
        self.callbacks: dict[int, Callable[[BaseException | None], None]] = {}

    def complete(self, token: int, error: BaseException | None) -> None:
        # Called by the C++ completion threads with the GIL held.
        self.callbacks.pop(token)(error)


def _check_tensor(t: object, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}: push_pull takes CPU tensors")
    if t.layout != torch.strided:
        raise ValueError(f"{name} has layout {t.layout}: push_pull takes dense (strided) tensors")
    if t.dtype not in DTYPE_CODES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise TypeError(f"{name} has dtype {t.dtype}, which the wire cannot carry; supported: {supported}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}): call .contiguous()")


def default_credentials(job_id: int, num_servers: int) -> ClientCredentials | None:
    """Return what a Client given no credentials presents: `ClientCredentials.for_pool` with BPS_POOL_CREDENTIAL and
    BPS_AUTH's mechanism, or None (no authentication) if the credential is unset or BPS_AUTH=off.

    Example: `RawPeer(address, job_id, auth=default_credentials(job_id, 1))` speaks as that job's Client would.
    """
    credential, mechanism = from_environment("pool_credential"), from_environment("auth")
    if not credential or mechanism == "off":
        return None
    return ClientCredentials.for_pool(credential, job_id, num_servers, mechanism)


class Client:
    """A worker's connection to the summation servers of one job.

    Args:
        servers: "host:port" of every server; keys are spread over them (key % len(servers)).
        job_id: the job, a u64 (see `job_id_from_name`); keys are namespaced by job on the servers.
        worker: this worker's index, 0 <= worker < num_workers.
        num_workers: how many workers push every round.
        timeout: seconds a request may wait for its reply (from when it is sent). A PULL waiting that long on
            workers that have not pushed is answered by the server with an error naming them.
        connect_timeout: seconds to wait for every server's HELLO reply.
        heartbeat_interval, heartbeat_timeout: a server silent for heartbeat_timeout seconds after a
            heartbeat (stopped, cut off) counts as lost; a killed one is known at once.
        auth: credentials (torch_bps.security.ClientCredentials, for every server): every connection is
            authenticated by token, or also encrypted by CURVE (`auth.mechanism`). None: those of
            BPS_POOL_CREDENTIAL if it is set (and BPS_AUTH is not off; see `default_credentials`);
            False: no authentication, for servers run with `--auth off`.
        credit_bytes: bytes of `push_pull_batch` pushes in flight (sent, not yet acknowledged) at most; one
            partition may always go, however big. With `auto_credit`, where the credit starts.
        auto_credit: the client sizes the credit from its pushes, as they are acknowledged: a partition toward
            each server it feeds plus the acknowledged push rate times 8 ms (cpp_ext/client/credit_sizer.h);
            `scheduler_stats()["credit_bytes"]` is the credit now.
        server_credit_bytes: the same toward any one server; 0: no limit but credit_bytes. One partition
            per server may always go, however big.
        socket_buffer_bytes: SO_SNDBUF and SO_RCVBUF of every server connection, which bound its bytes in
            flight both ways (pushes out, replies in); 0: the kernel's autotuned buffers.
        receive_buffer_bytes: SO_RCVBUF of each server's stream, one per server, in place of
            socket_buffer_bytes (0: the kernel's), e.g. `engine.placement.receive_buffers`; empty: all alike.
        failover: batches go on past a lost server and report each part's outcome (`push_pull_batch`), and per
            key the client keeps what failover needs (`kept`, `kept_bytes`; torch_bps/failover.py).
        on_link_down: called as `on_link_down(server_index, why)` on a completion thread whenever a server's
            connection goes down (or it comes back as another incarnation).
        stream: beside each ZeroMQ connection, use the plain TCP stream a server offers (not under CURVE;
            docs/protocol.md, "The stream transport"); a server offering none, or whose stream fails to open,
            is reached over ZeroMQ. None: BPS_TRANSPORT ("stream", the default, or "tcp"; not "zmq").
        local_stream: a server on this machine (in this network namespace) is reached over its local stream, a
            unix socket, where it offers one (docs/protocol.md): no TCP stack on the bytes. None: BPS_TRANSPORT is
            "stream" or "unix" (not "tcp").
        shared_memory: on a local stream, big frames go through shared memory the server maps
            (cpp_ext/transport/shared_ring.h): two memcpys in place of a unix socket's work. None: BPS_TRANSPORT is
            "stream" (not "unix").
        backups: backup workers b (docs/protocol.md): a floating SUM round closes once num_workers - b workers
            pushed it, its sum scaled to stand for all; every worker of the job must give the same b and window.
        window: with backups, rounds alive per key (2 to 64): how far a slow worker may fall behind and still
            catch up by pulling the rounds it missed.
        staleness: s for MODEL keys (asynchronous training, docs/protocol.md): a pull of round r waits until every
            worker pushed round r - s; None: never waits for the others. Every worker of the job gives the same.

    Example:
        with Client(["10.0.0.5:9000"], job_id_from_name("demo"), worker=0, num_workers=2) as c:
            total = c.push_pull(torch.ones(4), key=0).wait()
    """

    def __init__(
        self,
        servers: Sequence[str],
        job_id: int,
        worker: int,
        num_workers: int,
        *,
        timeout: float = 300.0,
        connect_timeout: float = 30.0,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 10.0,
        auth: ClientCredentials | bool | None = None,
        credit_bytes: int = DEFAULT_CREDIT_BYTES,
        server_credit_bytes: int = 0,
        socket_buffer_bytes: int = 0,
        failover: bool = False,
        on_link_down: Callable[[int, str], None] | None = None,
        stream: bool | None = None,
        auto_credit: bool = False,
        receive_buffer_bytes: Sequence[int] = (),
        local_stream: bool | None = None,
        shared_memory: bool | None = None,
        backups: int = 0,
        window: int = 2,
        staleness: int | None = 0,
    ) -> None:
        if isinstance(servers, str):
            raise TypeError("servers must be a sequence of 'host:port' strings, not one string")
        self._servers = tuple(servers)
        if not self._servers:
            raise ValueError("servers is empty: give at least one 'host:port'")
        for s in self._servers:
            split_host_port(s)
        if not 0 <= job_id < _U64:
            raise ValueError(f"job_id {job_id} is not a u64")
        if not 0 < num_workers < 1 << 32 or not 0 <= worker < num_workers:
            raise ValueError(f"worker {worker} must be in [0, num_workers={num_workers})")
        if not all(t > 0 for t in (timeout, connect_timeout, heartbeat_interval, heartbeat_timeout)):  # and NaN
            raise ValueError(
                f"timeouts must be positive (timeout={timeout}, connect_timeout={connect_timeout}, "
                f"heartbeat_interval={heartbeat_interval}, heartbeat_timeout={heartbeat_timeout})"
            )
        if not 0 <= backups < num_workers or not 2 <= window <= 64 or (window != 2 and not backups):
            raise ValueError(f"backups={backups} must be in [0, num_workers={num_workers}) and window={window} in "
                             "[2, 64] (2 without backups)")  # fmt: skip
        if staleness is not None and not 0 <= staleness < _U64 - 1 or (staleness != 0 and backups):
            raise ValueError(f"staleness={staleness} must be None or in [0, 2^64 - 1), and 0 with backups")
        if credit_bytes <= 0:
            raise ValueError(f"credit_bytes must be positive, got {credit_bytes}")
        if server_credit_bytes < 0 or not 0 <= socket_buffer_bytes < 1 << 31:
            raise ValueError(
                f"server_credit_bytes={server_credit_bytes} and socket_buffer_bytes={socket_buffer_bytes} must not be "
                "negative (0: no per-server limit, the kernel's buffers)"
            )
        receive_buffer_bytes = [int(b) for b in receive_buffer_bytes]
        if receive_buffer_bytes and (
            len(receive_buffer_bytes) != len(self._servers) or not all(0 <= b < 1 << 31 for b in receive_buffer_bytes)
        ):
            raise ValueError(
                f"receive_buffer_bytes {receive_buffer_bytes} must hold one size in [0, 2^31) per server "
                f"({len(self._servers)})"
            )
        by_name = transport_options(from_environment("transport"))
        stream = by_name["stream"] if stream is None else stream
        local_stream = by_name["local_stream"] if local_stream is None else local_stream
        shared_memory = by_name["shared_memory"] if shared_memory is None else shared_memory
        self.job_id, self.worker, self.num_workers = job_id, worker, num_workers
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)  # 0 means "no token" to the C++ side
        self._keys: dict[int, tuple[int, torch.dtype, int, Mode, int]] = {}  # key -> its signature
        self._pending = _Pending()
        if auth is None:
            auth = default_credentials(job_id, len(self._servers))
        if isinstance(auth, ClientCredentials) and len(auth.tokens) != len(self._servers):
            raise ValueError(f"auth has credentials for {len(auth.tokens)} servers, not {len(self._servers)}")
        credentials = auth.keywords() if isinstance(auth, ClientCredentials) else {}
        self._impl = _C.Client(list(self._servers), job_id, worker, num_workers, timeout, heartbeat_interval,
                               heartbeat_timeout, self._pending.complete, credit_bytes=credit_bytes,
                               server_credit_bytes=server_credit_bytes, socket_buffer_bytes=socket_buffer_bytes,
                               failover=failover, on_link_down=on_link_down, stream=stream, auto_credit=auto_credit,
                               receive_buffer_bytes=receive_buffer_bytes, local_stream=local_stream,
                               shared_memory=shared_memory, backups=backups, window=window,
                               staleness=_U64 - 1 if staleness is None else staleness,
                               **credentials)  # fmt: skip
        self._finalizer = weakref.finalize(self, self._impl.close)
        try:
            self._incarnations = tuple(self._impl.hello(connect_timeout))
        except TransportError as e:
            self.close()
            how = f"with BPS_AUTH={auth.mechanism}" if isinstance(auth, ClientCredentials) else "without authentication"
            raise TransportError(
                f"{e}. This client connects {how}: a server that runs otherwise, or holds another credential, "
                "drops the connection (check BPS_AUTH and BPS_POOL_CREDENTIAL on both sides)"
            ) from e
        except BaseException:
            self.close()
            raise

    @property
    def servers(self) -> tuple[str, ...]:
        return self._servers

    @property
    def incarnations(self) -> tuple[int, ...]:
        """Each server's incarnation from its HELLO reply (a restarted server has a new one)."""
        return self._incarnations

    def push_pull(
        self,
        tensor: torch.Tensor,
        key: int,
        *,
        server: int | None = None,
        out: torch.Tensor | None = None,
        pushed: torch.futures.Future | None = None,
        on_done: Callable[[BaseException | None], None] | None = None,
        on_pushed: Callable[[BaseException | None], None] | None = None,
        mode: Mode = Mode.SUM,
        key_numel: int | None = None,
        offset: int = 0,
        out_offset: int = 0,
    ) -> torch.futures.Future | None:
        """Sum `tensor` over all workers of the job; return a Future of `out` holding the sum.

        Each call is the key's next round. A round still in flight holds the next one back until its
        result arrived. `tensor` must stay unchanged until the future completes (it is sent zero-copy).
        With `mode=Mode.COPY` nothing is summed: each worker writes `tensor` at element `offset` of the
        key (the workers' pieces must tile it; a piece may be empty) and `out` receives the gathered bytes.

        Args:
            tensor: CPU, contiguous, a dtype of torch_bps.wire.DTYPE_CODES; same numel/dtype every call.
            key: the partition's key (u64); the same on every worker.
            server: index into `servers`; default `key % len(servers)`; fixed per key.
            out: where the result goes (contiguous, same dtype): elements [out_offset, out_offset + out.numel())
                of the key's result; default `tensor`, in place (SUM), or the whole key (COPY: required).
            mode: Mode.SUM (the default) or Mode.COPY; fixed per key.
            key_numel: the key's size in elements; default tensor.numel() (SUM keys are pushed whole).
            offset: COPY only: where `tensor` goes in the key, in elements.
            out_offset: the first element of the result to pull into `out`.
            pushed: optional Future, completed (with None) once the server acknowledged the push, or when
                the push_pull ends without that: for flow control of bytes leaving this worker.
            on_done, on_pushed: instead of the futures, callables run with None or the error on a completion
                thread (they may block); with on_done, push_pull returns None.

        Example: `fut = client.push_pull(grad, key=3); grad_sum = fut.wait()`
        """
        claimed: list[int] = []
        part = self._part_args(tensor, key, server, out, mode, key_numel, offset, out_offset, claimed=claimed)
        future = None
        if on_done is None:
            future = torch.futures.Future()
            on_done = completer(future, part[3])
        if pushed is not None:
            on_pushed = completer(pushed, None)
        token = self._register(on_done)
        pushed_token = self._register(on_pushed) if on_pushed is not None else 0
        try:
            self._impl.push_pull(token, part, pushed_token)  # never compressed
        except BaseException:
            self._pending.callbacks.pop(token, None)
            self._pending.callbacks.pop(pushed_token, None)
            self._release(claimed)
            raise
        return future

    def push_pull_batch(
        self,
        parts: Sequence[Partition],
        *,
        priority: int = 0,
        on_done: Callable[[BaseException | None], None] | None = None,
        outcomes: torch.Tensor | None = None,
    ) -> torch.futures.Future | None:
        """Run one `push_pull` per part, scheduled by the client; return a Future of None, done when all are.

        The client's IO thread sends the parts of every batch in priority order (higher first, then
        submission order) with at most `credit_bytes` of pushes unacknowledged; a part's credit returns when
        its server acknowledged the push. After a part failed, parts not yet sent are not sent and those in flight
        end at once (OUTCOME_NOT_RUN); the batch completes once, with the first part's error.

        Args:
            parts: a `torch_bps.wire.Partition` per part (or a tuple of its fields, in order): `push_pull`'s
                arguments (`server` and `out` may be None, as there).
            priority: the batch's, for all its parts.
            on_done: instead of the future, a callable run with None or the error on a completion thread.
            outcomes: a uint8 tensor of len(parts): each part's outcome is written there before the batch completes
                (OUTCOME_OK, OUTCOME_SERVER_LOST, OUTCOME_FAILED, OUTCOME_NOT_RUN). With `failover`, a part whose
                server was lost does not fail the batch: the other parts run on.

        Example: `client.push_pull_batch([Partition(g[:n], key=0), ...], priority=3).wait()`
        """
        future = None
        if on_done is None:
            future = torch.futures.Future()
            on_done = completer(future, None)
        token = self._register(on_done)
        claimed: list[int] = []
        try:
            specs = [self._part_args(*part, claimed=claimed) for part in parts]
            self._impl.push_pull_batch(token, specs, priority, outcomes)
        except BaseException:
            self._pending.callbacks.pop(token, None)
            self._release(claimed)
            raise
        return future

    def kept(self, key: int) -> tuple[int, bool, int]:
        """With `failover`: (rounds of `key` completed, whether the last one's whole result is kept (else the bytes
        it pushed are), the byte offset in the key those pushed bytes went to)."""
        return self._impl.kept(key)

    def kept_bytes(self, key: int) -> torch.Tensor:
        """With `failover`: a copy of what `key`'s last completed round kept (uint8; empty if none)."""
        return self._impl.kept_bytes(key)

    def abandon(self, server: int, why: str) -> None:
        """Treat server `server` as lost for good: everything outstanding on it fails now (TransportError naming
        `why`, outcome OUTCOME_SERVER_LOST), and it is never reconnected to."""
        self._impl.abandon(server, why)

    def scheduler_stats(self) -> dict[str, int]:
        """The batch scheduler's counters: credit_bytes, credit_in_flight (0 when idle), peak_credit_in_flight,
        queued, push_bytes_in_flight and its peak (counted apart from the credit, from a batch PUSH leaving to
        its acknowledgement), parts_sent, parts_acknowledged; server_credit_bytes, peak_server_credit_in_flight
        (the most credit one server's partitions held) and peak_server_push_bytes_in_flight (the most PUSH bytes
        in flight toward one server, counted apart from the credit); io_wakeups, the client's IO thread's waits that
        returned something to do."""
        return self._impl.scheduler_stats()

    def take_behind(self) -> int:
        """With backup workers: the most rounds of a key that had already closed past one this client pulled, since
        the last call (0: this worker is not behind the others)."""
        return self._impl.take_behind()

    def _part_args(self, tensor, key, server=None, out=None, mode=Mode.SUM, key_numel=None, offset=0, out_offset=0,
                   codec=0, dense_numel=0, *, claimed: list[int]) -> tuple:  # fmt: skip
        """Check what only Python knows of a partition (its tensors' types; its key's first use, added to `claimed`)
        and return it as the C++ PartSpec takes it: `Partition`'s fields, in elements, then the dtype's wire code.
        Whether it fits its key is checked once, in C++ (Client::makePushOp: a ValueError naming key, part, bound)."""
        _check_tensor(tensor, "tensor")
        mode = mode if type(mode) is Mode else Mode(mode)
        key_numel = tensor.numel() if key_numel is None else key_numel
        if out is None:
            if mode == Mode.COPY:
                raise ValueError("push_pull with mode=Mode.COPY needs `out`, where the gathered key goes")
            out = tensor
        elif out is not tensor:  # an all-reduce's partition pulls into the tensor it pushed: checked just above
            _check_tensor(out, "out")
        if not isinstance(key, int) or not 0 <= key < _U64:
            raise ValueError(f"key {key!r} is not a u64")
        if server is None:
            server = key % len(self._servers)
        elif not 0 <= server < len(self._servers):
            raise ValueError(f"server index {server} is out of range: {len(self._servers)} servers")
        if codec and (mode != Mode.SUM or tensor.dtype != torch.float32 or dense_numel <= 0):
            raise ValueError(f"key {key}: a compressed key ({codec_name(codec)}) is an fp32 SUM key of dense elements")
        signature = (key_numel, tensor.dtype, server, mode, codec)
        with self._lock:
            known = self._keys.setdefault(key, signature)
        if known is signature:
            claimed.append(key)
        elif known != signature:
            raise ValueError(
                f"key {key} was first used with {known[0]} elements of {known[1]} on server {known[2]} "
                f"({known[3].name}, {codec_name(known[4])}), now {signature[0]} elements of {signature[1]} on server "
                f"{signature[2]} ({mode.name}, {codec_name(codec)}): a key's size, dtype, server, mode and codec never "
                "change"
            )
        return (tensor, key, server, out, int(mode), key_numel, offset, out_offset, codec, dense_numel if codec else 0,
                DTYPE_CODES[tensor.dtype])  # fmt: skip

    def _release(self, keys: list[int]) -> None:
        """Forget the first use of `keys`: the C++ client refused the call that used them first, nothing was sent."""
        with self._lock:
            for key in keys:
                self._keys.pop(key, None)

    def server_stats(self, server: int) -> dict[str, int]:
        """Return the counters of server `server` (names: torch_bps.wire.STATS_FIELDS). Blocks."""
        if not 0 <= server < len(self._servers):
            raise ValueError(f"server index {server} is out of range: {len(self._servers)} servers")
        counters = torch.zeros(len(STATS_FIELDS), dtype=torch.int64)
        future: torch.futures.Future = torch.futures.Future()
        token = self._register(completer(future, counters))
        try:
            self._impl.stats(token, server, counters)
        except BaseException:
            self._pending.callbacks.pop(token, None)
            raise
        # Counters are u64 on the wire; they stay far below 2**63, so int64 reads them unchanged.
        return dict(zip(STATS_FIELDS, future.wait().tolist(), strict=True))

    def record_steps(self, capacity: int) -> tuple[torch.Tensor, int]:
        """Return (events, dropped) the IO thread recorded since the last call and record up to `capacity` more
        (0: stop): the partitions' steps, for torch_bps.timeline (cpp_ext/common/trace.h has the columns)."""
        return self._impl.trace(capacity)

    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn()` on one of the client's completion threads (where push_pull completions run)."""
        self._impl.post(fn)

    def _register(self, callback: Callable[[BaseException | None], None]) -> int:
        token = next(self._tokens)
        self._pending.callbacks[token] = callback
        return token

    def bytes_sent(self) -> list[int]:
        """Per server, every byte (headers and payloads) this client has sent."""
        return list(self._impl.bytes_sent())

    def bytes_received(self) -> list[int]:
        """Per server, every byte (headers and payloads) this client has received."""
        return list(self._impl.bytes_received())

    def stream_ready(self, server: int) -> bool:
        """Whether `server`'s stream is ready now: operations started now send their requests on it, not ZeroMQ."""
        return self._impl.stream_ready(server)

    def stream_local(self, server: int) -> bool:
        """Whether `server`'s stream is ready and is its local stream (a unix socket on this machine), not TCP."""
        return self._impl.stream_local(server)

    def stream_shared(self, server: int) -> bool:
        """Whether `server`'s stream is ready and moves its big frames through shared memory (a local stream)."""
        return self._impl.stream_shared(server)

    def stream_shared_bytes(self) -> list[int]:
        """Per server, the frame bytes its streams moved through shared memory, both ways (also in `stream_bytes`)."""
        return list(self._impl.stream_shared_bytes())

    def stream_bytes(self) -> list[tuple[int, int]]:
        """Per server, the bytes (headers and payloads) sent and received on its streams; counted in `bytes_sent`
        and `bytes_received` too."""
        return list(zip(self._impl.stream_bytes_sent(), self._impl.stream_bytes_received(), strict=True))

    def close(self) -> None:
        """Fail everything outstanding (its futures get an error), join the client's threads. Idempotent."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Client(servers={self._servers}, job_id={self.job_id:#x}, worker={self.worker}/{self.num_workers}, "
                f"{'closed' if self.closed else 'open'})")  # fmt: skip


__all__ = ["Client", "job_id_from_name"]
