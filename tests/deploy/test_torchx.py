"""The TorchX component (torch_bps/torchx_component.py) on TorchX's local_cwd scheduler: two bps-server replicas
register at the trainers' rendezvous, two trainer replicas train on them, the servers leave when the trainers are
done, and the parameters are bit-identical to torchrun's on two servers of its own (two workers' sums cannot differ
in order)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.deploy.train import SCRIPT, finish, lines_of, torchrun
from tests.helpers import REPO, _free_port, start_servers, stop_servers

pytest.importorskip("torchx", reason="torchx is missing: pip install torchx (`make deploy-check` installs it)")

pytestmark = pytest.mark.timeout(300)

STEPS = 10
COMPONENT = os.path.join(REPO, "torch_bps", "torchx_component.py") + ":trainer_with_servers"


def test_local_cwd_trains_like_torchrun(tmp_path):
    servers = start_servers(2)
    try:
        proc = torchrun(str(tmp_path / "torchrun"), [s.address for s in servers], STEPS)
        expected, _ = finish(proc, lines_of(proc), str(tmp_path / "torchrun"), [])
    finally:
        stop_servers(servers)

    torchx = shutil.which("torchx", path=os.path.dirname(sys.executable))
    assert torchx, f"no torchx beside {sys.executable}"
    out = str(tmp_path / "torchx")
    # The roles run bps-server and torchrun from PATH: this Python's, as from an activated virtual environment.
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "BPS_LOCAL_REDUCE": "0", "BPS_TIMEOUT": "30",
           "BPS_CONNECT_TIMEOUT": "60"}  # fmt: skip
    cmd = [torchx, "run", "-s", "local_cwd", "--wait", "--log", COMPONENT, "--script", SCRIPT, "--servers", "2",
           "--nnodes", "2", "--rdzv_port", str(_free_port()), "--server_port", "0", "--metrics_port", "0",
           "--server_advertise", "127.0.0.1", "--", "--steps", str(STEPS), "--out", out]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "Job finished: SUCCEEDED" in output, output[-6000:]
    ports = sorted(re.findall(r"server/\d bps-server listening on \S+ port (\d+)", output))
    assert len(ports) == 2, output[-6000:]
    for rank in (0, 1):  # the workers found both servers in the rendezvous store
        assert f"rank {rank} servers 127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}" in output, output[-6000:]
    for rank in (0, 1):
        assert f"rank {rank} step {STEPS - 1}" in output
    params = torch.load(out + ".pt")
    assert params.keys() == expected.keys()
    for name, value in params.items():
        assert torch.equal(value, expected[name]), f"{name} differs from torchrun's run"
