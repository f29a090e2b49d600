"""What every framework check shares: the model, the data, and how a run leaves its result (parameters and logged
metrics) for run.py to compare. May import: the standard library and torch."""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn

SEED = 0
SAMPLES, BATCH = 64, 8


def make_model() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def make_dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(SAMPLES, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def save_result(out: str, model: nn.Module, metrics: dict) -> None:
    """Write the parameters (params.pt) and the metrics (metrics.json) under `out` (rank 0 calls this)."""
    os.makedirs(out, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, "params.pt"))
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1, sort_keys=True)


def parse_args(doc: str, argv=None) -> argparse.Namespace:
    """The command line every check takes: --backend (byteps or gloo) and --out (where the result goes)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--backend", choices=["byteps", "gloo"], required=True)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)
