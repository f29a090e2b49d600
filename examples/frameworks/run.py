"""Train the same small model with each training framework on "byteps" and on gloo (2 CPU processes, the
framework's launcher, the same seed) and compare: the parameters after training bit for bit, the logged metrics
exactly, and the name torch gives the group.

    python examples/frameworks/run.py                  # every framework installed
    python examples/frameworks/run.py lightning --json

May import: torch (the framework scripts run as launched processes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_BIN = os.path.dirname(sys.executable)

# name -> (the module it needs, the launch command before the script's own arguments)
FRAMEWORKS = {
    "lightning": ("lightning", lambda port: [sys.executable, os.path.join(HERE, "lightning_check.py")]),
    "accelerate": ("accelerate", lambda port: [
        os.path.join(PYTHON_BIN, "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
        os.path.join(HERE, "accelerate_check.py")]),
    "ignite": ("ignite", lambda port: [
        os.path.join(PYTHON_BIN, "torchrun"), "--nproc-per-node", "2", "--master-port", str(port),
        os.path.join(HERE, "ignite_check.py")]),
}  # fmt: skip


def installed(name: str) -> bool:
    return importlib.util.find_spec(FRAMEWORKS[name][0]) is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(name: str, backend: str, out: str, timeout: float = 600.0) -> dict:
    """Run one framework's check on `backend`; return its metrics and parameters (raises, with its output, if it
    failed)."""
    cmd = FRAMEWORKS[name][1](_free_port()) + ["--backend", backend, "--out", out]
    repo = os.path.dirname(os.path.dirname(HERE))
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        output = f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        raise RuntimeError(f"{name} on {backend} failed (exit status {proc.returncode}):\n{output}")
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    return {"metrics": metrics, "params": torch.load(os.path.join(out, "params.pt"))}


def check(name: str) -> dict:
    """Train `name` on both backends; return what differs (empty lists: identical)."""
    with tempfile.TemporaryDirectory(prefix=f"frameworks-{name}-") as tmp:
        runs = {b: train(name, b, os.path.join(tmp, b)) for b in ("gloo", "byteps")}
    names = {b: r["metrics"].pop("backend_name") for b, r in runs.items()}
    p_gloo, p_bps = runs["gloo"]["params"], runs["byteps"]["params"]
    return {
        "framework": name,
        "group_names": names,
        "params_differ": [k for k in p_gloo if not torch.equal(p_gloo[k], p_bps[k])],
        "metrics_equal": runs["gloo"]["metrics"] == runs["byteps"]["metrics"],
        "epochs": len(runs["byteps"]["metrics"]["epochs"]),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("frameworks", nargs="*", help=f"some of {', '.join(FRAMEWORKS)} (default: all)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    if unknown := set(args.frameworks) - set(FRAMEWORKS):
        p.error(f"unknown frameworks {sorted(unknown)}: choose from {list(FRAMEWORKS)}")
    results, failed = [], False
    for name in args.frameworks or list(FRAMEWORKS):
        if not installed(name):
            results.append({"framework": name, "skipped": f"{FRAMEWORKS[name][0]} is not installed (make frameworks)"})
            continue
        r = check(name)
        named = r["group_names"] == {"gloo": "gloo", "byteps": "byteps"}
        r["ok"] = named and not r["params_differ"] and r["metrics_equal"]
        failed |= not r["ok"]
        results.append(r)
    if args.json:
        print(json.dumps(results, indent=1))
    for r in results:
        verdict = r.get("skipped") or ("identical to gloo" if r["ok"] else f"DIFFERS: {r}")
        print(f"{r['framework']:<11} {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
