"""Lightning's `Trainer.fit`, recovered in place: `Trainer(strategy="unbroken_ddp")`, or
automatically for `strategy="ddp"` (and `"auto"` with several processes) under
`unbroken run` (`unbroken.integrations.automatic`).

What holds (docs/integrations.md):
- Each optimizer step is a committed step (`trainer.global_step`). The engine's `begin` and
  `enter` come at the strategy's `on_train_batch_start` of the update's first batch; the
  last batch's closure (forward, backward, DDP's all-reduce) and the update run inside the
  strategy's `optimizer_step`; `check` comes after that closure (its backward, before
  Lightning's gradient clipping), `updating` spans the update, and `commit` follows it.
- The engine's verdict is obeyed (numerical checks, `AnomalyConfig`: pass the script's
  `unbroken.init(anomalies=...)` as `UnbrokenDDPStrategy(run=...)`). RERUN: the update is
  run again, its earlier batches from their inputs and RNG states, then the last batch's
  closure, and checked again. A step the engine passed over (at `check`, or at `begin`:
  `run.skip_steps`, a batch an earlier anomaly passes over) makes no update (its batches
  still run forward and backward, every rank alike), and its step-interval LR schedulers
  are not stepped; Lightning counts it as a step and goes on to the next batches. A
  rollback cannot be followed (Lightning's loops cannot be set back in place): the
  rollback remedy is taken as a skip, said at the start. The check's loss is the mean of
  the update's batches' training-step losses.
- Survivors never leave `fit()`. A collective that fails because a peer died, inside the
  closure, leaves the generation and joins the next one in the strategy's `optimizer_step`:
  the engine brings the committed state, every member builds a fresh DDP on the new group
  (`FitSteps.build` says why not the old one re-pointed), and the step is redone: under
  gradient accumulation its earlier batches first, on the same inputs and RNG, their
  reduction deferred as Lightning defers it (a half-accumulated update is dropped, never
  committed). A peer's
  fault met in the strategy's own collectives outside a step (validation's `sync_dist`, callbacks'
  broadcasts) returns the local value and is recovered at the next step.
- A joiner (a spare, or a replacement running the same script) calls `fit()` like everyone.
  In the strategy's `setup` it joins and takes the state from a peer: the LightningModule,
  the optimizers, and what Lightning's checkpoint carries besides (loops, callbacks, LR
  schedulers, precision, datamodule), which Lightning's own restore then applies. A
  `ckpt_path` the script passes is not read by a joiner. Its first epoch skips the batches
  already trained (those of the update in flight excepted: it trains them again). Until it
  reaches the batch its peer was in, its strategy collectives are local (the survivors are
  past theirs).
- The world size never changes (the sampler and `max_steps` depend on it): run the job
  with `--on-fault wait`, or with spares.

Not recovered in place (the worker fails, and the job recovers as it would without the
integration): an exception of the script's own outside a step (a callback's
`on_train_batch_end`, say: it leaves `fit()` as Lightning raises it), a peer's fault met
in a raw collective outside a step (DDP's buffer broadcast in a validation forward).
Manual optimization trains unprotected, saying so in one line.
The private Lightning attributes used are checked on the live Trainer first (`lightning_seams`),
whatever the version: a Lightning that lacks one trains unprotected, saying which in one
line.
"""

from __future__ import annotations

import importlib
import sys
from contextlib import ExitStack
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from unbroken.errors import JobStopped, is_peer_error
from unbroken.import_hooks import when_imported
from unbroken.integrations.lightning_replay import UpdateBatches
from unbroken.integrations.lightning_seams import PACKAGES, unprotected
from unbroken.integrations.lightning_state import LightningState
from unbroken.runtime.engine import Engine, Verdict
from unbroken.runtime.run import Run, init
from unbroken.telemetry import schema as ev

NAME = "unbroken_ddp"

def _fake_world() -> bool:
    """A joiner's stand-in world (the worker's bootstrap formed it for the script's call)."""
    return dist.is_initialized() and dist.get_backend() == "fake"


