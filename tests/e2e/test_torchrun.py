"""What a user runs: torchrun on examples/train_ddp.py, through "byteps" and bps_hook (faults: test_faults.py); and
what torchrun hands us: its variables, read in one place (Launch, Topology), and what a bad one says."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import REPO
from torch_bps.errors import ConfigError
from torch_bps.topology import Launch, Topology

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


# -- torchrun's variables ------------------------------------------------------------------------------------------


def test_launch_without_a_launcher_is_one_attempt_of_an_unnamed_job():
    assert Launch.from_env({}) == Launch(rank=None, world_size=None, master_addr="", attempt="0", run_id="job")


def test_launch_reads_torchruns_variables():
    env = {"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.7", "TORCHELASTIC_RESTART_COUNT": "2",
           "TORCHELASTIC_RUN_ID": "abc"}  # fmt: skip
    assert Launch.from_env(env) == Launch(5, 8, "10.0.0.7", "2", "abc")


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE"])
def test_a_launch_number_that_is_not_one_names_its_variable(name):
    with pytest.raises(ConfigError, match=f"{name}='two'"):
        Launch.from_env({name: "two"})


def test_a_process_whose_launcher_set_a_bad_rank_fails_at_init_naming_it():
    """A real process: init_process_group("byteps") with RANK garbled in its environment raises the ConfigError at
    once, before any server or store wait."""
    code = textwrap.dedent("""
        import torch.distributed as dist, torch_bps
        try:
            dist.init_process_group("byteps", store=dist.HashStore(), rank=0, world_size=1)
        except torch_bps.ConfigError as e:
            print("ConfigError:", e)
    """)
    env = {**os.environ, "RANK": "two"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "ConfigError: RANK='two' is not a number" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_topology_from_torchruns_variables():
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}
    assert Topology.from_env(3, 4, env) == Topology(3, 4, 1, 2, 1, 2)
    assert Topology.from_env(3, 4, {}) == Topology(3, 4, 3, 4, 0, 1)  # no launcher: one machine
    assert Topology.one_per_machine(3, 4) == Topology(3, 4, 0, 1, 3, 4)  # a subgroup's


def test_an_inconsistent_topology_names_every_variable():
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2"}
    with pytest.raises(ConfigError, match="inconsistent topology for rank 3: LOCAL_RANK=0 LOCAL_WORLD_SIZE=2"):
        Topology.from_env(3, 4, env)
