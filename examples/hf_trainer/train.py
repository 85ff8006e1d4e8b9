"""A Hugging Face Trainer job with nothing of unbroken in it: a tiny GPT-2 the script builds
(no download), a synthetic dataset, `Trainer.train()`. Under `unbroken run` the integration
recovers its steps in place (docs/integrations.md; `--no-integrations` turns that off):

    unbroken run --nproc-per-node 2 --on-fault wait --max-restarts 3 examples/hf_trainer/train.py --output-dir out

`--step-sleep S`: each optimizer step sleeps S seconds in a callback, as GPU time would
leave the CPU idle. `--final PATH`: rank 0 saves the final parameters there (torch.save).
`--step-log PATH`: rank 0 appends "<global_step> <wall time>" to PATH at each step's end
(benchmarks/frameworks.py reads it under every launcher, torchrun's included).
`--zero STAGE`: train under DeepSpeed ZeRO stage 1 or 2 (CPU, gloo; `pip install deepspeed`),
which the integration does not recover in place: a fault restarts every worker, and
`--resume` resumes from the Trainer's own (DeepSpeed) checkpoint.
"""

import argparse
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--output-dir", required=True)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--accum", type=int, default=1)
p.add_argument("--save-steps", type=int, default=10)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--sleep-until", default=None, metavar="PATH",
               help="sleep --step-sleep per step only until PATH exists")
p.add_argument("--samples", type=int, default=64)
p.add_argument("--final", default=None)
p.add_argument("--step-log", default=None, metavar="PATH",
               help="rank 0 appends '<global_step> <time>' to PATH at each step's end")
p.add_argument("--resume", action="store_true", help="train(resume_from_checkpoint=True) if "
               "the output dir holds a checkpoint, as restart-tolerant scripts do")
p.add_argument("--zero", type=int, choices=(1, 2), default=None)
args = p.parse_args()

torch.set_num_threads(1)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class GpuTime(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
        if STEP_LOG and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            with open(STEP_LOG, "a") as log:
                log.write(f"{state.global_step} {time.time():.6f}\n")
        if STEP_SLEEP and not (SLEEP_UNTIL and os.path.exists(SLEEP_UNTIL)):
            time.sleep(STEP_SLEEP)


STEP_SLEEP, SLEEP_UNTIL, STEP_LOG = args.step_sleep, args.sleep_until, args.step_log
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                   n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0))
training = TrainingArguments(
    output_dir=args.output_dir, per_device_train_batch_size=2, max_steps=args.steps,
    gradient_accumulation_steps=args.accum, learning_rate=1e-2, save_strategy="steps",
    save_steps=args.save_steps, logging_steps=5, report_to="none", use_cpu=True,
    ddp_backend="gloo", seed=0, dataloader_num_workers=0, disable_tqdm=True,
    deepspeed=None if args.zero is None else {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto", "torch_adam": True}},
        "zero_optimization": {"stage": args.zero}})
trainer = Trainer(model=model, args=training, train_dataset=Tokens(args.samples),
                  callbacks=[GpuTime()])
resume = args.resume and any(d.startswith("checkpoint-") for d in os.listdir(args.output_dir)) \
    if os.path.isdir(args.output_dir) else False
trainer.train(resume_from_checkpoint=True if resume else None)
if args.final and trainer.args.process_index == 0:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.final)
