"""PyTorch Lightning's DDP strategy on "byteps" (or gloo): Lightning's own launcher starts the second process;
metrics logged with sync_dist=True (Lightning also syncs an int64 batch count with them); a checkpoint saved,
loaded back, and training resumed from it for one more epoch.

    python examples/frameworks/lightning_check.py --backend byteps --out /tmp/lightning-byteps
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BATCH, make_dataset, make_model, parse_args, save_result  # noqa: E402

import torch_bps  # noqa: E402, F401  (registers "byteps")


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.history: list[dict] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True, on_step=False, on_epoch=True)
        self.log("rank_sum", float(self.global_rank + 1), sync_dist=True, reduce_fx="sum", on_epoch=True)
        # an int64 metric: Lightning averages it with ReduceOp.AVG on every backend but gloo
        self.log("samples", torch.tensor(len(x) * (self.global_rank + 1)), sync_dist=True, on_epoch=True)
        return loss

    def on_train_epoch_end(self):
        self.history.append({k: v.item() for k, v in self.trainer.callback_metrics.items()})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(argv=None) -> int:
    args = parse_args(__doc__, argv)
    loader = torch.utils.data.DataLoader(make_dataset(), batch_size=BATCH)  # Lightning adds a DistributedSampler
    # The one line "byteps" takes: the backend name of Lightning's DDP strategy.
    strategy = DDPStrategy(process_group_backend=args.backend)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    model = Regression()
    trainer.fit(model, loader)
    ckpt = os.path.join(args.out, "after-2-epochs.ckpt")
    trainer.save_checkpoint(ckpt)
    trainer.strategy.barrier()
    loaded = Regression.load_from_checkpoint(ckpt)
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), model.parameters(), strict=True))
    trainer.fit_loop.max_epochs = 3
    trainer.fit(loaded, loader, ckpt_path=ckpt)  # resumes: optimizer state and epoch from the checkpoint
    if trainer.global_rank == 0:
        save_result(args.out, loaded, {"epochs": model.history + loaded.history,
                                       "backend_name": torch.distributed.group.WORLD.name()})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
