"""The server's native rounds (cpp_ext/server/rounds.h, model.cpp) against their references in torch_bps/_reference/.

Both are driven with the same random sequences of push, pull, refused push, lost worker and expiry, and must
give the same answers (token, status, result bytes or error text), refuse the same calls with the same words,
and keep the same oldest live round.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from torch_bps import _C
from torch_bps._reference.model import ModelRounds
from torch_bps._reference.rounds import KeyRounds, Round, SumCounters
from torch_bps.errors import ProtocolError
from torch_bps.server.job import UNBOUNDED, Job
from torch_bps.wire import DTYPES, Mode, Status

pytestmark = pytest.mark.timeout(300)

NAME = "job 0x2a key 7"
SUM_DTYPES = [1, 3, 4, 8, 6]  # float32, float16, bfloat16, int8 (wraps), int64


class Reference:
    """_reference's KeyRounds (ModelRounds for a MODEL key), with its answers put in the shape KeyRoundsProbe
    returns."""

    def __init__(self, num_workers: int, mode: int, nbytes: int, dtype: int, backups: int = 0, window: int = 2,
                 staleness: int = 0):  # fmt: skip
        self.job = Job(num_workers, backups, window, staleness)
        self.mode, self.dtype = mode, dtype
        self.counters = SumCounters()
        if mode == Mode.MODEL:
            self.rounds = ModelRounds(NAME, self.job, self.counters, nbytes, DTYPES[dtype])
        else:
            self.rounds = KeyRounds(NAME, self.job, self.counters, Mode(mode), nbytes, DTYPES[dtype])
        self.pulls: dict[int, tuple[int, int, int, int]] = {}  # token -> (worker, round, offset, length)

    def _answer(self, token: int, result) -> tuple:
        worker, rnd, offset, length = self.pulls[token]
        if isinstance(result, Round):
            data = result.total.view(torch.uint8)[offset : offset + length].numpy().tobytes()
            return token, Status.OK, data, result.ahead
        return token, Status.KEY_MISMATCH, f"pull of {NAME} round {rnd} by worker {worker}: {result}", 0

    def _released(self) -> list:
        return [self._answer(t, r) for t, r in self.rounds.take_released()]

    def _call(self, fn) -> tuple:
        try:
            return 0, "", fn() + self._released()
        except ProtocolError as e:
            return e.status, str(e), self._released()

    def push(self, worker: int, rnd: int, data: bytes, offset: int) -> tuple:
        dtype = torch.uint8 if self.mode == Mode.COPY else DTYPES[self.dtype]
        tensor = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
        return self._call(lambda: [self._answer(t, r) for t, r in self.rounds.push(worker, rnd, tensor, offset)])

    def pull(self, worker: int, rnd: int, token: int, offset: int, length: int, deadline: float) -> tuple:
        self.pulls[token] = (worker, rnd, offset, length)
        closed = []

        def call():
            r = self.rounds.pull(worker, rnd, token, deadline)
            return [self._answer(token, r)] if r is not None else closed

        return self._call(call)

    def refuse(self, worker: int, rnd: int, reason: str) -> tuple:
        return self._call(lambda: [self._answer(t, reason) for t in self.rounds.refuse(worker, rnd, reason)])

    def lose(self, worker: int, how: str) -> list:
        self.job.lost[worker] = how
        return [(t, Status.WORKER_LOST, m, 0) for t, m in self.rounds.fail_lost()] + self._released()

    def expire(self, now: float) -> list:
        return [(t, Status.ROUND_TIMEOUT, m, 0) for t, m in self.rounds.expire(now)]


def _normalize(outcome) -> tuple:
    status, message, answers = outcome
    return status, message, sorted((int(t), int(s), r, int(a)) for t, s, r, a in answers)


@st.composite
def scenarios(draw):
    num_workers = draw(st.integers(1, 4))
    mode = draw(st.sampled_from([Mode.SUM, Mode.COPY, Mode.MODEL]))
    backups = draw(st.integers(0, num_workers - 1)) if mode != Mode.MODEL else 0
    window = draw(st.integers(2, 4)) if backups else 2
    staleness = draw(st.sampled_from([0, 1, 2, UNBOUNDED])) if mode == Mode.MODEL else 0
    if mode != Mode.COPY:
        dtype = draw(st.sampled_from(SUM_DTYPES if mode == Mode.SUM else [1, 2]))  # MODEL: float32, float64
        nbytes = DTYPES[dtype].itemsize * draw(st.integers(1, 4))
    else:
        dtype, nbytes = 7, draw(st.integers(0, 8))
    ops = []
    for _ in range(draw(st.integers(1, 30))):
        kind = draw(st.sampled_from(["push"] * 4 + ["pull"] * 4 + ["refuse", "lose", "expire"]))
        worker, rnd = draw(st.integers(0, num_workers - 1)), draw(st.integers(0, 3 if mode == Mode.MODEL else 5))
        if kind == "push":
            if mode != Mode.COPY:
                offset, data = 0, _sum_data(draw, dtype, nbytes)
            else:
                offset = draw(st.integers(0, nbytes))
                data = draw(st.binary(min_size=0, max_size=nbytes - offset))
            ops.append((kind, worker, rnd, data, offset))
        elif kind == "pull":
            offset = draw(st.integers(0, nbytes))
            length = draw(st.sampled_from([nbytes - offset, 0]) | st.integers(0, nbytes - offset))
            if offset == 0 and draw(st.booleans()):
                length = nbytes  # the whole result: shared, not copied
            deadline = draw(st.sampled_from([math.inf, 1.0, 2.0]))
            ops.append((kind, worker, rnd, offset, length, deadline))
        elif kind == "refuse":
            ops.append((kind, worker, rnd))
        elif kind == "lose":
            ops.append((kind, worker))
        else:
            ops.append((kind, draw(st.sampled_from([1.5, 2.5]))))
    return num_workers, int(mode), nbytes, dtype, backups, window, staleness, ops


# Besides hypothesis's floats (which favour simple values whose sums are exact), 11-bit significands at magnitudes
# up to 2**13: their sums need rounding, so a sum rounded at each add differs from one rounded once, and four of
# them stay below fp16's largest value.
FLOATS = st.floats(-1e4, 1e4, allow_nan=False, width=16) | st.builds(
    lambda m, e: m * 2.0**e, st.integers(-(2**11), 2**11), st.integers(-17, 2)
)


def _sum_data(draw, dtype: int, nbytes: int) -> bytes:
    n = nbytes // DTYPES[dtype].itemsize
    if DTYPES[dtype].is_floating_point:
        values = draw(st.lists(FLOATS, min_size=n, max_size=n))
        return torch.tensor(values, dtype=torch.float32).to(DTYPES[dtype]).view(torch.uint8).numpy().tobytes()
    return draw(st.binary(min_size=nbytes, max_size=nbytes))


# No shrinking: a failing sequence is reported as found (shrinking these can take minutes on a busy machine, past
# the timeout), with the step that diverged.
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # fmt: skip
@given(scenario=scenarios())
def test_the_native_rounds_answer_as_the_reference_does(scenario):
    num_workers, mode, nbytes, dtype, backups, window, staleness, ops = scenario
    ref = Reference(num_workers, mode, nbytes, dtype, backups, window, staleness)
    native = _C._testing.KeyRoundsProbe(num_workers, mode, nbytes, dtype, NAME, backups, window, staleness=staleness)
    token = 0
    for op in ops:
        kind = op[0]
        if kind == "push":
            _, worker, rnd, data, offset = op
            got, want = native.push(worker, rnd, data, offset), ref.push(worker, rnd, data, offset)
        elif kind == "pull":
            _, worker, rnd, offset, length, deadline = op
            token += 1
            got = native.pull(worker, rnd, token, offset, length, deadline)
            want = ref.pull(worker, rnd, token, offset, length, deadline)
        elif kind == "refuse":
            _, worker, rnd = op
            reason = f"the round failed because another worker's push was refused (worker {worker})"
            got, want = native.refuse(worker, rnd, reason), ref.refuse(worker, rnd, reason)
        elif kind == "lose":
            worker = op[1]
            if worker in ref.job.lost:
                continue  # the server loses a worker once per HELLO
            how = f"worker {worker} of job 0x2a (at 10.0.0.{worker}) disconnected"
            native.set_lost(worker, how)
            got, want = (0, "", native.fail_lost()), (0, "", ref.lose(worker, how))
        else:
            got, want = (0, "", native.expire(op[1])), (0, "", ref.expire(op[1]))
        assert _normalize(got) == _normalize(want), op
        assert native.floor == ref.rounds.floor, op
        assert native.has_waiting == ref.rounds.has_waiting, op
        assert native.late_pushes == ref.counters.late_pushes, op
        if mode == Mode.MODEL:
            assert [native.applied(w) for w in range(num_workers)] == ref.rounds.applied, op


def test_a_sum_round_adds_in_the_keys_dtype_and_frees_after_every_pull():
    probe = _C._testing.KeyRoundsProbe(2, int(Mode.SUM), 8, 8, NAME)  # 8 x int8: wraps
    a, b = bytes([100] * 8), bytes([100] * 8)
    assert probe.push(0, 0, a, 0) == (0, "", [])
    assert probe.push(0, 0, a, 0) == (0, "", [])  # a duplicate: never added twice
    assert probe.pull(0, 0, 1, 0, 8) == (0, "", [])  # waits
    status, _, answers = probe.push(1, 0, b, 0)
    assert status == 0 and answers == [(1, Status.OK, bytes([200] * 8), 0)]  # 100 + 100 wraps to -56 = 200 unsigned
    assert probe.floor == 0
    assert probe.pull(1, 0, 2, 0, 8)[2] == [(2, Status.OK, bytes([200] * 8), 0)]
    assert probe.floor == 1


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(dtype=st.sampled_from([3, 4]), data=st.data())
def test_16_bit_sums_are_the_fp32_sum_rounded_once_in_both(dtype, data):
    # The random sequences above seldom close a round of three or more workers; these always do, with or without
    # backup workers (a backup round's sum of c is scaled by n / c in fp32, before the one rounding).
    workers, n = data.draw(st.integers(2, 4)), data.draw(st.integers(1, 40))  # vector bodies and their tails
    backups = data.draw(st.integers(0, workers - 1))
    pushes = [torch.tensor(data.draw(st.lists(FLOATS, min_size=n, max_size=n))).to(DTYPES[dtype]) for _ in
              range(workers)]  # fmt: skip
    order = data.draw(st.permutations(range(workers)))
    closing = order[: workers - backups]  # the pushes the round holds; the others come late and are dropped
    want = pushes[closing[0]].float()  # the first push, then the others added in the order they arrived
    for w in closing[1:]:
        want += pushes[w].float()
    if backups:
        want = (want.mul_(workers / len(closing)) if len(closing) > 1 else
                pushes[closing[0]].mul(workers / len(closing)))  # fmt: skip
    want = want.to(DTYPES[dtype]).view(torch.uint8).numpy().tobytes()
    for rounds in (Reference(workers, int(Mode.SUM), 2 * n, dtype, backups),
                   _C._testing.KeyRoundsProbe(workers, int(Mode.SUM), 2 * n, dtype, NAME, backups, 2)):  # fmt: skip
        for w in order:
            assert rounds.push(w, 0, pushes[w].view(torch.uint8).numpy().tobytes(), 0)[0] == 0
        _, _, answers = rounds.pull(order[0], 0, 1, 0, 2 * n, math.inf)
        assert answers == [(1, Status.OK, want, 0)], type(rounds)


@pytest.mark.parametrize("dtype", [3, 4])  # float16, bfloat16
def test_a_16_bit_sum_is_made_in_fp32_and_rounded_once(dtype):
    # 1 + u/2 + u/2 (u: the dtype's ulp at 1): rounded at each add, 1 + u/2 ties to even, back to 1, twice; summed in
    # fp32 and rounded once, 1 + u. Both implementations, and in every order the pushes may arrive in.
    torch_dtype = DTYPES[dtype]
    ulp = torch.finfo(torch_dtype).eps
    values = [1.0, ulp / 2, ulp / 2]
    data = [torch.tensor([v, -v], dtype=torch_dtype).view(torch.uint8).numpy().tobytes() for v in values]
    want = torch.tensor([1 + ulp, -1 - ulp], dtype=torch_dtype).view(torch.uint8).numpy().tobytes()
    for order in ([0, 1, 2], [1, 2, 0], [2, 0, 1]):
        for rounds in (Reference(3, int(Mode.SUM), 4, dtype),
                       _C._testing.KeyRoundsProbe(3, int(Mode.SUM), 4, dtype, NAME)):  # fmt: skip
            for worker in order:
                status, message, answers = rounds.push(worker, 0, data[worker], 0)
                assert (status, message, answers) == (0, "", []), order
            assert rounds.pull(0, 0, 1, 0, 4, math.inf)[2] == [(1, Status.OK, want, 0)], (order, type(rounds))


def f32(*values: float) -> bytes:
    return torch.tensor(values, dtype=torch.float32).numpy().tobytes()


def test_a_backup_round_closes_without_the_slowest_and_the_window_holds_the_fastest():
    """n = 3, b = 1, W = 3: a round closes at 2 pushes, scaled by 3/2; the third push is dropped, never added; a
    worker may run 2 rounds ahead of the slowest puller, and the slowest learns how far behind it is."""
    probe = _C._testing.KeyRoundsProbe(3, int(Mode.SUM), 4, 1, NAME, 1, 3)
    assert probe.push(0, 0, f32(1.0), 0) == (0, "", [])
    assert probe.pull(0, 0, 1, 0, 4) == (0, "", [])  # waits: one push of the two it needs
    assert probe.push(1, 0, f32(2.0), 0) == (0, "", [(1, Status.OK, f32(4.5), 0)])  # (1 + 2) * 3 / 2
    assert probe.push(2, 0, f32(100.0), 0) == (0, "", [])  # late: acknowledged, dropped
    assert probe.late_pushes == 1
    assert probe.pull(1, 0, 2, 0, 4)[2] == [(2, Status.OK, f32(4.5), 0)]
    for rnd in (1, 2):
        probe.push(0, rnd, f32(1.0), 0)
        probe.push(1, rnd, f32(1.0), 0)
    assert probe.pull(0, 1, 3, 0, 4)[2] == [(3, Status.OK, f32(3.0), 1)]  # round 2 closed too
    assert probe.pull(0, 2, 4, 0, 4) == (0, "", [])  # closed, but held: worker 2 has not pulled round 0
    status, message, _ = probe.push(0, 3, f32(1.0), 0)
    assert status == Status.BAD_ROUND and "at most 3 rounds" in message
    # The slow worker pulls what it missed (without pushing round 1 or 2): round 0 frees and round 2's pull goes out.
    assert sorted(probe.pull(2, 0, 5, 0, 4)[2]) == [(4, Status.OK, f32(3.0), 0), (5, Status.OK, f32(4.5), 2)]
    assert probe.floor == 1


def test_a_backup_round_goes_on_without_a_lost_worker_and_fails_past_b():
    probe = _C._testing.KeyRoundsProbe(3, int(Mode.SUM), 4, 1, NAME, 1, 2)
    probe.set_lost(2, "worker 2 (at 10.0.0.2) disconnected")
    assert probe.fail_lost() == []
    probe.push(0, 0, f32(1.0), 0)
    probe.push(1, 0, f32(1.0), 0)
    probe.pull(0, 0, 1, 0, 4)
    probe.pull(1, 0, 2, 0, 4)
    assert probe.floor == 1  # freed without the lost worker's pull
    probe.set_lost(1, "worker 1 (at 10.0.0.1) disconnected")
    assert probe.fail_lost() == []
    status, message, _ = probe.pull(0, 1, 3, 0, 4)
    assert status == Status.WORKER_LOST and "can never close" in message


def test_integer_and_copy_rounds_of_a_backup_job_still_need_every_worker():
    probe = _C._testing.KeyRoundsProbe(2, int(Mode.SUM), 8, 6, NAME, 1, 2)  # int64: no mean to rescale
    probe.push(0, 0, bytes(8), 0)
    assert probe.pull(0, 0, 1, 0, 8) == (0, "", [])
    assert probe.push(1, 0, bytes(8), 0)[2] == [(1, Status.OK, bytes(8), 0)]


def test_a_model_key_adds_each_update_once_and_in_order():
    probe = _C._testing.KeyRoundsProbe(2, int(Mode.MODEL), 4, 1, NAME, staleness=UNBOUNDED)
    assert probe.pull(0, 1, 1, 0, 4)[0] == Status.BAD_ROUND  # past its own next push (round 0)
    assert probe.push(0, 0, f32(1.0), 0) == (0, "", [])
    assert probe.push(0, 0, f32(1.0), 0) == (0, "", [])  # resent: acknowledged, not added again
    status, message, _ = probe.push(0, 2, f32(4.0), 0)  # skips round 1: that update would be lost
    assert status == Status.BAD_ROUND and "its round 1 was never pushed" in message
    assert probe.pull(0, 0, 2, 0, 4) == (0, "", [(2, Status.OK, f32(1.0), 0)])  # unbounded: no wait for worker 1
    assert probe.push(1, 0, f32(2.0), 0) == (0, "", [])
    assert probe.push(0, 1, f32(4.0), 0) == (0, "", [])
    assert probe.pull(1, 0, 3, 0, 4)[2] == [(3, Status.OK, f32(7.0), 0)]  # everything pushed so far, once
    assert [probe.applied(0), probe.applied(1)] == [2, 1]


def test_a_model_keys_pull_waits_for_the_slowest_worker_s_rounds_behind():
    probe = _C._testing.KeyRoundsProbe(3, int(Mode.MODEL), 4, 1, NAME, staleness=1)  # s = 1
    for rnd in range(3):
        probe.push(0, rnd, f32(1.0), 0)
    probe.push(1, 0, f32(10.0), 0)
    probe.push(2, 0, f32(100.0), 0)
    assert probe.pull(0, 1, 1, 0, 4)[2] == [(1, Status.OK, f32(113.0), 0)]  # every worker pushed round 0
    assert probe.pull(0, 2, 2, 0, 4) == (0, "", [])  # waits: workers 1 and 2 have not pushed round 1
    assert probe.push(1, 1, f32(10.0), 0) == (0, "", [])
    probe.set_lost(2, "worker 2 (at 10.0.0.2) disconnected")  # a lost worker holds nobody back
    assert probe.fail_lost() == [(2, Status.OK, f32(123.0), 0)]
    probe2 = _C._testing.KeyRoundsProbe(2, int(Mode.MODEL), 4, 1, NAME, staleness=0)  # s = 0: lockstep
    probe2.push(0, 0, f32(1.0), 0)
    assert probe2.pull(0, 0, 1, 0, 4, 1.0) == (0, "", [])
    ((token, status, message, _),) = probe2.expire(2.0)
    assert status == Status.ROUND_TIMEOUT and "every worker pushed round 0 (staleness 0): 1 have not" in message
    assert "worker 1" in message
