"""The Hugging Face `Trainer`, recovered in place: `protect(trainer)`, or automatically for
every Trainer a script trains under `unbroken run` (`unbroken.integrations.automatic`).

What holds (docs/integrations.md):
- Each optimizer step is a committed step. The engine's `begin` comes as the update starts
  (at the count of its items, which every rank gathers), its `enter` inside the update's
  first micro-batch, `check` at `on_pre_optimizer_step` (after every micro-batch's backward
  and the clipping), `updating` spans `optimizer.step()`,
  and `commit` comes at `on_step_end` (after the scheduler and `global_step += 1`).
- The engine's verdict is obeyed (numerical checks, `AnomalyConfig`): a step to rerun
  runs its micro-batches again on the same inputs, and is clipped and checked again; a
  step the engine passed over (at `check`, or at `begin`: `run.skip_steps`, a batch an
  earlier anomaly passes over) makes no optimizer step and leaves the LR schedule where it
  was, and the Trainer goes on to its next batches; a rollback leaves the epoch and runs it
  again from the engine's step (5.x, as after a switch; under 4.x, whose loop cannot, a
  rollback remedy is taken as a skip, said at the start). The check's loss is the update's
  (`training_step`'s, summed over its micro-batches: their mean).
- Survivors never leave `train()`. A collective that fails because a peer died, inside
  `training_step` (DDP's all-reduce in backward) or in the count of the update's tokens
  (`_get_num_items_in_batch`), leaves the generation and joins the next one. Then the
  engine brings the committed state, DDP is rebuilt on the new group (an FSDP2 model, the
  Trainer's own through Accelerate, stays the same module: the engine rebinds its mesh on
  the new group and brings each rank its shard), the update's earlier micro-batches are
  replayed on the same inputs (a half-accumulated update is dropped, never committed), and
  the failed one is redone. The gradient norm before the optimizer step (a collective
  under FSDP2) is recovered the same way: the whole update is replayed, then the norm.
- A joiner (a spare, or a replacement running the same script) calls `train()` like
  everyone. At `on_train_begin` it joins, takes the state from a peer (model, optimizer,
  scheduler, `TrainerState` with the stateful callbacks' state), and its first epoch skips
  the batches already trained, with the Trainer's own skip. Nothing is read from storage; a
  `resume_from_checkpoint` the script passes is not used by a joiner.
- The world size never changes (the sampler and `max_steps` depend on it): run the job
  with `--on-fault wait`, or with spares.

A peer's fault met in the log, save and evaluation after a step is recovered in place too
(what was left of them at that step is skipped), as is a peer's death inside the Trainer's
own checkpoint save (the survivors meet it in their next collective). A switch may take
the state back: a sharded job's dead rank's shard comes from an in-memory snapshot, older
than the committed step. Then the Trainer's epoch is left and run again from the engine's
step, with the Trainer's own batch skip, still inside `train()` (transformers 5.x; under
4.x such a job is restarted: `hf_versions`). Faults met elsewhere (the evaluation of
`eval_on_start`, an `evaluate()` or `save_model()` the script calls outside `train()`) are
not recovered in place: the worker fails, and the job recovers as it would without the
integration. Protection is decided by what the installed Trainer has and does, never by
its version: the private methods the integration uses are checked first (`hf_seams.SEAMS`), and the
order of the calls in an update on the first two updates (`update_order`); a Trainer that
lacks one, or breaks one, trains unprotected, saying which in one line.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from typing import Any

import torch
import transformers
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback

import unbroken
from unbroken.control.worker_env import WorkerEnv
from unbroken.errors import JobStopped, UpdateRefused, is_peer_error
from unbroken.integrations.hf_seams import unprotected
from unbroken.integrations.hf_state import StateOfTrainer, take_slot
from unbroken.integrations.hf_versions import InlineEpochs, Rewind, epochs_for
from unbroken.integrations.update_order import (
    Call,
    UpdateOrder,
    scheduler_steps,
    steps_per_update,
)
from unbroken.runtime.engine import Engine, Verdict
from unbroken.runtime.run import Run, init
from unbroken.telemetry import schema as ev


def protect(trainer: Trainer, run: Run | None = None) -> Trainer:
    """Recover `trainer`'s training in place (see the module's docstring); returns it.

    Called before `trainer.train()`. `run`: an `unbroken.init()` of the script's own
    (default: one made here, without checkpoints of unbroken's: the Trainer keeps its own).
    Idempotent."""
    if getattr(trainer, "_unbroken", None) is not None:
        return trainer
    if (why := unprotected(trainer)) is not None:
        print(f"unbroken: transformers {transformers.__version__}: {why}; this Trainer trains "
              "unprotected, and a fault restarts every worker", file=sys.stderr, flush=True)
        trainer._unbroken = False
        return trainer
    trainer._unbroken = TrainerSteps(trainer, run or init())
    return trainer


class TrainerSteps:
    """A Trainer's optimizer steps on the engine's step transaction. One per Trainer."""

    def __init__(self, trainer: Trainer, run: Run) -> None:
        self.trainer, self.run = trainer, run
        self.engine: Engine = run.engine
        self._training_step = trainer.training_step  # bound: a subclass's override included
        self._num_items = trainer._get_num_items_in_batch
        self._clip_grad_norm = getattr(trainer, "_clip_grad_norm", None)  # 5.x; 4.x's is inline
        self._epochs = epochs_for(trainer)  # where a joiner starts
        trainer.training_step = self.training_step
        trainer._get_num_items_in_batch = self.num_items
        for name in ("_clip_grad_norm", "_get_grad_norm"):  # 5.x; 4.x's norm is inline
            if hasattr(trainer, name):
                setattr(trainer, name, self._norm(getattr(trainer, name), name == "_clip_grad_norm"))
        max_norm = trainer.args.max_grad_norm
        self._order = UpdateOrder(trainer.args.gradient_accumulation_steps,
                                  clips=self._clip_grad_norm is not None and bool(max_norm))
        trainer._maybe_log_save_evaluate = self._between_steps(trainer._maybe_log_save_evaluate)
        trainer.train = self._train(trainer.train)
        trainer.evaluate = self._long("evaluate", trainer.evaluate)
        trainer._save_checkpoint = self._long("save", trainer._save_checkpoint)
        trainer.add_callback(_Callback(self))
        self._micro: list[Any] = []  # this update's micro-batches so far (their inputs)
        self._fetched: tuple[list, Any] = ([], None)  # the update's batches and device
        self._count: Any = None  # the update's item count, as gathered in this generation
        self._update = ExitStack()
        self._loss = 0.0
        self._metrics: dict[str, Any] = {}  # the update's, as checked: committed with it
        self._reuse_view = True  # generation 0's DDP is the Trainer's own
        self._drawn = 0  # the step of the update the Trainer's loop draws next
        self._skip_update = False  # no update: the peers' state holds it, or the engine
        # passed over its step
        self._scheduler_state: dict[str, Any] = {}
        self._exact = False  # --exact-reduction: every DDP built gets exact_allreduce

    # ------------------------------------------------------------------ callbacks
    def train_begin(self) -> None:
        """Track the state and enter the job (collective); a joiner joins here."""
        trainer, run = self.trainer, self.run
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        run.track(trainer.model, optimizer, scheduler=trainer.lr_scheduler,
                  trainer_state=StateOfTrainer(trainer))
        self._order.schedules = steps_per_update(trainer.lr_scheduler)
        if self.engine.generations is not None:  # Accelerate counts the processes once
            self.engine.generations.fix_world("the Trainer")
        trainer.optimizer.step = self._unless_skipped(trainer.optimizer.step)
        self._exact = WorkerEnv.from_environ().exact_reduction
        if self._exact and isinstance(trainer.model_wrapped, DistributedDataParallel):
            trainer.model_wrapped.register_comm_hook(None, unbroken.exact_allreduce)
        joining = run.joining
        self._reuse_view = not joining
        if (why := self._epochs.why_not()) is not None:
            self.engine.in_place_unavailable(why)
        if isinstance(self._epochs, InlineEpochs):
            self.engine.anomalies.without_rollback(
                "transformers 4.x's inline epoch loop cannot be run again from an older step",
                self.engine.position.rank)
        self.engine.start(trainer.state.max_steps, self.build, self.shadow_step,
                          resumed_at=trainer.state.global_step)
        self._drawn = self.engine.position.step
        if run.spare:
            take_slot(trainer, self.engine.slot)
        if joining:  # after the spare's slot: 4.x's skip wraps the loader's batch sampler
            self._epochs.start_at(self.engine.position.step)

    def pre_optimizer_step(self) -> None:
        self._saw(Call.PRE_OPTIMIZER)
        if not self._skip_update:
            self._check()
        if self._skip_update:  # the Trainer steps the scheduler next: it is set back after
            self._scheduler_state = self.trainer.lr_scheduler.state_dict()
        self._update.enter_context(self.engine.updating())

    def optimizer_step(self) -> None:
        self._saw(Call.OPTIMIZER, scheduler_at=self._scheduler_at())
        self._update.close()

    def step_end(self) -> None:
        self._saw(Call.STEP_END, global_step=self.trainer.state.global_step,
                  scheduler_at=self._scheduler_at())
        if self._skip_update:
            self.trainer.lr_scheduler.load_state_dict(self._scheduler_state)
        step = self.trainer.state.global_step - 1
        if step >= self.engine.position.step:
            self.engine.commit(step, self._metrics)

    def train_end(self) -> None:
        self.engine.finish()

    # ------------------------------------------------------------------ the step
    def num_items(self, batches: list, device: Any) -> Any:
        """The Trainer's count of the update's items, first thing in each update (after its
        micro-batches are fetched, before any is run): the step boundary. The engine's
        `begin` runs here (a switch the leader asked for happens first, so that every member
        of the new generation meets at this count's gather); then the count, recovered."""
        self._saw(Call.COUNT, batches=len(batches), scheduler_at=self._scheduler_at())
        self._micro, self._loss, self._skip_update = [], 0.0, False
        self._metrics = {}
        self._fetched = (batches, device)
        drawn, self._drawn = self._drawn, self._drawn + 1
        step = self.engine.begin()
        if step is None:  # the engine is done (its last step committed): so is the Trainer
            self.trainer.control.should_training_stop = True
            step = self.engine.position.step
        elif step < drawn:  # a switch in `begin` took the state back
            self._rewind()
        elif step > drawn:  # the engine passed over this update's step (`run.skip_steps`, or
            self._skip_update = True  # a batch an anomaly passes over): no update is made
            return None
        if self._recount(step):
            return None
        return self._count

    def training_step(self, model: Any, inputs: Any, num_items: Any = None) -> torch.Tensor:
        """The Trainer's `training_step`, on the current generation's model, recovered in
        place: see the module's docstring."""
        self._saw(Call.MICRO)
        if self._skip_update:
            return torch.zeros((), device=self.trainer.args.device)
        self._micro.append(inputs)
        step = self.engine.position.step
        while True:
            try:
                if len(self._micro) == 1:
                    self.engine.enter(step)
                loss = self._training_step(self._view(model), inputs, self._count)
                self._loss = self._loss + loss.detach()  # on the device: no sync here
                return loss
            except Exception as exc:  # a peer's fault is recovered; anything else re-raised
                self.engine.fail(step, exc)
            if self._redo(step):
                return torch.zeros((), device=self.trainer.args.device)

    def _saw(self, call: Call, **detail: int) -> None:
        """The Trainer's `call`, checked against the update's order on the job's first
        updates (`update_order`; generation 0 only: a recovery's replays are the adapter's
        own). A broken invariant turns in-place recovery off before any fault."""
        if self._order.checking and self.engine.position.gen == 0 \
                and (broken := self._order.saw(call, **detail)) is not None:
            self.engine.in_place_unavailable(f"the Trainer broke an order the adapter relies on "
                                             f"({broken})")

    def _scheduler_at(self) -> int:
        """The scheduler's count of steps (`last_epoch`; -1 without one)."""
        return scheduler_steps(self.trainer.lr_scheduler)

    def _redo(self, step: int) -> bool:
        """After `engine.fail` inside an update: the new generation stands at the committed
        step. True if its state already holds this update (a peer committed it first): the
        rest of the update is skipped. Else the update starts over in the new generation as
        it did in the old: the count's gather (which a joiner meets with its own first
        collective), then the earlier micro-batches, on the same inputs."""
        if self._recount(step):
            return True
        self._replay(self._micro[:-1], step)
        return False

    def _check(self, again: bool = False) -> None:
        """The engine's check of the update, after every micro-batch's backward and the
        clipping, before the optimizer step (collective when numerical checks are on), and
        its verdict obeyed. RERUN: the engine dropped the update; it starts over as a new try
        (`begin`, the count, `enter`), its micro-batches run again on the same inputs, clipped
        and checked again. SKIPPED: the engine passed over the step: no optimizer step, the
        scheduler set back (`_skip_update`). ROLLED_BACK: the state went back (`Rewind`). A
        peer's fault met here (the check's gather, a replay) is recovered as in a
        micro-batch, then the whole update is run again (`again`: from the start, after a
        recovery the caller made). `JobStopped` propagates."""
        engine = self.engine
        step, recovered = engine.position.step, again  # again after a recovery: said
        while True:
            try:
                if again:
                    engine.enter(step)
                    self._replay(self._micro, step, reduce_last=True, recovered=recovered)
                    self._clip()
                self._metrics = {"loss": float(self._loss)}  # one sync per step
                verdict = engine.check(step, self._metrics)
            except JobStopped:
                raise
            except Exception as exc:  # a peer's fault is recovered; anything else re-raised
                engine.fail(step, exc)
                if self._recount(step):
                    return
                again = recovered = True
                continue
            if verdict is Verdict.COMMIT:
                return
            if verdict is Verdict.SKIPPED:
                self._skip_update = True
                return
            if verdict is Verdict.ROLLED_BACK:
                self._rewind()
            engine.begin()  # RERUN: the same step again (a switch asked for comes first)
            if self._recount(step):
                return
            again, recovered = True, False

    def _clip(self) -> None:
        """The Trainer's gradient clipping, again: it clipped the first try's gradients
        before `on_pre_optimizer_step`, where the update was run again."""
        trainer = self.trainer
        max_norm = trainer.args.max_grad_norm
        if max_norm is None or max_norm <= 0:
            return
        if self._clip_grad_norm is not None:  # 5.x: the Trainer's own (unwrapped)
            self._clip_grad_norm(trainer.model_wrapped)
        else:  # 4.x: the loop's inline clipping (DDP; FSDP2 under 4.x is not in place)
            trainer.accelerator.clip_grad_norm_(trainer.model.parameters(), max_norm)

    def _recount(self, step: int) -> bool:
        """The update's count (again, after a switch), recovered; True if the peers' state
        already holds this update (it is skipped). Raises `Rewind` if the state went back."""
        while True:
            if self.engine.position.step < step:
                self._rewind()
            if self.engine.position.step > step:
                self._skip_update = True
                return True
            try:
                self._count = self._num_items(*self._fetched)
                return False
            except Exception as exc:  # a peer's fault is recovered; anything else re-raised
                self.engine.fail(step, exc)

    def _replay(self, micro: list, step: int, reduce_last: bool = False,
                recovered: bool = True) -> None:
        """Run `micro` (this update's inputs) again in the new generation, their gradient
        reduction deferred as the Trainer defers it (DDP's `no_sync`, FSDP2's
        `set_requires_gradient_sync(False)`), except the last one's if `reduce_last`.
        `recovered`: after an in-place recovery (said in an event), not a rerun."""
        self._loss = 0.0
        view = self.engine.view
        for i, inputs in enumerate(micro):
            deferred = not (reduce_last and i == len(micro) - 1)
            with _no_sync(view) if deferred else ExitStack():
                self._loss = self._loss + self._training_step(view, inputs, self._count).detach()
        if micro and recovered:
            self.run.events.emit(ev.MicroBatchesReplayed(step=step, gen=self.engine.position.gen,
                                                         micro_batches=len(micro)))

    def _norm(self, original: Any, clips: bool) -> Any:
        """The Trainer's gradient norm (and clipping) before the optimizer step, recovered in
        place: under FSDP2 it is a collective (each rank holds a shard of the gradients). A
        peer's fault met there drops the update's gradients; in the new generation the
        whole update is run again on the same inputs, its reduction included, and the norm
        is taken again (or the update is skipped, if the peers' state holds it)."""
        def norm(model: Any, *args: Any, **kwargs: Any) -> Any:
            if clips:
                self._saw(Call.CLIP)
            if self._skip_update:
                return torch.zeros((), device=self.trainer.args.device)
            step, replay = self.engine.position.step, False
            while True:
                try:
                    if replay:
                        self._replay(self._micro, step, reduce_last=True)
                    return original(model, *args, **kwargs)
                except Exception as exc:  # a peer's fault is recovered; anything else re-raised
                    self.engine.fail(step, exc)
                if self._recount(step):
                    return torch.zeros((), device=self.trainer.args.device)
                replay = True
        return norm

    def _view(self, model: Any) -> Any:
        """The current generation's model; the Trainer's `no_sync` on the one its loop holds
        (the first DDP, inert after a switch) carries over."""
        view = self.engine.view
        if view is None:
            return model
        if view is not model and isinstance(view, DistributedDataParallel) \
                and isinstance(model, DistributedDataParallel):
            view.require_backward_grad_sync = model.require_backward_grad_sync
        return view

    def _rewind(self) -> None:
        """A switch took the state back to the engine's step, older than the update the
        Trainer's loop drew: the loop draws that step's batches next (`Rewind`)."""
        self._drawn = self.engine.position.step
        raise Rewind(self._drawn)

    def _between_steps(self, original: Any) -> Any:
        """The Trainer's log, save and evaluation after a step: a peer's fault met in their
        collectives (logging's loss gather) is recovered in place like one in a step, and
        what was left of them at that step is skipped (retried, a collective would meet a
        joiner's first one, not its own). Any other error propagates."""
        def between(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except Exception as exc:
                if not is_peer_error(exc):
                    raise
                self.engine.fail(self.engine.position.step, exc)
            if self.engine.position.step < self._drawn:
                self._rewind()
            return None
        return between

    def _train(self, original: Any) -> Any:
        def train(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
            if self.run.joining:  # its state comes from a peer, never from that checkpoint
                resume_from_checkpoint = None
            return original(resume_from_checkpoint, *args, **kwargs)
        return train

    def _long(self, name: str, original: Any) -> Any:
        """Evaluation and the Trainer's own saves: long phases (no hang timeout, no blame),
        with the heartbeat's clock restarted after them (`Run.phase`)."""
        def long(*args: Any, **kwargs: Any) -> Any:
            with self.run.phase(name):
                return original(*args, **kwargs)
        return long

    def _unless_skipped(self, original: Any) -> Any:
        """The update's optimizer step, unless the peers' state holds it or the engine
        passed over its step (an instance attribute of the Accelerator's wrapper, which no
        checkpoint pickles). The fence before it may refuse it (`runtime/generations/fence.py`: the
        generation was aborted between the reduction and the update): recovered in place
        like a fault met in the check, then the update is made in the new generation."""
        def step(*args: Any, **kwargs: Any) -> Any:
            while not self._skip_update:
                try:
                    return original(*args, **kwargs)
                except UpdateRefused as exc:
                    at = self.engine.position.step
                    self.engine.fail(at, exc)
                    if not self._recount(at):
                        self._check(again=True)
            return None
        return step

    # ------------------------------------------------------------------ the engine's
    def build(self) -> Any:
        """The model a generation trains: after a switch, every member builds a fresh DDP
        on the new group with the Trainer's settings (the same collectives on every member:
        parameter shapes and a broadcast), and the old one's gradient hooks are removed.
        Re-pointing the old DDP at the new group is not enough: a survivor's buckets keep
        the order it rebuilt after its first step, a joiner's have the initial order, and
        their all-reduce would sum mismatched gradients. An FSDP2 model (not DDP) is
        returned as it is: the engine has rebound its mesh on the new group."""
        trainer = self.trainer
        old = trainer.model_wrapped
        if self._reuse_view or not isinstance(old, DistributedDataParallel):
            self._reuse_view = False
            return old
        old._remove_autograd_hooks()
        kept = {"broadcast_buffers": False} if not old.broadcast_buffers else {}
        new = DistributedDataParallel(
            trainer.model, device_ids=old.device_ids, find_unused_parameters=old.find_unused_parameters,
            bucket_cap_mb=old.bucket_bytes_cap / (1024 * 1024),
            gradient_as_bucket_view=old.gradient_as_bucket_view, static_graph=old.static_graph,
            **kept)
        if self._exact:
            new.register_comm_hook(None, unbroken.exact_allreduce)
        trainer.model_wrapped = new
        return new

    def shadow_step(self, step: int, view: Any) -> None:
        """A spare's warm-up step, in its sandbox: a forward and backward on a first batch."""
        trainer = self.trainer
        if not hasattr(trainer, "current_gradient_accumulation_steps"):  # set by the epoch
            trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
        self._training_step(view, next(iter(trainer.callback_handler.train_dataloader)), None)


def _no_sync(view: Any) -> Any:
    """A context in which `view`'s backward defers its gradient reduction, as the Trainer's
    `accelerator.no_sync` does for DDP and FSDP2; a plain model has none."""
    if isinstance(view, DistributedDataParallel):
        return view.no_sync()
    stack = ExitStack()
    if hasattr(view, "set_requires_gradient_sync"):  # FSDP2
        view.set_requires_gradient_sync(False)
        stack.callback(view.set_requires_gradient_sync, True)
    return stack


class _Callback(TrainerCallback):
    """The Trainer's events, forwarded to its `TrainerSteps`."""

    def __init__(self, steps: TrainerSteps) -> None:
        self.steps = steps

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.steps.train_begin()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.steps.pre_optimizer_step()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.steps.optimizer_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.steps.step_end()

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.steps.train_end()
