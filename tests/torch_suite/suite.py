"""torch's own distributed test-suite (torch/testing/_internal/distributed/distributed_test.py) on 2 CPU processes,
with gloo or "byteps" as the default group (TORCH_SUITE_BACKEND). Run through run.py, which compares the two.

The suite reads BACKEND when it is imported, to skip what a backend lacks: it stays "gloo" here, so "byteps" is
held to every test gloo runs on CPU; the default group torch's harness creates with it is made "byteps" instead.
Tests that need gloo by name are skipped on "byteps" with their reason (GLOO_ONLY).

May import: torch, torch_bps.
"""

from __future__ import annotations

import os
import tempfile
import unittest

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="torch-suite-"))  # the spawned ranks inherit it

import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

import torch_bps  # noqa: E402, F401  (registers "byteps" in every spawned rank, which imports this module)

DEFAULT_BACKEND = os.environ.get("TORCH_SUITE_BACKEND", "gloo")

# Tests that need gloo itself, not a backend with gloo's semantics: named, with the reason.
_MONITORED = "calls dist.monitored_barrier, which torch runs on gloo groups alone (group.monitored_barrier works)"
GLOO_ONLY: dict[str, str] = {
    "test_get_backend": 'asserts dist.get_backend() == BACKEND, "gloo"',
    "test_monitored_barrier_gloo": _MONITORED,
    "test_monitored_barrier_gloo_subgroup": _MONITORED,
}


class TorchSuite(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        if DEFAULT_BACKEND != "gloo":
            # In this spawned rank only: the harness (and the tests that re-create the default group) ask for
            # BACKEND, "gloo"; they get DEFAULT_BACKEND. Explicit gloo subgroups stay gloo.
            real_init = dist.init_process_group

            def init_process_group(*args, backend=None, **kwargs):
                return real_init(*args, backend=DEFAULT_BACKEND if backend == "gloo" else backend, **kwargs)

            dist.init_process_group = init_process_group
        super()._run(rank, test_name, file_name, pipe, **kwargs)


if DEFAULT_BACKEND != "gloo":
    for _name, _reason in GLOO_ONLY.items():
        setattr(TorchSuite, _name, unittest.skip(_reason)(getattr(TorchSuite, _name)))
