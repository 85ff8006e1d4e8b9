"""A Lightning job with nothing of unbroken in it: a tiny model, a synthetic dataset,
`Trainer(strategy="ddp").fit()` on CPU. Under `unbroken run` the integration recovers its
steps in place (docs/integrations.md; `--no-integrations` turns that off):

    unbroken run --nproc-per-node 2 --on-fault wait examples/lightning/train.py

`--step-sleep S`: each training batch sleeps S seconds in a callback, as GPU time would
leave the CPU idle. `--final PATH`: rank 0 saves the final parameters there (torch.save).
`--val-every N`: validate every N batches, with a `sync_dist` metric; `--val-sleep S`: the first
validation's batches sleep S seconds each. `--raise-at N`: rank 1's callback raises at the
end of the batch whose update makes `global_step` N (a bug in the script, for the tests). `--accum K`: gradient accumulation
over K batches. `--checkpoint-every N`: Lightning's `ModelCheckpoint` saves every N steps,
in `--checkpoint-dir` (the newest kept). `--package pytorch_lightning`: the same job on the
standalone `pytorch_lightning` package.
"""

import argparse
import importlib
import os
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--samples", type=int, default=96)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--sleep-until", default=None, metavar="PATH",
               help="sleep --step-sleep per step only until PATH exists")
p.add_argument("--val-every", type=int, default=0)
p.add_argument("--val-sleep", type=float, default=0.0)
p.add_argument("--raise-at", type=int, default=None)
p.add_argument("--accum", type=int, default=1)
p.add_argument("--checkpoint-every", type=int, default=0)
p.add_argument("--checkpoint-dir", default="checkpoints")
p.add_argument("--final", default=None)
p.add_argument("--strategy", default="ddp")
p.add_argument("--package", default="lightning.pytorch", choices=["lightning.pytorch", "pytorch_lightning"],
               help="which Lightning to train with: the `lightning` package or the standalone one")
args = p.parse_args()
pl = importlib.import_module(args.package)

torch.set_num_threads(1)


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.validated = False
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        if not self.validated:
            time.sleep(args.val_sleep)
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self.validated = True

    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return {"optimizer": optimizer,
                "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)}


class GpuTime(pl.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):  # noqa: ANN001
        self.stepped_from = trainer.global_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):  # noqa: ANN001
        if args.step_sleep and not (args.sleep_until and os.path.exists(args.sleep_until)):
            time.sleep(args.step_sleep)
        if args.raise_at == trainer.global_step != self.stepped_from and trainer.global_rank == 1:
            raise RuntimeError(f"a bug in a callback, at step {args.raise_at}")


def data(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)


pl.seed_everything(0)
model = Tiny()
callbacks = [GpuTime()]
if args.checkpoint_every:
    callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.checkpoint_dir,
                                                  every_n_train_steps=args.checkpoint_every))
trainer = pl.Trainer(
    accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
    num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)), strategy=args.strategy,
    max_steps=args.steps, accumulate_grad_batches=args.accum, logger=False,
    enable_checkpointing=bool(args.checkpoint_every), enable_progress_bar=False,
    enable_model_summary=False, num_sanity_val_steps=0,
    val_check_interval=args.val_every or None, limit_val_batches=2 if args.val_every else 0,
    callbacks=callbacks)
trainer.fit(model, data(args.samples, 1), data(16, 2) if args.val_every else None)
if args.final and trainer.global_rank == 0:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.final)
