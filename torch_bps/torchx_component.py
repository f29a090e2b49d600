"""A TorchX component: a training job and its own summation servers, one AppDef of two roles.

    torchx run -s local_cwd torch_bps/torchx_component.py:trainer_with_servers --script train.py --servers 2 --nnodes 2
    torchx run -s kubernetes -cfg queue=default torch_bps/torchx_component.py:trainer_with_servers --script train.py \\
        --image torch-bps/worker:0.1.0 --server_image torch-bps/server:0.1.0 --credential_file /etc/bps/credential

Role `trainer` (first, so that TorchX's rank-0 host is its replica 0) runs torchrun on each of `nnodes` replicas
with the c10d rendezvous at that host's `rdzv_port`. Role `server` runs `servers` replicas of bps-server, each
registering at that rendezvous store (`--register`, the workers' BPS_REGISTRY, BPS_NUM_SERVERS) and leaving once it
is gone (`--leave-with-store`: the app ends when the trainers do). The pool credential: `credential_file`, a path
both roles read (a mounted Secret), or else BPS_POOL_CREDENTIAL from the environment TorchX gives the roles (on
local_cwd: the launching shell's). Commands run from PATH: launch local_cwd from an activated virtual environment.

Needs the `torchx` extra (pip install torch_bps[torchx]). May import: the standard library and torchx.
"""

import shlex
from typing import Dict, Optional  # noqa: UP035 - TorchX reads a component's annotations: no PEP 604 or 585 there

from torchx import specs


class _Shell(str):
    """A word of the shell command left unquoted: the shell expands it where the replica runs."""


def _command(words: list[str]) -> str:
    return " ".join(w if isinstance(w, _Shell) else shlex.quote(w) for w in words)


def trainer_with_servers(
    *script_args: str,
    script: str,
    servers: int = 2,
    nnodes: int = 1,
    nproc_per_node: int = 1,
    image: str = "torch-bps/worker:0.1.0",
    server_image: str = "torch-bps/server:0.1.0",
    credential_file: str = "",
    rdzv_port: int = 29500,
    server_port: int = 9000,
    metrics_port: int = 9100,
    server_advertise: str = "",
    cpu: int = 4,
    gpu: int = 0,
    memMB: int = 8192,  # noqa: N803 - TorchX's spelling
    server_cpu: int = 1,
    server_memMB: int = 4096,  # noqa: N803
    env: Optional[Dict[str, str]] = None,  # noqa: UP006, UP045
) -> specs.AppDef:
    """Train `script` under torchrun on `nnodes` replicas, with `servers` bps-server replicas of its own.

    Args:
        script_args: arguments to the training script
        script: the training script, run by torchrun on every trainer replica
        servers: summation servers (role `server`), all registered before the workers start
        nnodes: trainer replicas (machines)
        nproc_per_node: worker processes per trainer replica
        image: the trainers' image (deploy/docker/worker.Dockerfile)
        server_image: the servers' image (deploy/docker/server.Dockerfile)
        credential_file: a file holding the pool credential, at this path in both roles; empty: the roles'
            BPS_POOL_CREDENTIAL
        rdzv_port: the port of torchrun's c10d rendezvous store on the first trainer, where the servers register
        server_port: each server's push/pull port (0: a free one, for several servers on one machine: local_cwd)
        metrics_port: each server's /metrics, /healthz and /readyz port (0: a free one)
        server_advertise: the address the workers reach each server at (default: the server's host name)
        cpu: CPUs per trainer replica
        gpu: GPUs per trainer replica
        memMB: memory per trainer replica, MB
        server_cpu: CPUs per server (docs/deploy.md, "Sizing")
        server_memMB: memory per server, MB; its memory bound defaults to half the container's limit
        env: more environment variables for the trainers (BPS_* settings)
    """
    # The first trainer's host, expanded by the shell where each replica runs ("$$": a "$" past TorchX's macros).
    store = _Shell(f"$${{{specs.macros.rank0_env}:=localhost}}:{rdzv_port}")
    trainer = [_Shell(f"export BPS_REGISTRY={store};")]
    if credential_file:
        trainer.append(_Shell(f'export BPS_POOL_CREDENTIAL="$$(cat {shlex.quote(credential_file)})";'))
    trainer += ["exec", "torchrun", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node), "--rdzv-backend",
                "c10d", "--rdzv-endpoint", store, "--rdzv-id", specs.macros.app_id, script, *script_args]  # fmt: skip
    server = ["exec", "bps-server", "--host", "0.0.0.0", "--port", str(server_port), "--metrics-port",
              str(metrics_port), "--register", store, "--leave-with-store"]  # fmt: skip
    server += ["--credential-file", credential_file] if credential_file else []
    server += ["--advertise", server_advertise] if server_advertise else []
    return specs.AppDef(
        name="torch-bps",
        roles=[
            specs.Role(
                name="trainer",
                image=image,
                entrypoint="bash",
                args=["-c", _command(trainer)],
                num_replicas=nnodes,
                resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB),
                env={"BPS_NUM_SERVERS": str(servers), **(env or {})},
                port_map={"c10d": rdzv_port},
            ),
            specs.Role(
                name="server",
                image=server_image,
                entrypoint="bash",
                args=["-c", _command(server)],
                num_replicas=servers,
                resource=specs.resource(cpu=server_cpu, memMB=server_memMB),
                port_map={"push-pull": server_port, "metrics": metrics_port},
            ),
        ],
    )
