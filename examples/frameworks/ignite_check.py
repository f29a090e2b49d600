"""PyTorch Ignite's idist on "byteps" (or gloo), under torchrun: DDP (`idist.auto_model` on gloo), `auto_optim`,
`auto_dataloader`, a supervised trainer, metrics synced across ranks (an `Average` metric, `idist.all_reduce` of an
int64 count, `idist.all_gather`), a `Checkpoint` saved, spoilt, loaded and trained on for one more epoch.

    torchrun --nproc-per-node 2 examples/frameworks/ignite_check.py --backend byteps --out /tmp/ignite-byteps
"""

from __future__ import annotations

import os
import sys

import ignite.distributed as idist
import torch
import torch.distributed as dist
from ignite.engine import Events, create_supervised_trainer
from ignite.handlers import Checkpoint, DiskSaver
from ignite.metrics import Average
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BATCH, make_dataset, make_model, parse_args, save_result  # noqa: E402

import torch_bps  # noqa: E402, F401  (registers "byteps")


def training(local_rank: int, args) -> None:
    if args.backend == "gloo":
        model = idist.auto_model(make_model())
    else:
        # auto_model wraps in DDP only for the backends it lists, and otherwise returns the model as it is: every rank
        # would train alone, silently. Wrap it here, as auto_model does on CPU.
        model = DDP(make_model())
    opt = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
    loader = idist.auto_dataloader(make_dataset(), batch_size=BATCH * idist.get_world_size(), shuffle=False)
    trainer = create_supervised_trainer(model, opt, torch.nn.functional.mse_loss)
    average = Average()  # its compute() all-reduces across ranks
    average.attach(trainer, "loss")
    history: list[dict] = []

    @trainer.on(Events.EPOCH_COMPLETED)
    def log(engine):
        samples = idist.all_reduce(torch.tensor(len(loader.sampler), dtype=torch.int64))
        ranks = idist.all_gather(torch.tensor([idist.get_rank()]))
        history.append({"loss": engine.state.metrics["loss"], "samples": samples.item(), "ranks": ranks.tolist()})

    trainer.run(loader, max_epochs=2)
    to_save = {"model": model, "optimizer": opt, "trainer": trainer}
    checkpoint = Checkpoint(to_save, DiskSaver(os.path.join(args.out, "ckpt"), require_empty=False))
    checkpoint(trainer)
    idist.barrier()
    saved = [q.detach().clone() for q in model.parameters()]
    with torch.no_grad():  # spoil what load_objects must bring back
        for q in model.parameters():
            q.zero_()
    ckpt = torch.load(os.path.join(args.out, "ckpt", checkpoint.last_checkpoint), weights_only=False)
    Checkpoint.load_objects(to_load=to_save, checkpoint=ckpt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved, strict=True)), "load_objects"
    trainer.run(loader, max_epochs=3)  # resumes at epoch 2 from the restored trainer state
    if idist.get_rank() == 0:
        save_result(args.out, model.module, {"epochs": history, "backend_name": dist.group.WORLD.name()})


def main(argv=None) -> int:
    args = parse_args(__doc__, argv)
    if args.backend == "byteps":
        # idist.Parallel accepts only the backends it lists; it takes an already initialized group as it is.
        dist.init_process_group("byteps")
        parallel = idist.Parallel()
    else:
        parallel = idist.Parallel(backend="gloo")
    with parallel as p:
        p.run(training, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
