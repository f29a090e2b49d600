"""Launch and Topology: torchrun's variables, read in one place, and what a bad one says."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from torch_bps.errors import ConfigError
from torch_bps.topology import Launch, Topology


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
