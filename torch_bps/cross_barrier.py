"""CrossBarrier: BytePS's crossing of the barrier between iterations (ByteScheduler, `byteps.torch.cross_barrier`).

Each gradient is pushed as autograd produces it, with priority by its layer's place in the forward pass (the first
layers' partitions ahead of the later ones under the client's credit); a "bps-cross-barrier" thread runs the user's
optimizer on each parameter alone as its sum lands; each module's next forward waits, in a forward pre-hook, for its
own parameters only. Reached as `torch_bps.byteps.CrossBarrier`; built on byteps.py's DistributedOptimizer.

Which module waits for which parameter: every module that holds it (a weight tied between an embedding and the
output layer is waited for by both), and, for a parameter whose modules never run (nn.MultiheadAttention reads its
`out_proj`'s weight without calling `out_proj`), the nearest enclosing module that runs, as learnt in the forward
passes before the first step. A parameter read by a module that neither holds nor encloses it, before any module
holding it runs, is not waited for.

May import: torch, torch_bps.errors, torch_bps.byteps, torch_bps.pg.work.
"""

from __future__ import annotations

import queue
import threading

import torch

from torch_bps.byteps import Compression, _DistributedOptimizer, _extend, _handles, _runtime, rank
from torch_bps.errors import BpsTimeoutError, ConfigError
from torch_bps.pg.work import own_future


