"""Hugging Face Accelerate on "byteps" (or gloo), under `accelerate launch`: an `Accelerator` with a DDP model,
metrics through `gather` and `reduce` (an int64 count among them), `save_state`, parameters spoilt, `load_state`,
and one more epoch from there.

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \\
        examples/frameworks/accelerate_check.py --backend byteps --out /tmp/accelerate-byteps
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BATCH, make_dataset, make_model, parse_args, save_result  # noqa: E402

import torch_bps  # noqa: E402, F401  (registers "byteps")


def prepared(acc: Accelerator):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(make_dataset(), batch_size=BATCH)
    return acc.prepare(model, opt, loader)


def epoch(acc: Accelerator, model, opt, loader) -> dict:
    losses, samples = [], torch.zeros((), dtype=torch.int64)
    for x, y in loader:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        losses.append(acc.gather(loss.detach().reshape(1)))
        samples += len(x)
    return {"losses": torch.cat(losses).tolist(), "mean_loss": acc.reduce(torch.stack([loss.detach()]), "mean").item(),
            "samples": acc.reduce(samples, "sum").item()}  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(__doc__, argv)
    if args.backend == "byteps":
        # Accelerate picks gloo for CPU itself (any other name is ignored); a group created first is kept.
        dist.init_process_group("byteps")
    acc = Accelerator(cpu=True)
    model, opt, loader = prepared(acc)
    history = [epoch(acc, model, opt, loader) for _ in range(2)]
    state = os.path.join(args.out, "state")
    acc.save_state(state)
    acc.wait_for_everyone()
    saved = [q.detach().clone() for q in model.parameters()]
    with torch.no_grad():  # spoil what load_state must bring back
        for q in model.parameters():
            q.zero_()
    acc.load_state(state)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved, strict=True)), "load_state"
    history.append(epoch(acc, model, opt, loader))
    if acc.is_main_process:
        save_result(args.out, acc.unwrap_model(model), {"epochs": history, "backend_name": dist.group.WORLD.name()})
    acc.wait_for_everyone()
    acc.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
