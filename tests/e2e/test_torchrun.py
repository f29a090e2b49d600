"""What a user runs: torchrun on examples/train_ddp.py, through "byteps" and bps_hook (faults: test_faults.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.timeout(240)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
EXAMPLE = os.path.join(REPO, "examples", "train_ddp.py")
SMALL = ["--dim", "32", "--layers", "1", "--vocab", "64", "--seq", "8", "--batch", "4"]


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(TORCHRUN + [EXAMPLE, *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_train_ddp_on_byteps_with_embedded_server():
    done = run(["--steps", "12", *SMALL])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "backend=byteps" in done.stdout and "step   11 loss" in done.stdout and "samples/s" in done.stdout
    losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if " loss " in line]
    assert losses[-1] < losses[0]  # it learns


def test_bps_hook_on_a_gloo_group():
    done = run(["--steps", "6", "--backend", "gloo", "--hook", *SMALL])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "backend=gloo hook=True" in done.stdout


def test_no_comm_bound_runs():
    """`--no-comm` (the step with free communication, the demo's bound) trains with a hook that sends nothing."""
    done = run(["--steps", "4", "--backend", "gloo", "--no-comm", *SMALL])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "backend=gloo hook=False no_comm=True" in done.stdout and "steps/s" in done.stdout


def test_sync_only_bound_runs():
    """`--sync-only` (the ranks synchronize every bucket, no gradient moves) trains on "byteps" with its hook."""
    done = run(["--steps", "4", "--sync-only", *SMALL])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "backend=byteps hook=False no_comm=False sync_only=True" in done.stdout and "steps/s" in done.stdout
