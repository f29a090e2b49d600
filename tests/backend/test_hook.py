"""bps_hook: DDP on a gloo group whose gradient buckets are averaged on the summation servers, against the same
DDP on gloo without a hook (gradients within helpers.PAIR_TOL every step, parameters identical across ranks)."""

from __future__ import annotations

import inspect
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import torch_bps
from tests.helpers import run_ranks, train_pair


def _hooked(rank, world, gloo):
    assert dist.get_backend() == "gloo"
    worst = {}
    # several buckets (bucket_cap_mb tiny), bucket views, the default group; the state's Runtime is made lazily
    state = torch_bps.BpsHookState()
    hooks = {"byteps": (state, torch_bps.bps_hook)}
    kwargs = dict(bucket_cap_mb=0.002, gradient_as_bucket_view=True)
    worst["gloo+bps_hook"] = train_pair(rank, world, gloo, gloo, kwargs, False, hooks)
    assert state.connect().world_size == world and state.connect().name == "hook"
    # unused parameters: DDP's own bookkeeping all_reduce stays on gloo, the buckets go through the hook.
    # A second model's state on the same group shares the first one's Runtime (one rendezvous per name).
    second = torch_bps.BpsHookState()
    assert second.connect() is state.connect()
    hooks = {"byteps": (second, torch_bps.bps_hook)}
    worst["unused"] = train_pair(rank, world, gloo, gloo, dict(find_unused_parameters=True), True, hooks)
    # hooks compose: the bucket travels as float16 (divided first, so no overflow), decompressed after
    hooks = {"byteps": (state, default_hooks.fp16_compress_wrapper(torch_bps.bps_hook)),
             "gloo": (gloo, default_hooks.fp16_compress_hook)}  # fmt: skip
    worst["fp16_wrapper"] = train_pair(rank, world, gloo, gloo, {}, False, hooks, tol=dict(rtol=1e-3, atol=1e-3))
    second.close()
    state.close()
    # a "byteps" subgroup as the hook's group: the hook uses that group's Runtime, DDP uses the group too
    sub = dist.new_group(backend="byteps")
    assert dist.get_backend(sub) == "byteps"
    sub_state = torch_bps.BpsHookState(process_group=sub)
    hooks = {"byteps": (sub_state, torch_bps.bps_hook)}
    worst["byteps_subgroup"] = train_pair(rank, world, gloo, sub, {}, False, hooks)
    assert sub_state.connect() is torch_bps.implementation(sub).runtime
    return worst


@pytest.mark.timeout(180)
def test_bps_hook_on_gloo_matches_gloo_without_hook():
    results = run_ranks(_hooked, 2, backend="gloo", timeout=160)
    # Two ranks: a + b rounds the same whichever side adds, and halving is exact, so the hook matches gloo bit
    # for bit.
    assert results == [dict.fromkeys(("gloo+bps_hook", "unused", "fp16_wrapper", "byteps_subgroup"), 0.0)] * 2


def test_hook_signature_is_what_ddp_accepts():
    """DDP compares annotations with the real types (strings from `from __future__ import annotations` fail)."""
    sig = inspect.signature(torch_bps.bps_hook)
    assert sig.parameters["bucket"].annotation is dist.GradBucket
    assert sig.return_annotation == torch.futures.Future[torch.Tensor]


def test_bps_hook_stages_and_launches_a_bucket_under_the_runtimes_launch_lock(monkeypatch):
    """The launch lock the "byteps" group's collectives take: without it a bucket launched from DDP's thread and a
    collective from another thread can be ordered differently on two ranks."""
    from torch_bps import hook

    class Runtime:  # what bps_hook reads of a Runtime; the sum of one rank is its own tensor
        rank, world_size, config = 0, 2, torch_bps.Config.resolve()
        launch_lock = threading.RLock()

        def run(self, exchanges, done, priority=0):
            done(None)

    class Bucket:  # what bps_hook reads of a dist.GradBucket
        def __init__(self):
            self._grad, self._param = torch.full((4,), 3.0), torch.nn.Parameter(torch.zeros(4))

        def buffer(self):
            return self._grad

        def index(self):
            return 0

        def parameters(self):
            return [self._param]

        def gradients(self):
            return [self._grad]

    held = []

    class Recorded(hook.HostCopy):
        def __init__(self, *args, **kwargs):
            held.append(Runtime.launch_lock._is_owned())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(hook, "HostCopy", Recorded)
    state = torch_bps.BpsHookState()
    state._runtime = Runtime()
    assert torch.equal(torch_bps.bps_hook(state, Bucket()).wait(), torch.full((4,), 1.5))
    assert held == [True]