class _CrossBarrier(_DistributedOptimizer):
    """Mixed into the user's optimizer's class by CrossBarrier; its own state is named `_cb_*`."""

    def _cb_setup(self, model: torch.nn.Module, num_steps: int, priorities: bool) -> None:
        self._cb_priorities = priorities
        self._cb_num_steps, self._cb_steps = num_steps, 0
        self._cb_timeout = _runtime().config.timeout
        self._cb_group = {p: g for g in self.param_groups for p in g["params"]}
        self._cb_landed = {p: threading.Event() for p in self._bps_params}  # set: no update of p in flight
        for event in self._cb_landed.values():
            event.set()
        self._cb_position: dict = {}  # parameter -> its place in the forward pass: the first waited for, 0
        # module -> the parameters its forward waits for: those it holds (tied ones in each module holding them), and
        # from the first step on also those of enclosed modules that never run (_cb_adopt)
        self._cb_waits = {m: [p for p in m.parameters(recurse=False) if p in self._cb_landed] for m in model.modules()}
        self._cb_model = model
        self._cb_ran: dict | None = {}  # the modules whose forward ran before the first step, in order (then None)
        self._cb_pending: dict = {}  # parameter -> its push in flight (handle, ctx, tensor sent)
        self._cb_pending_lock = threading.Lock()
        self._cb_arrived: queue.SimpleQueue = queue.SimpleQueue()
        self._cb_error: BaseException | None = None
        for module in model.modules():
            module.register_forward_pre_hook(self._cb_before_forward)
        self._cb_updater = threading.Thread(target=self._cb_update_loop, name="bps-cross-barrier", daemon=True)
        self._cb_updater.start()

    def _cb_check(self) -> None:
        if self._cb_error is not None:
            raise self._cb_error

    def _cb_wait(self, p: torch.Tensor) -> None:
        if not self._cb_landed[p].wait(self._cb_timeout):
            raise BpsTimeoutError(f"CrossBarrier (rank {rank()}): the update of {self._bps_names[p]} did not land "
                                  f"within {self._cb_timeout:.0f} s")  # fmt: skip
        self._cb_check()

    def _cb_before_forward(self, module: torch.nn.Module, args) -> None:
        """A module's forward waits for the updates of the parameters it reads (see the module's docstring), and
        nothing else."""
        if self._cb_ran is not None:
            self._cb_ran.setdefault(module)
        for p in self._cb_waits[module]:
            self._cb_position.setdefault(p, len(self._cb_position))
            self._cb_wait(p)

    def _cb_adopt(self) -> None:
        """At the first step: a parameter that got a gradient although no module holding it ran is waited for by the
        nearest enclosing module that ran; the places in the forward pass are counted again with it."""
        ran, self._cb_ran = self._cb_ran, None
        used = {p for p in self._bps_params
                if p in self._bps_sent or self._bps_delay[p] < self.backward_passes_per_step}  # fmt: skip
        held = {p for m in ran for p in self._cb_waits[m]}
        parent = {child: m for m in self._cb_model.modules() for child in m.children()}
        for m in self._cb_model.modules():
            if m in ran:
                continue
            for p in self._cb_waits[m]:
                if p in used and p not in held:
                    up = parent.get(m)
                    while up is not None and up not in ran:
                        up = parent.get(up)
                    if up is not None:
                        self._cb_waits[up].append(p)
                        held.add(p)
        self._cb_position = {}
        for m in ran:
            for p in self._cb_waits[m]:
                self._cb_position.setdefault(p, len(self._cb_position))

    def _bps_send(self, p: torch.Tensor) -> None:
        """Push `p`'s gradient, the first layers' ahead of the later ones; its update runs when the sum lands."""
        self._cb_wait(p)  # the previous round's update of p (a parameter unused in a forward may still be in flight)
        self._cb_landed[p].clear()
        self._bps_sent.add(p)
        priority = -self._cb_position.get(p, len(self._cb_position)) if self._cb_priorities else 0
        entry = self._bps_push(p, priority)
        with self._cb_pending_lock:
            self._cb_pending[p] = entry
        own_future(_handles[entry[0]][0]).add_done_callback(lambda _: self._cb_arrived.put(p))

    def _cb_update_loop(self) -> None:
        """The "bps-cross-barrier" thread: each parameter's update as its sum lands, in landing order."""
        while (p := self._cb_arrived.get()) is not None:
            try:
                with self._cb_pending_lock:
                    entry = self._cb_pending.pop(p)
                self._bps_take(p, entry)
                self._cb_update(p)
                p.grad = None  # as zero_grad(): the next backward's gradient starts afresh
            except BaseException as e:  # noqa: BLE001 - the training thread raises it at its next wait
                self._cb_error = e
                for event in self._cb_landed.values():
                    event.set()
                return
            self._cb_landed[p].set()

    def _cb_update(self, p: torch.Tensor) -> None:
        """Run the optimizer's own step on `p` alone: a view of the optimizer sharing its state, with p's group's
        hyperparameters as they are now (an LR scheduler may have changed them)."""
        single = object.__new__(self._bps_base)
        single.__dict__.update(self.__dict__)
        group = self._cb_group[p]
        single.param_groups = [{**group, "params": [p]}]
        self._bps_base.step(single)

    def synchronize(self) -> None:
        """Wait until every update in flight has landed (before reading or saving the parameters)."""
        for p in self._bps_params:
            self._cb_wait(p)

    def skip_synchronize(self):
        raise ConfigError("CrossBarrier updates each parameter as its sum lands, so there is no moment when every "
                          "gradient is summed and none applied: clipping by the global norm needs one. Use "
                          "DistributedOptimizer")  # fmt: skip

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: each update clears its parameter's gradient (zeroing here would race the pushes in flight)."""

    def step(self, closure=None):
        """Push what autograd did not produce this step; return at once (the updates land in the background,
        each module's next forward waits for its own), except at the last of `num_steps`, which waits for all."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._cb_check()
        # The updates read each parameter's group from here: load_state_dict replaces the groups
        self._cb_group = {p: g for g in self.param_groups for p in g["params"]}
        if self._cb_ran is not None:
            self._cb_adopt()
        self._bps_send_missing()
        self._cb_steps += 1
        if self._cb_steps >= self._cb_num_steps:
            self.synchronize()
        return loss

    def close(self) -> None:
        """Wait for the updates in flight and stop the update thread."""
        self.synchronize()
        self._cb_arrived.put(None)
        self._cb_updater.join(timeout=self._cb_timeout)


def CrossBarrier(model: torch.nn.Module, optimizer: torch.optim.Optimizer, named_parameters=None,
                 compression=Compression.none, backward_passes_per_step: int = 1, num_steps: int = 10**6,
                 priorities: bool = True) -> torch.optim.Optimizer:  # fmt: skip
    """Cross the barrier between iterations (ByteScheduler): each gradient is pushed as autograd produces it, the
    first layers' ahead of the later ones; each parameter is updated by `optimizer` as soon as its sum lands; and
    each module's next forward waits only for its own parameters. `step()` returns at once.

    Args:
        model: the module trained (its modules get forward pre-hooks).
        optimizer: any torch optimizer whose update is per parameter (SGD, Adam, AdamW, RMSprop...); LBFGS refused.
        num_steps: the last step waits for every update (call `synchronize()` before reading parameters earlier).
        priorities: False pushes in submission order (to measure what the priorities buy).
        named_parameters, compression, backward_passes_per_step: as DistributedOptimizer's.

    Example: `opt = bps.CrossBarrier(model, torch.optim.SGD(model.parameters(), lr=0.1), num_steps=100)`.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ConfigError(
            "CrossBarrier cannot run LBFGS: its line search needs every gradient before any update "
            "(CrossBarrier updates each parameter as its sum lands). Use DistributedOptimizer"
        )
    optimizer = _extend(optimizer, _CrossBarrier)
    optimizer._bps_setup(named_parameters, compression, backward_passes_per_step)
    optimizer._cb_setup(model, num_steps, priorities)
    return optimizer