class InPlaceDDP:
    """Lightning's DDP strategy, whose `fit()` recovers in place (the module's docstring):
    mixed into the installed package's `DDPStrategy` (`strategy_class`). Outside `fit()`
    (validate, test, predict) it is Lightning's DDP. `run`: an `unbroken.init()` of the
    script's own (its anomaly checks, checkpoints, skipped steps); default: one made when
    `fit()` sets up."""

    package = "lightning.pytorch"
    """The Lightning package whose `DDPStrategy` this one extends (`PACKAGES`)."""

    def __init__(self, *args: Any, run: Run | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.run = run
        self.local = False
        """A joiner before its first batch: collectives return the local value."""
        self.steps: FitSteps | None = None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(NAME, cls, description="DDP, recovered in place by unbroken",
                                   override=True, start_method="popen")

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        super().setup_environment()
        self.local = _fake_world()
        if self.local:  # its state comes from a peer, never from the script's ckpt_path
            connector = self.lightning_module.trainer._checkpoint_connector
            connector.resume_start = lambda *args, **kwargs: None

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn == "fit" and self.steps is None:  # TrainerFn.FITTING
            why = unprotected(trainer, self.package)
            if why is not None:
                print(f"unbroken: {why}: this fit trains unprotected, and a fault restarts "
                      "every worker", file=sys.stderr, flush=True)
                self.local = False
                return
            self.steps = FitSteps(trainer, self, self.run or init())

    @property
    def root_device(self) -> torch.device:
        """A spare's device: its own, past the workers' (`LOCAL_RANK` counts the spares)."""
        devices = self.parallel_devices
        if devices and self.local_rank >= len(devices):
            first = devices[0]
            return first if first.type == "cpu" else torch.device(first.type, self.local_rank)
        return super().root_device

    @property
    def global_rank(self) -> int:
        """The rank in the job: the engine's once it entered (a promoted spare's slot; its
        `RANK` says -1), else the cluster environment's."""
        steps = self.steps
        if steps is not None and steps.started:
            return steps.engine.position.rank
        return super().global_rank

    @property
    def lightning_restore_optimizer(self) -> bool:
        """A joiner's optimizers come from a peer (tracked), not from Lightning's restore."""
        return not (self.steps is not None and self.steps.from_peer)

    # ------------------------------------------------------------------ hooks
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.steps is not None:
            self.steps.train_start()
        else:
            self.local = False

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.steps is not None:
            self.steps.step_begin(batch, batch_idx)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs)
        if self.steps is not None:
            self.steps.batches.record_loss(out)
        return out

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.steps is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return self.steps.optimizer_step(
            lambda wrapped: super(InPlaceDDP, self).optimizer_step(
                optimizer, wrapped, model, **kwargs), closure)

    def on_train_end(self) -> None:
        super().on_train_end()
        if self.steps is not None:
            self.steps.train_end()

    # ------------------------------------------------------------------ collectives
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self.local:
            self._outside_step(lambda: super(InPlaceDDP, self).barrier(*args, **kwargs),
                               None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.local:
            return obj
        return self._outside_step(lambda: super(InPlaceDDP, self).broadcast(obj, src), obj)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if self.local:
            return tensor
        return self._outside_step(
            lambda: super(InPlaceDDP, self).reduce(tensor, group, reduce_op), tensor)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> Any:
        if self.local:
            return torch.stack([tensor] * self.world_size)
        return self._outside_step(
            lambda: super(InPlaceDDP, self).all_gather(tensor, group, sync_grads),
            torch.stack([tensor] * self.world_size))

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self.local:
            return decision
        return self._outside_step(
            lambda: super(InPlaceDDP, self).reduce_boolean_decision(decision, all),
            decision)

    def _outside_step(self, collective: Any, local: Any) -> Any:
        """A strategy collective; one that fails for a peer's fault, outside a step, gives
        `local` and leaves the recovery to the next step (`FitSteps.pending`)."""
        steps = self.steps
        if steps is None or steps.in_step:
            return collective()
        try:
            return collective()
        except Exception as exc:
            if not is_peer_error(exc):
                raise
            if steps.pending is None:
                print("unbroken: a peer's fault met in a Lightning collective outside a step: "
                      "it gives the local value, and the next step recovers in place",
                      file=sys.stderr, flush=True)
            steps.pending = exc
            return local


def strategy_class(package: str = "lightning.pytorch") -> type:
    """`InPlaceDDP` on `package`'s `DDPStrategy` (one of `PACKAGES`), made once and
    registered in its `StrategyRegistry` as `unbroken_ddp`. This module registers it for
    each package the script imports."""
    made = _CLASSES.get(package)
    if made is None:
        strategies = importlib.import_module(f"{package}.strategies")
        made = type("UnbrokenDDPStrategy", (InPlaceDDP, strategies.DDPStrategy),
                    {"package": package, "__module__": __name__, "__doc__": InPlaceDDP.__doc__})
        _CLASSES[package] = made
        made.register_strategies(strategies.StrategyRegistry)
    return made


_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """`UnbrokenDDPStrategy`: the strategy on the `lightning` package's DDP."""
    if name == "UnbrokenDDPStrategy":
        return strategy_class("lightning.pytorch")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _NoUpdate(Exception):  # noqa: N818
    """Out of the closure, inside the optimizer's step and before its update: the step
    makes no update (`verdict`: the engine dropped it to run again, or passed over it)."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(f"no update: {verdict}")
        self.verdict = verdict


class FitSteps:
    """One `fit()`'s optimizer steps on the engine's step transaction."""

    def __init__(self, trainer: Any, strategy: InPlaceDDP, run: Run) -> None:
        self.trainer, self.strategy, self.run = trainer, strategy, run
        self.engine: Engine = run.engine
        self.in_step = False
        self.pending: Exception | None = None  # a peer's fault met outside a step
        self.from_peer = False  # a joiner's state came from a peer
        self.batches_that_stepped: int | None = None  # a joiner's logger step, from the peer
        self._reuse_view = not run.joining  # generation 0's DDP is Lightning's own
        self.started = False  # engine.start was called
        self.batches = UpdateBatches()  # the update in flight's, to run again if redone
        self.metrics: dict[str, Any] = {}  # the update's, as checked: committed with it
        self.passing = False  # the update in flight is one the engine passed over (`begin`)
        self.no_update = False  # the last update made none: its LR schedule holds
        self.local_batches = 0  # a joiner's batches run again with local collectives
        # Rank 0's per-batch raw broadcast of a SIGTERM flag would pair with a joiner's
        # first collective: off (a drain is the agent's, not Lightning's).
        if hasattr(trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor"):  # 2.6: present
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
        loop = trainer.fit_loop.epoch_loop
        loop.update_lr_schedulers = self._unless_no_update(loop.update_lr_schedulers)
        run.track(trainer.lightning_module, *trainer.optimizers, lightning=LightningState(self))
        if self.engine.generations is not None:  # its sampler and step count hold the world
            self.engine.generations.fix_world("Lightning")
        if run.joining:
            self._start()

    def _start(self) -> None:
        trainer = self.trainer
        if trainer.max_steps > 0 or self.run.spare:
            # A spare's data is set up once it has a rank, after this; without max_steps
            # Lightning's own epochs end its fit.
            last = trainer.max_steps if trainer.max_steps > 0 else sys.maxsize
        else:
            last = trainer.estimated_stepping_batches
            last = int(last) if last != float("inf") else sys.maxsize
        self.started = True
        self.engine.anomalies.without_rollback("Lightning's loops cannot be set back in place",
                                               self.engine.position.rank)
        self.engine.start(last, self.build, self.shadow_step, resumed_at=trainer.global_step)

    def train_start(self) -> None:
        """Enter the job (collective; a joiner entered in `setup`); a joiner skips the
        batches its peers trained this epoch."""
        if not self.from_peer:
            if not self.started:
                self._start()
            return
        fit_loop = self.trainer.fit_loop
        fabric = importlib.import_module(PACKAGES[self.strategy.package] + ".utilities.data")
        for loader in fit_loop._combined_loader.flattened:  # the iterator predates set_epoch
            fabric._set_sampler_epoch(loader, fit_loop.epoch_progress.current.processed)
        for _ in range(fit_loop.epoch_loop.batch_progress.current.completed):
            next(fit_loop._data_fetcher.iterator)

    def step_begin(self, batch: Any, batch_idx: int) -> None:
        """A batch starts: the first of an update begins and enters the engine's step (its
        RNG seeded). Each is recorded with its RNG state, to be run again on the same inputs
        and draws if the update is redone."""
        if self.batches_that_stepped is not None:  # the peer's logger step, exactly
            self.trainer.fit_loop.epoch_loop._batches_that_stepped = self.batches_that_stepped
            self.batches_that_stepped = None
        if self.local_batches:  # a joiner's batch its peer is past
            self.local_batches -= 1
        else:
            self.strategy.local = False
        if self.batches.in_update:  # a later batch of the update (accumulation)
            self.batches.later(batch, batch_idx)
            return
        if self.pending is not None:  # a peer's fault met between steps: recover it now
            exc, self.pending = self.pending, None
            self.engine.fail(self.engine.position.step, exc)
        step = self.engine.begin()
        if step is None:  # the engine's last step is committed
            self.trainer.should_stop = True
            return
        self.no_update = False
        # The engine passed over Lightning's step (`run.skip_steps`, or a batch an anomaly
        # passes over): this update runs its batches and makes no update.
        self.passing = step > self.trainer.global_step
        if not self.passing:
            self.engine.enter(step)
        self.batches.first(batch, batch_idx)

    def optimizer_step(self, step_fn: Any, closure: Any) -> Any:
        """The strategy's optimizer step (the update's last batch's closure, the engine's
        check, then the update), recovered in place and as the check's verdict says: see
        the module's docstring."""
        engine = self.engine
        step = engine.position.step
        self.in_step = True
        try:
            if self.pending is not None:  # met between this update's batches
                exc, self.pending = self.pending, None
                self._fail(step, exc)
            rerun = False
            while True:
                try:
                    if rerun:  # the same step again, as a new try, on the same inputs
                        rerun = False
                        engine.enter(step)
                        self._redo(step)
                    out, verdict = self._attempt(step_fn, closure, step)
                except JobStopped:
                    raise
                except Exception as exc:  # a peer's fault is recovered; anything else re-raised
                    self._fail(step, exc)
                    continue
                if verdict is not Verdict.RERUN:
                    break
                engine.begin()  # a switch the leader asked for comes first
                rerun = True
            self.batches.clear()
            if verdict is Verdict.COMMIT:
                engine.commit(step, self.metrics)
                return out
            if self.passing:  # the batches ran after the engine discarded the gradients
                for optimizer in self.trainer.optimizers:
                    optimizer.zero_grad()
            self.passing, self.no_update = False, True
            return out
        finally:
            self.in_step = False

    def _fail(self, step: int, exc: Exception) -> None:
        """Leave for the next generation (`engine.fail`), then start the update over in it,
        as it ran in the old one (`_redo`)."""
        self.engine.fail(step, exc)
        self._redo(step, exc)

    def _redo(self, step: int, exc: Exception | None = None) -> None:
        """Start the update over, as it ran before: the gradients zeroed, the earlier
        batches run again on the same inputs and RNG states, their reduction deferred
        (`no_sync`). The batch in flight is then redone by the caller, from its own RNG
        state (hooks between the batches, a validation say, may have drawn from the RNG:
        they are not run again). `exc`: the fault recovered in place before it (None: a
        rerun the engine's check asked for)."""
        engine = self.engine
        if engine.position.step > step:
            raise RuntimeError("unbroken: the peers committed a step this worker was still "
                               "running") from exc
        replayed = self.batches.replay(self.trainer, self.strategy)
        if replayed and exc is not None:
            self.run.events.emit(ev.MicroBatchesReplayed(step=step, gen=engine.position.gen,
                                                         micro_batches=replayed))

    def _attempt(self, step_fn: Any, closure: Any, step: int) -> tuple[Any, Verdict]:
        """One try of the update's last batch: its closure, the engine's check, the fence
        (which may refuse the update: a peer error), then the update (torn if it raises);
        with the verdict. Anything but COMMIT (or an update the
        engine passed over) leaves the optimizer's step before its update (`_NoUpdate`)."""
        engine = self.engine
        with ExitStack() as update:
            def closure_then_check_then_update() -> Any:
                result = closure()
                if self.passing:
                    raise _NoUpdate(Verdict.SKIPPED)
                loss = self.batches.mean_loss()
                self.metrics = {"loss": loss} if loss is not None else {}
                verdict = engine.check(step, self.metrics)
                if verdict is not Verdict.COMMIT:
                    raise _NoUpdate(verdict)
                update.enter_context(engine.updating())
                engine.tracked.begin_update()  # the fence, after the closure's reduction
                return result

            try:
                return step_fn(closure_then_check_then_update), Verdict.COMMIT
            except _NoUpdate as no:
                return None, no.verdict

    def _unless_no_update(self, original: Any) -> Any:
        """The epoch loop's LR scheduler update: a step-interval one is not stepped after a
        step that made no update (an instance attribute of the loop, which no checkpoint
        holds)."""
        def update_lr_schedulers(interval: str, *args: Any, **kwargs: Any) -> Any:
            if interval == "step" and self.no_update:
                return None
            return original(interval, *args, **kwargs)
        return update_lr_schedulers

    def train_end(self) -> None:
        self.engine.finish()

    # ------------------------------------------------------------------ the engine's
    def build(self) -> Any:
        """The model a generation trains: Lightning's own DDP in generation 0, then a fresh
        one on each new group, built by every member at the same point of the switch (its
        constructor's collectives line up). The old one's gradient hooks are removed first.
        Moving the old one onto the new group (`_update_process_group`) is not enough: a
        survivor's reducer keeps the bucket order it rebuilt after its first step, and a
        joiner's has the initial one, so their first all-reduce would sum misaligned
        gradients."""
        strategy = self.strategy
        old = strategy.model
        if self._reuse_view or not isinstance(old, DistributedDataParallel):
            self._reuse_view = False
            return old
        old._remove_autograd_hooks()
        strategy.model = strategy._setup_model(strategy.lightning_module)
        strategy._register_ddp_hooks()
        return strategy.model

    def shadow_step(self, step: int, view: Any) -> None:
        """A spare's warm-up step, in its sandbox: a forward and backward on a first batch."""
        trainer = self.trainer
        loader = trainer.fit_loop._data_source.dataloader()  # the script's, unsharded
        batch = next(iter(loader))
        out = trainer.lightning_module.training_step(batch, 0)
        loss = out["loss"] if isinstance(out, dict) else out
        loss.backward()


for _package in PACKAGES:  # `unbroken_ddp`, for whichever the script imports
    when_imported(f"{_package}.strategies",
                  lambda _module, package=_package: strategy_class(package))
