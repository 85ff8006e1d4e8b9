"""A TRL `SFTTrainer` job with nothing of unbroken in it: a tiny GPT-2 and a word-level
tokenizer the script builds (no download), a `datasets.Dataset` of text that the trainer
tokenizes itself, `trainer.train()`. TRL's trainers subclass the Hugging Face `Trainer`, so
under `unbroken run` the Trainer integration recovers its steps in place:

    unbroken run --nproc-per-node 2 --on-fault wait tests/scripts/trl_train.py --output-dir out

`--step-sleep S`: each optimizer step sleeps S seconds in a callback, as GPU time would
leave the CPU idle.
"""

import argparse
import time

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, TrainerCallback
from trl import SFTConfig, SFTTrainer

p = argparse.ArgumentParser()
p.add_argument("--output-dir", required=True)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--samples", type=int, default=64)
args = p.parse_args()

torch.set_num_threads(1)

SPECIAL = ["<pad>", "<eos>", "<unk>"]
WORDS = [f"w{i}" for i in range(64 - len(SPECIAL))]
vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>",
                                    eos_token="<eos>", unk_token="<unk>")

g = torch.Generator().manual_seed(1)
lengths = torch.randint(6, 15, (args.samples,), generator=g)
texts = [" ".join(WORDS[int(w)] for w in torch.randint(0, len(WORDS), (int(n),), generator=g))
         for n in lengths]
dataset = Dataset.from_dict({"text": texts})


class GpuTime(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
        if STEP_SLEEP:
            time.sleep(STEP_SLEEP)


STEP_SLEEP = args.step_sleep
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(vocab),
                                   n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
                                   pad_token_id=0))
config = SFTConfig(
    output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=2,
    learning_rate=1e-2, max_length=16, bf16=False, gradient_checkpointing=False,
    use_cpu=True, ddp_backend="gloo", report_to="none", save_strategy="no", logging_steps=5,
    seed=0, dataloader_num_workers=0, disable_tqdm=True)
trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                     callbacks=[GpuTime()])
trainer.train()
