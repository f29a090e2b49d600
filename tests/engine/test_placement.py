"""The paper's split, byte-balanced placement and partitioning: pure logic, no processes."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_bps.config import (
    DEFAULT_CREDIT_BYTES,
    DEFAULT_MIN_PARTITION_BYTES,
    SMALLEST_PARTITION_BYTES,
    Config,
    default_credit_bytes,
)
from torch_bps.engine.partition import KeyBook, cut, cut_mixed
from torch_bps.engine.placement import (
    MIN_RECEIVE_WINDOW,
    Placement,
    dedicated_fraction,
    receive_buffers,
    server_weights,
    t_opt,
)
from torch_bps.errors import ConfigError
from torch_bps.local.comm import split_range
from torch_bps.wire import Mode


def test_split_formula_special_cases():
    for n in range(2, 9):
        assert dedicated_fraction(n, 0) == 0.0  # all-reduce
        assert dedicated_fraction(n, n) == 1.0  # parameter server
        assert dedicated_fraction(n, n + 3) == 1.0
        M, B = 64e6, 1e9
        assert t_opt(n, 0, M, B) == pytest.approx(2 * (n - 1) * M / (n * B))  # the all-reduce bound
        assert t_opt(n, n, M, B) == pytest.approx(M / B)  # PS: send M once, receive M once
    assert dedicated_fraction(4, 2) == pytest.approx(2 * 2 * 3 / (16 + 8 - 4))  # 0.6
    assert t_opt(4, 2, 1.0, 1.0) == pytest.approx(2 * 4 * 3 / (16 + 8 - 4))


def test_t_opt_decreases_with_more_servers():
    times = [t_opt(4, k, 1.0, 1.0) for k in range(0, 6)]
    assert all(a >= b for a, b in zip(times, times[1:], strict=False)) and times[4] == times[5]


@pytest.mark.parametrize("n,k", [(4, 0), (4, 1), (4, 2), (4, 4), (3, 5)])
def test_weights_follow_the_split(n, k):
    servers = server_weights([f"c{i}:1" for i in range(n)], [f"d{i}:1" for i in range(k)])
    assert sum(s.weight for s in servers) == pytest.approx(1.0)
    assert sum(s.weight for s in servers if s.dedicated) == pytest.approx(dedicated_fraction(n, k))


def test_modes_and_missing_servers():
    assert all(s.dedicated for s in server_weights(["c:1"], ["d:1"], "dedicated"))
    assert not any(s.dedicated for s in server_weights(["c:1"], ["d:1"], "colocated"))
    with pytest.raises(ValueError, match="needs servers"):
        server_weights([], [], "optimal")
    with pytest.raises(ValueError, match="needs servers"):
        server_weights(["c:1"], [], "dedicated")
    with pytest.raises(ValueError, match="not one of"):
        server_weights(["c:1"], [], "hash")


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 1 << 20), min_size=30, max_size=200), n=st.integers(1, 5), k=st.integers(0, 5))
def test_placement_balances_bytes_and_is_deterministic(sizes, n, k):
    servers = server_weights([f"c{i}:1" for i in range(n)], [f"d{i}:1" for i in range(k)])
    a, b = Placement(servers), Placement(servers)
    where_a = [a.assign(key, size) for key, size in enumerate(sizes)]
    where_b = [b.assign(key, size) for key, size in enumerate(sizes)]
    assert where_a == where_b  # same order of first sight -> same placement on every worker
    assert [a.assign(key, 1) for key in range(len(sizes))] == where_a  # stable: placed keys never move
    total, biggest = sum(sizes), max(sizes)
    for load, s in zip(a.load, servers, strict=True):
        # Greedy on relative load: each server ends within one partition of its target share.
        assert abs(load - s.weight * total) <= biggest * (1 + len(servers))


def test_cut_covers_exactly():
    assert cut(10, 4, 16) == [(0, 4), (4, 4), (8, 2)]
    assert cut(3, 4, 1 << 20) == [(0, 3)]  # partition larger than the tensor
    assert cut(5, 8, 1) == [(i, 1) for i in range(5)]  # at least one element per partition
    assert cut(0, 4, 16) == []


@settings(max_examples=200, deadline=None)
@given(numel=st.integers(0, 5000), itemsize=st.sampled_from([1, 2, 4, 8]), end=st.integers(1, 64),
       factor=st.integers(1, 6), ends=st.integers(1, 9))  # fmt: skip
def test_cut_mixed_covers_exactly_with_normal_ends(numel, itemsize, end, factor, ends):
    pieces = cut_mixed(numel, itemsize, end * itemsize, end * itemsize * factor, ends)
    assert [s for s, _ in pieces] == list(itertools.accumulate((n for _, n in pieces), initial=0))[:-1]  # abut
    assert sum(n for _, n in pieces) == numel and all(n >= 1 for _, n in pieces)
    assert all(n <= end * factor for _, n in pieces)
    if factor > 1 and numel - 2 * ends * end > end:  # a middle: the ends exactly end-sized, the middle no smaller
        assert all(n == end for _, n in pieces[:ends] + pieces[-ends:])
        assert all(n >= end for _, n in pieces[ends:-ends])
    else:
        assert pieces == cut(numel, itemsize, end * itemsize)
    assert len(pieces) <= len(cut(numel, itemsize, end * itemsize))  # never more messages than the plain cut


def test_keybook_cuts_the_middle_bigger():
    servers = server_weights(["a:1", "b:1", "c:1"], [])
    book = KeyBook(Placement(servers), 4 << 20, lambda n: [(0, n)], middle_factor=4)
    plain = KeyBook(Placement(servers), 4 << 20, lambda n: [(0, n)]).plan((64 << 20) // 4, torch.float32)[0]
    parts = book.plan((64 << 20) // 4, torch.float32)[0]
    size, sizes = plain[0].numel * 4, [p.numel * 4 for p in parts]
    assert sizes[:3] == sizes[-3:] == [size] * 3  # one partition of today's size per server at each end
    assert all(3 * size < s <= 4 * size for s in sizes[3:-3]) and len(parts) <= 6 + len(plain) // 4
    capped = KeyBook(Placement(servers), 1 << 20, lambda n: [(0, n)], middle_factor=4)
    middle = [p.numel * 4 for p in capped.plan((64 << 20) // 4, torch.float32)[0]][3:-3]
    assert 2 * size < min(middle) <= max(middle) <= 1 << 20  # partition_bytes caps the middle


def test_keybook_slots_and_agreement():
    servers = server_weights(["a:1", "b:1"], [])
    books = [KeyBook(Placement(servers), 64, lambda n: [(0, n // 2), (n // 2, n)], slots=2) for _ in range(2)]
    seq = [(100, torch.float32), (100, torch.float32), (7, torch.int64), (100, torch.float32)]
    plans = [[book.plan(n, dt) for n, dt in seq] for book in books]
    assert plans[0] == plans[1]  # two ranks agree without talking
    p0, p1, p2, p3 = plans[0]
    keys = lambda p: {part.key for parts in p for part in parts}  # noqa: E731
    assert keys(p0).isdisjoint(keys(p1))  # concurrent same-size collectives use other keys
    assert p3 == p0  # the third same-size call reuses slot 0
    assert sum(part.numel for part in p0[0]) == 50 and all(part.numel * 4 <= 64 for part in p0[1])


def test_partition_size_shrinks_so_every_server_pipelines():
    servers = server_weights(["a:1", "b:1"], [])
    book = KeyBook(Placement(servers), 4 << 20, lambda n: [(0, n)])
    assert book.partition_size(1 << 30) == 4 << 20  # big tensors: the configured maximum
    assert book.partition_size(64 << 20) == 512 << 10  # 64 partitions per server
    assert book.partition_size(1 << 20) == DEFAULT_MIN_PARTITION_BYTES  # floor: per-message overhead stays small
    assert book.partition_size(1000) == DEFAULT_MIN_PARTITION_BYTES
    finer = KeyBook(Placement(servers), 4 << 20, lambda n: [(0, n)], min_partition_bytes=64 << 10)
    assert finer.partition_size(8 << 20) == 64 << 10  # BPS_MIN_PARTITION_BYTES lowers the floor
    parts = book.plan((64 << 20) // 4, torch.float32)[0]
    assert len(parts) == 128 and [p.server for p in parts].count(0) == 64
    mixed = KeyBook(Placement(server_weights(["a:1", "b:1", "c:1", "d:1"], ["e:1"])), 4 << 20, lambda n: [(0, n)])
    # x = 1/3: a colocated server's share is 1/6, and it still gets 64 partitions of a 384 MB tensor.
    assert mixed.partition_size(384 << 20) == 1 << 20


def test_the_partition_floor_is_a_setting(monkeypatch):
    monkeypatch.setenv("BPS_MIN_PARTITION_BYTES", "65536")
    assert Config.resolve().min_partition_bytes == 65536
    assert Config.resolve(socket_buffer_bytes=30_000).partition_floor() == 65536  # set, it wins
    with pytest.raises(ConfigError, match="min_partition_bytes=10"):
        Config.resolve(min_partition_bytes=10)


def test_the_partition_floor_follows_the_socket_buffers_when_they_are_set():
    """Unset, 128 KiB; under socket buffers of a link's queue share, that share (not under 16 KiB): a partition in
    flight toward every server then fits what the buffers were sized to. At n = 8, k = 4 (29.7 KB buffers, a
    colocated server's share 4.5% of 32 MiB) the engine cuts 29.7 KB partitions where it cut 128 KiB."""
    assert Config.resolve().partition_floor() == DEFAULT_MIN_PARTITION_BYTES
    assert Config.resolve(socket_buffer_bytes=29_700).partition_floor() == 29_700
    assert Config.resolve(socket_buffer_bytes=4096).partition_floor() == SMALLEST_PARTITION_BYTES
    assert Config.resolve(socket_buffer_bytes=1 << 20).partition_floor() == DEFAULT_MIN_PARTITION_BYTES
    servers = server_weights([f"c{i}:1" for i in range(8)], [f"d{i}:1" for i in range(4)])
    floor = Config.resolve(socket_buffer_bytes=29_700).partition_floor()
    book = KeyBook(Placement(servers), 4_096_000, lambda n: [(0, n)], min_partition_bytes=floor)
    assert book.partition_size(32 << 20) == 29_700
    assert KeyBook(Placement(servers), 4_096_000, lambda n: [(0, n)]).partition_size(32 << 20) == 128 << 10


def test_the_middle_factor_is_a_setting_and_the_credit_grows_with_it_with_dedicated_servers(monkeypatch):
    """The default credit is 2 MiB x F when bytes go to dedicated servers, 2 MiB with colocated ones only."""
    config = Config.resolve()
    assert config.middle_partition_factor == 1
    assert config.credit(dedicated=True) == config.credit(dedicated=False) == DEFAULT_CREDIT_BYTES
    monkeypatch.setenv("BPS_MIDDLE_PARTITION_FACTOR", "4")
    config = Config.resolve()
    assert config.middle_partition_factor == 4
    assert config.credit(dedicated=True) == default_credit_bytes(4, dedicated=True) == 4 * DEFAULT_CREDIT_BYTES
    assert config.credit(dedicated=False) == default_credit_bytes(4, dedicated=False) == DEFAULT_CREDIT_BYTES
    for dedicated in (True, False):  # an explicit credit wins either way
        assert Config.resolve(credit_bytes=1 << 20).credit(dedicated=dedicated) == 1 << 20
    monkeypatch.setenv("BPS_CREDIT_BYTES", str(3 << 20))
    assert Config.resolve().credit(dedicated=False) == Config.resolve().credit(dedicated=True) == 3 << 20
    with pytest.raises(ConfigError, match="middle_partition_factor=0"):
        Config.resolve(middle_partition_factor=0)


# What the engine places in a DDP step: the first 1 MiB bucket, 25 MiB buckets, a ragged last bucket, half-precision
# buckets, and the small collectives around them (buffers, metrics): about 270 partitions at the engine's sizes.
MIXED_TENSORS = [(1 << 20, torch.float32), (25 << 20, torch.float32), (13_107_200, torch.float16),
                 (6_553_600, torch.bfloat16), (3_145_732, torch.float32), (600 << 10, torch.float32),
                 (96 << 10, torch.float32), (12 << 10, torch.int64), (4096, torch.float32),
                 (256, torch.float32)]  # fmt: skip


@pytest.mark.parametrize("n,k", [(2, 1), (3, 1), (3, 2), (4, 1), (4, 2), (4, 3), (8, 1), (8, 4), (8, 7)])
@pytest.mark.parametrize("local_size", [1, 2])
@pytest.mark.parametrize("middle_factor", [1, 2, 3, 4])
def test_engine_places_bytes_by_the_papers_split(n, k, local_size, middle_factor):
    """Each server receives its share of the paper's split: x / k per dedicated server, (1 - x) / n per colocated
    one, within 2% of that share, or within what byte balancing guarantees where a partition is more than 2% of the
    share: at most one partition p short, at most p x w / w_min over (a server of weight w took its last partition
    when its load over weight, plus p / w, was the lowest; the server furthest behind has weight w_min at least).
    Bigger middle partitions do not loosen it: p stays the ends' size, because every tensor ends in len(servers) of
    those, which byte balancing gives to the servers furthest behind."""
    colocated, dedicated = [f"c{i}:1" for i in range(n)], [f"d{i}:1" for i in range(k)]
    servers = server_weights(colocated, dedicated)
    slices = lambda numel: [split_range(numel, local_size, i) for i in range(local_size)]  # noqa: E731
    book = KeyBook(Placement(servers), 4_096_000, slices, middle_factor=middle_factor)
    received = [0] * len(servers)
    sizes = []
    for nbytes, dtype in MIXED_TENSORS:
        for parts in book.plan(nbytes // dtype.itemsize, dtype):
            for p in parts:
                received[p.server] += p.numel * dtype.itemsize
                sizes.append(p.numel * dtype.itemsize)
    total, end = sum(received), max(book.partition_size(nbytes) for nbytes, _ in MIXED_TENSORS)
    assert total == sum(nbytes for nbytes, _ in MIXED_TENSORS) and len(sizes) >= 200 // middle_factor
    assert max(sizes) > (middle_factor - 1) * end  # the middles were cut bigger
    x = dedicated_fraction(n, k)
    lightest = min(s.weight for s in servers)
    for s, got in zip(servers, received, strict=True):
        target = (x / k if s.dedicated else (1 - x) / n) * total  # the paper's split, not the weights under test
        p = end * s.weight / lightest if got > target else end
        assert abs(got - target) <= max(0.02 * target, p), (s, got / total, target / total)


def test_receive_buffers_follow_the_servers_shares():
    """Equal shares: every server gets the base. Unequal: in proportion to the shares (n = 8, k = 2: dedicated 2.33x
    a colocated one's), no window under 8 segments or the base, and none at all with the kernel's buffers (0)."""
    assert receive_buffers(30_000, server_weights(["c"] * 8, [])) == [30_000] * 8
    assert receive_buffers(30_000, server_weights([], ["d"] * 4)) == [30_000] * 4
    two = receive_buffers(30_000, server_weights(["c"] * 8, ["d"] * 2))
    assert two[0] / two[-1] == pytest.approx(7 / 3, rel=1e-3) and two[0] > 30_000 > two[-1], two
    six = receive_buffers(30_000, server_weights(["c"] * 8, ["d"] * 6))
    assert six[-1] == MIN_RECEIVE_WINDOW and six[0] > 30_000, six  # share alone: 4,967 bytes, 3 segments
    assert receive_buffers(4096, server_weights(["c"] * 8, ["d"] * 6))[-1] == 4096
    assert receive_buffers(0, server_weights(["c"] * 8, ["d"] * 2)) == [0] * 10


def test_a_compressed_tensor_gets_keys_of_its_own():
    servers = server_weights(["a:1", "b:1"], [])
    book = KeyBook(Placement(servers), 4 << 20, lambda n: [(0, n)], slots=1)  # one slot: shapes alone part keys
    plain, topk = book.plan(4096, torch.float32)[0], book.plan(4096, torch.float32, Mode.SUM, codec=2)[0]
    assert {p.key for p in plain}.isdisjoint(p.key for p in topk), "a key's codec is fixed at its first INIT"
    assert book.plan(4096, torch.float32)[0] == plain and book.plan(4096, torch.float32, Mode.SUM, codec=2)[0] == topk
