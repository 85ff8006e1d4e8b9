"""The behavioural canary: a one-process Trainer (a tiny model, gradient accumulation of 2,
3 updates, clipping on) runs with every seam the adapter wraps traced, and the calls, in
order and with their arguments, must be the golden trace, and must keep the order the
adapter relies on (`update_order`). A transformers release that changes what the adapter
relies on fails here, in seconds, before any job does. No process: the Trainer runs here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from unbroken.integrations.hf_seams import unprotected  # noqa: E402
from unbroken.integrations.update_order import Call, UpdateOrder  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "trainer_trace.json"


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, labels=None):
        out = self.lin(x)
        return {"loss": torch.nn.functional.mse_loss(out.squeeze(-1), labels), "logits": out}


class Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(4, generator=g), "labels": torch.randn((), generator=g)}


def traced_run(tmp_path) -> list[list]:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=3, max_grad_norm=1.0, learning_rate=0.1, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=Tiny(), args=args, train_dataset=Data())
    trace: list[list] = []

    def wrap(name, call, detail=lambda *a, **k: {}):
        original = getattr(trainer, name)

        def traced(*a, **k):
            trace.append([call.value, detail(*a, **k)])
            return original(*a, **k)
        setattr(trainer, name, traced)

    def at() -> int:  # the scheduler's count of steps (the Trainer makes it in train())
        return trainer.lr_scheduler.last_epoch

    wrap("_get_num_items_in_batch", Call.COUNT,
         lambda batches, device: {"batches": len(batches), "scheduler_at": at()})
    wrap("training_step", Call.MICRO)
    if hasattr(trainer, "_clip_grad_norm"):
        wrap("_clip_grad_norm", Call.CLIP)

    class Record(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            trace.append([Call.PRE_OPTIMIZER.value, {}])

        def on_optimizer_step(self, args, state, control, **kw):
            trace.append([Call.OPTIMIZER.value, {"scheduler_at": at()}])

        def on_step_end(self, args, state, control, **kw):
            trace.append([Call.STEP_END.value, {"global_step": state.global_step,
                                                "scheduler_at": at()}])

    trainer.add_callback(Record())
    trainer.train()
    return trace


def test_the_installed_trainer_calls_the_seams_as_the_golden_trace_says(tmp_path):
    """The order on every release (benchmarks/framework_matrix.py runs this test in each
    cell); the trace, call for call, on the release CI pins."""
    assert unprotected() is None, "a seam is missing: see hf_seams.SEAMS"
    trace = traced_run(tmp_path)
    clips = hasattr(transformers.Trainer, "_clip_grad_norm")  # 4.x clips inline
    order = UpdateOrder(accumulation=2, clips=clips, schedules=True, updates=3)
    for call, detail in trace:
        assert order.saw(Call(call), **detail) is None, order.broken
    assert order.checked == 3
    golden = json.loads(GOLDEN.read_text())
    if transformers.__version__ == golden["transformers"]:
        assert trace == golden["trace"], (
            f"transformers {transformers.__version__} calls the seams differently: "
            f"{json.dumps(trace)}")
