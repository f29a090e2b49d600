"""Only the job gets in (issue 12): authentication by token and by CURVE, jobs bound to identities, servers
that listen where they should. Real server processes, real clients and raw peers over real sockets.

The cast: a pool server holding the session's pool credential P; a *job* whose workers connect with the
keys of their own job secret (as torch_bps.runtime does); *strangers* who know the server's address and the
job id but not P; *neighbours*, other jobs on the same pool (they hold P, not the job's secret).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading

import pytest
import torch

from tests.helpers import REPO, RawPeer, ServerProcess, push_pull_part, run_ranks
from torch_bps.client import Client
from torch_bps.config import Config
from torch_bps.engine.placement import Server
from torch_bps.errors import ConfigError, TransportError
from torch_bps.runtime import _client_credentials, _start_server
from torch_bps.security import ClientCredentials, KeyPair, derive, new_secret, token
from torch_bps.wire import Command, Status

pytestmark = pytest.mark.timeout(120)

JOB = 0x5EC0_0001


def pool() -> str:
    return os.environ["BPS_POOL_CREDENTIAL"]


def job_clients(server: ServerProcess, secret: str, job_id: int = JOB, n: int = 2) -> list[Client]:
    credentials = ClientCredentials.for_servers(secret, [pool()], server.mechanism)
    return [Client([server.address], job_id, w, n, timeout=20, auth=credentials) for w in range(n)]


def neighbour(server: ServerProcess, job_id: int = JOB, worker: int = 0) -> RawPeer:
    """A peer holding the pool credential with an identity of its own (another job on the pool)."""
    return RawPeer(server.address, job_id, worker, 2, timeout=5,
                   auth=ClientCredentials.for_servers(new_secret(), [pool()], server.mechanism))  # fmt: skip


def all_reduce_rounds(clients: list[Client], rounds: int, key: int = 3) -> int:
    """Run `rounds` all-reduces of distinct data; return how many results were wrong on any worker."""
    wrong = 0
    for r in range(rounds):
        tensors = [torch.full((4096,), float(r * 10 + w)) for w, _ in enumerate(clients)]
        expected = sum(t.clone() for t in tensors)
        futures = [push_pull_part(c, t, key) for c, t in zip(clients, tensors, strict=True)]
        wrong += sum(not torch.equal(f.wait(), expected) for f in futures)
    return wrong


@pytest.fixture(params=["token", "curve"])
def pool_server(request):
    s = ServerProcess(extra_args=("--auth", request.param))
    s.mechanism = request.param
    yield s
    s.stop()


def test_the_issues_attack_a_foreign_pusher_is_rejected_and_sums_stay_right(pool_server):
    """A process that knows the address and the job id says HELLO as worker 0 and pushes into every next round
    while the job runs (issue 12: without authentication its pushes land in the job's sums). Strangers get no byte
    back; a neighbour holding the pool credential gets refusals that name nothing of the job; every sum stays
    right."""
    clients = job_clients(pool_server, new_secret())
    stop = threading.Event()
    seen: list[tuple[int, bytes]] = []

    def attack():
        stranger = RawPeer(pool_server.address, JOB, 0, 2, timeout=0.2, auth=False)
        other_pool = ClientCredentials.for_servers(new_secret(), ["another pool"], pool_server.mechanism)
        wrong_pool = RawPeer(pool_server.address, JOB, 0, 2, timeout=0.2, auth=other_pool)
        insider = neighbour(pool_server)
        while not stop.is_set():
            for peer in (stranger, wrong_pool):
                with pytest.raises(TimeoutError):  # the handshake fails: nothing comes back, ever
                    peer.request(Command.HELLO, num_workers=2)
            for rnd in range(8):
                h, rest = insider.request(Command.HELLO, num_workers=2)
                seen.append((h.status, rest[0] if rest else b""))
                data = torch.full((4096,), 1e6).numpy().tobytes()
                h, rest = insider.request(Command.PUSH, data, key=3, round=rnd, nbytes=len(data), dtype=1,
                                          incarnation=pool_server.incarnation)  # fmt: skip
                seen.append((h.status, rest[0] if rest else b""))
        for peer in (stranger, wrong_pool, insider):
            peer.close()

    attacker = threading.Thread(target=attack)
    attacker.start()
    try:
        assert all_reduce_rounds(clients, 60) == 0
    finally:
        stop.set()
        attacker.join()
        for c in clients:
            c.close()
    assert seen and all(status == Status.UNKNOWN_JOB for status, _ in seen)
    for _, message in seen:  # refused as if the job did not exist: no key size, no round, no worker count
        assert b"4096" not in message and b"16384" not in message and b"round" not in message


def test_a_stranger_cannot_squat_the_jobs_keys(pool_server):
    """INIT of the job's keys with a wrong size, by a stranger before the job starts, does not kill the job."""
    secret = new_secret()
    stranger = RawPeer(pool_server.address, JOB + 1, 0, 2, timeout=0.5, auth=False)
    with pytest.raises(TimeoutError):
        stranger.request(Command.HELLO, num_workers=2)
    for key in range(4):  # whatever it sends, nothing reaches the server's state
        with contextlib.suppress(TimeoutError):  # between refused handshakes ZeroMQ has no pipe to queue on
            stranger.send(Command.INIT, key=key, nbytes=8, dtype=1)
    stranger.close()
    clients = job_clients(pool_server, secret, JOB + 1)
    try:
        assert all_reduce_rounds(clients, 3, key=0) == 0
    finally:
        for c in clients:
            c.close()


def test_two_jobs_with_different_secrets_on_one_pool_cannot_touch_each_others_keys(pool_server):
    a = job_clients(pool_server, new_secret(), JOB + 2)
    try:
        assert all_reduce_rounds(a, 1) == 0  # job A holds its job id and key 3 now
        b_credentials = ClientCredentials.for_servers(new_secret(), [pool()], pool_server.mechanism)
        with pytest.raises(Exception, match="belongs to another job"):  # B names A's job id
            Client([pool_server.address], JOB + 2, 0, 2, auth=b_credentials, connect_timeout=5)
        b_peer = neighbour(pool_server, JOB + 2)
        for command in (Command.INIT, Command.PUSH, Command.PULL):
            frames = [b"\0" * 16384] if command == Command.PUSH else []
            h, rest = b_peer.request(command, *frames, key=3, round=1, nbytes=16384, dtype=1,
                                     incarnation=pool_server.incarnation)  # fmt: skip
            assert h.status == Status.UNKNOWN_JOB and rest[0].endswith(b"has not said HELLO to this server")
        b_peer.close()
        b = [Client([pool_server.address], JOB + 3, w, 2, auth=b_credentials) for w in range(2)]  # B's own job works
        try:
            assert all_reduce_rounds(b, 3) == 0
            assert all_reduce_rounds(a, 3) == 0
        finally:
            for c in b:
                c.close()
    finally:
        for c in a:
            c.close()


@pytest.mark.parametrize("mechanism", ["token", "curve"])
def test_an_embedded_server_lets_in_its_job_only_and_listens_on_the_jobs_interface(mechanism):
    secret = new_secret()
    proc, port = _start_server(Config.resolve(auth=mechanism), 30, "127.0.0.1", secret)
    try:
        assert _listening(proc.pid, port) == {"127.0.0.1"}
        address = f"127.0.0.1:{port}"
        mine = ClientCredentials.for_servers(secret, [secret], mechanism)
        with Client([address], 9, 0, 1, auth=mine) as c:
            assert torch.equal(push_pull_part(c, torch.ones(3), 0).wait(), torch.ones(3))
        # Knowing the server's secret is not enough here: the ZAP handler admits the job's own identity only.
        other = ClientCredentials._make(derive(new_secret(), "client"), [secret], mechanism)
        # The job's identity with a proof made without the secret: a token of another secret, a CURVE secret key
        # that is not the identity's.
        forged = ClientCredentials(KeyPair(mine.client.public, other.client.secret), mine.server_keys,
                            (token(new_secret(), mine.client.public),), mechanism)  # fmt: skip
        other_mechanism = ClientCredentials.for_servers(secret, [secret], "curve" if mechanism == "token" else "token")
        for credentials in (other, forged, other_mechanism, ClientCredentials.for_pool(pool(), 9, 1, mechanism), False):
            with pytest.raises(TransportError, match="drops the connection"):
                Client([address], 9, 0, 1, auth=credentials, connect_timeout=5)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_dedicated_servers_without_the_pool_credential_are_a_config_error():
    servers = [Server("10.0.0.5:9000", True, 0.5), Server("127.0.0.1:1", False, 0.5)]
    with pytest.raises(ConfigError, match="BPS_POOL_CREDENTIAL"):
        _client_credentials(Config(), new_secret(), servers)
    credentials = _client_credentials(Config(pool_credential="p"), "s", servers)
    assert credentials.server_keys == (derive("p", "server").public, derive("s", "server").public)
    assert _client_credentials(Config(auth="off"), "s", servers) is False
    assert "s3cret" not in repr(Config(pool_credential="s3cret"))  # never printed


@pytest.mark.parametrize(
    "args, env, words",
    [
        (["--port", "0"], {}, "--host"),
        (["--host", "127.0.0.1", "--port", "0"], {"BPS_POOL_CREDENTIAL": ""}, "BPS_POOL_CREDENTIAL"),
    ],
)
def test_bps_server_refuses_to_start_without_a_bind_address_or_a_credential(args, env, words):
    env = {**os.environ, "PYTHONPATH": REPO, "BPS_SERVER_HOST": "", **env}
    done = subprocess.run([sys.executable, "-m", "torch_bps.server", *args], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0 and words in done.stderr, done.stderr


def _listening(pid: int, port: int) -> set[str]:
    """IPv4 addresses process pid listens on at port (from /proc/PID/net/tcp)."""
    found = set()
    with open(f"/proc/{pid}/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            host, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(".".join(str(int(host[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def _all_reduce(rank, world, gloo):
    import torch.distributed as dist

    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    return t[:2].tolist()


@pytest.mark.parametrize("auth", ["token", "curve", "off"])
def test_a_job_runs_with_every_authentication(auth):
    """The default (embedded servers, a token from the job's secret in the store), CURVE, and BPS_AUTH=off."""
    assert run_ranks(_all_reduce, 2, env={"BPS_AUTH": auth}) == [[3.0, 3.0]] * 2
